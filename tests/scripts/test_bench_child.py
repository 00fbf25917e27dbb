"""shardpool_dev.bench.child and workload.scratch: how a benchmark measures in a fresh process, and
the scratch directory it works in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from shardpool_dev.bench import child, workload


def test_a_child_runs_one_of_the_named_workers_and_nothing_else() -> None:
    assert child.child_argv("plain", "spec.json")[1:] == [
        "-m",
        "shardpool_dev.bench.child",
        "plain",
        "spec.json",
    ]
    with pytest.raises(ValueError, match="unknown child worker 'plan'; use one of .*plain"):
        child.child_argv("plan", "spec.json")


def test_every_named_worker_is_a_function_of_the_library() -> None:
    for name in child.WORKERS:
        assert callable(child.worker_function(name)), name


def test_the_result_is_the_last_json_line_whatever_was_printed_before() -> None:
    assert child.last_json_line('loading...\n{"a": 1}\n{"tokens_per_s": 42.5}\n') == {"tokens_per_s": 42.5}


def test_a_failed_child_raises_with_the_end_of_its_stderr(tmp_path: Path) -> None:
    with pytest.raises(child.ChildError, match=r"run plain-1 failed:\n(.|\n)*FileNotFoundError"):
        child.run_json_child("plain", tmp_path / "missing.json", env=child.thread_env(1), label="plain-1")


def test_the_thread_count_reaches_every_library_a_child_loads() -> None:
    env = child.thread_env(3)
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"], env["TOKENIZERS_PARALLELISM"]) == (
        "3",
        "3",
        "false",
    )


def test_scratch_profiles_afresh_and_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDPOOL_CACHE", "/users/cache")
    with workload.scratch("shardpool-test-", None) as work:
        assert os.environ["SHARDPOOL_CACHE"] == str(work / "cache") and work.is_dir()
    assert os.environ["SHARDPOOL_CACHE"] == "/users/cache"
    assert not work.exists()


def test_scratch_keeps_a_named_directory_and_puts_an_unset_cache_back_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SHARDPOOL_CACHE", raising=False)
    with workload.scratch("shardpool-test-", tmp_path / "kept") as work:
        (work / "model").mkdir()
    assert (tmp_path / "kept" / "model").is_dir()
    assert "SHARDPOOL_CACHE" not in os.environ
