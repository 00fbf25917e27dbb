"""CPU quotas for benchmark processes: find the cgroup hierarchy, write quotas, move processes, sample usage.

A quota stands in for a slower device: a process under 0.3 CPU does the same work as under 1.0, only
slower, at every timescale its work has (see :data:`PERIOD_US`)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from shardpool_dev.bench.procfs import (
    PROCESS_KINDS,
    ProcessCpu,
    command_label,
    cpu_seconds_by_kind,
    cpu_stat_delta,
    merged_sample,
    parent_pids,
    process_kind,
    process_tree,
    seen_windows,
    stat_cpu_ticks,
)
from shardpool_dev.bench.stats import ratio

PERIOD_US = 10_000
"""The CFS period of every quota (``--period-ms``), by default 10 ms, so a host is slow at every
timescale its work has (a layer pass takes milliseconds). Under the kernel's default 100 ms, a burst
shorter than the quota runs at full speed, and a host that waits less than its throttled part of a
period loses no work by waiting. Either way the quota is an emulation of a slower device: at 10 ms
the slow host pays for its short slices (0.3 CPU, 3 ms runs: 7 % more CPU for the same work than at
0.6), at 100 ms much less, but it absorbs waits that a slower device would lose."""


PERIOD_MS_RANGE = (10, 1000)
"""The periods ``--period-ms`` takes: up to the kernel's 1 s, and from 10 ms, under which a small
quota would meet the kernel's 1 ms floor."""


@dataclass(frozen=True)
class CgroupChoice:
    """Which cgroup hierarchy throttles the hosts: ``v2`` (``cpu.max``) or ``v1`` (CFS files), mounted where."""

    version: Literal["v1", "v2"]
    mount: Path


def choose_cgroup(mounts: str, unified_controllers: Mapping[str, str]) -> CgroupChoice | None:
    """The hierarchy to put CPU quotas in, from the text of ``/proc/self/mounts``.

    cgroup v2 where a ``cgroup2`` mount lists ``cpu`` in its ``cgroup.controllers`` (given in
    ``unified_controllers``, mount point -> file text); else the cgroup v1 mount with the ``cpu``
    controller among its options; None when neither exists.
    """
    v1: Path | None = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        kind, mount, options = fields[2], fields[1], fields[3].split(",")
        if kind == "cgroup2" and "cpu" in unified_controllers.get(mount, "").split():
            return CgroupChoice("v2", Path(mount))
        if kind == "cgroup" and "cpu" in options and v1 is None:
            v1 = Path(mount)
    return CgroupChoice("v1", v1) if v1 is not None else None


def quota_files(version: Literal["v1", "v2"], cpus: float, period_us: int = PERIOD_US) -> dict[str, str]:
    """The files (name -> text, in write order) that cap a cgroup at ``cpus`` CPUs."""
    quota_us = max(1000, round(cpus * period_us))  # the kernel refuses quotas under 1 ms
    if version == "v2":
        return {"cpu.max": f"{quota_us} {period_us}"}
    return {"cpu.cfs_period_us": str(period_us), "cpu.cfs_quota_us": str(quota_us)}


def cgroupfs_mounts(choice: CgroupChoice) -> str:
    """Shell commands that mount the cgroup filesystem at ``/sys/fs/cgroup`` as this machine has it.

    ``ip netns exec`` mounts a fresh ``/sys`` (in a mount namespace of its own, whose mounts do not
    reach the machine's) that lacks the cgroup filesystems, so a process in a lab host could not
    read its own CPU quota, which a profile records (``shardpool.host.cpu_quota``); a real host can.
    """
    if choice.version == "v2":
        return "mount -t cgroup2 cgroup2 /sys/fs/cgroup"
    hierarchy = choice.mount.name  # "cpu", or "cpu,cpuacct" where the controllers are mounted together
    return (
        f"mount -t tmpfs cgroup /sys/fs/cgroup && mkdir -p /sys/fs/cgroup/{hierarchy}"
        f" && mount -t cgroup -o {hierarchy} cgroup /sys/fs/cgroup/{hierarchy}"
    )


