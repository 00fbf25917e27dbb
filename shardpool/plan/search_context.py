"""What every device-sequence search shares: per-device constants, memoized stage costs, and how
one sequence is scored and compared.

A candidate is an ordered subset of the fleet's devices with a layer split; its objective is the
simulated step time (``plan.pipeline_sim``), ties broken by fewer stages, then a faster
bottleneck. The exact search splits each sequence with ``plan.split_search.best_split``, the
heuristic with ``quick_split``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.fleet import Device, Fleet
from shardpool.plan.memory_model import boundary_bytes
from shardpool.plan.pipeline_sim import Transfer
from shardpool.plan.precision import DTYPE_BYTES, PrecisionChoice, choose_dtype, nf4_refusal
from shardpool.plan.split_search import REL_TOL, SimulationBudget, SplitProblem, best_split, quick_split
from shardpool.plan.stage_costs import StageCosts, stage_costs

__all__ = [
    "Candidate",
    "SearchContext",
    "allowed_stage_counts",
    "device_precision",
    "evaluate_sequence",
    "is_better",
    "refusals",
    "scored",
]

_REL_TOL = REL_TOL


class SearchContext:
    """Per-device constants and a memo of stage costs, shared by every sequence evaluated."""

    def __init__(self, shape: ModelShape, workload: Workload, fleet: Fleet) -> None:
        self.shape, self.workload, self.fleet = shape, workload, fleet
        self.devices: tuple[Device, ...] = fleet.devices
        self.layers = shape.num_layers
        #: Each device's compute dtype (None: the workload's ``compute_bytes`` as given) and the
        #: workload as priced on it.
        self.precision = [device_precision(device, workload) for device in self.devices]
        self.workloads = [
            workload if choice is None else replace(workload, compute_bytes=DTYPE_BYTES[choice.dtype])
            for choice in self.precision
        ]
        self.times = [device.times(shape, w) for device, w in zip(self.devices, self.workloads, strict=True)]
        self.seconds = [times.layer_s for times in self.times]
        nbytes = boundary_bytes(shape, workload)
        hosts = [device.host for device in self.devices]
        links = [[fleet.link(a, b) for b in hosts] for a in hosts]
        self.transfer = [[Transfer(nbytes / link.bandwidth, link.latency) for link in row] for row in links]
        self.send_s = [[transfer.seconds for transfer in row] for row in self.transfer]
        # Replicas of a stage run on its device (the job reuses the placements), so they all-reduce
        # over that host's loopback.
        self.replica_link = [(links[d][d].bandwidth, links[d][d].latency) for d in range(len(hosts))]
        self._memo: dict[tuple, tuple[StageCosts, int]] = {}
        #: Simulations the current search may still run (the exact search sets a limit).
        self.budget = SimulationBudget()

    def costs(self, seq: Sequence[int], index: int) -> StageCosts:
        """Costs of stage ``index`` of the device sequence ``seq``."""
        return self.stage(seq, index)[0]

    def stage(self, seq: Sequence[int], index: int) -> tuple[StageCosts, int]:
        """Costs of stage ``index`` of ``seq`` and the most layers that fit there."""
        d = seq[index]
        s = len(seq)
        to_next = self.transfer[d][seq[index + 1]] if index < s - 1 else Transfer()
        to_previous = self.transfer[d][seq[index - 1]] if index > 0 else Transfer()
        # The in-flight count depends only on S - index (and M), so the key uses that.
        key = (d, index == 0, index == s - 1, s - index, to_next, to_previous)
        found = self._memo.get(key)
        if found is None:
            device = self.devices[d]
            costs = stage_costs(
                self.shape,
                self.workloads[d],
                times=self.times[d],
                capacity_bytes=device.memory_bytes,
                kind=device.kind,
                index=index,
                num_stages=s,
                to_next=to_next,
                to_previous=to_previous,
                replica_link=self.replica_link[d],
                measured_activation_bytes=device.activation_bytes_per_layer,
            )
            found = (costs, costs.max_layers())
            self._memo[key] = found
        return found

    def signature(self, d: int) -> tuple:
        """Devices with equal signatures are interchangeable for the cost model."""
        device = self.devices[d]
        return (
            device.host,
            self.times[d],
            device.memory_bytes,
            device.kind,
            device.activation_bytes_per_layer,
            self.precision[d] and self.precision[d].dtype,
        )

    def problem(self, seq: Sequence[int]) -> SplitProblem:
        """Splitting the model's layers over the device sequence ``seq``."""
        stages = [self.stage(seq, i) for i in range(len(seq))]
        return SplitProblem(
            costs=[c for c, _ in stages],
            caps=[cap for _, cap in stages],
            layers=self.layers,
            microbatches=self.workload.gradient_accumulation_steps,
            schedule=self.workload.schedule,
            budget=self.budget,
            lead=self.workload.lead,
        )


