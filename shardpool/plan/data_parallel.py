"""Data parallelism with shares: where every chosen device holds the whole model, split the step's
micro-batches between them in proportion to their speed.

A pipeline pays its fill and drain once a step (one micro-batch of every other stage,
``(S - 1) / (M + S - 1)`` of it when the stages are balanced) and its links on every micro-batch.
When each of several devices can hold the whole model, a step can instead give replica ``i``
``shares[i]`` of its ``M`` micro-batches: each replica runs them back to back, then the replicas
sum their LoRA gradients in one ring all-reduce over the hosts' links. The gradients are those of
one device training all ``M`` micro-batches (the loss is normalized by the whole step's tokens),
so the training is the same; only where the micro-batches run changes.

Cost model, with each replica a one-stage pipeline priced as the planner prices stages
(:class:`~shardpool.plan.stage_costs.StageCosts`, embedding and ``lm_head`` included):

    step = max_i (shares[i] × (f_i + b_i) + optimizer_i) + ring all-reduce of the LoRA gradients

over the slowest link of the ring (the replicas in rank order, the last back to the first).
:func:`best_shares` finds the integer shares that minimize the first term exactly (identical
micro-batches on machines of different speeds: handing out micro-batches one at a time to the
replica that would finish it first is optimal). :func:`data_parallel_candidate` tries every set
of devices (every subset up to :data:`EXHAUSTIVE_DEVICES` eligible devices, else the fastest
``k`` for each ``k``) and keeps the fastest step. Torch-free and deterministic.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardpool.plan.memory_model import lora_params_per_layer
from shardpool.plan.search_context import SearchContext
from shardpool.plan.stage_costs import StageCosts
from shardpool.plan.time_model import GRADIENT_BYTES, ring_allreduce_seconds

__all__ = [
    "EXHAUSTIVE_DEVICES",
    "DataParallelCandidate",
    "beats_pipeline",
    "best_shares",
    "data_parallel_candidate",
    "eligible_devices",
    "ring_seconds",
    "shares_step_seconds",
]

#: Eligible devices up to which every subset is tried (2^12 subsets); past it, the fastest k for each k.
EXHAUSTIVE_DEVICES = 12


@dataclass(frozen=True)
class DataParallelCandidate:
    """Replicas on ``devices`` (fleet indices, in rank order: fastest first) training ``shares``
    micro-batches each: the predicted ``step_s``, each replica's compute seconds (its share of
    forward + backward) and its one-stage costs."""

    devices: tuple[int, ...]
    shares: tuple[int, ...]
    step_s: float
    compute_s: tuple[float, ...]
    costs: tuple[StageCosts, ...]


def best_shares(seconds: Sequence[float], after: Sequence[float], microbatches: int) -> list[int]:
    """Integer shares (at least 1 each, summing to ``microbatches``) that minimize the latest
    replica's ``share × seconds + after``.

    Greedy: every replica starts with one micro-batch; each further one goes to the replica that
    would finish it earliest (ties to the lower index). With identical micro-batches this is
    optimal: the k-th micro-batch handed out finishes no later under the greedy order than under any
    other assignment. Raises ValueError for fewer micro-batches than replicas.
    """
    count = len(seconds)
    if count == 0 or count != len(after):
        raise ValueError(f"{len(seconds)} replica times and {len(after)} after-step times; give one each")
    if microbatches < count:
        raise ValueError(f"{microbatches} micro-batches cannot give each of {count} replicas one")
    shares = [1] * count
    for _ in range(microbatches - count):
        finish = [(shares[i] + 1) * seconds[i] + after[i] for i in range(count)]
        shares[finish.index(min(finish))] += 1
    return shares


def shares_step_seconds(
    seconds: Sequence[float], after: Sequence[float], shares: Sequence[int], allreduce_s: float
) -> float:
    """The predicted step of replicas training ``shares`` micro-batches: the latest one's compute and
    optimizer, plus the gradient all-reduce they all wait for."""
    return max(n * s + a for n, s, a in zip(shares, seconds, after, strict=True)) + allreduce_s


def ring_seconds(ctx: SearchContext, devices: Sequence[int]) -> float:
    """The ring all-reduce of the whole model's LoRA gradients over ``devices``' hosts, in rank
    order, at the ring's slowest link (bandwidth) and largest latency."""
    if len(devices) < 2:
        return 0.0
    hosts = [ctx.devices[d].host for d in devices]
    links = [ctx.fleet.link(a, b) for a, b in zip(hosts, hosts[1:] + hosts[:1], strict=True)]
    nbytes = lora_params_per_layer(ctx.shape, ctx.workload) * ctx.layers * GRADIENT_BYTES
    return ring_allreduce_seconds(
        nbytes,
        replicas=len(devices),
        bandwidth=min(link.bandwidth for link in links),
        latency=max(link.latency for link in links),
    )


