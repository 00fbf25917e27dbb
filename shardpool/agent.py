"""The shardpool agent: runs on every mesh member and starts stage processes for a remote launcher.

``shardpool agent`` listens on this member's mesh address (port 7710 by default) and answers only
current mesh members. A launcher asks it for this machine's devices (``POST /v1/devices``), starts
stage processes (``POST /v1/jobs``), long-polls their JSON events (``GET /v1/jobs/ID/events``),
reads their logs and stops them (``DELETE /v1/jobs/ID``). Only JSON crosses the wire; the job is the
same JSON document the local launcher hands its workers.

The event poll doubles as the launcher's heartbeat: a job nobody has polled for
``heartbeat_timeout_s`` is stopped, so a crashed or partitioned launcher never leaves stages holding
memory. Stage processes die with the agent (``PR_SET_PDEATHSIG``), and the agent stops every job on
SIGTERM/SIGINT. torch is imported only when devices are profiled, so the agent starts in well under
a second and stays small while idle.
"""

from __future__ import annotations

import collections
import ctypes
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qs, unquote, urlsplit

from shardpool import __version__
from shardpool.access import (
    GuardedHandler,
    GuardedHTTPServer,
    HTTPError,
    MemberAllowlist,
    mesh_member_addresses,
    start_in_thread,
)
from shardpool.contract import EVENT_PREFIX, ContractError, NotAMember, StageEvent, parse_job_start
from shardpool.fileserver import AtomicFile

__all__ = [
    "AGENT_PORT",
    "EVENT_PREFIX",
    "Agent",
    "stage_environment",
    "run_agent",
]

log = logging.getLogger("shardpool.agent")

AGENT_PORT = 7710
_EVENT_NAMES = frozenset(event.value for event in StageEvent)
#: The agent's own variables a stage process inherits; everything else it gets is set by the agent.
_INHERITED_ENV = ("PATH", "LANG", "PYTHONPATH", "SHARDPOOL_CACHE")
#: A relayed event line longer than this goes to the log instead (events are a few hundred bytes).
_MAX_EVENT_LINE = 1 << 20
_TERMINATE_GRACE_S = 5.0
_MAX_WAIT_S = 30.0
_MAX_EVENTS_PER_POLL = 5000
_MAX_FINISHED_JOBS = 64


