"""Calibrate a running plan against the step times its stages measured.

Each rank's compute seconds (forward + backward of its micro-batches, the ends included; no waits,
no optimizer) is taken as the median over the given steps, and a stage's as the mean over its
replicas (rank ``r`` runs stage ``r % S``). Divided by the micro-batches, that is the stage's
measured seconds per micro-batch; divided by the plan's own prediction for the same stage
(``PlannedStage.costs``: embedding on the first stage, ``lm_head`` + loss on the last, ``n``
decoder layers) it gives the stage's *speed factor*: how many times slower its device computes
than its profile said. The calibrated model multiplies that stage's forward and backward costs,
per layer and at the ends alike, by its factor; memory, transfers and the after-step work stay as
planned. :func:`resplit_calibrated` splits the same device sequence again under it.

What the launcher decides from a calibration (re-shard or keep) is
:mod:`shardpool.elastic.rebalance_decision`; the room each stage has left is :mod:`shardpool.plan.room`.
Pure.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardpool.config import Config
from shardpool.errors import ShardpoolError
from shardpool.plan.costmodel import Workload
from shardpool.plan.data_parallel import shares_step_seconds
from shardpool.plan.planner import resplit_plan
from shardpool.plan.result import Plan
from shardpool.plan.stage_costs import StageCosts

__all__ = [
    "Calibration",
    "StepMeasurement",
    "calibrate",
    "calibrated_plan",
    "calibrated_shares_step",
    "measured_replicas",
    "predicted_over_measured",
    "resplit_calibrated",
]


@dataclass(frozen=True)
class StepMeasurement:
    """One optimizer step as the STEP event reports it: per-rank compute and wait seconds."""

    step: int
    step_seconds: float
    stage_compute_s: tuple[float, ...]
    stage_wait_s: tuple[float, ...]


@dataclass(frozen=True)
class Calibration:
    """A plan's stages corrected by measured steps.

    ``speed``: per stage, measured compute ÷ the plan's prediction (2.0: twice as slow as
    profiled). ``measured_ms_per_microbatch``: the stage's median compute per micro-batch.
    ``measured_ms_per_layer``: the calibrated forward + backward of one decoder layer (the ends
    priced apart). ``costs``: the calibrated stage costs the split search runs on.
    """

    speed: tuple[float, ...]
    measured_ms_per_microbatch: tuple[float, ...]
    measured_ms_per_layer: tuple[float, ...]
    measured_step_s: float
    steps: tuple[int, ...]
    costs: tuple[StageCosts, ...]
    microbatches: int
    schedule: str
    #: The running plan's 1F1B warm-up lead: a re-split keeps the stages' schedule.
    lead: int = 1

    def to_json(self) -> dict[str, Any]:
        """What ``plan.json`` records under ``calibration``."""
        return {
            "speed": [round(x, 4) for x in self.speed],
            "measured_ms_per_microbatch": [round(x, 3) for x in self.measured_ms_per_microbatch],
            "measured_ms_per_layer": [round(x, 3) for x in self.measured_ms_per_layer],
            "measured_step_s": round(self.measured_step_s, 6),
            "steps": list(self.steps),
        }


def calibrate(plan: Plan, measured: Sequence[StepMeasurement], config: Config) -> Calibration:
    """Each stage's measured speed relative to ``plan`` and the calibrated stage costs (see the module
    docstring). Raises :class:`ShardpoolError` when the plan lacks stage costs (a hand-written or
    older ``plan.json``), no step was measured, or the ranks do not match the plan's stages."""
    workload = Workload.from_config(config)
    microbatches, schedule = workload.gradient_accumulation_steps, workload.schedule
    num_stages = len(plan.stages)
    costs: list[StageCosts] = []
    for stage in plan.stages:
        if stage.costs is None:
            raise ShardpoolError(
                "the plan has no stage costs to calibrate (an older or hand-written plan.json)"
            )
        costs.append(stage.costs)
    if not measured:
        raise ShardpoolError("no measured steps to calibrate the plan with")
    ranks = len(measured[0].stage_compute_s)
    if ranks == 0 or ranks % num_stages or any(len(m.stage_compute_s) != ranks for m in measured):
        raise ShardpoolError(
            f"the steps report compute for {ranks} ranks, not a multiple of the plan's {num_stages} stages"
        )
    per_rank = [statistics.median(m.stage_compute_s[r] for m in measured) for r in range(ranks)]
    speed, per_microbatch, per_layer, calibrated = [], [], [], []
    for index, (stage, stage_costs) in enumerate(zip(plan.stages, costs, strict=True)):
        replicas = per_rank[index::num_stages]
        seconds = sum(replicas) / len(replicas) / microbatches
        predicted = stage_costs.seconds(stage.num_layers)
        if predicted <= 0 or seconds <= 0:
            raise ShardpoolError(
                f"stage {index} has predicted {predicted:.6f} s and measured {seconds:.6f} s per micro-batch; "
                "both must be positive to calibrate"
            )
        factor = seconds / predicted
        scaled = stage_costs.scaled(factor)
        speed.append(factor)
        per_microbatch.append(seconds * 1e3)
        per_layer.append(scaled.per_layer_s * 1e3)
        calibrated.append(scaled)
    return Calibration(
        speed=tuple(speed),
        measured_ms_per_microbatch=tuple(per_microbatch),
        measured_ms_per_layer=tuple(per_layer),
        measured_step_s=statistics.median(m.step_seconds for m in measured),
        steps=tuple(sorted(m.step for m in measured)),
        costs=tuple(calibrated),
        microbatches=microbatches,
        schedule=schedule,
        lead=plan.warmup_lead,
    )


