"""The capability-aware sharder: which devices, in which order, holding which layers.

The objective is the predicted step time: the schedule (1F1B or GPipe) simulated over the
step's micro-batches with each stage's forward and backward compute and each link's transfers as
separate resources that overlap, plus the replicas' gradient all-reduce and the optimizer step
(``plan.pipeline_sim``). A device that would slow the pipeline (a slow bottleneck, or a stage
whose fill and drain cost more than its layers save) is left out. For a fixed sequence of devices
every stage's times and memory are affine in its layer count (all decoder layers are identical);
``plan.split_search`` finds the best split exactly by a bounded depth-first search over the
counts. The sequence itself (which devices, in what order) is searched exhaustively for small
fleets (identical devices are deduplicated, sequences visited by a lower bound and cut off past
the best step, ``plan.exact_search``) and by a seeded local search with a budget of evaluations
beyond (``plan.heuristic_search``). This module picks the search and explains a model that fits
nowhere; ``plan.assemble`` prices the chosen assignment as a :class:`Plan`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import permutations
from typing import Any

from shardpool.contract.schedule import MAX_LEAD
from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.assemble import assemble_plan, data_parallel_plan, stage_predictions
from shardpool.plan.costmodel import Workload
from shardpool.plan.data_parallel import beats_pipeline, data_parallel_candidate
from shardpool.plan.exact_search import distinct_sequences, exact_search
from shardpool.plan.fleet import Fleet
from shardpool.plan.heuristic_search import heuristic_search
from shardpool.plan.pipeline_sim import simulate_step
from shardpool.plan.result import Plan
from shardpool.plan.search_context import SearchContext, allowed_stage_counts, refusals
from shardpool.plan.stage_costs import StageCosts

__all__ = [
    "EXACT_SEQUENCE_LIMIT",
    "EXACT_SIMULATION_LIMIT",
    "HEURISTIC_EVALUATIONS",
    "evaluate_split",
    "plan_pipeline",
    "resplit_plan",
]

GIB = 2**30
#: Sequences (ordered device subsets, identical devices merged) searched exhaustively.
EXACT_SEQUENCE_LIMIT = 20000
#: Simulated steps the exhaustive search may run before the local search takes over.
EXACT_SIMULATION_LIMIT = 5000
#: Device orders a fixed split (``Workload.layers``) may try: beyond it the fleet is too large to try
#: every order of that many stages, and the split is refused with the fix.
GIVEN_SPLIT_ORDERS = 5040
#: Sequence evaluations the local search on large fleets may spend (a count, not a time, so a
#: fleet gets the same plan on any machine).
HEURISTIC_EVALUATIONS = 3000
#: Predicted steps closer than this are a tie (the shallower warm-up lead wins it).
STEP_TIE_S = 1e-9
#: Deeper warm-up leads that may predict no shorter step in a row before the search over leads
#: stops, on a fleet whose splits the heuristic search plans (an exact search tries every lead).
LEAD_PATIENCE = 2


def plan_pipeline(
    shape: ModelShape,
    workload: Workload,
    fleet: Fleet,
    *,
    exact_limit: int = EXACT_SEQUENCE_LIMIT,
    exact_simulations: int = EXACT_SIMULATION_LIMIT,
    evaluations: int = HEURISTIC_EVALUATIONS,
) -> Plan:
    """Choose devices, their order, a contiguous layer split and (``warmup_lead`` None, auto) the
    1F1B warm-up lead minimizing the predicted step time (:func:`_plan_at_lead` for one lead).

    Under auto each lead from 1 up is planned in full and the shortest predicted step wins, a
    shallower lead on a tie (less activation memory). Where the split search is exact, every lead
    up to ``MAX_LEAD`` is planned, so the plan is the model's optimum over devices, order, split
    and lead. Where it is heuristic (large fleets) the search over leads stops once
    ``LEAD_PATIENCE`` leads in a row predict no shorter step than the best so far: the step falls
    with the lead while links' round trips still stall the warm-up, then levels off. A deeper lead
    holds more micro-batches' activations, so once one fits nowhere the deeper ones are not tried
    (they fit nowhere either); the errors are those of lead 1. GPipe has no warm-up to deepen.
    """
    workload = _stages_of_nf4_list(workload)
    return _over_leads(
        workload,
        lambda at_lead: _plan_at_lead(
            shape,
            at_lead,
            fleet,
            exact_limit=exact_limit,
            exact_simulations=exact_simulations,
            evaluations=evaluations,
        ),
    )


def _stages_of_nf4_list(workload: Workload) -> Workload:
    """The workload with as many stages as its per-stage ``shardpool.nf4_backend`` list names (an NF4
    base only); a clear error when ``shardpool.stages`` says otherwise."""
    settings = workload.nf4_backend
    if not workload.quantize or not isinstance(settings, tuple):
        return workload
    if workload.stages is None:
        return replace(workload, stages=len(settings))
    if workload.stages != len(settings):
        raise ShardpoolError(
            f"shardpool.nf4_backend names {len(settings)} stages but {workload.stages} are planned; "
            "give one entry per stage, or a single setting for all"
        )
    return workload


def _over_leads(workload: Workload, plan_at: Callable[[Workload], Plan]) -> Plan:
    """``plan_at`` the workload's lead, or under auto (``warmup_lead`` None, 1F1B) the plan of the lead
    that predicts the shortest step by :func:`plan_pipeline`'s rule: leads from 1 up, the shallower
    on a tie, until one raises (fits nowhere) or ``MAX_LEAD``, or, for heuristic plans only,
    ``LEAD_PATIENCE`` leads in a row predict no shorter step. Lead 1's errors are the caller's."""
    if workload.warmup_lead is not None or workload.schedule != "1f1b":
        return plan_at(replace(workload, warmup_lead=workload.lead))
    best = plan_at(replace(workload, warmup_lead=1))
    since_better = 0
    for lead in range(2, MAX_LEAD + 1):
        try:
            deeper = plan_at(replace(workload, warmup_lead=lead))
        except ShardpoolError:
            break
        if deeper.fits and deeper.predicted_step_s < best.predicted_step_s - STEP_TIE_S:
            best, since_better = deeper, 0
        else:
            since_better += 1
            if since_better == LEAD_PATIENCE and deeper.search == "heuristic":
                break
    return best


def _plan_at_lead(
    shape: ModelShape,
    workload: Workload,
    fleet: Fleet,
    *,
    exact_limit: int,
    exact_simulations: int,
    evaluations: int,
) -> Plan:
    """Choose devices, their order and a contiguous layer split minimizing the predicted step time.

    The split is exact for every device sequence considered; sequences are searched
    exhaustively when there are at most ``exact_limit`` of them and the search needs at most
    ``exact_simulations`` simulated steps, else by local search spending at most ``evaluations``
    sequence evaluations. Both limits are counts, so a fleet gets the same plan on any machine. Raises :class:`ShardpoolError` saying how many GiB are missing, and where
    they would help, when the model fits on no subset of the fleet. Devices that cannot run the
    workload (bitsandbytes NF4 asked for on a card it has no kernels for) get no layers; the plan's
    ``refused`` says why. A card bitsandbytes cannot run on otherwise computes NF4 in plain
    PyTorch, priced as such (:meth:`SearchContext.nf4_choice`). With ``workload.layers`` the split
    is fixed and only the devices and their order are chosen (:func:`_given_split`).
    """
    refused = refusals(fleet, workload)
    if refused:
        usable = tuple(device for device in fleet.devices if device.name not in refused)
        if not usable:
            raise ShardpoolError(next(iter(refused.values())))
        fleet = replace(fleet, devices=usable)
    ctx = SearchContext(shape, workload, fleet)
    if workload.shares is not None:
        return _given_shares(ctx, workload.shares, refused)
    if workload.layers is not None:
        return _given_split(ctx, list(workload.layers), refused)
    allowed = allowed_stage_counts(ctx)
    sequences = distinct_sequences(ctx, allowed, exact_limit)
    best, complete = None, False
    if sequences is not None:
        best, complete = exact_search(ctx, sequences, simulations=exact_simulations)
    search = "exact" if complete else "heuristic"
    if not complete:
        best = heuristic_search(ctx, allowed, evaluations, start=best)
    if best is None:
        raise ShardpoolError(_explain_no_fit(ctx))
    if _may_split_batch(workload):
        replicas = data_parallel_candidate(ctx)
        if workload.data_parallel == "on" and replicas is None:
            raise ShardpoolError(
                "shardpool.data_parallel is on but fewer than two devices can each hold the whole "
                f"{shape.name or 'model'}; set it to auto or off to pipeline the layers instead"
            )
        if replicas is not None and (
            workload.data_parallel == "on" or beats_pipeline(replicas, best.objective)
        ):
            return data_parallel_plan(ctx, replicas, search=search, refused=refused)
    return assemble_plan(ctx, best.seq, best.counts, search=search, refused=refused)


def _may_split_batch(workload: Workload) -> bool:
    """Whether the planner may choose whole-model replicas: asked for (``data_parallel: auto | on``),
    and nothing in the config fixes the pipeline (its stages, its split, or pipeline replicas)."""
    return (
        workload.data_parallel != "off"
        and workload.stages is None
        and workload.layers is None
        and workload.replicas == 1
    )


def _given_shares(ctx: SearchContext, shares: Sequence[int], refused: dict[str, str]) -> Plan:
    """The fixed data-parallel split ``shares`` (``shardpool.shares``) on the fastest devices that hold the model."""
    found = data_parallel_candidate(ctx, shares=shares)
    if found is None:
        raise ShardpoolError(
            f"shardpool.shares names {len(shares)} replicas but fewer devices can hold the whole "
            f"{ctx.shape.name or 'model'}; give fewer shares, or remove them and let the planner split the layers"
        )
    return data_parallel_plan(ctx, found, search="given", refused=refused)


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
    splits) and by tests. The result has ``fits=False`` when a stage overflows its device. Under
    ``warmup_lead`` auto the lead is chosen by :func:`plan_pipeline`'s rule (:func:`_over_leads`).
    """
    return _over_leads(
        workload, lambda at_lead: _evaluate_at_lead(shape, at_lead, fleet, devices=devices, layers=layers)
    )