def stage_environment(
    job_dir: Path, *, interface: str | None, local_ranks: int, cache_dir: Path
) -> dict[str, str]:
    """The whole environment of a stage process: a few of the agent's variables plus what it needs.

    Nothing comes from the launcher, and the agent's own environment is not passed on (it may hold
    credentials or ``LD_PRELOAD``). ``HOME`` and ``TMPDIR`` are the job directory, so whatever a
    stage writes stays there; gloo and NCCL are pinned to the mesh interface and InfiniBand is off,
    so training traffic stays inside WireGuard; threads are this machine's cores over its ranks.
    ``SHARDPOOL_CACHE`` is the agent's when it has one, else ``cache_dir``: one content-addressed
    cache for all jobs, so a resumed or repeated run downloads nothing it already has (every
    cached byte is re-hashed when read).
    """
    threads = str(max(1, (os.cpu_count() or 1) // max(1, local_ranks)))
    env = {name: os.environ[name] for name in _INHERITED_ENV if os.environ.get(name)}
    env.setdefault("PATH", os.defpath)
    env.setdefault("SHARDPOOL_CACHE", str(cache_dir))
    env.update(
        {
            "HOME": str(job_dir),
            "TMPDIR": str(job_dir),
            "PYTHONUNBUFFERED": "1",
            "NCCL_IB_DISABLE": "1",
            "SHARDPOOL_LOCAL_RANKS": str(local_ranks),
            "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
        }
    )
    if interface:
        env["GLOO_SOCKET_IFNAME"] = interface
        env["NCCL_SOCKET_IFNAME"] = interface
    return env


# ---------------------------------------------------------------------------- processes


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A ``preexec_fn``: SIGKILL the child when the agent dies (and exit if it already has)."""

    def preexec() -> None:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return preexec


class _Spawner:
    """Starts every child from one long-lived thread.

    Linux delivers ``PR_SET_PDEATHSIG`` when the *thread* that forked the child exits, so a
    process forked from a short-lived HTTP request thread would be killed as soon as the request
    ended. Forking from this thread, which lives as long as the agent, ties children to the agent.
    """

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Callable[[], Any], Future[Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="agent-spawner", daemon=True)
        self._thread.start()

    def call(self, action: Callable[[], Any]) -> Any:
        """Run ``action`` on the spawner thread and return its result (or raise its exception)."""
        future: Future[Any] = Future()
        self._queue.put((action, future))
        return future.result()

    def close(self) -> None:
        """Stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            action, future = item
            try:
                future.set_result(action())
            except BaseException as error:  # noqa: BLE001 - handed back to the caller
                future.set_exception(error)


@dataclass
class _Rank:
    rank: int
    process: subprocess.Popen[bytes]
    log_path: Path
    reader: threading.Thread | None = None
    #: Set by the relay thread once stdout is drained *and* the process reaped, so a poller that
    #: sees a rank exited has already been able to see every event it printed.
    returncode: int | None = None


@dataclass
class _Job:
    job_id: str
    directory: Path
    max_events: int
    ranks: dict[int, _Rank] = field(default_factory=dict)
    next_seq: int = 1
    last_poll: float = field(default_factory=time.monotonic)
    stopped_by: str | None = None
    stopping: bool = False
    starting: bool = True
    finished_at: float | None = None

    def __post_init__(self) -> None:
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=self.max_events)
        self.changed = threading.Condition()

    def add_event(self, rank: int, event: dict[str, Any]) -> None:
        """Append one event with the next sequence number and wake the pollers."""
        with self.changed:
            self.events.append({"seq": self.next_seq, "rank": rank, "event": event})
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


# ---------------------------------------------------------------------------- the agent


class Agent:
    """The agent's HTTP service and job table (``shardpool agent`` runs one bound to the mesh address).

    ``worker_command`` replaces ``[python, -m, shardpool.worker]`` (tests run small scripts);
    the job file and the rank are appended to it. ``interface`` is the mesh interface, given to
    gloo and NCCL so training traffic stays inside WireGuard. ``is_member_address`` answers whether
    an address in a job (its rendezvous and file server) is a current member's; it defaults to the
    allowlist that guards the agent, which production reads from the roster.
    """

    def __init__(
        self,
        host: str,
        port: int = AGENT_PORT,
        *,
        allowlist: MemberAllowlist,
        work_dir: Path,
        interface: str | None,
        member_name: str,
        worker_command: list[str] | None = None,
        heartbeat_timeout_s: float = 20.0,
        max_events: int = 10_000,
        is_member_address: Callable[[str], bool] | None = None,
    ) -> None:
        self.host = host
        self.is_member_address = is_member_address or allowlist.allows
        self.work_dir = Path(work_dir)
        self.interface = interface
        self.member_name = member_name
        self.worker_command = list(worker_command or [sys.executable, "-m", "shardpool.worker"])
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_events = max_events
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._profile_lock = threading.Lock()
        self._profiles: dict[str, list[dict[str, Any]]] = {}
        self._closing = threading.Event()
        self._server = GuardedHTTPServer(host, port, _AgentHandler, allowlist)
        self._server.owner = self  # type: ignore[attr-defined]
        self._spawner: _Spawner | None = None
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://10.77.0.2:7710``."""
        return self._server.url

    def start(self) -> Agent:
        """Start serving, the spawner thread and the heartbeat watchdog; returns self."""
        if self._thread is None:
            (self.work_dir / "jobs").mkdir(parents=True, exist_ok=True)
            self._spawner = _Spawner()
            self._watchdog = threading.Thread(
                target=self._watch_heartbeats, name="agent-watchdog", daemon=True
            )
            self._watchdog.start()
            self._thread = start_in_thread(self._server, "agent-http")
        return self

    def stop(self) -> None:
        """Stop every job (SIGTERM, SIGKILL after 5 s), then the server and helper threads."""
        self._closing.set()
        self.stop_all_jobs()
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()
        if self._spawner is not None:
            self._spawner.close()
            self._spawner = None
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)
            self._watchdog = None

    def __enter__(self) -> Agent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ jobs

    def start_job(self, body: dict[str, Any]) -> dict[str, Any]:
        """Validate a ``POST /v1/jobs`` body against the contract, write the job file, start its ranks.

        A malformed request is 400; one naming an address outside the mesh is 403.
        """
        try:
            request = parse_job_start(body, is_member_address=self.is_member_address)
        except NotAMember as error:
            raise HTTPError(HTTPStatus.FORBIDDEN, str(error)) from None
        except ContractError as error:
            raise HTTPError(HTTPStatus.BAD_REQUEST, str(error)) from None
        job_id, ranks = request.job_id, request.ranks
        if self._closing.is_set() or self._spawner is None:
            raise HTTPError(HTTPStatus.SERVICE_UNAVAILABLE, "the agent is shutting down")
        directory = self.work_dir / "jobs" / job_id
        with self._lock:
            previous = self._jobs.get(job_id)
            if previous is not None and (previous.running or previous.stopping or previous.starting):
                raise HTTPError(
                    HTTPStatus.CONFLICT, f"job {job_id!r} is already running here; DELETE it first"
                )
            entry = _Job(job_id, directory, self.max_events)
            self._jobs[job_id] = entry
            self._forget_old_jobs()
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            job_file = directory / "job.json"
            with AtomicFile(job_file, mode=0o600) as out:
                job_json = json.dumps(request.job.model_dump(mode="json"), indent=2, sort_keys=True)
                out.write((job_json + "\n").encode("utf-8"))
                out.commit()
            child_env = stage_environment(
                directory, interface=self.interface, local_ranks=len(ranks), cache_dir=self.work_dir / "cache"
            )
            try:
                for rank in ranks:
                    log_path = directory / f"rank-{rank}.log"
                    argv = [*self.worker_command, str(job_file), str(rank)]
                    process = self._spawner.call(
                        lambda a=argv, p=log_path: self._popen(a, p, child_env, directory)
                    )
                    record = _Rank(rank, process, log_path)
                    entry.ranks[rank] = record
                    record.reader = threading.Thread(
                        target=self._relay, args=(entry, record), name=f"agent-{job_id}-{rank}", daemon=True
                    )
                    record.reader.start()
            except OSError as error:
                self._stop_job(entry, "start failed")
                raise HTTPError(
                    HTTPStatus.INTERNAL_SERVER_ERROR, f"cannot start rank processes: {error}"
                ) from None
        finally:
            entry.starting = False
        entry.last_poll = time.monotonic()
        pids = {str(r.rank): r.process.pid for r in entry.ranks.values()}
        log.info("job %s: started ranks %s (pids %s)", job_id, ranks, list(pids.values()))
        return {"job_id": job_id, "pids": pids}

    def job(self, job_id: str) -> _Job:
        """The job called ``job_id``, or a 404."""
        with self._lock:
            entry = self._jobs.get(job_id)
        if entry is None:
            raise HTTPError(HTTPStatus.NOT_FOUND, f"no job {job_id!r} on this agent")
        return entry

    def poll(self, job_id: str, after: int, wait: float) -> dict[str, Any]:
        """Events after ``after``, waiting up to ``wait`` s for one; also the launcher's heartbeat."""
        entry = self.job(job_id)
        entry.last_poll = time.monotonic()
        deadline = time.monotonic() + wait
        with entry.changed:
            while True:
                fresh = entry.events and entry.events[-1]["seq"] > after
                remaining = deadline - time.monotonic()
                if fresh or not entry.running or remaining <= 0 or self._closing.is_set():
                    break
                entry.changed.wait(min(remaining, 0.25))
        entry.last_poll = time.monotonic()
        return entry.snapshot(after)

    def delete_job(self, job_id: str) -> dict[str, Any]:
        """Stop a job's processes and return their exit codes."""
        entry = self.job(job_id)
        self._stop_job(entry, "request")
        return {"job_id": job_id, "exited": entry.exited(), "stopped_by": entry.stopped_by}

    def log_tail(self, job_id: str, rank: int, lines: int) -> str:
        """The last ``lines`` lines of a rank's log."""
        entry = self.job(job_id)
        record = entry.ranks.get(rank)
        if record is None:
            raise HTTPError(HTTPStatus.NOT_FOUND, f"job {job_id!r} has no rank {rank} on this agent")
        return _tail(record.log_path, lines)

    def stop_all_jobs(self) -> None:
        """Stop every running job at once (SIGTERM all, then SIGKILL whatever is left after 5 s)."""
        with self._lock:
            running = [job for job in self._jobs.values() if job.running]
        _terminate([r for job in running for r in job.ranks.values()], "agent shutdown", running)

    def _stop_job(self, entry: _Job, reason: str) -> None:
        _terminate(list(entry.ranks.values()), reason, [entry])

    def _popen(
        self, argv: list[str], log_path: Path, env: dict[str, str], cwd: Path
    ) -> subprocess.Popen[bytes]:
        with open(log_path, "ab") as log_file:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log_file,
                env=env,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent(os.getpid()),
            )

    def _relay(self, entry: _Job, record: _Rank) -> None:
        stream: IO[bytes] | None = record.process.stdout
        if stream is not None:
            with open(record.log_path, "ab") as log_file:
                for raw in stream:
                    event = _event_in(raw)
                    if event is not None:
                        entry.add_event(record.rank, event)
                        continue
                    log_file.write(raw)
                    log_file.flush()
            stream.close()
        code = record.process.wait()
        log.info("job %s: rank %d exited with %d", entry.job_id, record.rank, code)
        with entry.changed:
            record.returncode = code
            if not entry.running and entry.finished_at is None:
                entry.finished_at = time.monotonic()
            entry.changed.notify_all()

    def _watch_heartbeats(self) -> None:
        while not self._closing.wait(0.2):
            now = time.monotonic()
            with self._lock:
                stale = [
                    job
                    for job in self._jobs.values()
                    if not job.stopping and job.running and now - job.last_poll > self.heartbeat_timeout_s
                ]
            for job in stale:
                log.warning(
                    "job %s: no event poll for %.0f s, the launcher is gone; stopping it",
                    job.job_id,
                    self.heartbeat_timeout_s,
                )
                job.stopping = True
                threading.Thread(target=self._stop_job, args=(job, "heartbeat timeout"), daemon=True).start()

    def _forget_old_jobs(self) -> None:
        finished = [j for j in self._jobs.values() if j.finished_at is not None and not j.running]
        finished.sort(key=lambda j: j.finished_at or 0.0)
        for job in finished[: max(0, len(finished) - _MAX_FINISHED_JOBS)]:
            del self._jobs[job.job_id]

    # ------------------------------------------------------------------ devices

    def probe(self, body: dict[str, Any]) -> dict[str, Any]:
        """Measure latency and bandwidth from this member to other members' agents.

        Targets must be current mesh members (the same allowlist that guards this agent), so a
        probe can never be aimed outside the mesh. Payloads are bounded by ``MAX_ECHO_BYTES``.
        """
        from shardpool.agent_client import AgentClient, AgentRefused, AgentUnreachable

        targets = body.get("targets")
        nbytes = body.get("bytes", 4 * 2**20)
        if not isinstance(targets, list) or not all(
            isinstance(t, dict) and {"name", "url"} <= t.keys() for t in targets
        ):
            raise HTTPError(HTTPStatus.BAD_REQUEST, "targets must be a list of {name, url}")
        if not isinstance(nbytes, int) or not 1 <= nbytes <= MAX_ECHO_BYTES:
            raise HTTPError(HTTPStatus.BAD_REQUEST, f"bytes must be an integer from 1 to {MAX_ECHO_BYTES}")
        links: dict[str, Any] = {}
        for target in targets[:64]:
            host = urlsplit(str(target["url"])).hostname or ""
            if not self._server.allowlist.allows(host):
                raise HTTPError(HTTPStatus.FORBIDDEN, f"probe target {host!r} is not a mesh member")
            try:
                links[str(target["name"])] = AgentClient(str(target["url"]), timeout=10.0).measure_link(
                    nbytes=nbytes
                )
            except (AgentUnreachable, AgentRefused) as error:
                links[str(target["name"])] = {"error": str(error)}
        return {"links": links}

    def devices(self, body: dict[str, Any]) -> dict[str, Any]:
        """This machine's devices with one profiled layer each, for the launcher's planner (cached).

        ``workload`` takes the fields of :class:`shardpool.costmodel.Workload`; the cache key is the
        model shape and the workload's per-layer settings, so planner-only fields don't matter.
        """
        model_config, workload_fields = body.get("model_config"), body.get("workload", {})
        if not isinstance(model_config, dict):
            raise HTTPError(HTTPStatus.BAD_REQUEST, "model_config must be the model's config.json object")
        if not isinstance(workload_fields, dict):
            raise HTTPError(HTTPStatus.BAD_REQUEST, "workload must be an object")
        shape, workload = _shape_and_workload(model_config, workload_fields)
        key = f"{shape.key()}|{workload.profile_key()}"
        with self._profile_lock:
            if key not in self._profiles:
                self._profiles[key] = _profile_devices(shape, workload)
            return {"devices": self._profiles[key]}


