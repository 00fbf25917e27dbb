"""Starting and stopping the shardpool agent beside the mesh (``mesh init/join/up/down/leave``).

The shardpool agent (``shardpool agent``, :data:`mesh.constants.AGENT_PORT` on the mesh address)
lets launchers on other members start training stages here. It is started as a separate program,
only when the shardpool package is installed, because this package never imports shardpool or torch.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

from mesh.cli.accounts import AGENT_LAUNCH_GROUP, AGENT_RUN_AS, ensure_agent_accounts
from mesh.daemon import log_tail, read_pid, spawn_detached, stop_process
from mesh.errors import MeshError
from mesh.state import StatePaths, read_json

__all__ = ["agent_choice", "shardpool_agent_files", "start_shardpool_agent", "stop_shardpool_agent"]


def shardpool_agent_files(paths: StatePaths) -> tuple[Path, Path, Path, Path]:
    """Pid file, log, ready file and the ``--no-agent`` marker of the shardpool agent."""
    return (
        paths.run / "shardpool-agent.pid",
        paths.logs / "shardpool-agent.log",
        paths.run / "shardpool-agent.json",
        paths.root / "shardpool-agent.disabled",
    )


def start_shardpool_agent(paths: StatePaths, timeout: float = 15.0) -> str:
    """Start ``shardpool agent`` detached and wait until it listens; return the line saying what happened.

    As root, first creates its run-as account and launch group where missing, with a line before
    that one saying so. Never raises: the mesh works without the agent, so a failure is reported, not fatal.
    """
    pid_file, log_file, ready_file, disabled = shardpool_agent_files(paths)
    if disabled.exists():
        return f"shardpool agent: not started (disabled with --no-agent; delete {disabled} to enable it)"
    running = read_pid(pid_file)
    if running is not None:
        return f"shardpool agent: already running (pid {running})"
    spec = importlib.util.find_spec("shardpool")
    if spec is None or spec.origin is None:
        return "shardpool agent: not started (the shardpool package is not installed here)"
    try:
        created = ensure_agent_accounts(AGENT_RUN_AS, AGENT_LAUNCH_GROUP) if os.geteuid() == 0 else None
    except MeshError as error:
        return f"shardpool agent: not started: {error}"
    started = _launch(paths, str(Path(spec.origin).resolve().parent.parent), timeout)
    return started if created is None else f"{created}\n{started}"


def _launch(paths: StatePaths, package_parent: str, timeout: float) -> str:
    """Spawn ``shardpool agent`` from ``package_parent`` and wait until it listens; the line saying how it went."""
    pid_file, log_file, ready_file, _ = shardpool_agent_files(paths)
    path = os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, PYTHONPATH=package_parent + (os.pathsep + path if path else ""))
    ready_file.unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        "shardpool",
        "agent",
        "--state-dir",
        str(paths.root),
        "--ready-file",
        str(ready_file),
        "--run-as",
        AGENT_RUN_AS,
        "--group",
        AGENT_LAUNCH_GROUP,
    ]
    pid = spawn_detached(argv, pid_file, log_file, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if read_pid(pid_file) != pid:
            return f"shardpool agent: could not start: {log_tail(log_file, 2)} (log: {log_file})"
        if ready_file.exists():
            try:
                ready = read_json(ready_file)
            except MeshError:
                ready = {}
            if ready.get("pid") == pid:
                return f"shardpool agent: listening on {ready.get('url')} (pid {pid}; log {log_file})"
        time.sleep(0.05)
    stop_process(pid_file)
    return f"shardpool agent: not ready within {timeout:.0f} s, stopped it: {log_tail(log_file, 2)}"


def stop_shardpool_agent(paths: StatePaths) -> None:
    """Stop the shardpool agent (and so its jobs) if it runs."""
    pid_file, _, ready_file, _ = shardpool_agent_files(paths)
    stop_process(pid_file, timeout=10.0)
    ready_file.unlink(missing_ok=True)


def agent_choice(paths: StatePaths, no_agent: bool) -> str:
    """Remember ``--no-agent`` (until ``leave``) or start the agent; return the line to print."""
    if no_agent:
        shardpool_agent_files(paths)[3].touch()
        return "shardpool agent: not started (--no-agent); this machine cannot host remote training stages"
    return start_shardpool_agent(paths)
