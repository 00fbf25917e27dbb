"""Dynamic loss scaling for runs where any stage computes in fp16, shared by every rank.

fp16 gradients of small losses underflow; scaling the loss by ``S`` before backward keeps them
representable, and dividing the fp32 LoRA gradients by ``S`` afterwards restores them. Every rank
holds the same :class:`LossScale` and updates it from the same global fact (whether any rank's
gradients were non-finite this step, reduced with the step's other sums), so the scale never
drifts apart across stages or replicas. On overflow every rank skips the optimizer and LR
schedule step and halves the scale; after ``growth_interval`` finite steps in a row the scale
doubles. The defaults are torch's ``GradScaler`` (and so Hugging Face Trainer's): initial scale
``2**16``, growth factor 2, backoff 0.5, growth interval 2000.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["INJECT_INF_ENV", "LossScale", "inject_inf_at"]

#: Test hook: a 1-based step at which stage 0 makes its gradients infinite (an injected overflow).
INJECT_INF_ENV = "SHARDPOOL_TEST_INF_AT_STEP"


@dataclass
class LossScale:
    """The scale the last stage multiplies the loss by, and its schedule."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0

    def update(self, *, finite: bool) -> None:
        """After a step: halve on overflow (and restart the count), double after enough finite steps."""
        if not finite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_tensor(self) -> torch.Tensor:
        """The scale and the finite-step count, for checkpoints (float64: both exact)."""
        return torch.tensor([self.scale, float(self.good_steps)], dtype=torch.float64)

    def load_state_tensor(self, tensor: torch.Tensor) -> None:
        """Restore what :meth:`state_tensor` saved."""
        self.scale, self.good_steps = float(tensor[0]), int(tensor[1])


def inject_inf_at() -> int | None:
    """The step (1-based) the test hook :data:`INJECT_INF_ENV` makes overflow, or None."""
    value = os.environ.get(INJECT_INF_ENV, "")
    return int(value) if value.isdigit() else None