def calibrated_plan(plan: Plan, measured: Sequence[StepMeasurement], config: Config) -> Plan:
    """``plan``'s own split, predicted by the model calibrated on ``measured`` (its ``calibration``
    records how). The bench compares its ``predicted_step_s`` with the measured step."""
    calibration = calibrate(plan, measured, config)
    return resplit_calibrated(plan, calibration, [stage.num_layers for stage in plan.stages])


def calibrated_shares_step(plan: Plan, measured: Sequence[StepMeasurement]) -> float:
    """A data-parallel plan's step with its own shares, each replica at its measured seconds per
    micro-batch (the optimizer and all-reduce as planned): what :func:`shares_decision` compares with."""
    if not plan.is_data_parallel or not measured:
        raise ShardpoolError("calibrating shares needs a data-parallel plan and at least one measured step")
    seconds, _, after, allreduce = measured_replicas(plan, measured)
    return shares_step_seconds(seconds, after, plan.shares, allreduce)


def measured_replicas(
    plan: Plan, measured: Sequence[StepMeasurement]
) -> tuple[list[float], list[float], list[float], float]:
    """Each replica's measured and planned seconds per micro-batch (measured: median compute over
    its share), its planned after-step seconds, and the plan's all-reduce (its step less the
    slowest replica's part)."""
    seconds = [
        statistics.median(step.stage_compute_s[replica] for step in measured) / share
        for replica, share in enumerate(plan.shares)
    ]
    after = [stage.after_step_ms / 1e3 for stage in plan.data_parallel]
    planned = [stage.predicted_ms_per_microbatch / 1e3 for stage in plan.data_parallel]
    slowest = max(n * s + a for n, s, a in zip(plan.shares, planned, after, strict=True))
    return seconds, planned, after, max(0.0, plan.predicted_step_s - slowest)


def predicted_over_measured(plan: Plan, measured: Sequence[StepMeasurement]) -> float:
    """``plan.predicted_step_s`` ÷ the median measured step: 1.0 is a true prediction, 2.0 a plan
    that expected steps twice as long as they ran. Raises when no step was measured."""
    if not measured:
        raise ShardpoolError("no measured steps to compare the plan's prediction with")
    step = statistics.median(m.step_seconds for m in measured)
    if step <= 0:
        raise ShardpoolError(f"the median measured step is {step} s; it must be positive")
    return plan.predicted_step_s / step


def resplit_calibrated(plan: Plan, calibration: Calibration, counts: Sequence[int]) -> Plan:
    """``plan`` split into ``counts`` under the calibrated costs, with the calibration recorded."""
    return resplit_plan(
        plan,
        calibration.costs,
        counts,
        microbatches=calibration.microbatches,
        schedule=calibration.schedule,
        search="calibrated",
        calibration=calibration.to_json(),
    )
