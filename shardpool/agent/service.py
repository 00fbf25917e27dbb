"""The shardpool agent: runs on every mesh member and starts stage processes for a remote launcher.

``shardpool agent`` (root, because it signs with the member's WireGuard key) serves two listeners on
:mod:`mesh.http.server`:

- the **mesh listener**, TCP on this member's mesh address (:data:`AGENT_PORT`), for other members'
  agents. Every request must carry a :mod:`mesh.control.auth` proof from a current member's key; it is
  checked before any body byte is parsed (the proof's headers first, then the body's digest), a
  removed member gets a signed 403, and every reply is signed, status included. As a second line
  of defence, the connection's source IP must be the proven member's mesh address.
- the **local listener** (:mod:`shardpool.agent.local`), a Unix socket for people on this member:
  the kernel names the caller's uid, and only root or the launch group may use it.

A launcher asks an agent for this machine's devices (``POST /v1/devices``), starts stage
processes (``POST /v1/jobs``), long-polls their JSON events (``GET /v1/jobs/ID/events``), reads
their logs and stops them (``DELETE /v1/jobs/ID``, only the member that started the job). Stage
processes run as the unprivileged run-as account, never root, in a 0700 job directory it owns,
with an environment the agent sets itself.

The event poll doubles as the launcher's heartbeat: a job nobody has polled for
``heartbeat_timeout_s`` is stopped, so a crashed or partitioned launcher never leaves stages holding
memory. Stage processes die with the agent (``PR_SET_PDEATHSIG``), and the agent stops every job on
SIGTERM/SIGINT. torch is imported only when devices are profiled, so the agent starts in well under
a second and stays small while idle.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import ipaddress
import json
import logging
import os
import queue
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from mesh.constants import AGENT_PORT
from mesh.control.auth import AuthError
from mesh.control.directory import Member
from mesh.control.verifier import RequestVerifier
from mesh.files import atomic_write
from mesh.http.server import (
    CHUNK,
    HTTPError,
    HTTPServer,
    Limits,
    Reply,
    Request,
    Route,
    json_reply,
    text_reply,
)
from shardpool import __version__
from shardpool.agent.accounts import DEFAULT_LAUNCH_GROUP, RunAs
from shardpool.agent.client import agent_socket_path
from shardpool.agent.confine import landlock_abi, restrict_writes, stage_writable_dirs
from shardpool.contract.events import EVENT_PREFIX, StageEvent
from shardpool.contract.job import MAX_JOB_JSON_BYTES
from shardpool.contract.names import ContractError
from shardpool.contract.start import FILES_SECRET_FILE, NotAMember, parse_job_start
from shardpool.errors import ShardpoolError

__all__ = [
    "EVENT_PREFIX",
    "MAX_ECHO_BYTES",
    "Agent",
    "MeshPeer",
    "check_reachable",
    "stage_environment",
    "run_agent",
]

log = logging.getLogger("shardpool.agent.service")

_EVENT_NAMES = frozenset(event.value for event in StageEvent)
#: The agent's own variables a stage process inherits; everything else it gets is set by the agent.
#: Taken from the agent's own environment (set by the machine's admin, never by a launcher): the
#: search paths, and which accelerators this machine lends and where their driver libraries are.
_INHERITED_ENV = (
    "PATH",
    "LANG",
    "PYTHONPATH",
    "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "ZE_AFFINITY_MASK",
)
#: A relayed event line longer than this goes to the log instead (events are a few hundred bytes).
_MAX_EVENT_LINE = 1 << 20
_TERMINATE_GRACE_S = 5.0
_MAX_WAIT_S = 30.0
_MAX_EVENTS_PER_POLL = 5000
_MAX_FINISHED_JOBS = 64
_MAX_LOG_TAIL_BYTES = 8 * 2**20
#: Largest body POST /v1/echo accepts: enough to time a link, small enough to be harmless.
MAX_ECHO_BYTES = 32 * 2**20
_SMALL_BODY = 64 * 1024
#: Long polls hold a handler thread for up to _MAX_WAIT_S: room for many launchers at once.
AGENT_LIMITS = Limits(handler_threads=32)


@dataclass(frozen=True)
class MeshPeer:
    """A current mesh member as the agent sees it: who, where, its key, and whether it is up."""

    name: str
    address: str
    public_key: str
    online: bool = True


def stage_environment(
    job_dir: Path, *, interface: str | None, local_ranks: int, cache_dir: Path
) -> dict[str, str]:
    """The whole environment of a stage process: a few of the agent's variables plus what it needs.

    Nothing comes from the launcher, and the agent's own environment is not passed on (it may hold
    credentials or ``LD_PRELOAD``). ``HOME`` and ``TMPDIR`` are the job directory, so whatever a
    stage writes stays there; gloo and NCCL are pinned to the mesh interface and InfiniBand is off,
    so training traffic stays inside WireGuard; threads are this machine's cores over its ranks.
    ``SHARDPOOL_CACHE`` is ``cache_dir``, one content-addressed cache owned by the run-as account
    for all jobs, so a resumed or repeated run downloads nothing it already has (every cached byte
    is re-hashed when read).
    """
    threads = str(max(1, (os.cpu_count() or 1) // max(1, local_ranks)))
    env = {name: os.environ[name] for name in _INHERITED_ENV if os.environ.get(name)}
    env.setdefault("PATH", os.defpath)
    env.update(
        {
            "HOME": str(job_dir),
            "TMPDIR": str(job_dir),
            "SHARDPOOL_CACHE": str(cache_dir),
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


def check_reachable(account: RunAs, directory: Path) -> None:
    """Refuse a work directory the run-as account cannot reach (a 0700 ancestor it does not own).

    Stages run in ``directory/jobs/ID``; without search permission on every ancestor they would
    fail at start with a confusing error, so the agent says so once, at its own start.
    """
    for ancestor in [directory, *directory.parents]:
        try:
            info = ancestor.stat()
        except FileNotFoundError:
            continue
        if info.st_uid == account.uid:
            allowed = info.st_mode & stat.S_IXUSR
        elif info.st_gid == account.gid:
            allowed = info.st_mode & stat.S_IXGRP
        else:
            allowed = info.st_mode & stat.S_IXOTH
        if not allowed:
            raise ShardpoolError(
                f"run-as user {account.user!r} cannot reach {directory}: {ancestor} is mode "
                f"{stat.S_IMODE(info.st_mode):04o}; pass --work-dir DIR where it can (e.g. /var/lib/shardpool-work)"
            )


def _write_private(path: Path, data: bytes, owner: RunAs) -> None:
    """Write ``path`` atomically, 0600 and owned by ``owner``, never following a link a stage planted.

    The job directory belongs to the run-as account, so anything in it may be a trap:
    :func:`mesh.files.atomic_write` creates the file with O_EXCL under a random name and chowns it
    through its descriptor before the rename.
    """
    atomic_write(path, data, 0o600, owner=(owner.uid, owner.gid))


def _open_log(path: Path) -> int:
    """Open a rank's log for appending, refusing a symlink (the directory belongs to the stage's account)."""
    return os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


def _same_ip(left: str | None, right: str) -> bool:
    def canonical(text: str) -> str:
        try:
            parsed = ipaddress.ip_address(text.split("%", 1)[0])
        except ValueError:
            return text
        if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(parsed)

    return left is not None and canonical(left) == canonical(right)


# ---------------------------------------------------------------------------- processes


def _die_with_parent(parent: int, writable: list[str] | None = None, abi: int = 0) -> Callable[[], None]:
    """A ``preexec_fn``: SIGKILL the child when the agent dies (and exit if it already has); where
    the kernel has Landlock (``abi`` > 0), forbid it every write outside ``writable``."""

    def preexec() -> None:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if writable is not None and abi > 0:
            restrict_writes(writable, abi)
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
    log_fd: int
    reader: threading.Thread | None = None
    #: Set by the relay thread once stdout is drained *and* the process reaped, so a poller that
    #: sees a rank exited has already been able to see every event it printed.
    returncode: int | None = None


@dataclass
class _Job:
    job_id: str
    directory: Path
    max_events: int
    origin: Member
    submitter: str | None = None
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

    def close_logs(self) -> None:
        """Close the log descriptors the agent keeps (once the job is forgotten or the agent stops)."""
        for record in self.ranks.values():
            if record.log_fd >= 0:
                os.close(record.log_fd)
                record.log_fd = -1


@dataclass
class _Sender:
    """The principal of a mesh request: the member its proof names, and how far the proof got.

    ``proven`` once the MAC over the whole body checked out; ``removed`` when the sender proved a
    key that is no longer a member's. Only replies to those two are signed.
    """

    member: Member
    proven: bool = False
    removed: bool = False


# ---------------------------------------------------------------------------- the agent


class Agent:
    """The agent's two listeners and its job table (``shardpool agent`` runs one on the mesh address).

    ``verifier`` holds this member's private key and answers who signed a request; ``peers`` lists
    the current members (name, mesh address, key, online), which the agent uses to check the
    addresses in a job, to aim probes and to forward requests. ``run_as`` is the account stage
    processes run as; ``group`` and ``socket_path`` configure the local listener (none when
    ``socket_path`` is None). ``worker_command`` replaces ``[python, -m, shardpool.train.worker]``
    (tests run small scripts; it must be runnable by ``run_as``); the job file and the rank are
    appended to it. ``interface`` is the mesh interface, given to gloo and NCCL. Other members'
    agents are called on ``peer_port`` (default: the port this agent listens on).
    """

    def __init__(
        self,
        host: str,
        port: int = AGENT_PORT,
        *,
        verifier: RequestVerifier,
        peers: Callable[[], list[MeshPeer]],
        work_dir: Path,
        interface: str | None,
        member_name: str,
        run_as: RunAs,
        group: str = DEFAULT_LAUNCH_GROUP,
        socket_path: str | os.PathLike[str] | None = None,
        worker_command: list[str] | None = None,
        heartbeat_timeout_s: float = 20.0,
        max_events: int = 10_000,
        peer_port: int | None = None,
        check_peer_ip: bool = True,
        limits: Limits = AGENT_LIMITS,
    ) -> None:
        from shardpool.agent.local import LocalService

        self.host = host
        self.verifier = verifier
        self.peers = peers
        self.work_dir = Path(work_dir)
        self.interface = interface
        self.member_name = member_name
        self.run_as = run_as
        self.landlock_abi = landlock_abi()
        if not self.landlock_abi:
            log.warning(
                "this kernel has no Landlock: stages run as %r in 0700 job directories, but may write "
                "wherever that account can (see docs/security.md)",
                run_as.user,
            )
        self.worker_command = list(worker_command or [sys.executable, "-m", "shardpool.train.worker"])
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_events = max_events
        self.check_peer_ip = check_peer_ip
        self._peer_port = peer_port
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._profile_lock = threading.Lock()
        self._profiles: dict[str, list[dict[str, Any]]] = {}
        self._closing = threading.Event()
        self._server = HTTPServer(
            self._routes(),
            host=host,
            port=port,
            limits=limits,
            authenticate=self._authenticate,
            sign_reply=self._sign_reply,
            client_errors=(ShardpoolError,),
            name="agent",
        )
        self.local = (
            LocalService(self, socket_path=Path(socket_path), group=group, limits=limits)
            if socket_path is not None
            else None
        )
        self._spawner: _Spawner | None = None
        self._watchdog: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL of the mesh listener, e.g. ``http://10.77.0.2:7710``."""
        return self._server.url

    @property
    def peer_port(self) -> int:
        """The port other members' agents listen on (this agent's own unless told otherwise)."""
        return self._peer_port or int(self.url.rsplit(":", 1)[1])

    @property
    def cache_dir(self) -> Path:
        """The stages' shared content-addressed cache, owned by the run-as account (0700)."""
        return self.work_dir / "cache"

    def start(self) -> Agent:
        """Prepare the work directory, start both listeners, the spawner and the watchdog; returns self."""
        if self._spawner is not None:
            return self
        check_reachable(self.run_as, self.work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        (self.work_dir / "jobs").mkdir(mode=0o755, exist_ok=True)
        self.run_as.make_private_dir(self.cache_dir)
        self._closing.clear()
        self._spawner = _Spawner()
        self._watchdog = threading.Thread(target=self._watch_heartbeats, name="agent-watchdog", daemon=True)
        self._watchdog.start()
        try:
            self._server.start()
            if self.local is not None:
                self.local.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every job (SIGTERM, SIGKILL after 5 s), then the listeners and helper threads."""
        self._closing.set()
        self.stop_all_jobs()
        if self.local is not None:
            self.local.stop()
        self._server.stop()
        if self._spawner is not None:
            self._spawner.close()
            self._spawner = None
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)
            self._watchdog = None
        with self._lock:
            for job in self._jobs.values():
                if not job.running:
                    job.close_logs()

    def __enter__(self) -> Agent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ members

    def current_peers(self) -> list[MeshPeer]:
        """The current members, or none when the roster cannot be read (fails closed)."""
        try:
            return list(self.peers())
        except Exception as error:  # noqa: BLE001 - an unreadable roster must refuse, not crash
            log.warning("cannot list the mesh members, refusing every address until I can: %s", error)
            return []

    def is_member_address(self, address: str) -> bool:
        """Whether ``address`` is a current member's mesh address."""
        return any(_same_ip(address, peer.address) for peer in self.current_peers())

    # ------------------------------------------------------------------ jobs

    def start_job(self, body: dict[str, Any], origin: Member) -> dict[str, Any]:
        """Validate a ``POST /v1/jobs`` body against the contract, write the job's files, start its ranks.

        ``origin`` is the member whose key signed the request: it alone may stop the job. A
        malformed request is 400; one naming an address outside the mesh is 403.
        """
        try:
            request = parse_job_start(body, is_member_address=self.is_member_address)
        except NotAMember as error:
            raise HTTPError(403, str(error)) from None
        except ContractError as error:
            raise HTTPError(400, str(error)) from None
        request = request.model_copy(update={"origin": origin.name})
        job_id, ranks = request.job_id, request.ranks
        if self._closing.is_set() or self._spawner is None:
            raise HTTPError(503, "the agent is shutting down")
        directory = self.work_dir / "jobs" / job_id
        with self._lock:
            previous = self._jobs.get(job_id)
            if previous is not None and (previous.running or previous.stopping or previous.starting):
                raise HTTPError(409, f"job {job_id!r} is already running here; DELETE it first")
            if previous is not None:
                previous.close_logs()
            entry = _Job(job_id, directory, self.max_events, origin, request.submitter)
            self._jobs[job_id] = entry
            self._forget_old_jobs()
        try:
            self._launch(entry, request)
        finally:
            entry.starting = False
        entry.last_poll = time.monotonic()
        pids = {str(r.rank): r.process.pid for r in entry.ranks.values()}
        log.info(
            "job %s from %s (user %s): started ranks %s as %s (pids %s)",
            job_id, origin.name, request.submitter, ranks, self.run_as.user, list(pids.values()),
        )  # fmt: skip
        return {"job_id": job_id, "pids": pids}

    def _launch(self, entry: _Job, request: Any) -> None:
        """Write the job's files into its 0700 directory (owned by the run-as account), start its ranks."""
        assert self._spawner is not None
        directory = self.run_as.make_private_dir(entry.directory)
        job_file = directory / "job.json"
        job_json = json.dumps(request.job.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
        _write_private(job_file, job_json.encode("utf-8"), self.run_as)
        if request.files_secret is not None:
            _write_private(directory / FILES_SECRET_FILE, request.files_secret.encode("ascii"), self.run_as)
        child_env = stage_environment(
            directory, interface=self.interface, local_ranks=len(request.ranks), cache_dir=self.cache_dir
        )
        try:
            for rank in request.ranks:
                log_fd = _open_log(directory / f"rank-{rank}.log")
                argv = [*self.worker_command, str(job_file), str(rank)]
                try:
                    process = self._spawner.call(
                        lambda a=argv, fd=log_fd: self._popen(a, fd, child_env, directory)
                    )
                except BaseException:
                    os.close(log_fd)
                    raise
                record = _Rank(rank, process, log_fd)
                entry.ranks[rank] = record
                record.reader = threading.Thread(
                    target=self._relay, args=(entry, record), name=f"agent-{entry.job_id}-{rank}", daemon=True
                )
                record.reader.start()
        except OSError as error:
            self._stop_job(entry, "start failed")
            raise HTTPError(500, f"cannot start rank processes: {error}") from None

    def job(self, job_id: str) -> _Job:
        """The job called ``job_id``, or a 404."""
        with self._lock:
            entry = self._jobs.get(job_id)
        if entry is None:
            raise HTTPError(404, f"no job {job_id!r} on this agent")
        return entry

    def jobs(self) -> list[_Job]:
        """Every job the agent remembers (running, and the most recent finished ones)."""
        with self._lock:
            return list(self._jobs.values())

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

    def delete_job(self, job_id: str, requester: Member) -> dict[str, Any]:
        """Stop a job's processes and return their exit codes; only the member that started it may."""
        entry = self.job(job_id)
        if entry.origin.public_key != requester.public_key:
            raise HTTPError(
                403,
                f"job {job_id!r} was started by member {entry.origin.name!r}; only that member may stop it",
            )
        self._stop_job(entry, "request")
        return {"job_id": job_id, "exited": entry.exited(), "stopped_by": entry.stopped_by}

    def log_tail(self, job_id: str, rank: int, lines: int) -> str:
        """The last ``lines`` lines of a rank's log."""
        entry = self.job(job_id)
        record = entry.ranks.get(rank)
        if record is None:
            raise HTTPError(404, f"job {job_id!r} has no rank {rank} on this agent")
        return _tail(record.log_fd, lines)

    def stop_all_jobs(self) -> None:
        """Stop every running job at once (SIGTERM all, then SIGKILL whatever is left after 5 s)."""
        with self._lock:
            running = [job for job in self._jobs.values() if job.running]
        _terminate([r for job in running for r in job.ranks.values()], "agent shutdown", running)

    def _stop_job(self, entry: _Job, reason: str) -> None:
        _terminate(list(entry.ranks.values()), reason, [entry])

    def _popen(self, argv: list[str], log_fd: int, env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
        return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log_fd,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_die_with_parent(
                os.getpid(), stage_writable_dirs(cwd, self.cache_dir), self.landlock_abi
            ),
            **self.run_as.popen_kwargs(),
        )

    def _relay(self, entry: _Job, record: _Rank) -> None:
        stream: IO[bytes] | None = record.process.stdout
        if stream is not None:
            for raw in stream:
                event = _event_in(raw)
                if event is not None:
                    entry.add_event(record.rank, event)
                    continue
                try:
                    os.write(record.log_fd, raw)
                except OSError:
                    pass  # the job was forgotten and its log closed; the output has nowhere to go
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
            job.close_logs()
            del self._jobs[job.job_id]

    # ------------------------------------------------------------------ devices and links

    def signed_client(self, peer: MeshPeer, *, timeout: float = 10.0) -> Any:
        """A client of ``peer``'s agent whose requests this agent signs with its own key."""
        from shardpool.agent.client import SignedAgentClient

        shown = f"[{peer.address}]" if ":" in peer.address else peer.address
        return SignedAgentClient(
            f"http://{shown}:{self.peer_port}",
            timeout=timeout,
            private_key=self.verifier.private_key,
            peer_public_key=peer.public_key,
            mesh_id=self.verifier.mesh_id,
        )

    def probe(self, body: dict[str, Any]) -> dict[str, Any]:
        """Measure latency and bandwidth from this member to other members' agents, signing each call.

        Targets must be current mesh members (their key is what the request is signed for), so a
        probe can never be aimed outside the mesh. Payloads are bounded by ``MAX_ECHO_BYTES``.
        """
        from shardpool.agent.client import AgentRefused, AgentUnreachable

        targets = body.get("targets")
        nbytes = body.get("bytes", 4 * 2**20)
        if not isinstance(targets, list) or not all(
            isinstance(t, dict) and {"name", "url"} <= t.keys() for t in targets
        ):
            raise HTTPError(400, "targets must be a list of {name, url}")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 1 <= nbytes <= MAX_ECHO_BYTES:
            raise HTTPError(400, f"bytes must be an integer from 1 to {MAX_ECHO_BYTES}")
        peers = self.current_peers()
        links: dict[str, Any] = {}
        for target in targets[:64]:
            try:
                host = urlsplit(str(target["url"])).hostname or ""
            except ValueError:
                host = ""
            peer = next((p for p in peers if _same_ip(host, p.address)), None)
            if peer is None:
                raise HTTPError(403, f"probe target {host[:64]!r} is not a mesh member")
            try:
                links[str(target["name"])[:64]] = self.signed_client(peer).measure_link(nbytes=nbytes)
            except (AgentUnreachable, AgentRefused) as error:
                links[str(target["name"])[:64]] = {"error": str(error)}
        return {"links": links}

    def devices(self, body: dict[str, Any]) -> dict[str, Any]:
        """This machine's devices with one profiled layer each, for the launcher's planner (cached).

        ``workload`` takes the fields of :class:`shardpool.plan.costmodel.Workload`; the cache key is the
        model shape and the workload's per-layer settings, so planner-only fields don't matter.
        """
        model_config, workload_fields = body.get("model_config"), body.get("workload", {})
        if not isinstance(model_config, dict):
            raise HTTPError(400, "model_config must be the model's config.json object")
        if not isinstance(workload_fields, dict):
            raise HTTPError(400, "workload must be an object")
        shape, workload = _shape_and_workload(model_config, workload_fields)
        key = f"{shape.key()}|{workload.profile_key()}"
        with self._profile_lock:
            if key not in self._profiles:
                self._profiles[key] = _profile_devices(shape, workload)
            return {"devices": self._profiles[key]}

    # ------------------------------------------------------------------ the mesh listener

    def _routes(self) -> list[Route]:
        def proven(handler: Callable[[Request, Member], Reply], cap: int, method: str, pattern: str) -> Route:
            return Route(method, pattern, self._proven(handler), max_body=cap, stream_body=True)

        return [
            proven(self._get_health, 0, "GET", "/v1/health"),
            proven(self._post_devices, 4 * 2**20, "POST", "/v1/devices"),
            proven(self._post_echo, MAX_ECHO_BYTES, "POST", "/v1/echo"),
            proven(self._post_probe, _SMALL_BODY, "POST", "/v1/probe"),
            proven(self._post_job, MAX_JOB_JSON_BYTES, "POST", "/v1/jobs"),
            proven(self._get_events, 0, "GET", "/v1/jobs/{job_id}/events"),
            proven(self._get_log, 0, "GET", "/v1/jobs/{job_id}/log/{rank}"),
            proven(self._delete_job, 0, "DELETE", "/v1/jobs/{job_id}"),
        ]

    def _authenticate(self, request: Request) -> _Sender:
        """Check the proof before any body byte is parsed: its headers (streamed routes) or all of it.

        A removed member that proves its key on an unrouted path gets an unsigned 403; on a route
        it gets a signed one from :meth:`_proven`.
        """
        try:
            if request.body is None:
                member = self.verifier.precheck(request.headers)
            else:
                member = self.verifier.verify(request.method, request.target, request.headers, request.body)
        except AuthError as error:
            raise HTTPError(error.status, str(error)) from None
        if self.check_peer_ip and not _same_ip(request.peer.ip, member.address):
            log.warning(
                "refused a request signed by %s from %s, not its mesh address", member.name, request.peer.ip
            )
            raise HTTPError(
                403, f"a request signed by {member.name} came from {request.peer.ip}, not its mesh address"
            )
        return _Sender(member, proven=request.body is not None and member.current)

    def _proven(self, handler: Callable[[Request, Member], Reply]) -> Callable[[Request], Reply]:
        """Wrap a handler: read the body (hashing it), finish the proof, then run the handler."""

        def run(request: Request) -> Reply:
            sender: _Sender = request.principal
            digest, parts, total = hashlib.sha256(), [], 0
            keep = request.path != "/v1/echo"
            while chunk := request.read(CHUNK):
                digest.update(chunk)
                total += len(chunk)
                if keep:
                    parts.append(chunk)
            if total != request.length:
                raise HTTPError(400, "the request body ended early")
            try:
                member = self.verifier.verify_digest(
                    request.method, request.target, request.headers, digest.digest()
                )
            except AuthError as error:
                if error.removed is None:
                    raise HTTPError(error.status, str(error)) from None
                sender.removed = True
                return json_reply({"error": str(error).splitlines()[0], "removed": True}, 403)
            sender.proven = True
            request.body = b"".join(parts)
            return handler(request, member)

        return run

    def _sign_reply(
        self, request: Request, principal: Any, status: int, body: bytes | None
    ) -> dict[str, str]:
        if isinstance(principal, _Sender) and (principal.proven or principal.removed):
            return self.verifier.reply_headers(
                principal.member.public_key, status, body or b"", request.headers
            )
        return {}

    def _get_health(self, request: Request, member: Member) -> Reply:
        return json_reply({"name": self.member_name, "address": self.host, "version": __version__})

    def _post_devices(self, request: Request, member: Member) -> Reply:
        return json_reply(self.devices(request.json()))

    def _post_echo(self, request: Request, member: Member) -> Reply:
        return json_reply({"bytes": request.length})

    def _post_probe(self, request: Request, member: Member) -> Reply:
        return json_reply(self.probe(request.json()))

    def _post_job(self, request: Request, member: Member) -> Reply:
        return json_reply(self.start_job(request.json(), member), 201)

    def _get_events(self, request: Request, member: Member) -> Reply:
        after = _number(request.query, "after", 0, int, 0, 2**62)
        wait = _number(request.query, "wait", 1.0, float, 0.0, _MAX_WAIT_S)
        return json_reply(self.poll(request.params["job_id"], after, wait))

    def _get_log(self, request: Request, member: Member) -> Reply:
        rank = request.params["rank"]
        if not rank.isdigit() or len(rank) > 9:
            raise HTTPError(400, f"rank {rank[:20]!r} is not a number")
        lines = _number(request.query, "tail", 200, int, 1, 100_000)
        return text_reply(self.log_tail(request.params["job_id"], int(rank), lines))

    def _delete_job(self, request: Request, member: Member) -> Reply:
        return json_reply(self.delete_job(request.params["job_id"], member))


def _shape_and_workload(model_config: dict[str, Any], workload_fields: dict[str, Any]) -> tuple[Any, Any]:
    """Validate the request's model config and workload (cheap: no torch)."""
    import dataclasses

    from shardpool.model.shape import ModelShape
    from shardpool.plan.costmodel import Workload

    known = [f.name for f in dataclasses.fields(Workload)]
    unknown = sorted(set(workload_fields) - set(known))
    if unknown:
        raise HTTPError(400, f"unknown workload fields {unknown}; use {known}")
    fields = dict(workload_fields)
    if "lora_targets" in fields:
        targets = fields["lora_targets"]
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise HTTPError(400, "workload.lora_targets must be a list of module names")
        fields["lora_targets"] = tuple(targets)
    try:
        workload = Workload(**fields)
    except TypeError as error:
        raise HTTPError(400, f"bad workload: {error}") from None
    shape = ModelShape.from_config_json(model_config, name=str(model_config.get("_name_or_path", "")))
    return shape, workload


def _profile_devices(shape: Any, workload: Any) -> list[dict[str, Any]]:
    """Profile one layer on every local device (imports torch on first use)."""
    from shardpool.plan.devices import list_devices
    from shardpool.plan.profiler import profile_layer

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


def _tail(log_fd: int, lines: int) -> str:
    """The last ``lines`` lines of a rank's log, read through the descriptor the agent opened."""
    if log_fd < 0:
        return ""
    size = os.fstat(log_fd).st_size
    start = max(0, size - _MAX_LOG_TAIL_BYTES)
    data = os.pread(log_fd, size - start, start)
    text = data.decode("utf-8", errors="replace").splitlines()
    return "".join(line + "\n" for line in text[-lines:])


def _number(query: dict[str, list[str]], key: str, default: Any, kind: type, low: float, high: float) -> Any:
    values = query.get(key)
    if not values:
        return default
    try:
        value = kind(values[0][:40])
    except ValueError:
        raise HTTPError(400, f"{key}={values[0][:40]!r} is not a number") from None
    if not low <= value <= high:  # NaN fails both comparisons
        raise HTTPError(400, f"{key}={value} is out of range {low}..{high}")
    return value


# ---------------------------------------------------------------------------- command


def default_socket_path() -> Path:
    """Where the local listener lives: ``$SHARDPOOL_AGENT_SOCKET``, else ``/run/shardpool/agent.sock``."""
    return Path(agent_socket_path())


def _roster_peers(state_dir: Path) -> Callable[[], list[MeshPeer]]:
    def peers() -> list[MeshPeer]:
        from mesh.node.api import members

        return [
            MeshPeer(m.name, m.address, m.public_key, bool(m.online)) for m in members(state_dir, probe=False)
        ]

    return peers


def run_agent(
    state_dir: str | None,
    port: int = AGENT_PORT,
    *,
    work_dir: str | None = None,
    ready_file: str | None = None,
    run_as: str = "shardpool",
    group: str = DEFAULT_LAUNCH_GROUP,
    socket_path: str | None = None,
) -> int:
    """Run ``shardpool agent`` until SIGTERM/SIGINT: the mesh listener and the local Unix socket.

    Refuses to start (one-line error) when the run-as account does not exist, is root, or cannot
    run this Python; when the launch group does not exist; or when the work directory is out of
    the run-as account's reach. ``ready_file`` (used by ``mesh init/join/up``) is written with the
    pid and URL once listening.
    """
    import grp

    from mesh.control.directory import CachedRosterDirectory
    from mesh.node.config import load_config
    from mesh.state import StatePaths, resolve_state_dir
    from mesh.wireguard.keys import read_private_key
    from shardpool.agent.accounts import resolve_run_as

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    paths = StatePaths(resolve_state_dir(state_dir))
    config = load_config(paths)
    account = resolve_run_as(run_as)
    try:
        grp.getgrnam(group)
    except KeyError:
        raise ShardpoolError(
            f"launch group {group!r} does not exist; create it with `groupadd --system {group}` or pass --group"
        ) from None
    verifier = RequestVerifier(
        read_private_key(paths.private_key),
        config.mesh_id,
        CachedRosterDirectory(paths.roster, config.mesh_id),
    )
    socket = Path(socket_path) if socket_path else default_socket_path()
    socket.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    agent = Agent(
        config.address,
        port,
        verifier=verifier,
        peers=_roster_peers(paths.root),
        work_dir=Path(work_dir) if work_dir else paths.root.with_name(paths.root.name + "-work"),
        interface=config.interface,
        member_name=config.name,
        run_as=account,
        group=group,
        socket_path=socket,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    agent.start()
    log.info(
        "shardpool agent %s for member %r listening on %s and %s; stages run as %s",
        __version__, config.name, agent.url, socket, account.user,
    )  # fmt: skip
    if ready_file:
        atomic_write(Path(ready_file), json.dumps({"pid": os.getpid(), "url": agent.url}).encode("utf-8"))
    try:
        while not stop.wait(1.0):
            pass
    finally:
        log.info("stopping: terminating jobs, then the server")
        agent.stop()
        if ready_file:
            Path(ready_file).unlink(missing_ok=True)
    return 0
