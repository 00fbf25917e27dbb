"""The memory limit of this process's cgroup, and what is left of it: a CPU device's usable memory.

A container, a Slurm job or a systemd slice caps a process's memory with a cgroup while
``/proc/meminfo`` still shows the whole machine, so a CPU stage planned from the machine's
available memory would be killed by the kernel's OOM killer. The process's own cgroup comes from
``/proc/self/cgroup`` (its ``memory`` controller line in cgroup v1, the ``0::`` line in v2); its
limit is v2's ``memory.max`` (``max`` for none) or v1's ``memory.limit_in_bytes`` (a huge number
for none). Its usage counts the page cache of files its processes read, which the kernel drops
before it refuses memory, so what is in use is the *working set*, as container runtimes count
it: ``memory.current`` / ``memory.usage_in_bytes`` minus the inactive file cache of
``memory.stat`` (v2 ``inactive_file``, v1 ``total_inactive_file``). A parent's limit caps its
children, so every cgroup from the process's own up to the root counts: what is left is the
smallest ``limit - usage`` among them. A container that sees its own cgroup as the root has it at
the mount point itself. The parsers are pure functions of the files' text; :func:`cgroup_memory`
reads the files.

A running stage also asks what it can still take on (:func:`cpu_room_bytes`, before a re-shard
adds layers to it): the free memory now, less what its own peak already used above what it holds
between steps, since each step needs that again.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import psutil

from shardpool.host.cpu_quota import cgroup_ancestors, controller_cgroup_paths, read_or_none

__all__ = [
    "CgroupMemory",
    "ResidentMemory",
    "capped_memory",
    "cgroup_memory",
    "cpu_memory",
    "cpu_room_bytes",
    "memory_cgroup_paths",
    "memory_stat",
    "parse_memory_limit",
    "parse_resident_memory",
    "resident_memory",
    "room_after_peak",
]

_PROC_SELF_CGROUP = Path("/proc/self/cgroup")
_PROC_SELF_STATUS = Path("/proc/self/status")
_CGROUP_ROOT = Path("/sys/fs/cgroup")
#: cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit number; anything this
#: large is no limit on any machine.
_UNLIMITED = 1 << 60


class CgroupMemory(NamedTuple):
    """The tightest memory cap over this process's cgroup and its ancestors.

    ``limit_bytes`` is the cap of the cgroup that leaves the least, ``free_bytes`` that cgroup's
    limit minus its usage (never below 0).
    """

    limit_bytes: int
    free_bytes: int


class ResidentMemory(NamedTuple):
    """This process's resident memory now (``VmRSS``) and at its highest so far (``VmHWM``)."""

    current_bytes: int
    peak_bytes: int


class _Paths(NamedTuple):
    v1_memory: str | None
    v2: str | None


def memory_cgroup_paths(proc_self_cgroup: str) -> tuple[str | None, str | None]:
    """The v1 ``memory`` and the v2 cgroup paths named in the text of ``/proc/self/cgroup``."""
    return _Paths(*controller_cgroup_paths(proc_self_cgroup, "memory"))


def parse_memory_limit(text: str) -> int | None:
    """Bytes allowed by a v2 ``memory.max`` or v1 ``memory.limit_in_bytes``; None for no limit or bad text."""
    value = text.strip()
    if not value.isdigit():
        return None  # "max", empty, or not a number
    limit = int(value)
    return limit if limit < _UNLIMITED else None


def cgroup_memory(
    *, proc_self_cgroup: Path = _PROC_SELF_CGROUP, root: Path = _CGROUP_ROOT
) -> CgroupMemory | None:
    """The limit and free bytes of the tightest memory cgroup over this process; None if none is
    limited or none can be read (no cgroup filesystem, another OS)."""
    try:
        paths = memory_cgroup_paths(proc_self_cgroup.read_text())
    except OSError:
        return None
    levels: list[tuple[Path, str, str, str]] = []  # (directory, limit, usage, inactive cache key)
    if paths[1] is not None:
        levels += [
            (d, "memory.max", "memory.current", "inactive_file") for d in cgroup_ancestors(root, paths[1])
        ]
    if paths[0] is not None:
        levels += [
            (d, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            for d in cgroup_ancestors(root / "memory", paths[0])
        ]
    tightest: CgroupMemory | None = None
    for directory, limit_file, usage_file, inactive_key in levels:
        limit = parse_memory_limit(read_or_none(directory / limit_file) or "max")
        if limit is None:
            continue
        usage = parse_memory_limit(read_or_none(directory / usage_file) or "") or 0
        inactive = memory_stat(read_or_none(directory / "memory.stat") or "").get(inactive_key, 0)
        level = CgroupMemory(limit, max(0, limit - max(0, usage - inactive)))
        if tightest is None or level.free_bytes < tightest.free_bytes:
            tightest = level
    return tightest


def memory_stat(text: str) -> dict[str, int]:
    """The ``name value`` lines of a ``memory.stat`` file (v1 or v2) as a dict; other lines are skipped."""
    stats: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].isdigit():
            stats[fields[0]] = int(fields[1])
    return stats


def capped_memory(total: int, available: int, cap: CgroupMemory | None) -> tuple[int, int]:
    """(total, free) bytes of a CPU device: the machine's, cut down by a cgroup cap tighter than it.

    Free is the smaller of what the machine has available and what the cgroup has left.
    """
    if cap is None:
        return total, available
    return min(total, cap.limit_bytes), max(0, min(available, cap.free_bytes))


def cpu_memory() -> tuple[int, int]:
    """(total, free) bytes of this machine's memory as this process may use it: psutil's figures
    within its cgroup's cap (:func:`capped_memory`)."""
    memory = psutil.virtual_memory()
    return capped_memory(int(memory.total), int(memory.available), cgroup_memory())


def parse_resident_memory(status_text: str) -> ResidentMemory | None:
    """``VmRSS`` and ``VmHWM`` of a ``/proc/PID/status`` text; None when either is missing."""
    kib: dict[str, int] = {}
    for line in status_text.splitlines():
        name, _, value = line.partition(":")
        fields = value.split()
        if name in ("VmRSS", "VmHWM") and fields and fields[0].isdigit():
            kib[name] = int(fields[0])
    if len(kib) != 2:
        return None
    return ResidentMemory(current_bytes=kib["VmRSS"] * 1024, peak_bytes=kib["VmHWM"] * 1024)


def resident_memory(*, status: Path = _PROC_SELF_STATUS) -> ResidentMemory | None:
    """This process's resident memory now and at its peak; None where /proc does not say (not Linux)."""
    text = read_or_none(status)
    return parse_resident_memory(text) if text is not None else None


def room_after_peak(free_bytes: int, peak_bytes: int, in_use_bytes: int) -> int:
    """What a process can add to its peak without running out: ``free_bytes`` now, less what its
    peak took above what it holds now (between steps; every step takes that again). Never below 0."""
    return max(0, free_bytes - max(0, peak_bytes - in_use_bytes))


def cpu_room_bytes() -> int:
    """What this process can still add to its CPU memory peak (:func:`room_after_peak` of
    :func:`cpu_memory`'s free bytes and :func:`resident_memory`)."""
    _, free = cpu_memory()
    resident = resident_memory()
    if resident is None:
        return free
    return room_after_peak(free, resident.peak_bytes, resident.current_bytes)