def _shape_and_workload(model_config: dict[str, Any], workload_fields: dict[str, Any]) -> tuple[Any, Any]:
    """Validate the request's model config and workload (cheap: no torch)."""
    import dataclasses

    from shardpool.costmodel import Workload
    from shardpool.model_shape import ModelShape

    known = [f.name for f in dataclasses.fields(Workload)]
    unknown = sorted(set(workload_fields) - set(known))
    if unknown:
        raise HTTPError(HTTPStatus.BAD_REQUEST, f"unknown workload fields {unknown}; use {known}")
    fields = dict(workload_fields)
    if "lora_targets" in fields:
        targets = fields["lora_targets"]
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise HTTPError(HTTPStatus.BAD_REQUEST, "workload.lora_targets must be a list of module names")
        fields["lora_targets"] = tuple(targets)
    try:
        workload = Workload(**fields)
    except TypeError as error:
        raise HTTPError(HTTPStatus.BAD_REQUEST, f"bad workload: {error}") from None
    shape = ModelShape.from_config_json(model_config, name=str(model_config.get("_name_or_path", "")))
    return shape, workload


def _profile_devices(shape: Any, workload: Any) -> list[dict[str, Any]]:
    """Profile one layer on every local device (imports torch on first use)."""
    from shardpool.devices import list_devices
    from shardpool.profiler import profile_layer

    rows = []
    for info in list_devices():
        threads = info.threads if info.kind == "cpu" else None
        profile = profile_layer(shape, workload, device=info.name, threads=threads)
        rows.append(
            {
                "name": info.name,
                "kind": info.kind,
                "label": info.label,
                "total_bytes": info.total_bytes,
                "free_bytes": info.free_bytes,
                "threads": info.threads,
                "seconds_per_layer": profile.seconds_per_layer,
                "activation_bytes": profile.activation_bytes,
            }
        )
    return rows


