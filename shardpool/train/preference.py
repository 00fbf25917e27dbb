"""Preference losses on the last stage: DPO (sigmoid) and IPO, from completion log-probabilities.

A preference micro-batch holds ``b`` pairs as ``2b`` rows, every chosen row first and then every
rejected one in the same order (TRL's concatenated batch). Only completion tokens carry labels, so
a row's log-probability is the sum of its next-token log-probabilities over its label tokens. The
reference log-probabilities are the same stages' with the LoRA adapter disabled (the NF4 base
alone), as TRL computes them for a PEFT model without a ``ref_model``.

The formulas are TRL's ``DPOTrainer`` (1.16): with ``delta = (chosen - ref_chosen) - (rejected -
ref_rejected)``, ``sigmoid`` is ``-logsigmoid(beta * delta)`` and ``ipo`` is ``((chosen - ref_chosen) /
chosen_tokens - (rejected - ref_rejected) / rejected_tokens - 1 / (2 beta))^2``; the step's loss is
their mean over the step's pairs. The logged metrics are TRL's, means over the step's pairs:
rewards/chosen, rewards/rejected (``beta`` times each log ratio), rewards/accuracies (chosen reward
above rejected), rewards/margins, logps/chosen and logps/rejected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from shardpool.contract.events import PREFERENCE_METRICS

if TYPE_CHECKING:
    from shardpool.config import Config

__all__ = ["PREFERENCE_METRICS", "PairLogps", "PreferenceObjective", "completion_logps", "pair_losses"]


@dataclass(frozen=True)
class PreferenceObjective:
    """What a preference run optimises: TRL's loss type and ``beta`` (axolotl's ``rl_beta``)."""

    loss_type: Literal["sigmoid", "ipo"]
    beta: float

    @classmethod
    def of(cls, config: Config) -> PreferenceObjective | None:
        """The objective of ``config``, or None for supervised fine-tuning (no ``rl``)."""
        if config.rl is None:
            return None
        return cls(loss_type=config.preference_loss, beta=config.preference_beta)


@dataclass(frozen=True)
class PairLogps:
    """Summed completion log-probabilities and completion token counts of a micro-batch's pairs."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    @classmethod
    def split(cls, logps: torch.Tensor, tokens: torch.Tensor) -> PairLogps:
        """Per-row values of ``2b`` rows (chosen first, then rejected) as ``b`` pairs."""
        if logps.shape[0] % 2:
            raise ValueError(f"a preference micro-batch has an even number of rows, not {logps.shape[0]}")
        chosen, rejected = logps.chunk(2)
        chosen_tokens, rejected_tokens = tokens.chunk(2)
        return cls(chosen, rejected, chosen_tokens, rejected_tokens)


def completion_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed next-token log-probability over its label tokens (fp32), and how many there are.

    Position ``t`` predicts token ``t + 1``; labels of -100 (prompt, padding) count for nothing.
    """
    targets = labels[:, 1:].to(logits.device)
    mask = targets != -100
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(dim=1), mask.sum(dim=1)


def pair_losses(
    objective: PreferenceObjective, policy: PairLogps, reference: PairLogps
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's loss (with gradient through ``policy``) and the per-pair sums of
    :data:`PREFERENCE_METRICS` (no gradient), a tensor of ``len(PREFERENCE_METRICS)`` values."""
    chosen_ratio = policy.chosen - reference.chosen
    rejected_ratio = policy.rejected - reference.rejected
    if objective.loss_type == "sigmoid":
        losses = -torch.nn.functional.logsigmoid(objective.beta * (chosen_ratio - rejected_ratio))
    else:
        chosen_mean = chosen_ratio / policy.chosen_tokens.clamp(min=1)
        rejected_mean = rejected_ratio / policy.rejected_tokens.clamp(min=1)
        losses = (chosen_mean - rejected_mean - 1 / (2 * objective.beta)) ** 2
    with torch.no_grad():
        chosen_rewards = objective.beta * chosen_ratio.detach()
        rejected_rewards = objective.beta * rejected_ratio.detach()
        sums = torch.stack(
            [
                chosen_rewards.sum(),
                rejected_rewards.sum(),
                (chosen_rewards > rejected_rewards).float().sum(),
                (chosen_rewards - rejected_rewards).sum(),
                policy.chosen.detach().sum(),
                policy.rejected.detach().sum(),
            ]
        ).double()
    return losses, sums.cpu()
