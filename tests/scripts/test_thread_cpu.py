"""The pure helpers of scripts/thread_cpu.py (the runs are a script, not a test)."""

from __future__ import annotations

import os

import pytest
from shardpool_dev.bench import threads

STAT = "4242 (gloo_tcp_loop) S 1 2 3 0 -1 4194368 10 0 0 0 150 50 0 0 39 19 9 0 100 0 0"


def test_a_thread_stat_gives_its_name_and_cpu_seconds() -> None:
    assert threads.parse_task_stat(STAT, 100) == ("gloo_tcp_loop", 2.0)
    assert threads.parse_task_stat(STAT.replace("(gloo_tcp_loop)", "(a) (b)"), 100) == ("a) (b", 2.0)


def test_wakeups_are_the_voluntary_context_switches() -> None:
    status = "Name:\tpython\nvoluntary_ctxt_switches:\t921\nnonvoluntary_ctxt_switches:\t4\n"
    assert threads.parse_wakeups(status) == 921
    assert threads.parse_wakeups("Name:\tpython\n") == 0


def test_window_rows_are_per_second_and_busiest_first() -> None:
    before = {(1, 1): ("python", 10.0, 100), (1, 2): ("gloo_tcp_loop", 1.0, 1000)}
    after = {(1, 1): ("python", 30.0, 120), (1, 2): ("gloo_tcp_loop", 1.02, 2000), (1, 3): ("new", 0.0, 5)}
    rows = threads.window_rows(before, after, 10.0)
    assert [row["tid"] for row in rows] == [1, 2, 3]
    assert rows[0]["cpu_ms_per_s"] == pytest.approx(2000.0)
    assert rows[1]["cpu_ms_per_s"] == pytest.approx(2.0)
    assert rows[1]["wakeups_per_s"] == pytest.approx(100.0)
    assert rows[2]["wakeups_per_s"] == pytest.approx(0.5)


def test_this_process_is_sampled_with_every_thread() -> None:
    samples = threads.sample_threads(threads.process_tree(os.getpid()))
    assert (os.getpid(), os.getpid()) in samples
