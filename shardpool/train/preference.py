"""Preference losses on the last stage: DPO (sigmoid, with label smoothing), IPO, ORPO and SimPO.

A preference micro-batch holds ``b`` pairs as ``2b`` rows, every chosen row first and then every
rejected one in the same order (TRL's concatenated batch). Only completion tokens carry labels, so
a row's log-probability is the sum of its next-token log-probabilities over its label tokens (DPO,
IPO), or their mean (ORPO, SimPO). DPO and IPO compare the policy with a reference: the same
stages with the LoRA adapter disabled (the NF4 base alone), as TRL computes it for a PEFT model
without a ``ref_model``. ORPO and SimPO need no reference.

The formulas are TRL 1.16's. With ``delta = (chosen - ref_chosen) - (rejected - ref_rejected)``:

* ``sigmoid`` (``DPOTrainer``): ``-(1 - ls) logsigmoid(beta delta) - ls logsigmoid(-beta delta)``
  with ``ls`` the label smoothing (conservative DPO, as earlier TRL releases computed it; TRL 1.16
  reads ``label_smoothing`` only in its robust and exo_pair losses, so there it changes nothing);
* ``ipo``: ``((chosen - ref_chosen) / chosen_tokens - (rejected - ref_rejected) / rejected_tokens -
  1 / (2 beta))^2``;
* ``orpo`` (``ORPOTrainer``, ``beta`` its lambda): ``nll - beta logsigmoid(log_odds)``, where
  ``log_odds = (c - r) - (log(1 - e^c) - log(1 - e^r))`` on the mean log-probabilities and ``nll`` is
  the micro-batch's next-token loss over every attended token of its chosen rows, prompt included;
* ``simpo`` (``CPOTrainer`` with ``loss_type: simpo``): ``-logsigmoid(beta (c - r) - gamma) +
  cpo_alpha nll`` on the mean log-probabilities, ``nll`` over the chosen rows' completion tokens.

A step's loss is the mean of its pairs' losses, each micro-batch's term (``nll``) counted once per
pair of it, which is TRL's mean per micro-batch averaged over gradient accumulation. The logged
metrics are TRL's, means over the step's pairs: rewards/chosen, rewards/rejected (``beta`` times
each log ratio for DPO/IPO, times each mean log-probability for ORPO/SimPO), rewards/accuracies,
rewards/margins, logps/chosen, logps/rejected, and nll_loss, log_odds_ratio, log_odds_chosen where
TRL logs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from shardpool.contract.events import PREFERENCE_METRICS

if TYPE_CHECKING:
    from shardpool.config import Config
    from shardpool.data.rows import TokenRows

__all__ = [
    "PREFERENCE_METRICS",
    "PairLogps",
    "PreferenceObjective",
    "completion_logps",
    "completion_positions",
    "micro_batch_losses",
    "pair_losses",
]

LossType = Literal["sigmoid", "ipo", "orpo", "simpo"]


@dataclass(frozen=True)
class PreferenceObjective:
    """What a preference run optimises: TRL's loss type, ``beta`` and the loss's own settings."""

    loss_type: LossType
    beta: float
    #: ``dpo_label_smoothing`` (sigmoid only).
    label_smoothing: float = 0.0
    #: SimPO's target reward margin.
    simpo_gamma: float = 0.5
    #: SimPO's weight of the chosen rows' next-token loss.
    cpo_alpha: float = 1.0

    @classmethod
    def of(cls, config: Config) -> PreferenceObjective | None:
        """The objective of ``config``, or None for supervised fine-tuning (no ``rl``)."""
        if config.rl is None:
            return None
        return cls(
            loss_type=config.preference_loss,
            beta=config.preference_beta,
            label_smoothing=config.dpo_label_smoothing,
            simpo_gamma=config.simpo_gamma,
            cpo_alpha=config.cpo_alpha,
        )

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with the reference policy (DPO, IPO), so each step runs a reference pass."""
        return self.loss_type in ("sigmoid", "ipo")

    @property
    def reads_completions_only(self) -> bool:
        """Whether the loss reads the logits of completion positions only (all but ORPO, whose
        next-token loss covers the prompt too), so the last stage computes no others."""
        return self.loss_type != "orpo"

    @property
    def metrics(self) -> tuple[str, ...]:
        """The metrics this loss reports, in the order :func:`pair_losses` sums them."""
        extra = {"orpo": 3, "simpo": 1}.get(self.loss_type, 0)
        return PREFERENCE_METRICS[: 6 + extra]


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

    @classmethod
    def of(cls, logits: torch.Tensor, labels: torch.Tensor, *, kept: bool = False) -> PairLogps:
        """The pairs' completion log-probabilities from the last stage's ``logits`` of their rows;
        ``kept``: the logits are those of the :func:`completion_positions` only."""
        return cls.split(*completion_logps(logits, labels, kept=kept))

    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean completion log-probability of each chosen and each rejected row."""
        return self.chosen / self.chosen_tokens.clamp(min=1), self.rejected / self.rejected_tokens.clamp(
            min=1
        )


def completion_positions(labels: torch.Tensor) -> torch.Tensor:
    """The positions whose logits the completion log-probabilities read, as a boolean mask the
    shape of ``labels``: ``t`` where token ``t + 1`` has a label (position ``t`` predicts it)."""
    keep = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    keep[:, :-1] = labels[:, 1:] != -100
    return keep


def completion_logps(
    logits: torch.Tensor, labels: torch.Tensor, *, kept: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed next-token log-probability over its label tokens (fp32), and how many there are.

    Position ``t`` predicts token ``t + 1``; labels of -100 (prompt, padding) count for nothing.
    ``logits`` are ``[rows, seq, vocab]``, or with ``kept`` ``[kept, vocab]``: those of the
    :func:`completion_positions` only, in row order, which is all the sums read.
    """
    if kept:
        return _kept_completion_logps(logits, labels)
    targets = labels[:, 1:].to(logits.device)
    mask = targets != -100
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(dim=1), mask.sum(dim=1)