def _event_in(raw: bytes) -> dict[str, Any] | None:
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


def _terminate(ranks: list[_Rank], reason: str, jobs: list[_Job]) -> None:
    """SIGTERM each rank's process group, SIGKILL after the grace period, reap, and join relays."""
    for job in jobs:
        job.stopping = True
        if job.running and job.stopped_by is None:
            job.stopped_by = reason
    for record in ranks:
        _signal_group(record.process, signal.SIGTERM)
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for record in ranks:
        try:
            record.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(record.process, signal.SIGKILL)
            record.process.wait()
        _signal_group(record.process, signal.SIGKILL)  # anything the rank left behind in its group
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


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - 8 * 2**20))
            data = handle.read()
    except FileNotFoundError:
        return ""
    text = data.decode("utf-8", errors="replace").splitlines()
    return "".join(line + "\n" for line in text[-lines:])


# Largest body POST /v1/echo accepts: enough to time a link, small enough to be harmless.
MAX_ECHO_BYTES = 32 * 2**20

# ---------------------------------------------------------------------------- HTTP


class _AgentHandler(GuardedHandler):
    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        self.dispatch(self._get)

    def do_POST(self) -> None:  # noqa: N802 - stdlib naming
        self.dispatch(self._post)

    def do_DELETE(self) -> None:  # noqa: N802 - stdlib naming
        self.dispatch(self._delete)

    @property
    def agent(self) -> Agent:
        return self.server.owner  # type: ignore[attr-defined,no-any-return]

    def _parts(self) -> tuple[list[str], dict[str, list[str]]]:
        url = urlsplit(self.path)
        return [unquote(p) for p in url.path.strip("/").split("/")], parse_qs(url.query)

    def _get(self) -> None:
        parts, query = self._parts()
        if parts == ["v1", "health"]:
            self.send_json(
                HTTPStatus.OK,
                {"name": self.agent.member_name, "address": self.agent.host, "version": __version__},
            )
        elif len(parts) == 4 and parts[:2] == ["v1", "jobs"] and parts[3] == "events":
            after = _number(query, "after", 0, int, 0, 2**62)
            wait = _number(query, "wait", 1.0, float, 0.0, _MAX_WAIT_S)
            self.send_json(HTTPStatus.OK, self.agent.poll(parts[2], after, wait))
        elif len(parts) == 5 and parts[:2] == ["v1", "jobs"] and parts[3] == "log":
            if not parts[4].isdigit():
                raise HTTPError(HTTPStatus.BAD_REQUEST, f"rank {parts[4]!r} is not a number")
            lines = _number(query, "tail", 200, int, 1, 100_000)
            self.send_text(HTTPStatus.OK, self.agent.log_tail(parts[2], int(parts[4]), lines))
        else:
            raise HTTPError(HTTPStatus.NOT_FOUND, f"unknown path {urlsplit(self.path).path!r}")

    def _post(self) -> None:
        parts, _ = self._parts()
        if parts == ["v1", "jobs"]:
            self.send_json(HTTPStatus.CREATED, self.agent.start_job(self.read_json_body()))
        elif parts == ["v1", "devices"]:
            self.send_json(HTTPStatus.OK, self.agent.devices(self.read_json_body()))
        elif parts == ["v1", "echo"]:
            self.send_json(HTTPStatus.OK, {"bytes": self._discard_body(MAX_ECHO_BYTES)})
        elif parts == ["v1", "probe"]:
            self.send_json(HTTPStatus.OK, self.agent.probe(self.read_json_body()))
        else:
            self.close_connection = True
            raise HTTPError(HTTPStatus.NOT_FOUND, f"unknown path {urlsplit(self.path).path!r}")

    def _discard_body(self, limit: int) -> int:
        """Read a bounded body without keeping it (bandwidth probes); return its length."""
        remaining = length = self.content_length(limit)
        while remaining:
            chunk = self.rfile.read(min(remaining, 1 << 20))
            if not chunk:
                self.close_connection = True
                raise HTTPError(HTTPStatus.BAD_REQUEST, "the request body ended early")
            remaining -= len(chunk)
        return length

    def _delete(self) -> None:
        parts, _ = self._parts()
        if len(parts) == 3 and parts[:2] == ["v1", "jobs"]:
            self.send_json(HTTPStatus.OK, self.agent.delete_job(parts[2]))
        else:
            raise HTTPError(HTTPStatus.NOT_FOUND, f"unknown path {urlsplit(self.path).path!r}")


