"""Calibrate a running plan against the step times its stages measured, and decide whether to re-shard.

The launcher calls :func:`rebalance_decision` once the warm-up steps are done, with the plan it
started and the steps' measured per-rank compute and wait. A decision keeps the stages, their
devices and their order; only the layer boundaries move, so the runtime can re-shard in place at
the next step boundary (``shardpool.launch``), without restarting any process.

Calibration: each rank's compute seconds (forward + backward of its micro-batches, the ends
included; no waits, no optimizer) is taken as the median over the given steps, and a stage's as
the mean over its replicas (rank ``r`` runs stage ``r % S``). Divided by the micro-batches, that
is the stage's measured seconds per micro-batch; divided by the plan's own prediction for the
same stage (``PlannedStage.costs``: embedding on the first stage, ``lm_head`` + loss on the last,
``n`` decoder layers) it gives the stage's *speed factor*: how many times slower its device
computes than its profile said. The calibrated model multiplies that stage's forward and backward
costs, per layer and at the ends alike, by its factor; memory, transfers and the after-step work
stay as planned. The exact split search (``plan.split_search.best_split``) then finds the best
split of the same device sequence under the calibrated model, within each stage's memory, and
:func:`rebalance_decision` returns it when it shortens the calibrated step by at least
:data:`MIN_GAIN` of the current split's calibrated step.

Memory, as measured: the plan's memory model caps each stage at what its device held when it was
planned. At the check each rank also reports its *room* (the bytes it can still take on now), and
a stage may then gain only as many layers as its modelled peak can grow within the least room of
its replicas (:func:`layers_within_room`): another program that took memory since, or a model
that under-counts, shrinks the choice instead of failing the hand-over. Stages on one device (one
host's CPU, one GPU) share its room: their growths together must fit the least room any of them
measured. The search stays exact under that joint bound (:func:`shared_room_caps`): the splits that
respect it are the union of the boxes under its maximal per-stage caps, so the best of the exact
searches within each box is the best split that fits. A job that grows in place when a member
joins is checked against its running ranks' rooms the same way (:func:`growth_shortfalls`).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from shardpool.config import Config
from shardpool.errors import ShardpoolError
from shardpool.plan.costmodel import Workload
from shardpool.plan.data_parallel import best_shares, shares_step_seconds
from shardpool.plan.planner import resplit_plan
from shardpool.plan.result import Plan, PlannedStage
from shardpool.plan.split_search import SplitProblem, best_split
from shardpool.plan.stage_costs import StageCosts

__all__ = [
    "MAX_SHARED_CAP_CHOICES",
    "MIN_GAIN",
    "MIN_SHARE_GAIN",
    "Calibration",
    "Rebalance",
    "StepMeasurement",
    "calibrate",
    "calibrated_plan",
    "calibrated_shares_step",
    "growth_shortfalls",
    "layers_within_room",
    "memory_shortfalls",
    "predicted_over_measured",
    "rebalance_decision",
    "shared_room_caps",
    "shares_decision",
    "stage_rooms",
]

#: Re-shard only when the calibrated model predicts a step at least this much faster.
MIN_GAIN = 0.10
#: Move replicas' shares when the measured speeds predict a step at least this much faster. Far
#: below :data:`MIN_GAIN`: new shares move no state and build nothing (every replica holds the whole
#: model), so only the measurement's own noise argues for a margin; one micro-batch moved is 1/M of
#: the step (6 % at M = 16).
MIN_SHARE_GAIN = 0.02
#: The most per-stage cap vectors that stages sharing a device are searched under; a fleet with
#: more (many growing stages on one device) is searched under each stage's own room alone, and
#: the launcher holds a split back whose stages outgrow their device together.
MAX_SHARED_CAP_CHOICES = 256
_MIB, _GIB = 2**20, 2**30


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
    return _resplit(plan, calibration, [stage.num_layers for stage in plan.stages])


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
    new_plan = _resplit(plan, calibration, counts)
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
    seconds, planned, after, allreduce = _measured_replicas(plan, measured)
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


def calibrated_shares_step(plan: Plan, measured: Sequence[StepMeasurement]) -> float:
    """A data-parallel plan's step with its own shares, each replica at its measured seconds per
    micro-batch (the optimizer and all-reduce as planned): what :func:`shares_decision` compares with."""
    if not plan.is_data_parallel or not measured:
        raise ShardpoolError("calibrating shares needs a data-parallel plan and at least one measured step")
    seconds, _, after, allreduce = _measured_replicas(plan, measured)
    return shares_step_seconds(seconds, after, plan.shares, allreduce)


def _measured_replicas(
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


def stage_rooms(room_by_rank: Sequence[float], num_stages: int) -> list[float]:
    """Each stage's room: the least that any of its replicas reported (rank ``r`` runs stage ``r % S``)."""
    if not room_by_rank or len(room_by_rank) % num_stages:
        raise ShardpoolError(
            f"the check reports room for {len(room_by_rank)} ranks, not a multiple of the plan's {num_stages} stages"
        )
    return [min(room_by_rank[index::num_stages]) for index in range(num_stages)]


