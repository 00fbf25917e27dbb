"""The CPU quota of this process's cgroup, in CPUs (``0.5`` for half a core), or None when unlimited.

A host throttled by a cgroup CPU quota shows every core in ``os.sched_getaffinity`` yet runs a
fraction of them, so a profile records the quota it was measured under. The process's own cgroup
comes from ``/proc/self/cgroup``; its quota is cgroup v2's ``cpu.max`` (``"50000 100000"`` or
``"max 100000"``) or cgroup v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (``-1`` unlimited).
A parent cgroup's quota caps its children, so the tightest quota from the cgroup up to the root
counts. The parsers are pure functions of the files' text; :func:`cpu_quota` reads the files.
"""

from __future__ import annotations

import math
import os
from pathlib import Path, PurePosixPath
from typing import NamedTuple

__all__ = [
    "controller_cgroup_paths",
    "CgroupPaths",
    "available_cpus",
    "cgroup_ancestors",
    "cgroup_paths",
    "cpu_quota",
    "parse_cfs_quota",
    "parse_cpu_max",
    "read_or_none",
    "usable_cpus",
]

_PROC_SELF_CGROUP = Path("/proc/self/cgroup")
_CGROUP_ROOT = Path("/sys/fs/cgroup")


class CgroupPaths(NamedTuple):
    """This process's path in the cgroup v1 hierarchy holding the ``cpu`` controller and in the
    unified (v2) hierarchy (None where absent)."""

    v1_cpu: str | None
    v2: str | None


def cgroup_paths(proc_self_cgroup: str) -> CgroupPaths:
    """The v1 ``cpu`` and the v2 cgroup paths named in the text of ``/proc/self/cgroup``."""
    return CgroupPaths(*controller_cgroup_paths(proc_self_cgroup, "cpu"))


def controller_cgroup_paths(proc_self_cgroup: str, controller: str) -> tuple[str | None, str | None]:
    """The v1 path of ``controller`` and the v2 path named in the text of ``/proc/self/cgroup``.

    Each line is ``hierarchy-id:controllers:path``; v2's line has id 0 and no controllers.
    """
    v1: str | None = None
    v2: str | None = None
    for line in proc_self_cgroup.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif controller in controllers.split(","):
            v1 = path
    return v1, v2


def parse_cpu_max(text: str) -> float | None:
    """CPUs allowed by a cgroup v2 ``cpu.max`` (``"quota period"``); None for ``max`` or bad text."""
    fields = text.split()
    if len(fields) not in (1, 2) or fields[0] == "max":
        return None
    period = fields[1] if len(fields) == 2 else "100000"
    return _ratio(fields[0], period)


def parse_cfs_quota(quota_text: str, period_text: str) -> float | None:
    """CPUs allowed by cgroup v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``; None for ``-1``."""
    return _ratio(quota_text.strip(), period_text.strip())


def _ratio(quota: str, period: str) -> float | None:
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:
        return None
    if quota_us <= 0 or period_us <= 0:
        return None
    return quota_us / period_us


def cpu_quota(*, proc_self_cgroup: Path = _PROC_SELF_CGROUP, root: Path = _CGROUP_ROOT) -> float | None:
    """The tightest CPU quota on this process's cgroup and its ancestors, in CPUs; None if unlimited
    or unreadable (no cgroup filesystem, another OS)."""
    try:
        paths = cgroup_paths(proc_self_cgroup.read_text())
    except OSError:
        return None
    quotas: list[float] = []
    if paths.v2 is not None:
        for directory in cgroup_ancestors(root, paths.v2):
            quota = parse_cpu_max(read_or_none(directory / "cpu.max") or "max")
            if quota is not None:
                quotas.append(quota)
    if paths.v1_cpu is not None:
        for mount in (root / "cpu", root / "cpu,cpuacct"):
            for directory in cgroup_ancestors(mount, paths.v1_cpu):
                quota_text, period_text = (
                    read_or_none(directory / "cpu.cfs_quota_us"),
                    read_or_none(directory / "cpu.cfs_period_us"),
                )
                if quota_text is not None and period_text is not None:
                    quota = parse_cfs_quota(quota_text, period_text)
                    if quota is not None:
                        quotas.append(quota)
    return min(quotas) if quotas else None


def cgroup_ancestors(mount: Path, path: str) -> list[Path]:
    """``mount/path`` and each parent up to ``mount`` (a container sees its own cgroup as the root)."""
    relative = PurePosixPath(path).relative_to("/")
    return [mount / part for part in (relative, *relative.parents)]


def read_or_none(path: Path) -> str | None:
    """A cgroup or /proc file's text; None where it cannot be read (no such controller, another OS)."""
    try:
        return path.read_text()
    except OSError:
        return None


def usable_cpus(cores: int, quota: float | None) -> int:
    """How many threads a process can keep busy: its cores, capped by its CPU quota rounded up (at least 1).

    Threads beyond the quota only queue for it. Under a 0.6-CPU quota, two OpenMP threads are
    throttled in turn, each mid-barrier while the other spins for it: a 16-layer step measured
    50 s with two threads on one core's 0.6, where one thread does the same work without the waits.
    """
    if quota is None:
        return max(1, cores)
    return max(1, min(cores, math.ceil(quota - 1e-9)))


def available_cpus() -> int:
    """:func:`usable_cpus` of this process: its CPU affinity and its cgroup's quota."""
    return usable_cpus(len(os.sched_getaffinity(0)), cpu_quota())
