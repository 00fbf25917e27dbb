"""scripts/bench_chaos.py: its pure helpers (the metrics poll, the summary) and its skip answer.

The chaos rounds themselves need root, network namespaces and wireguard-go, and take minutes per
round: they are run by hand (docs/performance.md), not here.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from shardpool_dev.bench import chaos

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_chaos.py"
_spec = importlib.util.spec_from_file_location("bench_chaos", _SCRIPT)
bench = importlib.util.module_from_spec(_spec)  # the script, for its command line
_spec.loader.exec_module(bench)


def _lines(path: Path, *records: dict) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_training_again_is_the_first_step_after_the_loss_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics = tmp_path / "metrics.jsonl"
    clock = iter([10.0, 11.0, 30.0, 31.5, 40.0])
    monkeypatch.setattr(chaos.time, "monotonic", lambda: next(clock))
    watch = chaos.MetricsPoll(metrics)
    step = lambda n, loss: {"step": n, "loss": loss}  # noqa: E731
    _lines(metrics, step(1, 2.0), step(2, 1.9))
    watch.poll()  # t = 10
    assert watch.newest_step() == 2 and watch.training_again(since=10.5) is None
    _lines(metrics, step(1, 2.0), step(2, 1.9), step(3, 1.8))
    watch.poll()  # t = 11: step 3 finished just as the member went; it does not count
    # the launcher restored the copy of step 2: it trimmed the file to step 2, then wrote its events
    _lines(
        metrics,
        step(1, 2.0),
        step(2, 1.9),
        {"event": "member_lost", "member": "c", "step": 2, "steps_lost": 0},
    )
    watch.poll()  # t = 30
    assert watch.training_again(since=10.5) is None
    _lines(metrics, step(1, 2.0), step(2, 1.9), {"event": "member_lost", "member": "c", "step": 2, "steps_lost": 0},
           {"step": 3, "loss": 1.8, "step_seconds": 0.5})  # fmt: skip
    watch.poll()  # t = 31.5: step 3 redone
    assert watch.training_again(since=10.5) == pytest.approx(21.0)
    assert watch.steps_lost() == [0]
    assert watch.reported_redone() == []  # no replan line yet: the step it went on from is not known


def test_a_reported_step_trained_again_is_counted_from_the_lines_themselves(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    watch = chaos.MetricsPoll(metrics)
    _lines(metrics, {"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.9}, {"step": 3, "loss": 1.8})
    watch.poll()
    lost = {"event": "member_lost", "member": "c", "step": 3, "steps_lost": 0, "unreported_steps_redone": 0}
    replan = {"event": "replan", "member": "c", "step": 2, "steps_lost": 0}
    # the launcher says nothing was lost, but step 3 had been logged and it goes on from step 2
    _lines(metrics, {"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.9}, lost, replan)
    watch.poll()
    assert watch.steps_lost() == [0] and watch.reported_redone() == [1]
    assert watch.unreported_redone() == [0]


def test_a_step_whose_copy_was_in_flight_counts_as_unreported_not_lost(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    watch = chaos.MetricsPoll(metrics)
    lost = {"event": "member_lost", "member": "b", "step": 3, "steps_lost": 0, "unreported_steps_redone": 1}
    replan = {"event": "replan", "member": "b", "step": 2, "steps_lost": 0}
    _lines(
        metrics, {"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.9}, lost, replan, {"step": 3, "loss": 1.8}
    )
    watch.poll()
    assert watch.reported_redone() == [0] and watch.unreported_redone() == [1]


def test_the_copy_window_is_the_median_of_the_slowest_rank_s_copy(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    watch = chaos.MetricsPoll(metrics)
    _lines(metrics, {"step": 1, "loss": 2.0})
    watch.poll()
    assert watch.median_copy_window_s() is None  # no copy figures: not a keep-state run
    _lines(
        metrics,
        {"step": 1, "loss": 2.0, "stage_copy_s": [0.0, 0.0]},  # no copy finished before step 1 ended
        {"step": 2, "loss": 1.9, "stage_copy_s": [0.02, 0.05, 0.01]},
        {"step": 3, "loss": 1.8, "stage_copy_s": [0.03, 0.01, 0.09]},
        {"step": 4, "loss": 1.7, "stage_copy_s": [0.07, 0.01, 0.01]},
    )
    watch.poll()
    assert watch.median_copy_window_s() == pytest.approx(0.07)


def test_summary_counts_finished_runs_and_takes_the_worst_and_the_median() -> None:
    window = {"copy_window_s": 0.1, "step_s": 2.0}
    rounds = [
        chaos.RoundResult(
            "b",
            3,
            1.5,
            **window,
            exit_code=0,
            steps_lost=[0],
            reported_redone=[0],
            unreported_redone=[1],
            training_again_s=20.0,
            max_abs_diff=2e-7,
        ),
        chaos.RoundResult(
            "c", 5, 0.05, **window, exit_code=0, steps_lost=[1], training_again_s=30.0, max_abs_diff=5e-7
        ),
        chaos.RoundResult("c", 1, exit_code=2, steps_lost=[1], training_again_s=None, error="x"),
    ]
    assert chaos.summary(rounds) == {
        "runs": 3,
        "finished_by_themselves": 2,
        "steps_lost_per_loss": [0, 1, 1],
        "losses_that_lost_a_step": 2,
        "reported_steps_redone_per_loss": [0],
        "losses_in_a_copy_window": 1,
        "copy_window_over_step_median": 0.05,
        "worst_max_abs_diff": 5e-7,
        "training_again_s": {"median": 25.0, "max": 30.0},
    }


def test_it_says_skipped_where_it_cannot_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench, "netns_skip_reason", lambda: "needs root")
    assert bench.main(["--runs", "2"]) == 0
    assert json.loads(capsys.readouterr().out) == {"skipped": "needs root"}