def detect_cgroup() -> CgroupChoice | None:
    """:func:`choose_cgroup` on this machine's mounts."""
    mounts = Path("/proc/self/mounts").read_text()
    controllers: dict[str, str] = {}
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            with contextlib.suppress(OSError):
                controllers[fields[1]] = (Path(fields[1]) / "cgroup.controllers").read_text()
    return choose_cgroup(mounts, controllers)


@dataclass
class HostCgroups:
    """One cgroup per host under ``<mount>/shardpool-bench-<pid>``, each capped at its CPU quota.

    A context manager: on exit every process still in them is killed by pid and the cgroups are removed.
    """

    choice: CgroupChoice
    quotas: dict[str, float]
    unthrottled: tuple[str, ...] = ()
    period_us: int = PERIOD_US
    parent: Path = field(init=False)

    def __post_init__(self) -> None:
        self.parent = self.choice.mount / f"shardpool-bench-{os.getpid()}"

    def __enter__(self) -> HostCgroups:
        self.parent.mkdir()
        try:
            if self.choice.version == "v2":
                (self.choice.mount / "cgroup.subtree_control").write_text("+cpu")
                (self.parent / "cgroup.subtree_control").write_text("+cpu")
            for label, cpus in self.quotas.items():
                self.path(label).mkdir()
                for name, text in quota_files(self.choice.version, cpus, self.period_us).items():
                    (self.path(label) / name).write_text(text)
            for label in self.unthrottled:
                self.path(label).mkdir()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def path(self, label: str) -> Path:
        """The cgroup directory of host ``label``."""
        return self.parent / label

    def procs(self, label: str) -> Path:
        """The ``cgroup.procs`` file of host ``label`` (write a pid to move that process in)."""
        return self.path(label) / "cgroup.procs"

    def add(self, label: str, pid: int) -> None:
        """Move process ``pid`` (all its threads) into host ``label``'s cgroup."""
        self.procs(label).write_text(str(pid))

    def pids(self, label: str) -> list[int]:
        """The processes in host ``label``'s cgroup now."""
        try:
            return [int(pid) for pid in self.procs(label).read_text().split()]
        except OSError:
            return []

    def close(self) -> None:
        """Kill what is left in the cgroups (by pid) and remove them, the parent last."""
        for label in (*self.quotas, *self.unthrottled):
            directory = self.path(label)
            if not directory.is_dir():
                continue
            deadline = time.monotonic() + 10
            while (pids := self.pids(label)) and time.monotonic() < deadline:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.1)
            with contextlib.suppress(OSError):
                directory.rmdir()
        with contextlib.suppress(OSError):
            self.parent.rmdir()


def cgroup_skip_reason() -> str | None:
    """Why the hosts cannot be throttled here, or None: no ``cpu`` controller, or no write to it."""
    choice = detect_cgroup()
    if choice is None:
        return "needs a cgroup hierarchy with the cpu controller (v2 cpu.max or v1 cpu.cfs_quota_us)"
    try:
        with HostCgroups(choice, {"probe": 0.5}):
            pass
    except OSError as error:
        return f"cannot create a throttled {choice.version} cgroup under {choice.mount}: {error}"
    return None


class ChildMover:
    """Moves the processes ``parent`` starts into cgroup ``label`` as they appear (every 20 ms).

    A stage imports torch for about a second before it computes, so the few milliseconds it may
    run outside the quota do not count; its thread count comes from the config
    (``threads_per_stage``), not from the quota it sees at start."""

    def __init__(self, cgroups: HostCgroups, label: str, parent: int, period_s: float = 0.02) -> None:
        import threading

        self.cgroups, self.label, self.parent, self.period_s = cgroups, label, parent, period_s
        self.moved: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="child-mover", daemon=True)

    def start(self) -> None:
        """Start watching."""
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (the processes stay where they were moved)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with contextlib.suppress(OSError):
                for pid in process_tree(self.parent, parent_pids()) - {self.parent} - self.moved:
                    with contextlib.suppress(ProcessLookupError, OSError):
                        self.cgroups.add(self.label, pid)
                        self.moved.add(pid)


