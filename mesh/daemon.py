"""Background processes: start them detached with a pid file, and stop them by that pid.

A pid file holds the pid and the process's start time, so a recycled pid is never mistaken
for ours and a stranger's process is never signalled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

from mesh.errors import MeshError
from mesh.files import atomic_write

__all__ = ["log_tail", "read_pid", "spawn_detached", "stop_process"]


def spawn_detached(
    argv: Sequence[str], pid_file: Path, log_file: Path, env: Mapping[str, str] | None = None
) -> int:
    """Start ``argv`` in its own session, output appended to ``log_file``, and record its pid.

    The process outlives the command that started it; ``stop_process(pid_file)`` ends it.
    """
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            env=dict(env) if env is not None else None,
        )
    record = {"pid": process.pid, "started": psutil.Process(process.pid).create_time(), "argv": list(argv)}
    atomic_write(pid_file, json.dumps(record).encode("utf-8"), mode=0o644)
    return process.pid


def read_pid(pid_file: Path) -> int | None:
    """Return the pid recorded in ``pid_file`` if that very process still runs, else ``None``."""
    try:
        record = json.loads(pid_file.read_text(encoding="utf-8"))
        pid, started = int(record["pid"]), float(record["started"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    try:
        process = psutil.Process(pid)
        if abs(process.create_time() - started) > 0.05 or process.status() == psutil.STATUS_ZOMBIE:
            return None
    except psutil.Error:
        return None
    return pid


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop_process(pid_file: Path, timeout: float = 5.0) -> bool:
    """Stop the process of ``pid_file`` (SIGTERM, then SIGKILL after ``timeout``); remove the file.

    Returns whether a live process was stopped.
    """
    pid = read_pid(pid_file)
    stopped = False
    if pid is not None:
        try:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and read_pid(pid_file) == pid:
                _reap(pid)
                time.sleep(0.05)
            if read_pid(pid_file) == pid:
                os.kill(pid, signal.SIGKILL)
                for _ in range(100):
                    _reap(pid)
                    if read_pid(pid_file) != pid:
                        break
                    time.sleep(0.02)
            stopped = True
        except ProcessLookupError:
            pass
        except PermissionError:
            raise MeshError(f"not allowed to stop process {pid} from {pid_file}: run as root") from None
    pid_file.unlink(missing_ok=True)
    return stopped


def log_tail(log_file: Path, lines: int = 5) -> str:
    """Return the last lines of a log, joined with `` | ``, for one-line error messages."""
    try:
        text = log_file.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return "(no log)"
    tail = [line.strip() for line in text.strip().splitlines()[-lines:] if line.strip()]
    return " | ".join(tail) or "(empty log)"