def _evaluate_at_lead(
    shape: ModelShape,
    workload: Workload,
    fleet: Fleet,
    *,
    devices: Sequence[str],
    layers: Sequence[tuple[int, int]] | Sequence[int],
) -> Plan:
    """:func:`evaluate_split` at the workload's own lead."""
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
    _stages_of_nf4_list(replace(workload, stages=len(devices)))  # one nf4_backend entry per stage
    refused = refusals(fleet, workload)
    for name in devices:
        if name in refused:
            raise ShardpoolError(refused[name])
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
    for position, d in enumerate(seq):  # a per-stage nf4_backend may ask a stage for what its device lacks
        nf4 = ctx.nf4_choice(d, position)
        if nf4 is not None and nf4.backend is None:
            raise ShardpoolError(nf4.reason)
    return assemble_plan(ctx, seq, counts, search="given")


def _given_split(ctx: SearchContext, counts: list[int], refused: dict[str, str]) -> Plan:
    """The fixed split ``counts`` on the order of devices predicted fastest (fitting orders first).

    For ``shardpool.layers`` on the mesh, where the user fixes the split but not the members: every
    order of ``len(counts)`` of the fleet's devices is simulated.
    """
    stages, devices = len(counts), len(ctx.devices)
    if sum(counts) != ctx.layers:
        raise ShardpoolError(
            f"shardpool.layers {counts} sums to {sum(counts)} but the model has {ctx.layers} layers; "
            "make the counts add up"
        )
    if stages > devices:
        raise ShardpoolError(
            f"shardpool.layers asks for {stages} stages but {devices} devices can take them; give at most {devices}"
        )
    if math.perm(devices, stages) > GIVEN_SPLIT_ORDERS:
        raise ShardpoolError(
            f"{devices} devices have too many orders for a fixed split of {stages} stages; "
            "remove shardpool.layers and let the planner split"
        )

    def rank(seq: tuple[int, ...]) -> tuple[bool, float]:
        stage_costs = [ctx.stage(seq, i) for i in range(stages)]
        fits = all(n <= cap for (_, cap), n in zip(stage_costs, counts, strict=True))
        step = simulate_step(
            [c.times(n) for (c, _), n in zip(stage_costs, counts, strict=True)],
            microbatches=ctx.workload.gradient_accumulation_steps,
            schedule=ctx.workload.schedule,
            lead=ctx.workload.lead,
        ).step_s
        return (not fits, step)

    best = min(permutations(range(devices), stages), key=rank)
    return assemble_plan(ctx, best, counts, search="given", refused=refused)


