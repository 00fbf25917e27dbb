"""Calibrate a running plan against the step times its stages measured, and decide whether to re-shard.

The launcher calls :func:`rebalance_decision` once the warm-up steps are done, with the plan it
started and the steps' measured per-rank compute and wait. A decision keeps the stages, their
devices and their order; only the layer boundaries move, so the runtime can re-shard in place at
the next step boundary (``shardpool.launch``), without restarting any process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardpool.config import Config
from shardpool.plan.result import Plan

__all__ = ["MIN_GAIN", "Rebalance", "StepMeasurement", "rebalance_decision"]

#: Re-shard only when the calibrated model predicts a step at least this much faster.
MIN_GAIN = 0.10


@dataclass(frozen=True)
class StepMeasurement:
    """One optimizer step as the STEP event reports it: per-rank compute and wait seconds."""

    step: int
    step_seconds: float
    stage_compute_s: tuple[float, ...]
    stage_wait_s: tuple[float, ...]


@dataclass(frozen=True)
class Rebalance:
    """A better split of the same stages: the new plan and the calibrated predictions behind it."""

    plan: Plan
    predicted_step_s: float
    current_step_s: float
    reason: str

    @property
    def layers(self) -> list[tuple[int, int]]:
        """Each stage's new ``[start, stop)``, in pipeline order."""
        return [(stage.start, stage.stop) for stage in self.plan.stages]


def rebalance_decision(
    plan: Plan, measured: Sequence[StepMeasurement], config: Config, *, min_gain: float = MIN_GAIN
) -> Rebalance | None:
    """The re-shard that the measured steps justify, or None to keep the running plan.

    Placeholder until calibration lands: it keeps the plan.
    """
    del plan, measured, config, min_gain
    return None
