"""What the agent keeps of one job: its ranks, their events and logs, and how it is stopped.

A rank's stdout is relayed line by line: a line carrying a :class:`StageEvent` becomes an event
with the next sequence number (what the launcher long-polls), anything else goes to the rank's
log in the 0700 job directory. Stopping is SIGTERM to each rank's process group, SIGKILL after
a grace period.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mesh.control.directory import Member
from shardpool.agent.processes import signal_group
from shardpool.contract.events import EVENT_PREFIX, StageEvent

__all__ = ["MAX_EVENT_BYTES", "Job", "Rank", "event_in", "open_log", "tail", "terminate"]

log = logging.getLogger(__name__)

_EVENT_NAMES = frozenset(event.value for event in StageEvent)
#: A relayed event line longer than this goes to the log instead (events are a few hundred bytes).
_MAX_EVENT_LINE = 1 << 20
#: The most bytes of event lines a job keeps for its launcher; past it the oldest are dropped (the
#: launcher, which polls every second, sees them as ``lost``). 10,000 events of a few hundred bytes fit.
MAX_EVENT_BYTES = 8 * 2**20
_TERMINATE_GRACE_S = 5.0
_MAX_EVENTS_PER_POLL = 5000
_MAX_LOG_TAIL_BYTES = 8 * 2**20


@dataclass
class Rank:
    """One stage process of a job, the agent's descriptor of its log, and the thread relaying its output."""

    rank: int
    process: subprocess.Popen[bytes]
    log_fd: int
    reader: threading.Thread | None = None
    #: Set by the relay thread once stdout is drained *and* the process reaped, so a poller that
    #: sees a rank exited has already been able to see every event it printed.
    returncode: int | None = None


@dataclass
class Job:
    """One job on this agent: who started it (``origin``, the member whose key signed the start),
    its ranks, the last ``max_events`` events (at most ``max_event_bytes`` of them), and when it
    was last polled (the heartbeat)."""

    job_id: str
    directory: Path
    max_events: int
    origin: Member
    submitter: str | None = None
    ranks: dict[int, Rank] = field(default_factory=dict)
    next_seq: int = 1
    last_poll: float = field(default_factory=time.monotonic)
    stopped_by: str | None = None
    stopping: bool = False
    starting: bool = True
    finished_at: float | None = None
    max_event_bytes: int = MAX_EVENT_BYTES

    def __post_init__(self) -> None:
        self.events: collections.deque[dict[str, Any]] = collections.deque()
        self._event_sizes: collections.deque[int] = collections.deque()
        self.event_bytes = 0
        self._dropping = False
        self.changed = threading.Condition()

    def add_event(self, rank: int, event: dict[str, Any], size: int | None = None) -> None:
        """Append one event with the next sequence number and wake the pollers.

        ``size`` is the length of the line that carried it (measured here when not given). The
        oldest events are dropped to keep at most ``max_events`` of them and ``max_event_bytes``.
        """
        size = len(json.dumps(event)) if size is None else size
        with self.changed:
            while self.events and (
                len(self.events) >= self.max_events or self.event_bytes + size > self.max_event_bytes
            ):
                if not self._dropping and self.event_bytes + size > self.max_event_bytes:
                    self._dropping = True
                    log.warning(
                        "job %s: its stages printed more than %d MiB of events; dropping the oldest",
                        self.job_id,
                        self.max_event_bytes >> 20,
                    )
                self.events.popleft()
                self.event_bytes -= self._event_sizes.popleft()
            self.events.append({"seq": self.next_seq, "rank": rank, "event": event})
            self._event_sizes.append(size)
            self.event_bytes += size
            self.next_seq += 1
            self.changed.notify_all()

    def exited(self) -> dict[str, int]:
        """Exit codes of the ranks that have finished (negative: killed by that signal)."""
        return {str(r.rank): r.returncode for r in self.ranks.values() if r.returncode is not None}

    @property
    def running(self) -> bool:
        """Whether any rank still runs (or has output not yet relayed)."""
        return any(r.returncode is None for r in self.ranks.values())

    def snapshot(self, after: int) -> dict[str, Any]:
        """Events after ``after`` (at most a few thousand), exit codes, and whether anything runs."""
        with self.changed:
            events = [e for e in self.events if e["seq"] > after][:_MAX_EVENTS_PER_POLL]
            first = self.events[0]["seq"] if self.events else self.next_seq
        return {
            "events": events,
            "exited": self.exited(),
            "running": self.running,
            "lost": max(0, first - after - 1),
            "stopped_by": self.stopped_by,
        }

    def relay(self, record: Rank) -> None:
        """Relay one rank's stdout until it ends (events to the job, other lines to the log), then reap it."""
        stream = record.process.stdout
        if stream is not None:
            for raw in stream:
                event = event_in(raw)
                if event is not None:
                    self.add_event(record.rank, event, len(raw))
                    continue
                try:
                    os.write(record.log_fd, raw)
                except OSError:
                    pass  # the job was forgotten and its log closed; the output has nowhere to go
            stream.close()
        code = record.process.wait()
        log.info("job %s: rank %d exited with %d", self.job_id, record.rank, code)
        with self.changed:
            record.returncode = code
            if not self.running and self.finished_at is None:
                self.finished_at = time.monotonic()
            self.changed.notify_all()

    def close_logs(self) -> None:
        """Close the log descriptors the agent keeps (once the job is forgotten or the agent stops)."""
        for record in self.ranks.values():
            if record.log_fd >= 0:
                os.close(record.log_fd)
                record.log_fd = -1


def event_in(raw: bytes) -> dict[str, Any] | None:
    """The event a stage's output line carries: a JSON object named by a :class:`StageEvent`.

    Anything else (plain output, broken JSON, an unknown name, an overlong line) is not an event
    and goes to the rank's log; the launcher validates each event's fields against the contract.
    """
    if not raw.startswith(EVENT_PREFIX.encode()) or len(raw) > _MAX_EVENT_LINE:
        return None
    try:
        event = json.loads(raw[len(EVENT_PREFIX) :])
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if isinstance(event, dict) and event.get("event") in _EVENT_NAMES:
        return event
    return None


def open_log(path: Path) -> int:
    """Open a rank's log for appending, refusing a symlink (the directory belongs to the stage's account)."""
    return os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


def tail(log_fd: int, lines: int) -> str:
    """The last ``lines`` lines of a rank's log, read through the descriptor the agent opened."""
    if log_fd < 0:
        return ""
    size = os.fstat(log_fd).st_size
    start = max(0, size - _MAX_LOG_TAIL_BYTES)
    data = os.pread(log_fd, size - start, start)
    text = data.decode("utf-8", errors="replace").splitlines()
    return "".join(line + "\n" for line in text[-lines:])


def terminate(ranks: list[Rank], reason: str, jobs: list[Job]) -> None:
    """SIGTERM each rank's process group, SIGKILL after the grace period, reap, and join relays."""
    for job in jobs:
        job.stopping = True
        if job.running and job.stopped_by is None:
            job.stopped_by = reason
    for record in ranks:
        signal_group(record.process, signal.SIGTERM)
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for record in ranks:
        try:
            record.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(record.process, signal.SIGKILL)
            record.process.wait()
        signal_group(record.process, signal.SIGKILL)  # anything the rank left behind in its group
    for record in ranks:
        if record.reader is not None:
            record.reader.join(timeout=2)
        if record.returncode is None:  # the relay is stuck on a pipe some orphan holds open
            record.returncode = record.process.returncode
    for job in jobs:
        job.stopping = False
        with job.changed:
            job.finished_at = job.finished_at or time.monotonic()
            job.changed.notify_all()
