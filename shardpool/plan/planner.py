"""The capability-aware sharder: which devices, in which order, holding which layers.

For a fixed sequence of devices every stage's time and memory are affine in its layer count
(all decoder layers are identical), so the split that minimizes the slowest stage is exact
and cheap: start every stage at one layer and hand out the remaining layers one at a time to
the stage whose time after taking it is smallest (a min-heap), respecting each stage's memory
cap. This is the dynamic program over layers collapsed by homogeneity; it returns the true
optimum for that sequence. The sequence itself (which devices, in what order) is searched
exhaustively for small fleets (identical devices are deduplicated) and by a seeded local
search beyond. The objective is the predicted step time ``(M + S - 1) * t_max``, so a device
that would slow the pipeline (a slow bottleneck, or a stage whose bubble costs more than its
layers save) is left out. The split is ``plan.splits``, the two searches ``plan.exact_search``
and ``plan.heuristic_search``; this module picks the search, builds the :class:`Plan` and
explains a model that fits nowhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.exact_search import distinct_sequences, exact_search
from shardpool.plan.fleet import Fleet
from shardpool.plan.heuristic_search import heuristic_search
from shardpool.plan.result import Plan, PlannedStage
from shardpool.plan.search_context import SearchContext, allowed_stage_counts
from shardpool.plan.time_model import bubble_fraction, step_seconds

__all__ = ["EXACT_SEQUENCE_LIMIT", "HEURISTIC_BUDGET_S", "evaluate_split", "plan_pipeline"]

GIB = 2**30
#: Sequences (ordered device subsets, identical devices merged) searched exhaustively.
EXACT_SEQUENCE_LIMIT = 20000
#: Wall-clock budget of the local search on large fleets.
HEURISTIC_BUDGET_S = 1.0


def plan_pipeline(
    shape: ModelShape,
    workload: Workload,
    fleet: Fleet,
    *,
    exact_limit: int = EXACT_SEQUENCE_LIMIT,
    budget_s: float = HEURISTIC_BUDGET_S,
) -> Plan:
    """Choose devices, their order and a contiguous layer split minimizing the predicted step time.

    The split is exact for every device sequence considered; sequences are searched
    exhaustively when there are at most ``exact_limit`` of them, else by local search within
    ``budget_s``. Raises :class:`ShardpoolError` saying how many GiB are missing, and where
    they would help, when the model fits on no subset of the fleet.
    """
    ctx = SearchContext(shape, workload, fleet)
    allowed = allowed_stage_counts(ctx)
    sequences = distinct_sequences(ctx, allowed, exact_limit)
    if sequences is not None:
        best, search = exact_search(ctx, sequences), "exact"
    else:
        best, search = heuristic_search(ctx, allowed, budget_s), "heuristic"
    if best is None:
        raise ShardpoolError(_explain_no_fit(ctx))
    return _build_plan(ctx, best.seq, best.counts, search=search)


def evaluate_split(
    shape: ModelShape,
    workload: Workload,
    fleet: Fleet,
    *,
    devices: Sequence[str],
    layers: Sequence[tuple[int, int]] | Sequence[int],
) -> Plan:
    """Predict a given assignment: device names in pipeline order and their layer ranges (or counts).

    Used for ``shardpool.layers`` given by the user, for baselines (even or proportional
    splits) and by tests. The result has ``fits=False`` when a stage overflows its device.
    """
    if len(devices) != len(layers):
        raise ShardpoolError(
            f"{len(devices)} devices but {len(layers)} layer ranges; give one range per device"
        )
    counts = [c if isinstance(c, int) else c[1] - c[0] for c in layers]
    if sum(counts) != shape.num_layers or min(counts) < 1:
        raise ShardpoolError(
            f"the layer ranges cover {sum(counts)} layers with counts {counts}; "
            f"cover all {shape.num_layers} layers with at least one per stage"
        )
    ctx = SearchContext(shape, workload, fleet)
    index = {device.name: i for i, device in enumerate(fleet.devices)}
    missing = [name for name in devices if name not in index]
    if missing:
        raise ShardpoolError(f"devices {missing} are not in the fleet; use names from {list(index)}")
    seq = tuple(index[name] for name in devices)
    if len(set(seq)) != len(seq):
        raise ShardpoolError(
            "a device appears twice in the stage list; give every stage its own device or slot"
        )
    return _build_plan(ctx, seq, counts, search="given")


def _build_plan(ctx: SearchContext, seq: tuple[int, ...], counts: Sequence[int], *, search: str) -> Plan:
    w = ctx.workload
    stages: list[PlannedStage] = []
    start = 0
    fits = True
    for i, (d, n) in enumerate(zip(seq, counts, strict=True)):
        device = ctx.devices[d]
        costs, cap = ctx.stage(seq, i)
        memory = int(math.ceil(costs.memory(n)))
        fits = fits and n <= cap
        stages.append(
            PlannedStage(
                device=device.torch_device or device.name,
                host=device.host,
                start=start,
                stop=start + n,
                predicted_ms_per_microbatch=costs.seconds(n) * 1e3,
                memory_bytes=memory,
                free_bytes=device.memory_bytes - memory,
                slot=device.name,
                capacity_bytes=device.memory_bytes,
                compute_ms=(costs.seconds(n) - costs.comm_s) * 1e3,
                comm_ms=costs.comm_s * 1e3,
                in_flight_microbatches=costs.in_flight,
                memory_breakdown=costs.breakdown(n),
            )
        )
        start += n
    bottleneck_s = max(stage.predicted_ms_per_microbatch for stage in stages) / 1e3
    m, s = w.gradient_accumulation_steps, len(stages)
    plan = Plan(
        stages=stages,
        predicted_step_s=step_seconds(bottleneck_s, microbatches=m, num_stages=s),
        bubble_fraction=bubble_fraction(microbatches=m, num_stages=s),
        microbatches=m,
        recommended_microbatches=_recommend_microbatches(ctx, seq, counts),
        schedule=w.schedule,
        num_layers=ctx.layers,
        model=ctx.shape.name,
        left_out=[device.name for i, device in enumerate(ctx.devices) if i not in seq],
        search=search,
        fits=fits,
    )
    plan.stages[plan.bottleneck_index].bottleneck = True
    return plan


def _recommend_microbatches(ctx: SearchContext, seq: tuple[int, ...], counts: Sequence[int]) -> int:
    """Smallest M with M >= 4S (bubble under 20%); under GPipe, memory grows with M, so cap it."""
    s = len(seq)
    if s == 1:
        return ctx.workload.gradient_accumulation_steps
    target = 4 * s
    if ctx.workload.schedule != "gpipe":
        return target
    for m in range(target, 0, -1):
        trial = SearchContext(ctx.shape, replace(ctx.workload, gradient_accumulation_steps=m), ctx.fleet)
        if all(n <= trial.stage(seq, i)[1] for i, n in enumerate(counts)):
            return m
    return 1


def _explain_no_fit(ctx: SearchContext) -> str:
    """One line: how many GiB are missing, and which devices would make it fit with more memory."""
    w, shape, layers = ctx.workload, ctx.shape, ctx.layers
    allowed = allowed_stage_counts(ctx)
    by_room = sorted(range(len(ctx.devices)), key=lambda d: -ctx.devices[d].memory_bytes)
    seq = tuple(by_room[: max(allowed)])
    stages = [ctx.stage(seq, i) for i in range(len(seq))]
    options = []
    for pos, d in enumerate(seq):
        others = sum(max(0, min(cap, layers)) for j, (_, cap) in enumerate(stages) if j != pos)
        # Stages that hold nothing still count as stages here; keep at least one layer each.
        need_layers = max(1, layers - others)
        needed = stages[pos][0].memory(need_layers)
        options.append((needed - ctx.devices[d].memory_bytes, ctx.devices[d].name))
    # An order-specific shortfall can leave some options at <= 0; a little memory still helps there.
    options = sorted((max(extra, 2**20), name) for extra, name in options)
    missing_gib = options[0][0] / GIB
    usable = sum(ctx.devices[d].memory_bytes for d in seq) / GIB
    where = ", or ".join(f"{extra / GIB:.2f} GiB more on {name}" for extra, name in options[:3])
    hints = []
    if not w.gradient_checkpointing:
        hints.append("enable gradient_checkpointing")
    if w.micro_batch_size > 1 or w.sequence_len > 512:
        hints.append("lower micro_batch_size or sequence_len")
    if w.schedule == "gpipe":
        hints.append("use schedule 1f1b")
    hint = f"; or {', '.join(hints)}" if hints else ""
    return (
        f"{shape.name or 'the model'} ({layers} layers) does not fit: about {missing_gib:.2f} GiB are missing "
        f"across {len(seq)} devices with {usable:.1f} GiB usable; it would fit with {where}{hint}"
    )
