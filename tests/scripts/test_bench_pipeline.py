"""The pure helpers of scripts/bench_pipeline.py (the benchmark itself is a script, not a test)."""

from __future__ import annotations

import pytest
from shardpool_dev.bench import cpu, pipeline, stats


def test_thread_split_keeps_the_budget_with_at_least_one_thread() -> None:
    assert cpu.threads_per_stage(2, 1) == 2
    assert cpu.threads_per_stage(2, 2) == 1
    assert cpu.threads_per_stage(2, 4) == 1
    assert cpu.threads_per_stage(8, 4) == 2


def test_ring_allreduce_bytes() -> None:
    assert pipeline.ring_allreduce_bytes_per_worker(1000, 1) == 0
    assert pipeline.ring_allreduce_bytes_per_worker(1000, 2) == 1000
    assert pipeline.ring_allreduce_bytes_per_worker(1000, 4) == 1500
    with pytest.raises(ValueError):
        pipeline.ring_allreduce_bytes_per_worker(1000, 0)


def test_boundary_bytes_count_both_directions_over_every_boundary() -> None:
    args = {
        "microbatches": 8,
        "micro_batch_size": 1,
        "sequence_len": 128,
        "hidden_size": 512,
        "wire_bytes": 4,
    }
    assert pipeline.boundary_bytes_per_step(stages=1, **args) == 0
    assert pipeline.boundary_bytes_per_step(stages=2, **args) == 2 * 8 * 128 * 512 * 4
    assert pipeline.boundary_bytes_per_step(stages=4, **args) == 3 * pipeline.boundary_bytes_per_step(
        stages=2, **args
    )


def test_efficiency_and_medians() -> None:
    assert pipeline.pipeline_efficiency([0.5, 0.5], 0.5) == pytest.approx(1.0)
    assert pipeline.pipeline_efficiency([0.25, 0.25], 0.5) == pytest.approx(0.5)
    assert stats.median_after_warmup([9.0, 9.0, 1.0, 2.0, 3.0]) == 2.0
    assert stats.median_after_warmup([4.0]) == 4.0


def test_summarize_steps_skips_warmup_and_eval_lines() -> None:
    records = [
        {
            "step": step,
            "loss": 1.0 / step,
            "step_seconds": 10.0 if step <= 2 else 1.0,
            "tokens_per_s": 100.0,
            "stage_compute_s": [0.5, 0.25],
            "stage_wait_s": [0.1, 0.2],
            "bytes_sent": 64,
        }
        for step in (4, 1, 3, 2)
    ] + [{"step": 2, "epoch": 0.5, "eval_loss": 3.0}]
    summary = pipeline.summarize_steps(records)
    assert summary["steps_measured"] == 2
    assert summary["step_seconds"] == 1.0
    assert summary["pipeline_efficiency"] == pytest.approx(0.375)
    assert summary["bytes_sent_per_step"] == 64
    assert summary["final_loss"] == 0.25


def test_disturbed() -> None:
    assert not cpu.disturbed({"other_cpu_seconds": 0.5, "elapsed_seconds": 10.0}, 2)
    assert cpu.disturbed({"other_cpu_seconds": 1.5, "elapsed_seconds": 10.0}, 2)