def _number(query: dict[str, list[str]], key: str, default: Any, kind: type, low: float, high: float) -> Any:
    values = query.get(key)
    if not values:
        return default
    try:
        value = kind(values[0])
    except ValueError:
        raise HTTPError(HTTPStatus.BAD_REQUEST, f"{key}={values[0]!r} is not a number") from None
    if not low <= value <= high:
        raise HTTPError(HTTPStatus.BAD_REQUEST, f"{key}={value} is out of range {low}..{high}")
    return value


# ---------------------------------------------------------------------------- command


def run_agent(
    state_dir: str | None,
    port: int = AGENT_PORT,
    *,
    work_dir: str | None = None,
    ready_file: str | None = None,
) -> int:
    """Run ``shardpool agent`` until SIGTERM/SIGINT: bind the mesh address, serve members only.

    ``ready_file`` (used by ``mesh init/join/up``) is written with the pid and URL once listening.
    """
    from mesh.config import load_config
    from mesh.state import StatePaths, resolve_state_dir

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    paths = StatePaths(resolve_state_dir(state_dir))
    config = load_config(paths)
    allowlist = MemberAllowlist(mesh_member_addresses(paths.root))
    agent = Agent(
        config.address,
        port,
        allowlist=allowlist,
        work_dir=Path(work_dir) if work_dir else paths.root / "work",
        interface=config.interface,
        member_name=config.name,
        is_member_address=allowlist.allows,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    agent.start()
    log.info("shardpool agent %s for member %r listening on %s", __version__, config.name, agent.url)
    if ready_file:
        with AtomicFile(Path(ready_file)) as out:
            out.write(json.dumps({"pid": os.getpid(), "url": agent.url}).encode("utf-8"))
            out.commit()
    try:
        while not stop.wait(1.0):
            pass
    finally:
        log.info("stopping: terminating jobs, then the server")
        agent.stop()
        if ready_file:
            Path(ready_file).unlink(missing_ok=True)
    return 0