def shared_room_caps(
    plan: Plan,
    costs: Sequence[StageCosts],
    caps: Sequence[int],
    rooms: Sequence[float],
    *,
    limit: int = MAX_SHARED_CAP_CHOICES,
) -> list[list[int]]:
    """Per-stage layer caps under which stages sharing a device grow within its room together.

    Stages are grouped by ``(host, device)``; a group's stages may together grow their modelled
    peaks (``costs``, from the layers they hold now) by at most the least room among them. Every
    split that respects that is within one of the returned cap vectors (each at most ``caps``), so
    the best split under the joint bound is the best of the searches under each. ``[caps]`` when
    no two stages share a device; empty when the groups give more than ``limit`` vectors (the
    caller then searches under ``caps`` alone).
    """
    shared = [members for members in _device_groups(plan.stages).values() if len(members) > 1]
    per_group = []
    for members in shared:
        room = min(rooms[index] for index in members)
        held = [plan.stages[index].num_layers for index in members]
        options = _maximal(
            list(
                _caps_within(
                    [costs[index] for index in members], held, [caps[index] for index in members], room
                )
            )
        )
        per_group.append((members, options))
    if math.prod(len(options) for _, options in per_group) > limit:
        return []
    choices = []
    for picks in itertools.product(*(options for _, options in per_group)):
        stage_caps = list(caps)
        for (members, _), pick in zip(per_group, picks, strict=True):
            for index, cap in zip(members, pick, strict=True):
                stage_caps[index] = cap
        choices.append(stage_caps)
    return choices


def _caps_within(
    costs: Sequence[StageCosts], held: Sequence[int], caps: Sequence[int], room: float
) -> Iterator[tuple[int, ...]]:
    """Cap vectors for stages on one device whose growths above ``held`` sum to at most ``room``:
    each earlier stage at every count it can reach, the last one at the most the rest leaves.
    A count at or below what a stage holds needs no room."""
    reachable = []
    for count in range(min(held[0], caps[0]), caps[0] + 1):
        growth = max(0.0, costs[0].growth(held[0], count))
        if count > held[0] and growth > room:
            break
        reachable.append((count, growth))
    if len(costs) == 1:
        yield (reachable[-1][0],)
        return
    for count, growth in reachable:
        for rest in _caps_within(costs[1:], held[1:], caps[1:], room - growth):
            yield (count, *rest)


def _device_groups(placed: Sequence[PlannedStage | _Growth]) -> dict[tuple[str, str], list[int]]:
    """The indexes of the stages (or growths) on each device, by ``(host, device)``: those that
    share its memory. The split search and the check after it group alike."""
    groups: dict[tuple[str, str], list[int]] = {}
    for index, item in enumerate(placed):
        groups.setdefault((item.host, item.device), []).append(index)
    return groups


