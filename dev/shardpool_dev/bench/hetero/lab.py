"""The pool benchmark's hosts: quotas on their processes, their agents and profile caches, and finetune runs on them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mesh.files import write_json
from shardpool_dev.bench.cgroups import ChildMover, HostCgroups, cgroup_skip_reason, cgroupfs_mounts
from shardpool_dev.bench.hetero.modes import LABELS
from shardpool_dev.bench.hetero.summary import swap_profile_entries
from shardpool_dev.bench.mesh import BenchError, log_tail, stop_launcher, wait_for_agents, wait_until
from shardpool_dev.bench.procfs import parent_pids, process_tree
from shardpool_dev.lab import Host, Lab, netns_skip_reason


def gated_argv(argv: Sequence[str], prepare: str = ":") -> list[str]:
    """``argv`` behind a gate: a shell runs ``prepare`` (its failure is ignored), waits for one line
    on its standard input, then becomes ``argv``. Moving the shell into a cgroup before opening the
    gate throttles the command and everything it forks from their first instruction. (A command
    inside a lab host cannot join a cgroup itself: its ``/sys`` has no cgroup filesystem.)"""
    return ["sh", "-c", f'{{ {prepare}; }} >/dev/null 2>&1; read -r _ && exec "$@"', "gated", *argv]


def skip_reason() -> str | None:
    """Why this benchmark cannot run here (no root, namespaces, wireguard-go or cgroup write), or None."""
    return netns_skip_reason() or cgroup_skip_reason()


def namespace_pids(host: Host) -> list[int]:
    """Every process in ``host``'s network namespace."""
    listed = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True)
    return [int(pid) for pid in listed.stdout.split() if pid.isdigit()]


def overhead_cgroup(label: str, scope: str) -> str:
    """The cgroup of host ``label``'s own processes (launcher, WireGuard, sync daemon): its throttled
    one in ``host`` scope, an unthrottled ``<label>-host`` beside it in ``stage`` scope."""
    return label if scope == "host" else f"{label}-host"


def settle_scope(lab: Lab, cgroups: HostCgroups, scope: str) -> None:
    """In ``stage`` scope, move every process of each host but its agent's tree (the agent, its
    stages and profilers) out of the quota, into ``<label>-host``; ``mesh up`` may have started
    WireGuard or the sync daemon inside it. Nothing to do in ``host`` scope."""
    from mesh.daemon import read_pid

    if scope == "host":
        return
    parents = parent_pids()
    for label, host in lab.hosts.items():
        agent = read_pid(agent_pid_file(host))
        if agent is None:
            raise BenchError(f"host {label} has no agent to keep under its quota")
        device = process_tree(agent, parents)
        for pid in namespace_pids(host):
            with contextlib.suppress(ProcessLookupError, OSError):
                cgroups.add(label if pid in device else overhead_cgroup(label, scope), pid)


def throttle(lab: Lab, cgroups: HostCgroups, scope: str = "host") -> dict[str, int]:
    """Move every process of every host into the host's cgroup (``host`` scope) or its unthrottled
    ``<label>-host`` one (``stage`` scope: the restarted agents bring the quota to what they start);
    how many each had."""
    moved: dict[str, int] = {}
    for label, host in lab.hosts.items():
        pids = namespace_pids(host)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, OSError):  # gone meanwhile
                cgroups.add(overhead_cgroup(label, scope), pid)
        moved[label] = len(pids)
        if not pids:
            raise BenchError(f"host {label} runs no process to throttle (is its agent up?)")
    return moved


def agent_pid_file(host: Host) -> Path:
    """The agent's pid file in ``host``'s state directory (``mesh.cli.agent_process``)."""
    return host.home / "run" / "shardpool-agent.pid"


