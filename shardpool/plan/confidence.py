"""When a profile has measured enough: repeat until the 95% confidence interval is within ±5%.

One timed pass of a layer is noisy (other processes, frequency scaling, allocator); the planner
needs the typical time. A profile times at least :data:`MIN_RUNS` passes and keeps going until the
95% confidence interval of the mean pass time (Student's t) is within :data:`TARGET_CI95` of the
median, or until :data:`MAX_RUNS` passes or :data:`TIME_BUDGET_S` seconds, whichever comes first.
The interval reached is recorded with the profile (``ci95_rel``) and in plan.json, so a plan says
how sure its numbers are. Pure functions: tested without timing anything.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = [
    "MAX_RUNS",
    "MIN_RUNS",
    "QUOTA_SAMPLE_S",
    "TARGET_CI95",
    "TIME_BUDGET_S",
    "ci95_relative",
    "measured_enough",
    "passes_per_sample",
]

MIN_RUNS = 3
MAX_RUNS = 25
TARGET_CI95 = 0.05
TIME_BUDGET_S = 10.0
#: Under a CPU quota the kernel lets a process run for quota x period, then holds it until the
#: period ends (CFS: 100 ms by default). A timed pass shorter than a period is fast or slow
#: depending on where in the period it falls, so a throttled profile times samples of several
#: passes that span this many seconds (ten default periods) and divides: the duty cycle averages out.
QUOTA_SAMPLE_S = 1.0

# Two-sided 95% Student t quantiles by degrees of freedom; 1.96 (the normal quantile) past 30.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042}  # fmt: skip


def _t95(degrees: int) -> float:
    if degrees > 30:
        return 1.96
    return _T95[max(d for d in _T95 if d <= degrees)]  # the next smaller tabled df: a wider, safe interval


def ci95_relative(times: Sequence[float]) -> float | None:
    """Half-width of the 95% confidence interval of the mean of ``times``, over their median (None below 2)."""
    if len(times) < 2:
        return None
    median = statistics.median(times)
    if median <= 0:
        return None
    half_width = _t95(len(times) - 1) * statistics.stdev(times) / math.sqrt(len(times))
    return half_width / median


def measured_enough(times: Sequence[float], *, spent_seconds: float) -> bool:
    """Whether to stop timing: the interval is within the target, or the run or time budget is used up."""
    if len(times) < MIN_RUNS:
        return False
    if len(times) >= MAX_RUNS or spent_seconds >= TIME_BUDGET_S:
        return True
    relative = ci95_relative(times)
    return relative is not None and relative <= TARGET_CI95


def passes_per_sample(pass_seconds: float, *, throttled: bool, sample_s: float = QUOTA_SAMPLE_S) -> int:
    """Passes to time together as one sample: 1, or under a CPU quota (``throttled``) enough passes
    of ``pass_seconds`` to span ``sample_s`` (see :data:`QUOTA_SAMPLE_S`)."""
    if not throttled or pass_seconds <= 0:
        return 1
    return max(1, math.ceil(sample_s / pass_seconds))
