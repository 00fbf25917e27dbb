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
from shardpool.plan.precision import (
    DTYPE_BYTES,
    NF4Choice,
    NF4Setting,
    PrecisionChoice,
    choose_dtype,
    choose_nf4_backend,
)
from shardpool.plan.split_search import REL_TOL, SimulationBudget, SplitProblem, best_split, quick_split
from shardpool.plan.stage_costs import StageCosts, stage_costs
from shardpool.plan.time_model import DeviceTimes

__all__ = [
    "Candidate",
    "SearchContext",
    "allowed_stage_counts",
    "device_nf4_choice",
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
        self._times: dict[tuple[int, str | None], DeviceTimes] = {}
        #: Each device's times as the first stage (its NF4 backend can depend on the position).
        self.times = [self.device_times(d, 0) for d in range(len(self.devices))]
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

    def nf4_choice(self, d: int, index: int) -> NF4Choice | None:
        """How device ``d`` computes with NF4 weights as pipeline stage ``index``; None for an unquantized base."""
        if not self.workload.quantize:
            return None
        return device_nf4_choice(self.devices[d], self.workload.nf4_setting(index))

    def device_times(self, d: int, index: int) -> DeviceTimes:
        """Device ``d``'s compute times as pipeline stage ``index`` (on the NF4 backend it has there)."""
        choice = self.nf4_choice(d, index)
        backend = choice.backend if choice else None
        found = self._times.get((d, backend))
        if found is None:
            found = self.devices[d].times(self.shape, self.workloads[d], nf4_backend=backend)
            self._times[(d, backend)] = found
        return found

    def costs(self, seq: Sequence[int], index: int) -> StageCosts:
        """Costs of stage ``index`` of the device sequence ``seq``."""
        return self.stage(seq, index)[0]

    def stage(self, seq: Sequence[int], index: int) -> tuple[StageCosts, int]:
        """Costs of stage ``index`` of ``seq`` and the most layers that fit there (-1 where the
        device cannot compute with NF4 weights as that stage)."""
        d = seq[index]
        s = len(seq)
        to_next = self.transfer[d][seq[index + 1]] if index < s - 1 else Transfer()
        to_previous = self.transfer[d][seq[index - 1]] if index > 0 else Transfer()
        choice = self.nf4_choice(d, index)
        backend = choice.backend if choice else None
        # The in-flight count depends only on S - index (and M), so the key uses that.
        key = (d, backend, index == 0, index == s - 1, s - index, to_next, to_previous)
        found = self._memo.get(key)
        if found is None:
            device = self.devices[d]
            costs = stage_costs(
                self.shape,
                self.workloads[d],
                times=self.device_times(d, index),
                capacity_bytes=device.memory_bytes,
                kind=device.kind,
                index=index,
                num_stages=s,
                to_next=to_next,
                to_previous=to_previous,
                replica_link=self.replica_link[d],
                measured_activation_bytes=device.activation_bytes_per_layer,
                nf4_backend=backend,
            )
            found = (costs, -1 if choice is not None and backend is None else costs.max_layers())
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
            device.compute_capability,
            device.nf4_backend,
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


def device_nf4_choice(device: Device, setting: NF4Setting) -> NF4Choice:
    """How a stage on ``device`` computes with NF4 weights under ``setting``: a local device's choice,
    made when it was profiled (``plan.local_fleet``), else the one its compute capability allows."""
    if device.nf4_backend is not None:
        return NF4Choice("torch" if device.nf4_backend == "torch" else "bitsandbytes", device.nf4_reason)
    return choose_nf4_backend(setting, device.facts())


def refusals(fleet: Fleet, workload: Workload) -> dict[str, str]:
    """Devices that may hold no layers of this workload, each with its one-line reason: an NF4 base
    on a device that cannot compute with it under ``shardpool.nf4_backend`` at any stage (bitsandbytes
    asked for where it has no kernels). A device bitsandbytes cannot run on computes NF4 in plain
    PyTorch under ``auto`` and ``torch``, so it is not refused."""
    if not workload.quantize:
        return {}
    settings = workload.nf4_backend if isinstance(workload.nf4_backend, tuple) else (workload.nf4_backend,)
    found: dict[str, str] = {}
    for device in fleet.devices:
        choices = [device_nf4_choice(device, setting) for setting in settings]
        if all(choice.backend is None for choice in choices):
            found[device.name] = choices[0].reason
    return found


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
