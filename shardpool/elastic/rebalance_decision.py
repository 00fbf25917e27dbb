"""Whether a running plan re-shards: the decision the launcher takes at the re-balance check.

The launcher calls :func:`rebalance_decision` once the warm-up steps are done, with the plan it
started and the steps' measured per-rank compute and wait. The plan is calibrated on them
(:mod:`shardpool.plan.calibrate`); the exact split search (``plan.split_search.best_split``) then
finds the best split of the same device sequence under the calibrated model, within each stage's
memory and the room it reported (:mod:`shardpool.plan.room`), and the decision is that split when
it shortens the calibrated step by at least :data:`MIN_GAIN` of the current split's calibrated
step. A decision keeps the stages, their devices and their order; only the layer boundaries move,
so the ranks re-shard in place at the next step boundary, without restarting any process. A
data-parallel plan moves its replicas' shares instead (:func:`shares_decision`). Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from shardpool.config import Config
from shardpool.plan.calibrate import (
    Calibration,
    StepMeasurement,
    calibrate,
    measured_replicas,
    resplit_calibrated,
)
from shardpool.plan.data_parallel import best_shares, shares_step_seconds
from shardpool.plan.result import Plan
from shardpool.plan.room import layers_within_room, shared_room_caps, stage_rooms
from shardpool.plan.split_search import SplitProblem, best_split

__all__ = ["MIN_GAIN", "MIN_SHARE_GAIN", "Rebalance", "rebalance_decision", "shares_decision"]

#: Re-shard only when the calibrated model predicts a step at least this much faster.
MIN_GAIN = 0.10


#: Move replicas' shares when the measured speeds predict a step at least this much faster. Far
#: below :data:`MIN_GAIN`: new shares move no state and build nothing (every replica holds the whole
#: model), so only the measurement's own noise argues for a margin; one micro-batch moved is 1/M of
#: the step (6 % at M = 16).
MIN_SHARE_GAIN = 0.02


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
    plan: Plan,
    measured: Sequence[StepMeasurement],
    config: Config,
    *,
    min_gain: float = MIN_GAIN,
    room_bytes: Sequence[float] | None = None,
) -> Rebalance | None:
    """The re-shard that the measured steps justify, or None to keep the running plan.

    Calibrates the plan's stages on ``measured`` (the warm-up steps), searches the exact best split
    of the same stages under the calibrated model within each stage's memory, and returns it when
    its predicted step is at least ``min_gain`` (a fraction) shorter than the current split's under
    that same model. ``room_bytes`` (per rank, as the check step measured them) caps each stage's
    gain further (:func:`layers_within_room`). None too for a plan without stage costs (older
    ``plan.json``) or no steps. Pure and deterministic.
    """
    if not measured or any(stage.costs is None for stage in plan.stages):
        return None
    calibration = calibrate(plan, measured, config)
    current = [stage.num_layers for stage in plan.stages]
    caps = [c.max_layers() for c in calibration.costs]
    cap_choices = [caps]
    if room_bytes is not None:
        rooms = stage_rooms(room_bytes, len(plan.stages))
        caps = [
            min(cap, layers_within_room(c, n, room, most=plan.num_layers))
            for cap, c, n, room in zip(caps, calibration.costs, current, rooms, strict=True)
        ]
        cap_choices = shared_room_caps(plan, calibration.costs, caps, rooms) or [caps]

    def problem_within(stage_caps: list[int]) -> SplitProblem:
        return SplitProblem(
            costs=calibration.costs,
            caps=stage_caps,
            layers=sum(current),
            microbatches=calibration.microbatches,
            schedule=calibration.schedule,
            lead=calibration.lead,
        )

    current_step = problem_within(caps).simulate(current)
    found = None
    for stage_caps in cap_choices:
        candidate = best_split(problem_within(stage_caps))
        if candidate is not None and (found is None or candidate[0] < found[0]):
            found = candidate
    if found is None:
        return None
    best_step, counts = found
    if list(counts) == current or best_step > current_step * (1 - min_gain):
        return None
    new_plan = resplit_calibrated(plan, calibration, counts)
    return Rebalance(
        plan=new_plan,
        predicted_step_s=best_step,
        current_step_s=current_step,
        reason=_reason(plan, calibration, counts, current_step, best_step),
    )


def shares_decision(
    plan: Plan, measured: Sequence[StepMeasurement], *, min_gain: float = MIN_SHARE_GAIN
) -> Rebalance | None:
    """The shares that the measured steps justify for a data-parallel plan, or None to keep its own.

    Each replica's measured seconds per micro-batch is the median over ``measured`` of its compute
    (rank ``r`` is replica ``r``) over its share. With those, and the plan's optimizer and
    all-reduce times, :func:`~shardpool.plan.data_parallel.best_shares` splits the step again; the
    new shares are returned when they predict a step at least ``min_gain`` shorter than the current
    shares under the same measured times. Nothing moves but the shares: every replica holds the
    whole model and the same state.
    """
    if not plan.is_data_parallel or not measured:
        return None
    shares = list(plan.shares)
    seconds, planned, after, allreduce = measured_replicas(plan, measured)
    current = shares_step_seconds(seconds, after, shares, allreduce)
    chosen = best_shares(seconds, after, sum(shares))
    best = shares_step_seconds(seconds, after, chosen, allreduce)
    if chosen == shares or best > current * (1 - min_gain):
        return None
    speeds = ", ".join(
        f"{stage.slot or stage.device} {measured_s / planned_s:.2f}x"
        for stage, measured_s, planned_s in zip(plan.data_parallel, seconds, planned, strict=True)
        if planned_s > 0
    )
    reason = (
        f"measured compute vs plan: {speeds}; shares {'/'.join(map(str, shares))} -> "
        f"{'/'.join(map(str, chosen))} predicts {best:.3f} s per step instead of {current:.3f} s "
        f"({1 - best / current:.0%} faster)"
    )
    replicas = [
        replace(stage, predicted_ms_per_microbatch=s * 1e3, compute_ms=s * 1e3, bottleneck=False)
        for stage, s in zip(plan.data_parallel, seconds, strict=True)
    ]
    slowest = max(range(len(replicas)), key=lambda i: chosen[i] * seconds[i] + after[i])
    replicas[slowest] = replace(replicas[slowest], bottleneck=True)
    calibration = {
        "steps": [step.step for step in measured],
        "measured_ms_per_microbatch": [round(s * 1e3, 3) for s in seconds],
        "speed": [round(m / p, 4) if p > 0 else None for m, p in zip(seconds, planned, strict=True)],
    }
    new_plan = replace(
        plan,
        stages=[replicas[0]],
        data_parallel=replicas,
        shares=chosen,
        predicted_step_s=best,
        search="calibrated",
        calibration=calibration,
    )
    return Rebalance(plan=new_plan, predicted_step_s=best, current_step_s=current, reason=reason)


def _reason(plan: Plan, calibration: Calibration, counts: Sequence[int], current: float, best: float) -> str:
    """One line for the console and the metrics event: what was measured and what moves."""
    speeds = ", ".join(
        f"{stage.slot or stage.device} {factor:.2f}x"
        for stage, factor in zip(plan.stages, calibration.speed, strict=True)
    )
    before = "/".join(str(stage.num_layers) for stage in plan.stages)
    after = "/".join(str(n) for n in counts)
    return (
        f"measured compute vs plan: {speeds}; layers {before} -> {after} predicts "
        f"{best:.3f} s per step instead of {current:.3f} s ({1 - best / current:.0%} faster)"
    )
