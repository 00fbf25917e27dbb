"""Tests of mesh/daemon.py: detached processes tracked and stopped by pid file."""

from __future__ import annotations

import json
import sys
import time

import psutil

from mesh.daemon import log_tail, read_pid, spawn_detached, stop_process


def test_spawn_and_stop_by_pid_file(tmp_path) -> None:
    pid_file, log = tmp_path / "run" / "x.pid", tmp_path / "logs" / "x.log"
    pid = spawn_detached(
        [sys.executable, "-c", "import time; print('hello', flush=True); time.sleep(60)"], pid_file, log
    )
    try:
        assert read_pid(pid_file) == pid
        assert psutil.Process(pid).ppid() != 0
        deadline = time.monotonic() + 5
        while "hello" not in log_tail(log) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert log_tail(log) == "hello"
        assert stop_process(pid_file) is True
        assert read_pid(pid_file) is None and not pid_file.exists()
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        if psutil.pid_exists(pid):
            psutil.Process(pid).kill()


def test_a_process_ignoring_sigterm_is_killed(tmp_path) -> None:
    pid_file = tmp_path / "x.pid"
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    pid = spawn_detached([sys.executable, "-c", code], pid_file, tmp_path / "x.log")
    deadline = time.monotonic() + 5
    while "ready" not in log_tail(tmp_path / "x.log") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stop_process(pid_file, timeout=0.5) is True
    assert read_pid(pid_file) is None
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_recycled_pid_is_not_ours(tmp_path) -> None:
    pid_file = tmp_path / "x.pid"
    me = psutil.Process()
    pid_file.write_text(json.dumps({"pid": me.pid, "started": me.create_time() - 100}))
    assert read_pid(pid_file) is None
    assert stop_process(pid_file) is False
    assert me.is_running()


def test_garbage_pid_files_are_ignored(tmp_path) -> None:
    for text in ("", "{", "[]", '{"pid": "x"}'):
        (tmp_path / "x.pid").write_text(text)
        assert read_pid(tmp_path / "x.pid") is None
    assert log_tail(tmp_path / "none.log") == "(no log)"
