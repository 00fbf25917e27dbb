"""How much slower CPU stages run side by side on one host than each ran alone, measured.

A CPU slot's layer profile is taken alone. When a host runs several CPU stages at once, each of
them gets fewer CPUs than it had (time-sharing, which :func:`shardpool.plan.local_fleet` computes
from the core count and the cgroup quota), and even when there are enough cores to go round the
stages still share caches, memory bandwidth and, on SMT machines, the cores themselves. The second
effect depends on the host: on a 2-vCPU cloud VM two single-thread stages each ran about a quarter
slower than alone, which the planner's time model missed by that much. So it is measured: one
matrix-multiply loop run alone and then ``copies`` at once (threads, each with ``threads`` torch
threads, as each stage process has), in interleaved pairs, the median ratio taken. The result is
cached with the layer profiles, keyed by what it depends on.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable

from shardpool.host.cpu_quota import cpu_quota
from shardpool.plan.profile_cache import cached_profile, store_profile

__all__ = ["co_run_key", "co_run_slowdown", "median_ratio"]

#: Interleaved alone/together pairs per measurement: the median of five survives one or two
#: samples disturbed by the rest of a noisy host.
_PAIRS = 5
#: How long one sample runs, seconds; under a CPU quota long enough to span several of its
#: 100 ms periods, so that the throttling shows as an average rather than as luck.
_SAMPLE_S = 0.12
_THROTTLED_SAMPLE_S = 0.4
#: The loop's matrices: a decoder layer's projections at a small model's width.
_ROWS, _WIDTH = 256, 768


def co_run_key(copies: int, threads: int, quota: float | None) -> str:
    """The cache key of one co-run measurement: what it depends on (torch's version, the host's
    CPUs and quota, how many stages of how many threads)."""
    import torch

    return f"co_run|copies={copies}|threads={threads}|quota={quota}|cpus={os.cpu_count()}|torch={torch.__version__}"


def co_run_slowdown(copies: int, threads: int, *, use_cache: bool = True) -> float:
    """How many times slower each of ``copies`` CPU stages of ``threads`` torch threads computes
    while all run together than one computes alone, on this host (at least 1; 1 for one copy)."""
    if copies <= 1:
        return 1.0
    quota = cpu_quota()
    key = co_run_key(copies, threads, quota)
    if (
        use_cache
        and (cached := cached_profile(key)) is not None
        and isinstance(cached.get("slowdown"), float)
    ):
        return float(cached["slowdown"])
    slowdown = _measure(copies, threads, sample_s=_THROTTLED_SAMPLE_S if quota is not None else _SAMPLE_S)
    if use_cache:
        store_profile(key, {"slowdown": slowdown})
    return slowdown


def median_ratio(alone: list[float], together: list[float]) -> float:
    """The median of ``together[i] / alone[i]`` over interleaved pairs, at least 1: running side by
    side never makes a stage faster, so a ratio below 1 is noise."""
    return max(1.0, statistics.median(t / a for a, t in zip(alone, together, strict=True)))


def _measure(copies: int, threads: int, *, sample_s: float) -> float:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # each thread that runs torch work starts with this many
    try:
        loop = _matmul_loop()
        iterations = _iterations_for(loop, sample_s)
        alone: list[float] = []
        together: list[float] = []
        for _ in range(_PAIRS):
            alone.append(_run_side_by_side(loop, iterations, 1, threads))
            together.append(_run_side_by_side(loop, iterations, copies, threads))
        return median_ratio(alone, together)
    finally:
        torch.set_num_threads(before)


def _matmul_loop() -> Callable[[int], None]:
    import torch

    generator = torch.Generator().manual_seed(0)
    left = torch.randn(_ROWS, _WIDTH, generator=generator)
    right = torch.randn(_WIDTH, _WIDTH, generator=generator)

    def loop(iterations: int) -> None:
        for _ in range(iterations):
            torch.mm(left, right)

    return loop


def _iterations_for(loop: Callable[[int], None], sample_s: float) -> int:
    """Iterations that take about ``sample_s`` alone (after one warm-up)."""
    loop(3)
    started = time.perf_counter()
    loop(10)
    per_iteration = max((time.perf_counter() - started) / 10, 1e-6)
    return max(10, round(sample_s / per_iteration))


def _run_side_by_side(loop: Callable[[int], None], iterations: int, copies: int, threads: int) -> float:
    """The mean seconds each of ``copies`` threads took to run ``loop(iterations)`` with ``threads``
    torch threads each, all started together."""
    import torch

    seconds: list[float] = [0.0] * copies
    start = threading.Barrier(copies)

    def worker(index: int) -> None:
        torch.set_num_threads(threads)  # a new thread starts with torch's default, not the caller's
        start.wait()
        began = time.perf_counter()
        loop(iterations)
        seconds[index] = time.perf_counter() - began

    workers = [threading.Thread(target=worker, args=(index,), daemon=True) for index in range(copies)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    return statistics.fmean(seconds)