def resplit_plan(
    plan: Plan,
    costs: Sequence[StageCosts],
    counts: Sequence[int],
    *,
    microbatches: int,
    schedule: str,
    search: str,
    calibration: dict[str, Any] | None = None,
) -> Plan:
    """``plan``'s stages (same devices, same order) holding ``counts`` layers, predicted with ``costs``.

    Calibration (``plan.calibrate``) re-splits a running plan with costs corrected by the measured
    steps; the result is a full plan whose predictions are those costs', so ``plan.json`` stays true.
    """
    if len(costs) != len(plan.stages) or len(counts) != len(plan.stages):
        raise ShardpoolError(
            f"{len(plan.stages)} stages but {len(costs)} stage costs and {len(counts)} layer counts; give one each"
        )
    simulation = simulate_step(
        [c.times(n) for c, n in zip(costs, counts, strict=True)],
        microbatches=microbatches,
        schedule=schedule,
        lead=plan.warmup_lead,
    )
    stages, start, fits = [], 0, True
    for old, stage_costs, n in zip(plan.stages, costs, counts, strict=True):
        fits = fits and n <= stage_costs.max_layers()
        capacity = old.capacity_bytes or int(stage_costs.capacity_bytes)
        fields = stage_predictions(stage_costs, n, capacity)
        stages.append(replace(old, start=start, stop=start + n, bottleneck=False, **fields))
        start += n
    resplit = replace(
        plan,
        stages=stages,
        predicted_step_s=simulation.step_s,
        bubble_fraction=simulation.bubble_fraction,
        microbatches=microbatches,
        schedule=schedule,
        search=search,
        fits=fits,
        calibration=dict(calibration or {}),
    )
    resplit.stages[resplit.bottleneck_index].bottleneck = True
    return resplit


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
