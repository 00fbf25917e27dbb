"""The measuring child process: it runs what it is sent in another process, several of them at
once, and never outlives its block (an error, a crash or Ctrl-C included)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from typing import Any

import pytest

from shardpool.errors import ShardpoolError
from shardpool.plan.measuring_process import MeasuringProcess


def test_a_call_runs_in_another_process_that_ends_with_the_block() -> None:
    with MeasuringProcess() as child:
        child_pid = child.call(os.getpid)
        assert child_pid == child.pid != os.getpid()
        assert child.call(divmod, 17, 5) == (3, 2), "arguments and results cross as values"
    assert multiprocessing.active_children() == []
    with pytest.raises(ProcessLookupError):
        os.kill(child_pid, 0)  # exited and reaped: no orphan, no zombie


def test_children_sent_work_compute_at_once() -> None:
    """What co-run measurement relies on: work sent to two children runs side by side, and each
    result comes back to the child's own receive."""
    with MeasuringProcess() as first, MeasuringProcess() as second:
        first.call(os.getpid)
        second.call(os.getpid)  # both started and idle
        started = time.monotonic()
        first.send(time.sleep, 1.0)
        second.send(time.sleep, 1.0)
        first.receive()
        second.receive()
        assert time.monotonic() - started < 1.8
        first.send(divmod, 7, 2)
        second.send(divmod, 9, 4)
        assert (second.receive(), first.receive()) == ((2, 1), (3, 1))
    assert multiprocessing.active_children() == []


def test_a_child_that_dies_is_one_line_and_the_next_call_too() -> None:
    with MeasuringProcess() as child:
        with pytest.raises(ShardpoolError, match="exited with status 3 before it answered"):
            child.call(os._exit, 3)
        with pytest.raises(ShardpoolError, match="exited with status 3"):
            child.call(os.getpid)
    with MeasuringProcess(purpose="how CPU stages share this host") as child:
        with pytest.raises(
            ShardpoolError, match="measuring how CPU stages share this host was killed by signal 9"
        ):
            child.call(os.kill, child.pid, signal.SIGKILL)
    assert multiprocessing.active_children() == []


def test_an_interrupt_ends_a_busy_child_at_once() -> None:
    """Ctrl-C while the child measures: this process raises at once, and the child is gone, not
    left to finish a long profile holding a GPU."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt), MeasuringProcess() as child:
            child.call(os.getpid)
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            child.call(time.sleep, 60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < 20
    assert multiprocessing.active_children() == []
