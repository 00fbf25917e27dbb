"""A :class:`Plan` from a chosen assignment: devices in pipeline order and their layer counts.

The searches (``plan.planner``) choose which devices hold how many layers; this module prices
the choice: each stage's predicted times and memory (:func:`stage_predictions`), the simulated
step and its bubble, the bottleneck stage, and the micro-batch count that keeps the bubble
small; or, for whole-model replicas, the data-parallel plan of their shares.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from shardpool.plan.data_parallel import DataParallelCandidate
from shardpool.plan.pipeline_sim import simulate_step
from shardpool.plan.result import Plan, PlannedStage
from shardpool.plan.search_context import SearchContext
from shardpool.plan.stage_costs import StageCosts

__all__ = [
    "assemble_plan",
    "data_parallel_plan",
    "planned_stage",
    "stage_predictions",
]


def data_parallel_plan(
    ctx: SearchContext, found: DataParallelCandidate, *, search: str, refused: dict[str, str]
) -> Plan:
    """The plan of whole-model replicas on ``found.devices`` training ``found.shares`` micro-batches each."""
    replicas = [
        planned_stage(ctx, d, costs, 0, ctx.layers, index=0)
        for d, costs in zip(found.devices, found.costs, strict=True)
    ]
    finish = [
        compute + costs.after(ctx.layers) for compute, costs in zip(found.compute_s, found.costs, strict=True)
    ]
    replicas[finish.index(max(finish))].bottleneck = True
    busiest = max(found.compute_s)
    plan = Plan(
        stages=[replicas[0]],
        predicted_step_s=found.step_s,
        bubble_fraction=max(0.0, 1.0 - busiest / found.step_s) if found.step_s > 0 else 0.0,
        microbatches=ctx.workload.gradient_accumulation_steps,
        recommended_microbatches=ctx.workload.gradient_accumulation_steps,
        schedule=ctx.workload.schedule,
        num_layers=ctx.layers,
        model=ctx.shape.name,
        left_out=[device.name for i, device in enumerate(ctx.devices) if i not in found.devices],
        search=search,
        fits=True,
        refused=dict(refused),
        data_parallel=replicas,
        shares=list(found.shares),
    )
    return plan


def assemble_plan(
    ctx: SearchContext,
    seq: tuple[int, ...],
    counts: Sequence[int],
    *,
    search: str,
    refused: dict[str, str] | None = None,
) -> Plan:
    """The pipeline plan of devices ``seq`` (indices into the fleet, in stage order) holding ``counts``
    layers each: every stage priced, the step simulated, the bottleneck marked; ``fits`` False
    where a stage holds more layers than its device has room for."""
    w = ctx.workload
    stages: list[PlannedStage] = []
    start = 0
    fits = True
    costs = [ctx.stage(seq, i) for i in range(len(seq))]
    simulation = simulate_step(
        [c.times(n) for (c, _), n in zip(costs, counts, strict=True)],
        microbatches=w.gradient_accumulation_steps,
        schedule=w.schedule,
        lead=w.lead,
    )
    for index, (d, n, (stage_costs, cap)) in enumerate(zip(seq, counts, costs, strict=True)):
        fits = fits and n <= cap
        stages.append(planned_stage(ctx, d, stage_costs, start, start + n, index=index))
        start += n
    plan = Plan(
        stages=stages,
        predicted_step_s=simulation.step_s,
        bubble_fraction=simulation.bubble_fraction,
        microbatches=w.gradient_accumulation_steps,
        recommended_microbatches=_recommend_microbatches(ctx, seq, counts),
        schedule=w.schedule,
        num_layers=ctx.layers,
        model=ctx.shape.name,
        left_out=[device.name for i, device in enumerate(ctx.devices) if i not in seq],
        search=search,
        fits=fits,
        refused=dict(refused or {}),
        warmup_lead=w.lead,
    )
    plan.stages[plan.bottleneck_index].bottleneck = True
    return plan


def planned_stage(
    ctx: SearchContext, d: int, costs: StageCosts, start: int, stop: int, *, index: int
) -> PlannedStage:
    """Device ``d`` of the fleet holding layers ``[start, stop)`` as pipeline stage ``index``, at the
    position ``costs`` price: where it is, how it was measured, its dtype, its NF4 backend and the
    predictions."""
    device = ctx.devices[d]
    choice = ctx.precision[d]
    nf4 = ctx.nf4_choice(d, index)
    return PlannedStage(
        device=device.torch_device or device.name,
        host=device.host,
        start=start,
        stop=stop,
        slot=device.name,
        measured=device.measurement.to_json() if device.measurement else {},
        dtype=choice.dtype if choice else "",
        dtype_reason=choice.reason if choice else "",
        nf4_backend=(nf4.backend or "") if nf4 else "",
        nf4_reason=nf4.reason if nf4 else "",
        **stage_predictions(costs, stop - start, device.memory_bytes),
    )


def stage_predictions(costs: StageCosts, layers: int, capacity_bytes: int) -> dict[str, Any]:
    """A :class:`PlannedStage`'s predicted fields for ``layers`` layers under ``costs``."""
    memory = int(math.ceil(costs.memory(layers)))
    return {
        "predicted_ms_per_microbatch": costs.seconds(layers) * 1e3,
        "memory_bytes": memory,
        "free_bytes": capacity_bytes - memory,
        "capacity_bytes": capacity_bytes,
        "compute_ms": costs.seconds(layers) * 1e3,
        "comm_ms": costs.comm_s * 1e3,
        "in_flight_microbatches": costs.in_flight,
        "memory_breakdown": costs.breakdown(layers),
        "forward_ms": costs.forward(layers) * 1e3,
        "backward_ms": costs.backward(layers) * 1e3,
        "after_step_ms": costs.after(layers) * 1e3,
        "costs": costs,
    }


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
