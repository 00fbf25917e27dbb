"""Memory-capped lab hosts: a cgroup per host with a memory limit, and agents started inside it.

A lab host is a network namespace, not a machine: its processes see the machine's whole memory. To
give a host less, its agent (and so every profiler and stage it starts: children inherit the
cgroup) runs in a memory cgroup of its own, and sees that cgroup's filesystem, which ``ip netns
exec`` would otherwise hide behind a fresh ``/sys`` (see ``scripts/bench_hetero.py``, which does
the same with CPU quotas). The agent's device report then says ``free = limit - usage``
(:mod:`shardpool.host.memory_limit`), as on a container or a Slurm job.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from shardpool_dev.lab import Host, Lab

__all__ = ["MemoryCgroups", "memory_cgroup_skip_reason", "probe_free_bytes"]

_MOUNTS = Path("/proc/self/mounts")


@dataclass(frozen=True)
class _Hierarchy:
    version: Literal["v1", "v2"]
    mount: Path


def _memory_hierarchy() -> _Hierarchy | None:
    """cgroup v2 where a ``cgroup2`` mount has the ``memory`` controller, else the v1 ``memory`` mount."""
    v1: Path | None = None
    for line in _MOUNTS.read_text().splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        kind, mount, options = fields[2], Path(fields[1]), fields[3].split(",")
        if kind == "cgroup2":
            with contextlib.suppress(OSError):
                if "memory" in (mount / "cgroup.controllers").read_text().split():
                    return _Hierarchy("v2", mount)
        elif kind == "cgroup" and "memory" in options and v1 is None:
            v1 = mount
    return _Hierarchy("v1", v1) if v1 is not None else None


@dataclass
class MemoryCgroups:
    """One memory cgroup per host label under ``<mount>/<name>``; a context manager.

    On exit the processes still in them go back to the hierarchy's root cgroup (the lab stops
    them with the rest of its hosts) and the cgroups are removed.
    """

    name: str
    labels: str
    hierarchy: _Hierarchy = field(init=False)

    def __post_init__(self) -> None:
        found = _memory_hierarchy()
        if found is None:
            raise OSError("no cgroup hierarchy with the memory controller is mounted")
        self.hierarchy = found

    @property
    def parent(self) -> Path:
        """The cgroup holding the hosts' cgroups."""
        return self.hierarchy.mount / self.name

    def __enter__(self) -> MemoryCgroups:
        self.parent.mkdir()
        try:
            if self.hierarchy.version == "v2":
                (self.hierarchy.mount / "cgroup.subtree_control").write_text("+memory")
                (self.parent / "cgroup.subtree_control").write_text("+memory")
            for label in self.labels:
                (self.parent / label).mkdir()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_limit(self, label: str, limit_bytes: int) -> None:
        """Cap host ``label``'s cgroup at ``limit_bytes``."""
        name = "memory.max" if self.hierarchy.version == "v2" else "memory.limit_in_bytes"
        (self.parent / label / name).write_text(str(int(limit_bytes)))

    def reclaim(self, label: str) -> None:
        """Have the kernel drop what it can of host ``label``'s page cache (v1 ``memory.force_empty``,
        v2 ``memory.reclaim``), so what its processes read earlier does not count as used."""
        directory = self.parent / label
        with contextlib.suppress(OSError):  # it reclaims what it can and may still say EBUSY/EAGAIN
            if self.hierarchy.version == "v2":
                (directory / "memory.reclaim").write_text(str(self.usage(label)))
            else:
                (directory / "memory.force_empty").write_text("0")

    def usage(self, label: str) -> int:
        """Bytes host ``label``'s cgroup uses now."""
        name = "memory.current" if self.hierarchy.version == "v2" else "memory.usage_in_bytes"
        return int((self.parent / label / name).read_text())

    def pids(self, label: str) -> list[int]:
        """The processes in host ``label``'s cgroup."""
        with contextlib.suppress(OSError):
            return [int(pid) for pid in (self.parent / label / "cgroup.procs").read_text().split()]
        return []

    def add(self, label: str, pid: int) -> None:
        """Move process ``pid`` into host ``label``'s cgroup (its children from then on are born there)."""
        (self.parent / label / "cgroup.procs").write_text(str(pid))

    def mount_inside(self) -> str:
        """Shell commands that mount this hierarchy at ``/sys/fs/cgroup`` inside a lab host's fresh ``/sys``."""
        if self.hierarchy.version == "v2":
            return "mount -t cgroup2 cgroup2 /sys/fs/cgroup"
        return (
            "mount -t tmpfs cgroup /sys/fs/cgroup && mkdir -p /sys/fs/cgroup/memory"
            " && mount -t cgroup -o memory cgroup /sys/fs/cgroup/memory"
        )

    def start_agent(self, lab: Lab, host: Host) -> None:
        """(Re)start ``host``'s agent with ``mesh up`` inside the host's cgroup, seeing its cgroup files.

        A running agent is stopped first (by its pid file), so the new one, and what it starts,
        are born in the cgroup; WireGuard and the sync daemon keep running where they are (when
        the whole host was killed, ``mesh up`` starts them here too).
        """
        from mesh.daemon import read_pid

        pid_file = host.home / "run" / "shardpool-agent.pid"
        pid = read_pid(pid_file)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            _wait(lambda: read_pid(pid_file) is None, 30, f"the agent of {host.label} stopping")
        gate = f'{{ {self.mount_inside()}; }} >/dev/null 2>&1; read -r _ && exec "$@"'
        argv = ["sh", "-c", gate, "gated", sys.executable, "-m", "shardpool", "mesh", "up"]
        log = host.home.parent / f"{host.label}-mesh-up.log"
        with open(log, "w") as sink:  # not a pipe: the detached agent must not hold our end open
            process = subprocess.Popen(
                lab.command(host, *argv), stdin=subprocess.PIPE, stdout=sink, stderr=sink
            )
            try:
                self.add(host.label, process.pid)  # ip netns exec and env exec in place: the same pid
                assert process.stdin is not None
                process.stdin.write(b"go\n")
                process.stdin.close()
                process.wait(timeout=120)
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        if process.returncode != 0 or read_pid(pid_file) is None:
            raise OSError(f"mesh up on {host.label} in its cgroup failed: {log.read_text()[-600:]}")

    def close(self) -> None:
        """Move what is left back to the root cgroup and remove the cgroups, the parent last."""
        root_procs = self.hierarchy.mount / "cgroup.procs"
        for label in self.labels:
            directory = self.parent / label
            if not directory.is_dir():
                continue
            for pid in self.pids(label):
                with contextlib.suppress(OSError):
                    root_procs.write_text(str(pid))
            with contextlib.suppress(OSError):
                directory.rmdir()
        with contextlib.suppress(OSError):
            self.parent.rmdir()


