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
layers save) is left out.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import (
    StageCosts,
    Workload,
    boundary_bytes,
    bubble_fraction,
    stage_costs,
    step_seconds,
)
from shardpool.plan.fleet import Device, Fleet, local_fleet

__all__ = [
    "Plan",
    "PlannedStage",
    "Workload",
    "evaluate_split",
    "even_split",
    "load_config_with_overrides",
    "local_fleet",
    "plan_for_config",
    "plan_pipeline",
    "plan_table",
    "proportional_split",
]

GIB = 2**30
#: Sequences (ordered device subsets, identical devices merged) searched exhaustively.
EXACT_SEQUENCE_LIMIT = 20000
#: Wall-clock budget of the local search on large fleets.
HEURISTIC_BUDGET_S = 1.0
_REL_TOL = 1e-9


# ---------------------------------------------------------------------------- plan types


@dataclass
class PlannedStage:
    """One pipeline stage: a device and its contiguous layers ``[start, stop)``, with predictions."""

    device: str
    host: str
    start: int
    stop: int
    predicted_ms_per_microbatch: float
    memory_bytes: int
    free_bytes: int
    slot: str = ""
    capacity_bytes: int = 0
    compute_ms: float = 0.0
    comm_ms: float = 0.0
    in_flight_microbatches: int = 1
    memory_breakdown: dict[str, int] = field(default_factory=dict)
    bottleneck: bool = False

    @property
    def num_layers(self) -> int:
        """Number of decoder layers this stage holds."""
        return self.stop - self.start

    def to_json(self) -> dict[str, Any]:
        """This stage as a ``plan.json`` entry."""
        return {
            "device": self.device,
            "host": self.host,
            "layers": [self.start, self.stop],
            "slot": self.slot or self.device,
            "predicted_ms_per_microbatch": round(self.predicted_ms_per_microbatch, 3),
            "compute_ms": round(self.compute_ms, 3),
            "comm_ms": round(self.comm_ms, 3),
            "memory_bytes": self.memory_bytes,
            "free_bytes": self.free_bytes,
            "capacity_bytes": self.capacity_bytes,
            "in_flight_microbatches": self.in_flight_microbatches,
            "memory_breakdown": dict(self.memory_breakdown),
            "bottleneck": self.bottleneck,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PlannedStage:
        """Read a ``plan.json`` stage entry; only ``device`` and ``layers`` are required."""
        try:
            start, stop = (int(x) for x in data["layers"])
            device = str(data["device"])
        except (KeyError, TypeError, ValueError):
            raise ShardpoolError(
                f"plan stage {dict(data)!r} lacks 'device' or a 'layers': [start, stop] pair; fix plan.json"
            ) from None
        return cls(
            device=device,
            host=str(data.get("host", "local")),
            start=start,
            stop=stop,
            predicted_ms_per_microbatch=float(data.get("predicted_ms_per_microbatch", 0.0)),
            memory_bytes=int(data.get("memory_bytes", 0)),
            free_bytes=int(data.get("free_bytes", 0)),
            slot=str(data.get("slot", device)),
            capacity_bytes=int(data.get("capacity_bytes", 0)),
            compute_ms=float(data.get("compute_ms", 0.0)),
            comm_ms=float(data.get("comm_ms", 0.0)),
            in_flight_microbatches=int(data.get("in_flight_microbatches", 1)),
            memory_breakdown={str(k): int(v) for k, v in dict(data.get("memory_breakdown", {})).items()},
            bottleneck=bool(data.get("bottleneck", False)),
        )


@dataclass
class Plan:
    """A pipeline plan: stages in pipeline order and the predicted step.

    ``predicted_step_s`` uses ``microbatches`` (the configured gradient accumulation);
    ``recommended_microbatches`` is the smallest M that keeps the bubble under about 20%
    (``M >= 4 S``) while fitting in memory. ``fits`` is False only for plans built by
    :func:`evaluate_split` from a split that overflows a device.
    """

    stages: list[PlannedStage]
    predicted_step_s: float
    bubble_fraction: float
    microbatches: int
    recommended_microbatches: int
    schedule: str = "1f1b"
    num_layers: int = 0
    model: str = ""
    left_out: list[str] = field(default_factory=list)
    search: str = "exact"
    fits: bool = True

    @property
    def bottleneck_ms(self) -> float:
        """Predicted milliseconds per micro-batch of the slowest stage."""
        return max(stage.predicted_ms_per_microbatch for stage in self.stages)

    @property
    def bottleneck_index(self) -> int:
        """Position of the slowest stage."""
        times = [stage.predicted_ms_per_microbatch for stage in self.stages]
        return times.index(max(times))

    def layer_ranges(self) -> list[tuple[int, int]]:
        """``[start, stop)`` of every stage, in pipeline order."""
        return [(stage.start, stage.stop) for stage in self.stages]

    def to_json(self) -> dict[str, Any]:
        """The plan in ``plan.json`` format (stages in pipeline order)."""
        return {
            "stages": [stage.to_json() for stage in self.stages],
            "predicted_step_s": round(self.predicted_step_s, 6),
            "bottleneck_ms": round(self.bottleneck_ms, 3),
            "bottleneck_stage": self.bottleneck_index,
            "bubble_fraction": round(self.bubble_fraction, 6),
            "microbatches": self.microbatches,
            "recommended_microbatches": self.recommended_microbatches,
            "schedule": self.schedule,
            "num_layers": self.num_layers,
            "model": self.model,
            "left_out": list(self.left_out),
            "search": self.search,
            "fits": self.fits,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Plan:
        """Read a plan written by :meth:`to_json` (or a hand-written one with just stages)."""
        raw_stages = data.get("stages") if isinstance(data, Mapping) else None
        if not raw_stages or not isinstance(raw_stages, list):
            raise ShardpoolError("plan.json has no 'stages' list; write at least one stage")
        stages = [PlannedStage.from_json(stage) for stage in raw_stages]
        expected = 0
        for stage in stages:
            if stage.start != expected or stage.stop <= stage.start:
                raise ShardpoolError(
                    f"plan.json stage on {stage.device} has layers [{stage.start}, {stage.stop}) but the "
                    f"next stage must start at layer {expected} and hold at least one; make the ranges contiguous"
                )
            expected = stage.stop
        num_stages = len(stages)
        microbatches = int(data.get("microbatches", 1))
        return cls(
            stages=stages,
            predicted_step_s=float(data.get("predicted_step_s", 0.0)),
            bubble_fraction=float(
                data.get("bubble_fraction", bubble_fraction(microbatches=microbatches, num_stages=num_stages))
            ),
            microbatches=microbatches,
            recommended_microbatches=int(data.get("recommended_microbatches", microbatches)),
            schedule=str(data.get("schedule", "1f1b")),
            num_layers=int(data.get("num_layers", expected)),
            model=str(data.get("model", "")),
            left_out=[str(x) for x in data.get("left_out", [])],
            search=str(data.get("search", "given")),
            fits=bool(data.get("fits", True)),
        )


# ---------------------------------------------------------------------------- splits


def even_split(num_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Split ``num_layers`` into ``n_stages`` contiguous ranges as evenly as possible (baseline)."""
    return proportional_split(num_layers, [1.0] * n_stages)


def proportional_split(num_layers: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous ranges with layer counts proportional to ``weights`` (e.g. memory), each >= 1.

    Largest-remainder rounding; used as a baseline and by the benchmark.
    """
    n = len(weights)
    if n == 0 or num_layers < n:
        raise ShardpoolError(
            f"cannot split {num_layers} layers into {n} stages; use at most {num_layers} stages"
        )
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ShardpoolError("split weights must be non-negative with a positive sum")
    spare = num_layers - n
    total = sum(weights)
    shares = [spare * w / total for w in weights]
    counts = [1 + math.floor(s) for s in shares]
    order = sorted(range(n), key=lambda i: shares[i] - math.floor(shares[i]), reverse=True)
    for i in order[: num_layers - sum(counts)]:
        counts[i] += 1
    return _ranges(counts)


def _ranges(counts: Sequence[int]) -> list[tuple[int, int]]:
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


# ---------------------------------------------------------------------------- cost context


class _Context:
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
class _Candidate:
    objective: float
    num_stages: int
    bottleneck: float
    seq: tuple[int, ...] = field(compare=False)
    counts: list[int] = field(compare=False)


def _split_for(
    fixed: Sequence[float], per: Sequence[float], caps: Sequence[int], layers: int
) -> list[int] | None:
    """Layer counts minimizing ``max(fixed[i] + n_i * per[i])`` with ``1 <= n_i <= caps[i]``, summing to ``layers``.

    Exact: any split with bottleneck T gives stage i at most ``count_i(T)`` layers, and this
    greedy stops at the smallest T whose counts reach ``layers``.
    """
    s = len(fixed)
    if s > layers or min(caps) < 1 or sum(min(c, layers) for c in caps) < layers:
        return None
    counts = [1] * s
    heap = [(fixed[i] + 2 * per[i], i) for i in range(s) if caps[i] >= 2]
    heapq.heapify(heap)
    for _ in range(layers - s):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        if counts[i] < caps[i]:
            heapq.heappush(heap, (fixed[i] + (counts[i] + 1) * per[i], i))
    return counts


def _evaluate(ctx: _Context, seq: tuple[int, ...]) -> _Candidate | None:
    stages = [ctx.stage(seq, i) for i in range(len(seq))]
    fixed = [c.fixed_s for c, _ in stages]
    per = [c.per_layer_s for c, _ in stages]
    counts = _split_for(fixed, per, [cap for _, cap in stages], ctx.layers)
    if counts is None:
        return None
    bottleneck = max(f + n * p for f, n, p in zip(fixed, counts, per, strict=True))
    objective = step_seconds(
        bottleneck, microbatches=ctx.workload.gradient_accumulation_steps, num_stages=len(seq)
    )
    return _Candidate(objective, len(seq), bottleneck, seq, counts)


def _better(new: _Candidate | None, best: _Candidate | None) -> bool:
    if new is None:
        return False
    if best is None:
        return True
    if new.objective < best.objective * (1 - _REL_TOL):
        return True
    if new.objective <= best.objective * (1 + _REL_TOL):
        return (new.num_stages, new.bottleneck) < (best.num_stages, best.bottleneck * (1 - _REL_TOL))
    return False


# ---------------------------------------------------------------------------- searches


def _allowed_stage_counts(ctx: _Context) -> list[int]:
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


def _class_sequences(ctx: _Context, allowed: Sequence[int], limit: int) -> list[tuple[int, ...]] | None:
    """All ordered device subsets with lengths in ``allowed``, identical devices merged; None past ``limit``."""
    classes: dict[tuple, list[int]] = {}
    for d in range(len(ctx.devices)):
        classes.setdefault(ctx.signature(d), []).append(d)
    members = list(classes.values())
    remaining = [len(m) for m in members]
    out: list[tuple[int, ...]] = []
    top = max(allowed)
    wanted = set(allowed)

    def extend(prefix: list[int]) -> bool:
        if len(prefix) in wanted:
            out.append(tuple(prefix))
            if len(out) > limit:
                return False
        if len(prefix) == top:
            return True
        for c, group in enumerate(members):
            if remaining[c]:
                remaining[c] -= 1
                prefix.append(group[len(group) - remaining[c] - 1])
                ok = extend(prefix)
                prefix.pop()
                remaining[c] += 1
                if not ok:
                    return False
        return True

    return out if extend([]) else None


def _exact(ctx: _Context, sequences: Sequence[tuple[int, ...]]) -> _Candidate | None:
    best = None
    for seq in sequences:
        candidate = _evaluate(ctx, seq)
        if _better(candidate, best):
            best = candidate
    return best


def _arrange(ctx: _Context, subset: Sequence[int]) -> tuple[int, ...]:
    """A sensible order: devices of one host together, hosts chained by their fastest links,
    roomier devices first within a host (early 1F1B stages hold more micro-batches)."""
    by_host: dict[str, list[int]] = {}
    for d in subset:
        by_host.setdefault(ctx.devices[d].host, []).append(d)
    for group in by_host.values():
        group.sort(key=lambda d: -ctx.devices[d].memory_bytes)
    hosts = list(by_host)
    if len(hosts) > 1:
        rep = {h: by_host[h][0] for h in hosts}

        def hop(a: str, b: str) -> float:
            return ctx.send_s[rep[a]][rep[b]]

        if len(hosts) <= 6:
            hosts = list(
                min(
                    itertools.permutations(hosts),
                    key=lambda p: sum(hop(a, b) for a, b in itertools.pairwise(p)),
                )
            )
        else:
            chain = [hosts[0]]
            rest = set(hosts[1:])
            while rest:
                nxt = min(rest, key=lambda h: (hop(chain[-1], h), h))
                chain.append(nxt)
                rest.remove(nxt)
            hosts = chain
    return tuple(d for h in hosts for d in by_host[h])


def _neighbours(seq: tuple[int, ...], unused: Sequence[int], allowed: set[int]) -> Iterator[tuple[int, ...]]:
    s = len(seq)
    pairs = itertools.combinations(range(s), 2)
    if s > 24:
        pairs = (
            {(i, i + 1) for i in range(s - 1)}
            | {(0, j) for j in range(1, s)}
            | {(j, s - 1) for j in range(s - 1)}
        )
    for i, j in pairs:
        swapped = list(seq)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        yield tuple(swapped)
    for i in range(s):
        for u in unused:
            yield seq[:i] + (u,) + seq[i + 1 :]
    if s - 1 in allowed:
        for i in range(s):
            yield seq[:i] + seq[i + 1 :]
    if s + 1 in allowed:
        for u in unused[:8]:
            for i in range(s + 1):
                yield seq[:i] + (u,) + seq[i:]


def _heuristic(ctx: _Context, allowed: Sequence[int], budget_s: float) -> _Candidate | None:
    """Seed with the fastest (and, separately, the roomiest) k devices for every k, descend from
    the best seeds, then perturb and descend again (iterated local search) until ``budget_s``
    runs out or many perturbations in a row bring nothing."""
    deadline = time.perf_counter() + budget_s
    n = len(ctx.devices)
    by_speed = sorted(range(n), key=lambda d: (ctx.seconds[d], -ctx.devices[d].memory_bytes, d))
    by_room = sorted(range(n), key=lambda d: (-ctx.devices[d].memory_bytes, ctx.seconds[d], d))
    seeds: list[_Candidate] = []
    for k in allowed:
        for ranking in (by_speed, by_room):
            candidate = _evaluate(ctx, _arrange(ctx, ranking[:k]))
            if candidate is not None:
                seeds.append(candidate)
    seeds.sort()
    allowed_set = set(allowed)

    def descend(current: _Candidate) -> _Candidate:
        improved = True
        while improved and time.perf_counter() < deadline:
            improved = False
            used = set(current.seq)
            unused = [d for d in by_speed if d not in used][:16]
            for seq in _neighbours(current.seq, unused, allowed_set):
                candidate = _evaluate(ctx, seq)
                if _better(candidate, current):
                    current, improved = candidate, True
                    break
                if time.perf_counter() >= deadline:
                    break
        return current

    best = None
    for seed in seeds[:3]:
        current = descend(seed)
        if _better(current, best):
            best = current
    if best is None:
        return None
    rng = random.Random(0)
    stale = 0
    while stale < 40 and time.perf_counter() < deadline:
        seq = list(best.seq)
        for _ in range(2):
            used = set(seq)
            unused = [d for d in range(n) if d not in used]
            i = rng.randrange(len(seq))
            if unused and rng.random() < 0.5:
                seq[i] = rng.choice(unused)
            else:
                j = rng.randrange(len(seq))
                seq[i], seq[j] = seq[j], seq[i]
        start = _evaluate(ctx, tuple(seq))
        if start is None:
            stale += 1
            continue
        current = descend(start)
        if _better(current, best):
            best, stale = current, 0
        else:
            stale += 1
    return best


# ---------------------------------------------------------------------------- public API


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
    ctx = _Context(shape, workload, fleet)
    allowed = _allowed_stage_counts(ctx)
    sequences = _class_sequences(ctx, allowed, exact_limit)
    if sequences is not None:
        best, search = _exact(ctx, sequences), "exact"
    else:
        best, search = _heuristic(ctx, allowed, budget_s), "heuristic"
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
    ctx = _Context(shape, workload, fleet)
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


def _build_plan(ctx: _Context, seq: tuple[int, ...], counts: Sequence[int], *, search: str) -> Plan:
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


def _recommend_microbatches(ctx: _Context, seq: tuple[int, ...], counts: Sequence[int]) -> int:
    """Smallest M with M >= 4S (bubble under 20%); under GPipe, memory grows with M, so cap it."""
    s = len(seq)
    if s == 1:
        return ctx.workload.gradient_accumulation_steps
    target = 4 * s
    if ctx.workload.schedule != "gpipe":
        return target
    for m in range(target, 0, -1):
        trial = _Context(ctx.shape, replace(ctx.workload, gradient_accumulation_steps=m), ctx.fleet)
        if all(n <= trial.stage(seq, i)[1] for i, n in enumerate(counts)):
            return m
    return 1


def _explain_no_fit(ctx: _Context) -> str:
    """One line: how many GiB are missing, and which devices would make it fit with more memory."""
    w, shape, layers = ctx.workload, ctx.shape, ctx.layers
    allowed = _allowed_stage_counts(ctx)
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


# ---------------------------------------------------------------------------- configs and display


def plan_for_config(
    config: Any,
    *,
    fleet: Fleet | None = None,
    model_path: str | None = None,
    use_cache: bool = True,
) -> Plan:
    """Plan a loaded shardpool config: on ``fleet`` if given, else on its local ``shardpool.devices``.

    Only ``config.json`` of the base model (or ``model_path``) is read. With a hypothetical
    fleet, the config's ``shardpool.stages`` and ``devices`` describe a local run and are not
    applied. With ``shardpool.layers`` on a local run, that manual split is predicted as given.
    """
    shape = ModelShape.from_config_dir(model_path or config.base_model)
    workload = Workload.from_config(config)
    if fleet is not None:
        return plan_pipeline(shape, replace(workload, stages=None), fleet)
    section = config.shardpool
    devices = section.stage_devices() if hasattr(section, "stage_devices") else ["cpu"]
    local = local_fleet(
        devices,
        shape=shape,
        workload=workload,
        use_cache=use_cache,
        threads_per_stage=getattr(section, "threads_per_stage", None),
    )
    if getattr(section, "layers", None):
        return evaluate_split(
            shape, workload, local, devices=[d.name for d in local.devices], layers=section.layers
        )
    return plan_pipeline(shape, workload, local)


def plan_table(plan: Plan) -> Any:
    """A rich Table of the plan: one row per stage, the bottleneck marked, step time and bubble below."""
    from rich.table import Table

    caption = (
        f"ms/mb: predicted forward + backward per micro-batch. Predicted step {plan.predicted_step_s:.3f} s "
        f"with {plan.microbatches} micro-batches ({plan.schedule}), "
        f"bubble {plan.bubble_fraction:.1%}; recommended micro-batches: {plan.recommended_microbatches}"
    )
    if plan.left_out:
        caption += f"; left out: {', '.join(plan.left_out)}"
    if not plan.fits:
        caption += "; DOES NOT FIT in memory"
    title = f"plan for {plan.model or 'the model'} ({plan.num_layers} layers, {plan.search} search)"
    table = Table(title=title, caption=caption)
    for column in ("#", "host", "device", "layers", "used GiB", "free GiB", "ms/mb", ""):
        table.add_column(
            column, justify="right" if "GiB" in column or "ms" in column else "left", no_wrap=True
        )
    for index, stage in enumerate(plan.stages):
        table.add_row(
            str(index),
            stage.host,
            stage.slot or stage.device,
            f"[{stage.start}, {stage.stop})",
            f"{stage.memory_bytes / GIB:.2f}",
            f"{stage.free_bytes / GIB:.2f}",
            f"{stage.predicted_ms_per_microbatch:.1f}",
            "bottleneck" if stage.bottleneck else "",
        )
    return table


def load_config_with_overrides(path: str, overrides: Sequence[str] = ()) -> Any:
    """Load and validate a config after applying ``KEY=VALUE`` overrides (values parsed as YAML).

    Dotted keys reach into sections (``shardpool.schedule=gpipe``). Lets ``shardpool plan``
    try other batch shapes without editing the file.
    """
    import yaml

    from shardpool.config import load_config, parse_config

    if not overrides:
        return load_config(path)
    load_config(path)  # same errors as without overrides for a missing or broken file
    with open(path, encoding="utf-8") as handle:
        raw = yaml.safe_load(handle)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ShardpoolError(f"--set {item!r} is not KEY=VALUE; write e.g. --set sequence_len=2048")
        target = raw
        *parents, leaf = key.split(".")
        for part in parents:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ShardpoolError(f"--set {item!r}: {part} is not a section; set a key inside a section")
        target[leaf] = yaml.safe_load(value)
    return parse_config(raw, source=f"{path} with --set")