class CgroupCpuSampler:
    """CPU seconds per kind of process (:func:`shardpool_dev.bench.procfs.process_kind`) in each host's throttled cgroup over a
    run: ``/proc/<pid>/stat`` utime + stime of the cgroup's processes at :meth:`start`, every
    ``period_s`` while it trains (a stage or profiler exits before the run ends; up to its last
    ``period_s`` of CPU goes uncounted) and at :meth:`stop`; and the growth of the cgroup's
    ``cpu.stat`` (its throttling counters). Tells whether the agent or anything beside the stage
    uses a host's quota."""

    def __init__(self, cgroups: HostCgroups, agents: Mapping[str, int | None], period_s: float = 0.5) -> None:
        import threading

        self.cgroups, self.agents, self.period_s = cgroups, dict(agents), period_s
        self.first: dict[str, dict[int, ProcessCpu]] = {}
        self.last: dict[str, dict[int, ProcessCpu]] = {}
        self.cpu_stat: dict[str, str] = {}
        self.started = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cgroup-cpu", daemon=True)

    def start(self) -> None:
        """Take the first sample and start sampling."""
        self.started = time.monotonic()
        self.cpu_stat = {label: self._cpu_stat(label) for label in self.cgroups.quotas}
        self.first = self._sample()
        self.last = {label: dict(seen) for label, seen in self.first.items()}
        self._thread.start()

    def stop(self) -> dict[str, dict[str, Any]]:
        """Take the last sample; per host, CPU seconds by kind, the wall seconds sampled, the CPU
        seconds its quota allowed over them, and the growth of its ``cpu.stat``."""
        self._stop.set()
        self._thread.join(timeout=10)
        self._merge(self._sample())
        wall = time.monotonic() - self.started
        ticks_per_s = float(os.sysconf("SC_CLK_TCK"))
        result: dict[str, dict[str, Any]] = {}
        for label, quota in self.cgroups.quotas.items():
            used = cpu_seconds_by_kind(self.first.get(label, {}), self.last.get(label, {}), ticks_per_s)
            total = sum(used[kind] for kind in PROCESS_KINDS)
            result[label] = used | {
                "total": round(total, 3),
                "wall_s": round(wall, 1),
                "quota_cpu_s": round(quota * wall, 1),
                "total_over_quota": ratio(total, quota * wall),
                "cpu_stat": cpu_stat_delta(self.cpu_stat.get(label, ""), self._cpu_stat(label)),
                "seen_s": seen_windows(self.last.get(label, {}), self.started),
            }
        return result

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._merge(self._sample())

    def _merge(self, sample: dict[str, dict[int, ProcessCpu]]) -> None:
        for label, seen in sample.items():
            self.last[label] = merged_sample(self.last.get(label, {}), seen)

    def _cpu_stat(self, label: str) -> str:
        try:
            return (self.cgroups.path(label) / "cpu.stat").read_text()
        except OSError:
            return ""

    def _sample(self) -> dict[str, dict[int, ProcessCpu]]:
        sample: dict[str, dict[int, ProcessCpu]] = {}
        now = time.monotonic()
        for label in self.cgroups.quotas:
            seen: dict[int, ProcessCpu] = {}
            for pid in self.cgroups.pids(label):
                try:
                    name, ticks = stat_cpu_ticks(Path(f"/proc/{pid}/stat").read_text())
                    cmdline = (
                        Path(f"/proc/{pid}/cmdline")
                        .read_bytes()
                        .replace(b"\0", b" ")
                        .decode(errors="replace")
                    )
                except (OSError, ValueError, IndexError):
                    continue  # gone meanwhile
                kind = process_kind(pid, cmdline, self.agents.get(label))
                seen[pid] = ProcessCpu(kind, command_label(name, cmdline), ticks, now, now)
            sample[label] = seen
        return sample