def memory_cgroup_skip_reason(name: str) -> str | None:
    """Why hosts cannot be memory-capped here (no memory controller, or no write to it), or None."""
    try:
        with MemoryCgroups(name, "p") as probe:
            probe.set_limit("p", 1 << 30)
    except OSError as error:
        return f"cannot make a memory cgroup: {error}"
    return None


_PROBE = """
import json, sys
from shardpool.agent.local_client import LocalAgentClient
request = json.loads(sys.stdin.read())
client = LocalAgentClient()
out = {}
for name in request["members"]:
    rows = client.member(name, "").devices(request["model_config"], request["workload"])
    out[name] = [row["free_bytes"] for row in rows if row.get("kind") == "cpu"][0]
print(json.dumps(out))
"""


def probe_free_bytes(
    lab: Lab, source: Host, members: str, model_config: dict[str, Any], workload: dict[str, Any]
) -> dict[str, int]:
    """Each member's CPU ``free_bytes`` as its agent reports it for this model and workload (asked
    through ``source``'s agent, as a launcher there would)."""
    request = json.dumps({"members": list(members), "model_config": model_config, "workload": workload})
    done = lab.run(source, sys.executable, "-c", _PROBE, stdin=request, timeout=300)
    if done.returncode != 0:
        raise OSError(f"probing free memory failed: {done.stderr.strip()[-600:]}")
    return {name: int(value) for name, value in json.loads(done.stdout).items()}


def _wait(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise OSError(f"{what} took over {timeout:.0f} s")
        time.sleep(0.2)