def _maximal(vectors: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The vectors no other one is at least as large as in every place (order kept)."""
    return [
        vector
        for vector in vectors
        if not any(
            other != vector and all(o >= v for o, v in zip(other, vector, strict=True)) for other in vectors
        )
    ]


def layers_within_room(costs: StageCosts, layers: int, room: float, *, most: int) -> int:
    """The most layers, up to ``most``, that a stage holding ``layers`` can go to when its modelled
    peak (:meth:`StageCosts.memory`) may grow by at most ``room`` bytes. Never fewer than ``layers``:
    giving layers away needs no room."""
    count = layers
    while count < most and costs.growth(layers, count + 1) <= room:
        count += 1
    return count


def memory_shortfalls(
    plan: Plan, layers: Sequence[tuple[int, int]], room_by_rank: Sequence[float]
) -> list[str]:
    """One phrase per stage to which ``layers`` give more than its room (how much more its modelled
    peak needs, and how much room it has), then one per device whose stages grow by more together
    than the least room any of them measured (stages on one host's CPU or one GPU share its free
    memory, and a stage that gives layers away may free them only after another has built its
    own). Empty when the split fits (or the plan has no costs)."""
    rooms = stage_rooms(room_by_rank, len(plan.stages))
    growths = [
        _Growth(
            noun="stage",
            number=index,
            slot=stage.slot or stage.device,
            host=stage.host,
            device=stage.device,
            need=stage.costs.growth(stage.num_layers, stop - start),
            layers=stop - start,
            room=room,
        )
        for index, (stage, (start, stop), room) in enumerate(zip(plan.stages, layers, rooms, strict=True))
        if stage.costs is not None
    ]
    return _shortfall_phrases(growths)


def growth_shortfalls(
    running: Plan, grown: Plan, renumber: dict[int, int], room_by_rank: Sequence[float]
) -> list[str]:
    """:func:`memory_shortfalls` for a job that grows in place from ``running`` to ``grown``
    (a member joined): one phrase per running rank whose stage in ``grown`` needs more than the room
    it measured, then one per device whose running ranks outgrow it together. ``renumber`` maps each
    running rank to its rank in the grown job (rank ``r`` runs stage ``r % S`` of its plan). A rank
    gains memory where its new stage holds more layers, or the same layers at a position with more
    micro-batches in flight. Empty when every running rank fits (or a plan has no costs)."""
    if len(room_by_rank) != len(renumber):
        raise ShardpoolError(
            f"the job's ranks reported room for {len(room_by_rank)} ranks, not its {len(renumber)}"
        )
    growths = []
    for rank, new_rank in sorted(renumber.items()):
        old = running.stages[rank % len(running.stages)]
        new = grown.stages[new_rank % len(grown.stages)]
        if old.costs is None or new.costs is None:
            continue
        need = new.costs.memory(new.num_layers) - old.costs.memory(old.num_layers)
        growths.append(
            _Growth(
                noun="rank",
                number=rank,
                slot=new.slot or new.device,
                host=old.host,
                device=old.device,
                need=need,
                layers=new.num_layers,
                room=room_by_rank[rank],
            )
        )
    return _shortfall_phrases(growths)


@dataclass(frozen=True)
class _Growth:
    """What one stage (or rank) would add to its modelled peak, against the room it measured."""

    noun: str  # "stage" or "rank"
    number: int
    slot: str
    host: str
    device: str
    need: float
    layers: int
    room: float


def _shortfall_phrases(growths: Sequence[_Growth]) -> list[str]:
    """One phrase per growth above its own room, then one per device whose other growths exceed,
    together, the least room among them."""
    phrases = [
        f"{growth.noun} {growth.number} ({growth.slot}) needs {_size(growth.need)} more for {growth.layers} layers and "
        f"has {_size(growth.room)} of room"
        for growth in growths
        if growth.need > growth.room
    ]
    fitting = [growth for growth in growths if 0 < growth.need <= growth.room]
    for (host, device), indexes in _device_groups(fitting).items():
        growing = [fitting[index] for index in indexes]
        if len(growing) < 2:
            continue
        need, room = sum(growth.need for growth in growing), min(growth.room for growth in growing)
        if need > room:
            numbers = " and ".join(str(growth.number) for growth in growing)
            phrases.append(
                f"{growing[0].noun}s {numbers} ({device} on {host}) need {_size(need)} more together and have "
                f"{_size(room)} of room"
            )
    return phrases


def _size(nbytes: float) -> str:
    return f"{nbytes / _GIB:.2f} GiB" if nbytes >= _GIB else f"{nbytes / _MIB:.1f} MiB"


def predicted_over_measured(plan: Plan, measured: Sequence[StepMeasurement]) -> float:
    """``plan.predicted_step_s`` ÷ the median measured step: 1.0 is a true prediction, 2.0 a plan
    that expected steps twice as long as they ran. Raises when no step was measured."""
    if not measured:
        raise ShardpoolError("no measured steps to compare the plan's prediction with")
    step = statistics.median(m.step_seconds for m in measured)
    if step <= 0:
        raise ShardpoolError(f"the median measured step is {step} s; it must be positive")
    return plan.predicted_step_s / step


def _resplit(plan: Plan, calibration: Calibration, counts: Sequence[int]) -> Plan:
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
