"""The loss a step trains on, and what a step reduces across ranks.

The last stage sums the next-token cross-entropy of a micro-batch and divides it by the label
tokens of the *whole* step (all micro-batches, all replicas), as transformers does with
``num_items_in_batch``. After the schedule, replicas sum their LoRA gradients, every rank adds its
squared gradient norms and its loss into one global norm and step loss, and the gradients are
clipped on that norm; every rank's compute and wait times are gathered for the step event.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardpool.train.process_group import others_in_world

__all__ = ["StepTotals", "gather_timings", "label_tokens", "reduce_and_clip_gradients", "token_loss_sum"]


@dataclass
class StepTotals:
    """What one rank adds up over the micro-batches of a step.

    The loss stays a tensor on the stage's device until the step ends: reading it per micro-batch
    would wait for the device every time.
    """

    loss: torch.Tensor | float = 0.0
    compute_seconds: float = 0.0
    #: The most micro-batches whose activations the stage held at once (the schedule's warm-up
    #: depth, which the lead sets): what the memory model charged it for.
    peak_in_flight: int = 0
    #: A preference run's per-pair metric sums on the last stage
    #: (:data:`shardpool.train.preference.PREFERENCE_METRICS`), None elsewhere.
    preference_sums: torch.Tensor | None = None

    def add_preference_sums(self, sums: torch.Tensor) -> None:
        """Add one micro-batch's per-pair metric sums."""
        self.preference_sums = sums if self.preference_sums is None else self.preference_sums + sums

    def add_loss(self, loss: torch.Tensor) -> None:
        """Add one micro-batch's loss without waiting for the device."""
        self.loss = self.loss + loss.detach()

    def loss_value(self) -> float:
        """The summed loss as a float (one wait for the device, at the end of the step)."""
        return float(self.loss)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over the label tokens, computed as transformers does."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    return torch.nn.functional.cross_entropy(
        logits.float().view(-1, logits.shape[-1]),
        shifted.view(-1).to(logits.device),
        ignore_index=-100,
        reduction="sum",
    )


def label_tokens(labels: torch.Tensor) -> int:
    """How many positions of ``labels`` contribute to the next-token loss."""
    return int((labels[..., 1:] != -100).sum())


def reduce_and_clip_gradients(
    grads: list[torch.Tensor],
    replica_group: tuple[Any, bool] | None,
    *,
    loss: float,
    replicas: int,
    max_grad_norm: float,
    loss_scale: float | None = None,
) -> tuple[float, float, bool]:
    """Sum gradients over replicas, unscale, clip on the global norm; return (norm before clipping,
    step loss, whether to take the optimizer step).

    ``replica_group`` is this stage's replica group and whether it is native, or None without
    replicas. The replica all-reduce runs on the device when the group is native, else on the host
    over gloo; the norm and loss sums and the non-finite flag always run on the host over the gloo
    world, in one all-reduce. With ``loss_scale`` (fp16 runs, :mod:`shardpool.train.loss_scale`)
    the gradients are divided by it first, and when any rank's are not finite nothing is clipped
    and the third value is False: every rank skips the step. Without a loss scale it is always
    True, as before (a diverged fp32 run's non-finite norm reaches the clip).
    """
    if replica_group is not None:
        group, native = replica_group
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        flat = flat if native else flat.to("cpu")
        dist.all_reduce(flat, group=group)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
    if loss_scale is not None:
        # A power of two, so dividing fp32 gradients by it is exact.
        torch._foreach_mul_(grads, 1.0 / loss_scale)
    norms = torch.stack(torch._foreach_norm(grads, 2.0)).to("cpu")
    squares = float((norms.double() ** 2).sum())
    not_finite = 0.0 if math.isfinite(squares) else 1.0
    summary = torch.tensor([squares, loss, not_finite], dtype=torch.float64)
    if others_in_world():
        dist.all_reduce(summary)
    finite = float(summary[2]) == 0.0
    if not finite and loss_scale is not None:
        return math.inf, float(summary[1]), False
    grad_norm = math.sqrt(float(summary[0]) / replicas)
    if max_grad_norm > 0:
        coefficient = min(1.0, max_grad_norm / (grad_norm + 1e-6))
        torch._foreach_mul_(grads, torch.tensor(coefficient, dtype=grads[0].dtype, device=grads[0].device))
    return grad_norm, float(summary[1]), True


def gather_timings(
    compute_seconds: float, wait_seconds: float, bytes_sent: int, world_size: int, *extra: float
) -> list[list[float]]:
    """Every rank's compute seconds, wait seconds, bytes sent (and any ``extra`` figures) this step,
    each as a list by rank, in that order: one all-gather for all of them. The step's report names
    the extra figures (:func:`shardpool.train.step_report.gather_step_reports`)."""
    mine = torch.tensor([compute_seconds, wait_seconds, float(bytes_sent), *extra], dtype=torch.float64)
    columns = len(mine)
    if world_size == 1:
        return [[float(value)] for value in mine]
    gathered = [torch.zeros(columns, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    return [[float(row[column]) for row in gathered] for column in range(columns)]