def _kept_completion_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`completion_logps` from the ``[kept, vocab]`` logits of the completion positions."""
    labelled = labels[:, 1:] != -100  # where the labels are (the host): counting waits for no device
    if logits.shape[0] != int(labelled.sum()):
        raise ValueError(f"{logits.shape[0]} kept logits for {int(labelled.sum())} completion positions")
    targets = labels[:, 1:][labelled].to(logits.device)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    picked = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    mask = labelled.to(logits.device)
    return log_probs.new_zeros(mask.shape).masked_scatter(mask, picked).sum(dim=1), mask.sum(dim=1)


def chosen_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss over the chosen rows (the first half) where ``targets`` is not -100."""
    chosen = logits.shape[0] // 2
    shifted = logits[:chosen, :-1].float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(shifted, targets[:chosen, 1:].reshape(-1).to(logits.device), ignore_index=-100)


def micro_batch_losses(
    objective: PreferenceObjective,
    logits: torch.Tensor,
    rows: TokenRows,
    reference: PairLogps | None,
    *,
    kept: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's loss of one micro-batch from the last stage's ``logits`` (gradient through them)
    and the per-pair sums of the objective's metrics; ``reference`` is None for ORPO and SimPO.
    ``kept``: the logits are those of the :func:`completion_positions` only
    (:attr:`PreferenceObjective.reads_completions_only`)."""
    if kept and not objective.reads_completions_only:
        raise ValueError(f"the {objective.loss_type} loss needs the logits of every position")
    policy = PairLogps.of(logits, rows.labels, kept=kept)
    nll = None
    if objective.loss_type == "orpo":
        attended = torch.where(rows.attention_mask == 1, rows.input_ids, -100)
        nll = chosen_nll(logits, attended)
    elif objective.loss_type == "simpo" and objective.cpo_alpha > 0:
        # The mean next-token loss over the chosen rows' completion tokens.
        nll = -policy.chosen.sum() / policy.chosen_tokens.sum() if kept else chosen_nll(logits, rows.labels)
    return pair_losses(objective, policy, reference, nll)


def pair_losses(
    objective: PreferenceObjective,
    policy: PairLogps,
    reference: PairLogps | None,
    nll: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's loss (with gradient through ``policy`` and ``nll``) and the per-pair sums of
    :attr:`PreferenceObjective.metrics` (no gradient, float64 on the CPU).

    ``reference`` is the reference policy's log-probabilities (DPO, IPO); ``nll`` the micro-batch's
    next-token loss on its chosen rows (ORPO, and SimPO with ``cpo_alpha``), added to each pair's loss.
    """
    if objective.needs_reference:
        if reference is None:
            raise ValueError(f"the {objective.loss_type} loss needs the reference log-probabilities")
        return _reference_losses(objective, policy, reference)
    chosen, rejected = policy.means()
    nll_value = nll if nll is not None else torch.zeros((), device=chosen.device)
    extra: list[torch.Tensor] = []
    if objective.loss_type == "orpo":
        log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        losses = nll_value - objective.beta * ratio
        extra = [ratio.detach().sum(), log_odds.detach().sum()]
    else:
        margin = objective.beta * (chosen - rejected) - objective.simpo_gamma
        losses = -F.logsigmoid(margin) + objective.cpo_alpha * nll_value
    pairs = chosen.shape[0]
    sums = _reward_sums(objective.beta * chosen, objective.beta * rejected, chosen, rejected)
    sums = torch.cat([sums, torch.stack([nll_value.detach() * pairs, *extra]).double().cpu()])
    return losses, sums


def _reference_losses(
    objective: PreferenceObjective, policy: PairLogps, reference: PairLogps
) -> tuple[torch.Tensor, torch.Tensor]:
    chosen_ratio = policy.chosen - reference.chosen
    rejected_ratio = policy.rejected - reference.rejected
    if objective.loss_type == "sigmoid":
        logits = objective.beta * (chosen_ratio - rejected_ratio)
        smoothing = objective.label_smoothing
        losses = -F.logsigmoid(logits) * (1 - smoothing) - F.logsigmoid(-logits) * smoothing
    else:
        chosen_mean = chosen_ratio / policy.chosen_tokens.clamp(min=1)
        rejected_mean = rejected_ratio / policy.rejected_tokens.clamp(min=1)
        losses = (chosen_mean - rejected_mean - 1 / (2 * objective.beta)) ** 2
    sums = _reward_sums(
        objective.beta * chosen_ratio, objective.beta * rejected_ratio, policy.chosen, policy.rejected
    )
    return losses, sums


def _reward_sums(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor
) -> torch.Tensor:
    """The six metrics every preference loss reports, summed over the pairs (float64, CPU)."""
    with torch.no_grad():
        chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
        return (
            torch.stack(
                [
                    chosen_rewards.sum(),
                    rejected_rewards.sum(),
                    (chosen_rewards > rejected_rewards).float().sum(),
                    (chosen_rewards - rejected_rewards).sum(),
                    chosen.detach().sum(),
                    rejected.detach().sum(),
                ]
            )
            .double()
            .cpu()
        )


def _log1mexp(values: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, switching form at ``-log 2`` to keep its precision (as TRL)."""
    return torch.where(
        values < -0.6931471805599453, torch.log1p(-torch.exp(values)), torch.log(-torch.expm1(values))
    )
