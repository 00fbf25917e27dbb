"""How long a profile keeps timing: until the 95% interval is within ±5%, or its budget is spent."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from shardpool.plan import confidence, profile_cache


def test_steady_times_stop_at_the_minimum_runs() -> None:
    times = [0.100, 0.101, 0.099]
    relative = confidence.ci95_relative(times)
    assert relative is not None and relative < 0.03
    assert confidence.measured_enough(times, spent_seconds=0.3)
    assert not confidence.measured_enough(times[:2], spent_seconds=0.2), "never fewer than MIN_RUNS"


def test_noisy_times_keep_going_until_the_interval_is_narrow_or_the_budget_ends() -> None:
    noisy = [0.10, 0.14, 0.09]
    relative = confidence.ci95_relative(noisy)
    assert relative is not None and relative > 0.3  # t(2) = 4.30 makes three noisy runs very unsure
    assert not confidence.measured_enough(noisy, spent_seconds=0.3)
    assert confidence.measured_enough(noisy, spent_seconds=confidence.TIME_BUDGET_S)
    assert confidence.measured_enough(noisy * 9, spent_seconds=1.0), "MAX_RUNS ends it"


def test_the_interval_is_the_t_interval_of_the_mean_over_the_median() -> None:
    times = [1.0, 2.0, 3.0, 4.0]  # mean 2.5, median 2.5, stdev 1.291, t(3) = 3.182
    assert confidence.ci95_relative(times) == pytest.approx(3.182 * 1.2909944 / 2 / 2.5, rel=1e-6)
    assert confidence.ci95_relative([1.0]) is None


def _write(key: str, cache_dir: str) -> None:
    import os

    os.environ["SHARDPOOL_CACHE"] = cache_dir
    for round_ in range(20):
        profile_cache.store_profile(f"{key}-{round_}", {"seconds_per_layer": 1.0})


def test_concurrent_profile_writers_lose_no_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four processes add 20 profiles each at once; the lock keeps all 80."""
    monkeypatch.setenv("SHARDPOOL_CACHE", str(tmp_path))
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_write, args=(f"w{n}", str(tmp_path))) for n in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
    assert all(writer.exitcode == 0 for writer in writers)
    cached = json.loads((tmp_path / "profiles.json").read_text())
    assert len(cached) == 80


def test_a_throttled_profile_times_samples_of_passes_spanning_ten_quota_periods() -> None:
    # A 47 ms pass under a 0.6-CPU quota fits in one 100 ms period's 60 ms of run time: timed alone
    # it is fast or slow by where in the period it starts (0.047 vs 0.063 s per layer in two
    # profiles of one host). Samples of 22 passes (1.03 s) span ten periods.
    assert confidence.passes_per_sample(0.047, throttled=True) == 22
    assert confidence.passes_per_sample(2.5, throttled=True) == 1  # a pass longer than the sample: alone
    assert confidence.passes_per_sample(0.047, throttled=False) == 1  # no quota: every pass is a sample
    assert confidence.passes_per_sample(0.0, throttled=True) == 1
