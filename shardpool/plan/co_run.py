"""How much slower CPU stages run side by side on one host than each ran alone, measured.

A CPU slot's layer profile is taken alone. When a host runs several CPU stages at once, each of
them gets fewer CPUs than it had (time-sharing, which :func:`shardpool.plan.local_fleet` computes
from the core count and the cgroup quota), and even when there are enough cores to go round the
stages still share caches, memory bandwidth and, on SMT machines and busy hypervisors, the cores
themselves. How much that costs depends on the host and on the work: a shared core costs dense
matrix multiplies more than the operator overhead and element-wise work that much of a small
model's step is, so a matrix-multiply loop is no stand-in for a stage. So it is measured with
the work itself: the slot's profiled layer (:func:`shardpool.plan.sample_layer.layer_run`),
forward and backward, run by one process alone and then by ``copies`` processes at once (each
with ``threads`` torch threads, as each stage process has), in interleaved pairs, the median
ratio taken. Processes, not threads: a small layer's Python between operators would contend for
one interpreter lock, which stage processes never share. The result is cached with the layer
profiles, keyed by what it depends on.
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from shardpool.host.cpu_quota import cpu_quota
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.measuring_process import MeasuringProcess
from shardpool.plan.profile_cache import cached_profile, profile_key, store_profile

__all__ = ["CpuLayer", "co_run_key", "co_run_slowdown", "median_ratio"]

#: Interleaved alone/together pairs per measurement: the median of five survives one or two
#: samples disturbed by the rest of a noisy host.
_PAIRS = 5
#: Pairs when one sample takes longer than :data:`_LONG_SAMPLE_S` (a big layer on one thread): the
#: median of three still drops one disturbed pair, at a bounded cost.
_FEW_PAIRS = 3
_LONG_SAMPLE_S = 1.0
#: How long one sample runs at least, seconds; under a CPU quota long enough to span several of
#: its 100 ms periods, so that the throttling shows as an average rather than as luck.
_SAMPLE_S = 0.15
_THROTTLED_SAMPLE_S = 0.4
#: Steps each process runs before any sample (kernels, allocator), and steps that time one alone.
_WARM_UP_STEPS = 2
_CALIBRATION_STEPS = 2


@dataclass(frozen=True)
class CpuLayer:
    """The layer CPU stages compute, as their profile builds it: the model's shape, the workload,
    the CPU's label, the compute dtype and the NF4 backend (None: bitsandbytes or no NF4)."""

    shape: ModelShape
    workload: Workload
    label: str
    dtype: str
    nf4_backend: str | None = None


def co_run_key(copies: int, threads: int, quota: float | None, layer: CpuLayer) -> str:
    """The cache key of one co-run measurement: what it depends on (the host's CPUs and quota, how
    many stages of how many threads, and the layer they compute: the layer profile's key)."""
    profiled = profile_key(
        layer.shape, layer.workload, label=layer.label, threads=threads, quota=quota,
        dtype=layer.dtype, nf4_backend=layer.nf4_backend,
    )  # fmt: skip
    return f"co_run|copies={copies}|cpus={os.cpu_count()}|{profiled}"


def co_run_slowdown(copies: int, threads: int, layer: CpuLayer, *, use_cache: bool = True) -> float:
    """How many times slower each of ``copies`` CPU stages of ``threads`` torch threads computes
    ``layer`` while all run together than one computes it alone, on this host (at least 1; 1 for
    one copy). Measured in ``copies`` child processes, which end before this returns."""
    if copies <= 1:
        return 1.0
    quota = cpu_quota()
    key = co_run_key(copies, threads, quota, layer)
    if (
        use_cache
        and (cached := cached_profile(key)) is not None
        and isinstance(cached.get("slowdown"), float)
    ):
        return float(cached["slowdown"])
    slowdown = _measure(
        copies, threads, layer, sample_s=_THROTTLED_SAMPLE_S if quota is not None else _SAMPLE_S
    )
    if use_cache:
        store_profile(key, {"slowdown": slowdown})
    return slowdown


def median_ratio(alone: list[float], together: list[float]) -> float:
    """The median of ``together[i] / alone[i]`` over interleaved pairs, at least 1: running side by
    side never makes a stage faster, so a ratio below 1 is noise."""
    return max(1.0, statistics.median(t / a for a, t in zip(alone, together, strict=True)))


def _measure(copies: int, threads: int, layer: CpuLayer, *, sample_s: float) -> float:
    with ExitStack() as stack:  # each child ends with the measurement, at once on an error
        children = [
            stack.enter_context(MeasuringProcess(purpose="how CPU stages share this host"))
            for _ in range(copies)
        ]
        for child in children:  # the layers are built and warmed up at once
            child.send(_prepare, layer, threads)
        for child in children:
            child.receive()
        first = children[0]
        step_s = max(first.call(_run_steps, _CALIBRATION_STEPS) / _CALIBRATION_STEPS, 1e-6)
        steps = max(1, round(sample_s / step_s))
        pairs = _PAIRS if steps * step_s <= _LONG_SAMPLE_S else _FEW_PAIRS
        alone: list[float] = []
        together: list[float] = []
        for _ in range(pairs):
            alone.append(first.call(_run_steps, steps))
            for child in children:
                child.send(_run_steps, steps)
            together.append(statistics.fmean(child.receive() for child in children))
        return median_ratio(alone, together)


# ---------------------------------------------------------------------------- in each child

#: The child's built layer, between :func:`_prepare` and the :func:`_run_steps` that time it.
_PREPARED: dict[str, Any] = {}


def _prepare(layer: CpuLayer, threads: int) -> None:
    """Build ``layer`` on the CPU with ``threads`` torch threads and warm it up."""
    import torch

    from shardpool.plan.sample_layer import layer_run

    torch.set_num_threads(threads)
    run = layer_run(layer.shape, layer.workload, "cpu", layer.dtype, layer.nf4_backend)
    for _ in range(_WARM_UP_STEPS):
        run.step()
    _PREPARED["run"] = run


def _run_steps(steps: int) -> float:
    """Seconds ``steps`` forward + backward steps of the prepared layer took."""
    run = _PREPARED["run"]
    started = time.perf_counter()
    for _ in range(steps):
        run.step()
    return time.perf_counter() - started