def eligible_devices(ctx: SearchContext, *, distinct: bool = True) -> list[int]:
    """Fleet devices that can each hold the whole model alone, fastest first (ties in fleet order).

    ``distinct``: one per physical device, and no slot of a device that several stages share
    (replicas there would only split its speed). A manual split (``shares``) takes slots too.
    """
    seen: set[tuple[str, str]] = set()
    found: list[int] = []
    for index, device in enumerate(ctx.devices):
        place = (device.host, device.torch_device or device.name)
        if distinct and (device.shared_by > 1 or place in seen):
            continue
        if ctx.stage((index,), 0)[1] < ctx.layers:
            continue
        seen.add(place)
        found.append(index)
    return sorted(found, key=lambda d: (ctx.costs((d,), 0).seconds(ctx.layers), d))


def _candidate(
    ctx: SearchContext, devices: tuple[int, ...], shares: Sequence[int] | None
) -> DataParallelCandidate:
    costs = tuple(ctx.costs((d,), 0) for d in devices)
    seconds = [c.seconds(ctx.layers) for c in costs]
    after = [c.after(ctx.layers) for c in costs]
    chosen = (
        list(shares)
        if shares is not None
        else best_shares(seconds, after, ctx.workload.gradient_accumulation_steps)
    )
    step = shares_step_seconds(seconds, after, chosen, ring_seconds(ctx, devices))
    compute = tuple(n * s for n, s in zip(chosen, seconds, strict=True))
    return DataParallelCandidate(devices, tuple(chosen), step, compute, costs)


def data_parallel_candidate(
    ctx: SearchContext, *, shares: Sequence[int] | None = None
) -> DataParallelCandidate | None:
    """The fastest set of at least two replicas under the cost model, or None where fewer than two
    devices can hold the whole model (or the step has fewer micro-batches than two replicas need).

    With ``shares`` (the config's fixed split of the micro-batches) the replicas are the
    ``len(shares)`` fastest devices that hold the model, slots included, the first share on the
    fastest; None when there are fewer.
    """
    microbatches = ctx.workload.gradient_accumulation_steps
    if shares is not None:
        fitting = eligible_devices(ctx, distinct=False)
        if len(fitting) < len(shares):
            return None
        return _candidate(ctx, tuple(fitting[: len(shares)]), shares)
    eligible = eligible_devices(ctx)
    top = min(len(eligible), microbatches)
    if top < 2:
        return None
    if len(eligible) <= EXHAUSTIVE_DEVICES:
        sets = (subset for size in range(2, top + 1) for subset in itertools.combinations(eligible, size))
    else:
        sets = (tuple(eligible[:size]) for size in range(2, top + 1))
    best: DataParallelCandidate | None = None
    for devices in sets:
        found = _candidate(ctx, devices, None)
        if best is None or found.step_s < best.step_s * (1 - 1e-9):
            best = found
    return best


def beats_pipeline(candidate: DataParallelCandidate | None, pipeline_step_s: float) -> bool:
    """Whether ``candidate`` predicts a shorter step than the pipeline's by more than rounding (a tie
    keeps the pipeline, which holds less on each device)."""
    return (
        candidate is not None
        and math.isfinite(candidate.step_s)
        and candidate.step_s < pipeline_step_s * (1 - 1e-6)
    )
