"""What every device-sequence search shares: per-device constants, memoized stage costs, and how
one sequence is scored and compared.

A candidate is an ordered subset of the fleet's devices with its exact layer split
(:func:`~shardpool.plan.splits.min_max_split`); its objective is the predicted step time
``(M + S - 1) * t_max``, ties broken by fewer stages, then a faster bottleneck.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.fleet import Device, Fleet
from shardpool.plan.memory_model import boundary_bytes
from shardpool.plan.splits import min_max_split
from shardpool.plan.stage_costs import StageCosts, stage_costs
from shardpool.plan.time_model import step_seconds

__all__ = ["Candidate", "SearchContext", "allowed_stage_counts", "evaluate_sequence", "is_better"]

_REL_TOL = 1e-9


class SearchContext:
    """Per-device constants and a memo of stage costs, shared by every sequence evaluated."""

    def __init__(self, shape: ModelShape, workload: Workload, fleet: Fleet) -> None:
        self.shape, self.workload, self.fleet = shape, workload, fleet
        self.devices: tuple[Device, ...] = fleet.devices
        self.layers = shape.num_layers
        self.seconds = [device.layer_seconds(shape, workload) for device in self.devices]
        nbytes = boundary_bytes(shape, workload)
        hosts = [device.host for device in self.devices]
        self.send_s = [[fleet.link(a, b).seconds(nbytes) for b in hosts] for a in hosts]
        self._memo: dict[tuple, tuple[StageCosts, int]] = {}

    def costs(self, seq: Sequence[int], index: int) -> StageCosts:
        """Costs of stage ``index`` of the device sequence ``seq``."""
        return self.stage(seq, index)[0]

    def stage(self, seq: Sequence[int], index: int) -> tuple[StageCosts, int]:
        """Costs of stage ``index`` of ``seq`` and the most layers that fit there."""
        d = seq[index]
        s = len(seq)
        fwd = self.send_s[d][seq[index + 1]] if index < s - 1 else 0.0
        bwd = self.send_s[d][seq[index - 1]] if index > 0 else 0.0
        # The in-flight count depends only on S - index (and M), so the key uses that.
        key = (d, index == 0, index == s - 1, s - index, fwd, bwd)
        found = self._memo.get(key)
        if found is None:
            device = self.devices[d]
            costs = stage_costs(
                self.shape,
                self.workload,
                seconds_per_layer=self.seconds[d],
                capacity_bytes=device.memory_bytes,
                kind=device.kind,
                index=index,
                num_stages=s,
                send_forward_s=fwd,
                send_backward_s=bwd,
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
            self.seconds[d],
            device.memory_bytes,
            device.kind,
            device.activation_bytes_per_layer,
        )


@dataclass(order=True)
class Candidate:
    """A scored device sequence: its step time, stage count, bottleneck and layer counts."""

    objective: float
    num_stages: int
    bottleneck: float
    seq: tuple[int, ...] = field(compare=False)
    counts: list[int] = field(compare=False)


def evaluate_sequence(ctx: SearchContext, seq: tuple[int, ...]) -> Candidate | None:
    """Score the device sequence ``seq`` with its best split; None when the model does not fit on it."""
    stages = [ctx.stage(seq, i) for i in range(len(seq))]
    fixed = [c.fixed_s for c, _ in stages]
    per = [c.per_layer_s for c, _ in stages]
    counts = min_max_split(fixed, per, [cap for _, cap in stages], ctx.layers)
    if counts is None:
        return None
    bottleneck = max(f + n * p for f, n, p in zip(fixed, counts, per, strict=True))
    objective = step_seconds(
        bottleneck, microbatches=ctx.workload.gradient_accumulation_steps, num_stages=len(seq)
    )
    return Candidate(objective, len(seq), bottleneck, seq, counts)


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