def device_precision(device: Device, workload: Workload) -> PrecisionChoice | None:
    """The dtype a stage on ``device`` computes in under the workload's cap (None: no cap given)."""
    if workload.precision is None:
        return None
    return choose_dtype(device.facts(), workload.precision)


def refusals(fleet: Fleet, workload: Workload) -> dict[str, str]:
    """Devices that may hold no layers of this workload, each with its one-line reason (NF4 support)."""
    if not workload.quantize:
        return {}
    found = {device.name: nf4_refusal(device.facts()) for device in fleet.devices}
    return {name: reason for name, reason in found.items() if reason}


@dataclass(order=True)
class Candidate:
    """A scored device sequence: its step time, stage count, bottleneck and layer counts."""

    objective: float
    num_stages: int
    bottleneck: float
    seq: tuple[int, ...] = field(compare=False)
    counts: list[int] = field(compare=False)


def evaluate_sequence(
    ctx: SearchContext,
    seq: tuple[int, ...],
    *,
    exact: bool = True,
    limit: Candidate | None = None,
) -> Candidate | None:
    """Score the device sequence ``seq`` with its best split (``exact``) or the heuristic's split;
    None when the model does not fit on it, or when it cannot beat ``limit``."""
    problem = ctx.problem(seq)
    bound = math.inf
    allow_tie = False
    if limit is not None:
        bound = limit.objective
        allow_tie = len(seq) < limit.num_stages
    if exact:
        found = best_split(problem, limit=bound, allow_tie=allow_tie)
    else:
        found = quick_split(problem, limit=bound * (1 + _REL_TOL) if allow_tie else bound)
    if found is None:
        return None
    return scored(problem, seq, *found)


def scored(problem: SplitProblem, seq: tuple[int, ...], step: float, counts: list[int]) -> Candidate:
    """The candidate of ``seq`` split into ``counts`` with simulated ``step``."""
    bottleneck = max(c.seconds(n) for c, n in zip(problem.costs, counts, strict=True))
    return Candidate(step, len(seq), bottleneck, seq, counts)


def is_better(new: Candidate | None, best: Candidate | None) -> bool:
    """Whether ``new`` beats ``best``: a lower step time, or (within rounding) fewer stages or a faster bottleneck."""
    if new is None:
        return False
    if best is None:
        return True
    if new.objective < best.objective * (1 - _REL_TOL):
        return True
    if new.objective <= best.objective * (1 + _REL_TOL):
        return (new.num_stages, new.bottleneck) < (best.num_stages, best.bottleneck * (1 - _REL_TOL))
    return False


def allowed_stage_counts(ctx: SearchContext) -> list[int]:
    """Stage counts the search may use: exactly ``workload.stages`` when set, else 1 up to the cap."""
    w, d, layers = ctx.workload, len(ctx.devices), ctx.layers
    if w.stages is not None:
        if w.stages > d:
            raise ShardpoolError(
                f"shardpool.stages is {w.stages} but the fleet has {d} devices; list more devices or lower stages"
            )
        if w.stages > layers:
            raise ShardpoolError(
                f"shardpool.stages is {w.stages} but the model has {layers} layers; use at most {layers} stages"
            )
        return [w.stages]
    top = min(d, layers, w.max_stages or d)
    return list(range(1, top + 1))
