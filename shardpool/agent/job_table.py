"""The agent's job table: starting a job's ranks, long-polling their events, stopping them.

A job start is checked against the contract (:func:`shardpool.contract.start.parse_job_start`),
its files are written into a fresh 0700 directory (a job id is never re-used) owned by the job's
own uid (:class:`shardpool.agent.accounts.JobUids`, with the run-as account's group), and each
rank is started there through :func:`shardpool.agent.processes.popen_as`. Once a job's ranks are
gone, whatever still runs under its uid is killed, its directory handed to root, and the uid freed.

A job is its submitter's: its events, logs and stop are answered only to the member whose key
signed its start (``origin``), and, when that member's agent says it asks on behalf of a local
user (``submitter=`` in the signed path), only for the user it started the job for. The event
poll doubles as the launcher's heartbeat: a job nobody has polled for ``heartbeat_timeout_s`` is
stopped, so a crashed or partitioned launcher never leaves stages holding memory. The most
recent finished jobs are remembered, older ones forgotten.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mesh.control.directory import Member
from mesh.files import atomic_write
from mesh.http.server import HTTPError
from shardpool.agent.accounts import JobUids, RunAs, disown_tree, kill_uid, make_directory, share_with_group
from shardpool.agent.confine import stage_writable_dirs
from shardpool.agent.jobs import Job, Rank, open_log, tail, terminate
from shardpool.agent.processes import Spawner, StageSettings, popen_as, stage_environment
from shardpool.contract.inference import InferenceJob
from shardpool.contract.names import ContractError
from shardpool.contract.start import FILES_SECRET_FILE, JobStartRequest, NotAMember, parse_job_start
from shardpool.errors import ShardpoolError

__all__ = ["SUBMITTER_PARAMETER", "JobTable", "on_behalf_of"]

#: The query parameter by which a job's origin agent says which of its users a request is for.
SUBMITTER_PARAMETER = "submitter"

log = logging.getLogger(__name__)

_MAX_FINISHED_JOBS = 64
_MAX_STARTS_PER_JOB = 1000


class JobTable:
    """Every job this agent runs or recently ran, keyed by job id."""

    def __init__(
        self,
        settings: StageSettings,
        spawner: Spawner,
        *,
        is_member_address: Callable[[str], bool],
        heartbeat_timeout_s: float,
        max_events: int,
    ) -> None:
        self.settings = settings
        self.spawner = spawner
        self.is_member_address = is_member_address
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_events = max_events
        self._jobs: dict[str, Job] = {}
        self._job_uids = JobUids(settings.job_uids)
        self._held: dict[Path, tuple[int, Job]] = {}  # job directory -> its uid and job, until reclaimed
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._watchdog: threading.Thread | None = None

    def open(self) -> None:
        """Accept jobs and start the heartbeat watchdog.

        ``jobs/`` becomes 0711 (others may pass through to their own job's directory but not list
        it); with a uid per job, the fetch cache becomes the run-as group's (setgid 2770) and any
        job directory a previous agent left to a job uid is taken back (its processes killed).
        """
        jobs = make_directory(self.settings.work_dir / "jobs", mode=0o711, owner=(os.geteuid(), os.getegid()))
        if self.settings.uid_per_job:
            share_with_group(self.settings.cache_dir, self.settings.run_as.gid)
            for directory in jobs.iterdir():  # job directories and root's ~owner files
                owner = directory.lstat().st_uid
                if owner in self.settings.job_uids and not kill_uid(owner):
                    disown_tree(directory)
        self._closing.clear()
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch_heartbeats, name="agent-watchdog", daemon=True
            )
            self._watchdog.start()

    def close(self) -> None:
        """Refuse new jobs, stop every running one (SIGTERM, SIGKILL after 5 s) and the watchdog,
        and take back the jobs' uids."""
        self._closing.set()
        self.stop_all()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)
            self._watchdog = None
        for _ in range(50):
            if not self._reclaim_uids():
                break
            time.sleep(0.1)

    def close_finished_logs(self) -> None:
        """Close the log descriptors of every job that no longer runs (once the agent has stopped)."""
        with self._lock:
            for job in self._jobs.values():
                if not job.running:
                    job.close_logs()

    def start(self, body: dict[str, Any], origin: Member) -> dict[str, Any]:
        """Validate a ``POST /v1/jobs`` body against the contract, write the job's files, start its ranks.

        ``origin`` is the member whose key signed the request: it alone may see and stop the job,
        and only for ``submitter`` when it names one. A malformed request is 400; one naming an
        address outside the mesh is 403; a job id that runs here is 409, and one that ran here
        for another member or user (recorded beside its directory, so across agent restarts) 403.
        Its own launcher may start it here again (a run taking a member back), always in a
        fresh directory: a job's directory and logs are never re-used.
        """
        try:
            request = parse_job_start(
                body, is_member_address=self.is_member_address, origin_address=origin.address
            )
        except NotAMember as error:
            raise HTTPError(403, str(error)) from None
        except ContractError as error:
            raise HTTPError(400, str(error)) from None
        request = request.model_copy(update={"origin": origin.name})
        job_id = request.job_id
        if self._closing.is_set() or not self.spawner.running:
            raise HTTPError(503, "the agent is shutting down")
        account = self._job_account()
        try:
            with self._lock:
                previous = self._jobs.get(job_id)
                if previous is not None and (previous.running or previous.stopping or previous.starting):
                    raise HTTPError(409, f"job {job_id!r} is already running here; DELETE it first")
                self._claim(job_id, origin, request.submitter)
                directory = self._fresh_directory(job_id, account)
                if previous is not None:
                    previous.close_logs()
                entry = Job(job_id, directory, self.max_events, origin, request.submitter)
                self._jobs[job_id] = entry
                if account.uid != self.settings.run_as.uid:
                    self._held[directory] = (account.uid, entry)
                self._forget_old_jobs()
        except BaseException:
            if account.uid != self.settings.run_as.uid:
                self._job_uids.release(account.uid)
            raise
        try:
            self._launch(entry, request, account)
        finally:
            entry.starting = False
        entry.last_poll = time.monotonic()
        pids = {str(r.rank): r.process.pid for r in entry.ranks.values()}
        log.info(
            "job %s from %s (user %s): started ranks %s as uid %d in %s (pids %s)",
            job_id, origin.name, request.submitter, request.ranks, account.uid, directory.name,
            list(pids.values()),
        )  # fmt: skip
        return {"job_id": job_id, "pids": pids}

    def _claim(self, job_id: str, origin: Member, submitter: str | None) -> None:
        """Record ``job_id`` as ``origin``'s for ``submitter``, or refuse (403) an id another member
        or user started here before. The record is a root-only file beside the job directories
        (``jobs/ID~owner``: ``~`` is in no job id), so it outlives the agent."""
        claim = {"origin": origin.public_key, "submitter": submitter}
        path = self.settings.work_dir / "jobs" / f"{job_id}~owner"
        try:
            recorded = json.loads(path.read_bytes())
        except FileNotFoundError:
            atomic_write(path, json.dumps(claim).encode("utf-8"), 0o600)
            return
        except ValueError:
            recorded = None
        if recorded != claim:
            raise HTTPError(
                403, f"job id {job_id!r} was used here by another member or user; choose another job id"
            )

    def _fresh_directory(self, job_id: str, account: RunAs) -> Path:
        """A new 0700 directory for one start of ``job_id``, owned by ``account``: ``jobs/ID``, or
        ``jobs/ID~N`` when the job ran here before (never an existing one)."""
        jobs = self.settings.work_dir / "jobs"
        for number in range(1, _MAX_STARTS_PER_JOB + 1):
            directory = jobs / (job_id if number == 1 else f"{job_id}~{number}")
            try:
                return account.make_private_dir(directory, fresh=True)
            except FileExistsError:
                continue
        raise HTTPError(409, f"job {job_id!r} was started here {_MAX_STARTS_PER_JOB} times; start a new job")

    def _job_account(self) -> RunAs:
        """The account a new job runs as: a uid of its own with the run-as group, or the run-as account."""
        run_as = self.settings.run_as
        if not self.settings.uid_per_job:
            return run_as
        try:
            uid = self._job_uids.take()
        except ShardpoolError as error:
            raise HTTPError(503, str(error)) from None
        return RunAs(f"{run_as.user}-{uid}", uid, run_as.gid)

    def _launch(self, entry: Job, request: JobStartRequest, account: RunAs) -> None:
        """Write the job's files into its fresh 0700 directory (owned by ``account``), start its ranks."""
        directory = entry.directory
        job_file = directory / "job.json"
        job_json = json.dumps(request.job.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
        _write_private(job_file, job_json.encode("utf-8"), account)
        if request.files_secret is not None:
            _write_private(directory / FILES_SECRET_FILE, request.files_secret.encode("ascii"), account)
        try:
            inference = isinstance(request.job, InferenceJob)
            command = self.settings.inference_command if inference else self.settings.worker_command
            for rank in request.ranks:
                argv = [*command, str(job_file), str(rank)]
                self._start_rank(entry, rank, argv, account, local_ranks=len(request.ranks))
        except OSError as error:
            self._stop_job(entry, "start failed")
            raise HTTPError(500, f"cannot start rank processes: {error}") from None

    def _start_rank(
        self, entry: Job, rank: int, argv: list[str], account: RunAs, *, local_ranks: int
    ) -> None:
        settings, directory = self.settings, entry.directory
        env = stage_environment(
            directory, interface=settings.interface, local_ranks=local_ranks, cache_dir=settings.cache_dir
        )
        env["USER"] = env["LOGNAME"] = account.user  # a job uid has no passwd entry to name it
        log_fd = open_log(directory / f"rank-{rank}.log")

        def spawn() -> subprocess.Popen[bytes]:
            return popen_as(
                account, argv, env=env, cwd=directory,
                writable=stage_writable_dirs(directory, settings.cache_dir), landlock_abi=settings.landlock_abi,
                stdin=subprocess.DEVNULL, stderr=log_fd,
            )  # fmt: skip

        try:
            process = self.spawner.call(spawn)
        except BaseException:
            os.close(log_fd)
            raise
        record = Rank(rank, process, log_fd)
        entry.ranks[rank] = record
        record.reader = threading.Thread(
            target=entry.relay, args=(record,), name=f"agent-{entry.job_id}-{rank}", daemon=True
        )
        record.reader.start()

    def job(self, job_id: str) -> Job:
        """The job called ``job_id``, or a 404."""
        with self._lock:
            entry = self._jobs.get(job_id)
        if entry is None:
            raise HTTPError(404, f"no job {job_id!r} on this agent")
        return entry

    def jobs(self) -> list[Job]:
        """Every job the agent remembers (running, and the most recent finished ones)."""
        with self._lock:
            return list(self._jobs.values())

    def poll(
        self, job_id: str, after: int, wait: float, requester: Member, on_behalf: str | None
    ) -> dict[str, Any]:
        """Events after ``after``, waiting up to ``wait`` s for one; also the launcher's heartbeat.

        Only for the job's origin member (and submitter: see :meth:`owned`).
        """
        entry = self.owned(job_id, requester, on_behalf)
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

    def delete(self, job_id: str, requester: Member, on_behalf: str | None) -> dict[str, Any]:
        """Stop a job's processes and return their exit codes; only its origin (and submitter) may."""
        entry = self.owned(job_id, requester, on_behalf)
        self._stop_job(entry, "request")
        return {"job_id": job_id, "exited": entry.exited(), "stopped_by": entry.stopped_by}

    def log_tail(self, job_id: str, rank: int, lines: int, requester: Member, on_behalf: str | None) -> str:
        """The last ``lines`` lines of a rank's log; only for the job's origin (and submitter)."""
        entry = self.owned(job_id, requester, on_behalf)
        record = entry.ranks.get(rank)
        if record is None:
            raise HTTPError(404, f"job {job_id!r} has no rank {rank} on this agent")
        return tail(record.log_fd, lines)

    def owned(self, job_id: str, requester: Member, on_behalf: str | None) -> Job:
        """The job ``job_id`` if ``requester`` (the signer) started it and, when it asks
        ``on_behalf`` of one of its users, for that user; else a 403.

        A request from the origin without ``on_behalf`` is its root's (the agent itself), which
        may manage every job its member started: the origin agent adds ``on_behalf`` for every
        other local user, and is trusted for its own users.
        """
        entry = self.job(job_id)
        if entry.origin.public_key != requester.public_key:
            raise HTTPError(
                403,
                f"job {job_id!r} was started by member {entry.origin.name!r}; only that member may manage it",
            )
        if on_behalf is not None and on_behalf != entry.submitter:
            raise HTTPError(
                403,
                f"job {job_id!r} belongs to another user of member {entry.origin.name!r}, not {on_behalf!r}",
            )
        return entry

    def stop_all(self) -> None:
        """Stop every running job at once (SIGTERM all, then SIGKILL whatever is left after 5 s)."""
        with self._lock:
            running = [job for job in self._jobs.values() if job.running]
        terminate([r for job in running for r in job.ranks.values()], "agent shutdown", running)

    def _stop_job(self, entry: Job, reason: str) -> None:
        terminate(list(entry.ranks.values()), reason, [entry])

    def _reclaim_uids(self) -> int:
        """Take back the uid of every job whose ranks are gone: kill what still runs under it, hand
        the job's directory to root, free the uid. Returns how many uids are still held."""
        with self._lock:
            done = [
                (directory, uid, job)
                for directory, (uid, job) in self._held.items()
                if not (job.running or job.starting or job.stopping)
            ]
        for directory, uid, job in done:
            if kill_uid(uid):
                continue  # killed now; gone by the next round
            try:
                disown_tree(directory)
            except OSError as error:
                log.warning("job %s: cannot hand %s back to root: %s", job.job_id, directory, error)
                continue
            self._job_uids.release(uid)
            with self._lock:
                self._held.pop(directory, None)
        with self._lock:
            return len(self._held)

    def _watch_heartbeats(self) -> None:
        while not self._closing.wait(0.2):
            self._reclaim_uids()
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


def on_behalf_of(query: dict[str, list[str]]) -> str | None:
    """The local user a signed request asks for (``submitter=`` in its path), if it names one."""
    values = query.get(SUBMITTER_PARAMETER)
    return values[0][:64] if values else None


def _write_private(path: Path, data: bytes, owner: RunAs) -> None:
    """Write ``path`` atomically, 0600 and owned by ``owner``, never following a link a stage planted.

    The job directory belongs to the job's account, so anything in it may be a trap:
    :func:`mesh.files.atomic_write` creates the file with O_EXCL under a random name and chowns it
    through its descriptor before the rename.
    """
    atomic_write(path, data, 0o600, owner=(owner.uid, owner.gid))