def start_in_cgroup(
    lab: Lab,
    host: Host,
    cgroups: HostCgroups,
    argv: Sequence[str],
    cgroup: str | None = None,
    **popen: Any,
) -> subprocess.Popen[Any]:
    """Start ``argv`` inside ``host`` and inside ``cgroup`` (default: the host's throttled one; see
    :func:`gated_argv`)."""
    gated = gated_argv(argv, cgroupfs_mounts(cgroups.choice))
    process = subprocess.Popen(lab.command(host, *gated), stdin=subprocess.PIPE, **popen)
    try:
        cgroups.add(
            cgroup or host.label, process.pid
        )  # ``ip netns exec`` and ``env`` exec in place: same pid
        assert process.stdin is not None
        process.stdin.write(b"go\n")
        process.stdin.close()
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process


def restart_agent(lab: Lab, host: Host, cgroups: HostCgroups) -> None:
    """Stop ``host``'s agent by pid and start it again with ``mesh up``, inside the host's cgroup."""
    from mesh.daemon import read_pid

    pid = read_pid(agent_pid_file(host))
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: read_pid(agent_pid_file(host)) is None, 30, f"agent of {host.label} stopping")
    log = host.home.parent / f"{host.label}-mesh-up.log"
    with open(log, "w") as sink:  # not a pipe: the detached agent must not hold our end open
        process = start_in_cgroup(
            lab, host, cgroups, [sys.executable, "-m", "shardpool", "mesh", "up"], stdout=sink, stderr=sink
        )
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise BenchError(f"restarting the agent of {host.label} took over 120 s") from None
    if process.returncode != 0 or read_pid(agent_pid_file(host)) is None:
        raise BenchError(f"restarting the agent of {host.label}: {log_tail(log, 3)}")


def profiles_file(host: Host) -> Path:
    """Where ``host``'s agent caches its layer profiles (its work dir's profiler directory)."""
    return host.home.with_name(host.home.name + "-work") / "profile" / "profiles.json"


def swap_profiles(lab: Lab, cgroups: HostCgroups, first: str, second: str, scope: str = "host") -> int:
    """Swap two hosts' cached profiles and restart both agents; how many entries were swapped."""
    paths = [profiles_file(lab.hosts[label]) for label in (first, second)]
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise BenchError(f"no cached profiles to swap at {missing}; the agents have not profiled yet")
    contents = [json.loads(path.read_text()) for path in paths]
    new_first, new_second, swapped = swap_profile_entries(*contents)
    if not swapped:
        raise BenchError(f"the profiles of {first} and {second} share no model and workload to swap")
    for path, content in zip(paths, (new_first, new_second), strict=True):
        owner = path.stat()
        write_json(path, content, mode=owner.st_mode & 0o777)
        os.chown(path, owner.st_uid, owner.st_gid)
    for label in (first, second):
        restart_agent(lab, lab.hosts[label], cgroups)
    wait_for_agents(lab, "".join(lab.hosts))
    settle_scope(lab, cgroups, scope)
    return swapped


def run_finetune(
    lab: Lab, cgroups: HostCgroups, config_path: Path, log: Path, timeout_s: float, scope: str = "host"
) -> None:
    """``shardpool finetune`` on host a, in a's overhead cgroup (:func:`overhead_cgroup`); in ``stage``
    scope what the launcher starts itself (the fastest-alone run's stage) is moved under a's quota
    as it appears. Raise BenchError with the log's tail on failure."""
    host = lab.hosts[LABELS[0]]
    argv = [sys.executable, "-m", "shardpool", "finetune", str(config_path)]
    with open(log, "w") as sink:
        launcher = start_in_cgroup(
            lab,
            host,
            cgroups,
            argv,
            overhead_cgroup(host.label, scope),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        mover = None if scope == "host" else ChildMover(cgroups, host.label, launcher.pid)
        try:
            if mover is not None:
                mover.start()
            launcher.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as error:
            raise BenchError(
                f"{config_path.stem} took over {timeout_s:.0f} s; log {log}:\n{log_tail(log)}"
            ) from error
        finally:
            if mover is not None:
                mover.stop()
            stop_launcher(launcher)
    if launcher.returncode != 0:
        raise BenchError(f"{config_path.stem} failed (exit {launcher.returncode}):\n{log_tail(log)}")


def read_pid_of_agent(host: Host) -> int | None:
    """The pid of ``host``'s agent now (None when it runs none)."""
    from mesh.daemon import read_pid

    return read_pid(agent_pid_file(host))
