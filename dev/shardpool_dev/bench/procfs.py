"""CPU time per process from /proc: who is whose child, what kind of process it is, and how much CPU each kind used."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardpool_dev.bench.stats import ratio


def parent_pids(proc: Path = Path("/proc")) -> dict[int, int]:
    """Every process's parent, from ``/proc/<pid>/stat``."""
    parents: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
        parents[int(entry.name)] = int(fields[1])
    return parents


STAGE_MODULE = "shardpool.elastic.rank"
"""The module every stage process runs (``python -m shardpool.elastic.rank JOB RANK``)."""

PROCESS_KINDS = ("stage", "profiler", "agent", "other")
"""What :func:`process_kind` calls a process in a host's throttled cgroup."""


def process_kind(pid: int, cmdline: str, agent: int | None) -> str:
    """``agent`` (the host's agent, by pid), ``stage`` (:data:`STAGE_MODULE`), ``profiler``
    (``shardpool.plan.report``) or ``other``, from ``/proc/<pid>/cmdline`` (NULs as spaces)."""
    if pid == agent:
        return "agent"
    if STAGE_MODULE in cmdline:
        return "stage"
    if "shardpool.plan.report" in cmdline:
        return "profiler"
    return "other"


def stat_cpu_ticks(stat: str) -> tuple[str, int]:
    """``(command name, utime + stime)`` from the text of ``/proc/<pid>/stat``, in clock ticks: the
    CPU the process itself used (its reaped children's, cutime and cstime, left out)."""
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()  # fields[0] is the state, field 3 of the file
    return name, int(fields[11]) + int(fields[12])  # fields 14 and 15: utime, stime


def command_label(name: str, cmdline: str, words: int = 4) -> str:
    """A process's name for ``other_by_name``: the first ``words`` words of its command line without
    paths (``python -m mesh.node.syncd``), or its command name where the line is empty (a kernel
    thread, or a process gone meanwhile)."""
    parts = [part.rsplit("/", 1)[-1] for part in cmdline.split()[:words]]
    return " ".join(parts) or name


@dataclass(frozen=True)
class ProcessCpu:
    """One process seen in a cgroup: its kind, command name and utime + stime (ticks) when last seen,
    and when (``time.monotonic``) it was first and last seen."""

    kind: str
    name: str
    ticks: int
    first_seen_s: float = 0.0
    last_seen_s: float = 0.0


def merged_sample(last: Mapping[int, ProcessCpu], now: Mapping[int, ProcessCpu]) -> dict[int, ProcessCpu]:
    """Each process's latest ticks, keeping the kind and name it was first given one by: an exited
    process not yet reaped (a zombie) has an empty command line, and would turn ``other``, as
    would one sampled between fork and exec."""
    merged = dict(last)
    for pid, seen in now.items():
        before = last.get(pid)
        if before is not None:
            kept = before if seen.kind == "other" and before.kind != "other" else seen
            seen = ProcessCpu(kept.kind, kept.name, seen.ticks, before.first_seen_s, seen.last_seen_s)
        merged[pid] = seen
    return merged


def cpu_seconds_by_kind(
    first: Mapping[int, ProcessCpu], last: Mapping[int, ProcessCpu], ticks_per_s: float
) -> dict[str, Any]:
    """CPU seconds each kind of process used between two samples of a cgroup: per pid, its ticks
    when last seen less its ticks at ``first`` (0 for a process started after it), summed by
    :data:`PROCESS_KINDS`; ``other_by_name`` splits ``other`` by command name. ``stage_seen_s`` is
    the seconds the stage processes were seen for (first to last sighting, summed), and
    ``stage_cpus`` their CPU seconds over it: the CPUs a stage got while it lived (against its
    quota), which the run's wall time, with the stage's start and the launcher's end in it, does
    not give."""
    by_kind = dict.fromkeys(PROCESS_KINDS, 0.0)
    other: dict[str, float] = {}
    stage_seen_s = 0.0
    for pid, seen in last.items():
        before = first[pid].ticks if pid in first else 0
        seconds = max(0, seen.ticks - before) / ticks_per_s
        by_kind[seen.kind] = by_kind.get(seen.kind, 0.0) + seconds
        if seen.kind == "other":
            other[seen.name] = other.get(seen.name, 0.0) + seconds
        if seen.kind == "stage":
            stage_seen_s += seen.last_seen_s - seen.first_seen_s
    result: dict[str, Any] = {kind: round(seconds, 3) for kind, seconds in by_kind.items()}
    result["other_by_name"] = {name: round(seconds, 3) for name, seconds in sorted(other.items())}
    result["stage_seen_s"] = round(stage_seen_s, 1)
    result["stage_cpus"] = ratio(by_kind["stage"], stage_seen_s)
    return result


def seen_windows(seen: Mapping[int, ProcessCpu], since: float) -> dict[str, list[list[float]]]:
    """When each stage and profiler process was seen, as ``[first, last]`` seconds after ``since``
    (the run's start), by kind, earliest first: shows whether a profiler ran beside a stage, on the
    same quota."""
    windows: dict[str, list[list[float]]] = {"stage": [], "profiler": []}
    for process in seen.values():
        if process.kind in windows:
            window = [round(process.first_seen_s - since, 1), round(process.last_seen_s - since, 1)]
            windows[process.kind].append(window)
    return {kind: sorted(found) for kind, found in windows.items()}


def cpu_stat_delta(before: str, after: str) -> dict[str, int]:
    """The growth of each counter of a cgroup's ``cpu.stat`` text (``name value`` lines) between two
    reads: v1's ``nr_periods``, ``nr_throttled``, ``throttled_time`` (ns); v2's also ``usage_usec``."""

    def counters(text: str) -> dict[str, int]:
        pairs = (line.split() for line in text.splitlines())
        return {pair[0]: int(pair[1]) for pair in pairs if len(pair) == 2 and pair[1].isdigit()}

    start, end = counters(before), counters(after)
    return {name: end[name] - start.get(name, 0) for name in end}


def process_tree(root: int, parents: Mapping[int, int]) -> set[int]:
    """``root`` and all its descendants, given each process's parent."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, ()))
    return tree
