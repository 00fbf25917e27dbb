"""Where a benchmark runs and who else used the CPUs meanwhile: pinning, /proc/stat accounting, idle waits."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


def threads_per_stage(budget: int, stages: int) -> int:
    """Torch threads per stage so all stages together use about ``budget`` threads (at least 1 each)."""
    return max(1, budget // stages)


@contextlib.contextmanager
def pinned(cores: Sequence[int]) -> Iterator[None]:
    """Run with this process (and every child it starts) on ``cores``; restore the affinity after."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def machine_busy_seconds() -> float:
    """CPU-seconds all CPUs of this machine have been busy since boot (user, nice, system, irq, softirq)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(value) for value in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU-seconds used by this process and its reaped children (the stage processes)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


@contextlib.contextmanager
def cpu_accounting(into: dict[str, Any]) -> Iterator[None]:
    """Record the load average and the CPU time *other* processes used while the block ran.

    ``other_cpu_seconds`` is the machine's busy CPU time minus this process tree's; on an idle
    machine it is near zero, and anything larger competed with the benchmark for the cores.
    """
    load = os.getloadavg()[0]
    busy, own, started = machine_busy_seconds(), own_cpu_seconds(), time.monotonic()
    try:
        yield
    finally:
        into["loadavg_1m_before"] = round(load, 2)
        into["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
        into["own_cpu_seconds"] = round(own_cpu_seconds() - own, 1)
        into["other_cpu_seconds"] = round(
            max(0.0, (machine_busy_seconds() - busy) - (own_cpu_seconds() - own)), 1
        )
        into["elapsed_seconds"] = round(time.monotonic() - started, 1)


def wait_for_idle(max_wait_s: float, *, window_s: float = 2.0, busy_fraction: float = 0.1) -> float:
    """Wait until other processes use under ``busy_fraction`` of one core over a ``window_s`` window.

    Gives up after ``max_wait_s``; returns the seconds waited (``max_wait_s`` or more if it gave up).
    """
    started = time.monotonic()
    while True:
        busy, own = machine_busy_seconds(), own_cpu_seconds()
        time.sleep(window_s)
        other = (machine_busy_seconds() - busy) - (own_cpu_seconds() - own)
        waited = time.monotonic() - started
        if other < busy_fraction * window_s or waited >= max_wait_s:
            return round(waited, 1)


def disturbed(load: dict[str, Any], cores: int, *, tolerance: float = 0.05) -> bool:
    """Whether other processes took more than ``tolerance`` of the pinned cores' time during a run."""
    return load["other_cpu_seconds"] > tolerance * load["elapsed_seconds"] * cores


def least_disturbed(
    run_once: Any, *, label: str, cores: Sequence[int], max_wait_idle_s: float, retries: int
) -> dict[str, Any]:
    """Run ``run_once(attempt)`` after waiting for idle CPUs; if other processes disturbed it, run it
    again (up to ``retries`` more times) and keep the attempt that saw the least foreign CPU time."""
    attempts = []
    for attempt in range(retries + 1):
        waited = wait_for_idle(max_wait_idle_s)
        print(f"bench: {label} (attempt {attempt + 1})", file=sys.stderr, flush=True)
        result = run_once(attempt)
        result["load"]["waited_for_idle_seconds"] = waited
        attempts.append(result)
        if not disturbed(result["load"], len(cores)):
            break
    best = min(attempts, key=lambda result: result["load"]["other_cpu_seconds"])
    best["load"]["attempts"] = len(attempts)
    best["load"]["other_cpu_seconds_per_attempt"] = [
        result["load"]["other_cpu_seconds"] for result in attempts
    ]
    return best
