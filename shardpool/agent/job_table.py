"""The agent's job table: starting a job's ranks, long-polling their events, stopping them.

A job start is checked against the contract (:func:`shardpool.contract.start.parse_job_start`),
its files are written into a 0700 directory owned by the run-as account, and each rank is started
there through :func:`shardpool.agent.processes.popen_as`. The event poll doubles as the launcher's
heartbeat: a job nobody has polled for ``heartbeat_timeout_s`` is stopped, so a crashed or
partitioned launcher never leaves stages holding memory. Only the member that started a job may
stop it; the most recent finished jobs are remembered, older ones forgotten.
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
from shardpool.agent.accounts import RunAs
from shardpool.agent.confine import stage_writable_dirs
from shardpool.agent.jobs import Job, Rank, open_log, tail, terminate
from shardpool.agent.processes import Spawner, StageSettings, popen_as, stage_environment
from shardpool.contract.names import ContractError
from shardpool.contract.start import FILES_SECRET_FILE, JobStartRequest, NotAMember, parse_job_start

__all__ = ["JobTable"]

log = logging.getLogger(__name__)

_MAX_FINISHED_JOBS = 64


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
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._watchdog: threading.Thread | None = None

    def open(self) -> None:
        """Accept jobs and start the heartbeat watchdog."""
        self._closing.clear()
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch_heartbeats, name="agent-watchdog", daemon=True
            )
            self._watchdog.start()

    def close(self) -> None:
        """Refuse new jobs, stop every running one (SIGTERM, SIGKILL after 5 s) and the watchdog."""
        self._closing.set()
        self.stop_all()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)
            self._watchdog = None

    def close_finished_logs(self) -> None:
        """Close the log descriptors of every job that no longer runs (once the agent has stopped)."""
        with self._lock:
            for job in self._jobs.values():
                if not job.running:
                    job.close_logs()

    def start(self, body: dict[str, Any], origin: Member) -> dict[str, Any]:
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
        job_id = request.job_id
        if self._closing.is_set() or not self.spawner.running:
            raise HTTPError(503, "the agent is shutting down")
        with self._lock:
            previous = self._jobs.get(job_id)
            if previous is not None and (previous.running or previous.stopping or previous.starting):
                raise HTTPError(409, f"job {job_id!r} is already running here; DELETE it first")
            if previous is not None:
                previous.close_logs()
            directory = self.settings.work_dir / "jobs" / job_id
            entry = Job(job_id, directory, self.max_events, origin, request.submitter)
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
            job_id, origin.name, request.submitter, request.ranks, self.settings.run_as.user, list(pids.values()),
        )  # fmt: skip
        return {"job_id": job_id, "pids": pids}

    def _launch(self, entry: Job, request: JobStartRequest) -> None:
        """Write the job's files into its 0700 directory (owned by the run-as account), start its ranks."""
        run_as = self.settings.run_as
        directory = run_as.make_private_dir(entry.directory)
        job_file = directory / "job.json"
        job_json = json.dumps(request.job.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
        _write_private(job_file, job_json.encode("utf-8"), run_as)
        if request.files_secret is not None:
            _write_private(directory / FILES_SECRET_FILE, request.files_secret.encode("ascii"), run_as)
        try:
            for rank in request.ranks:
                argv = [*self.settings.worker_command, str(job_file), str(rank)]
                self._start_rank(entry, rank, argv, local_ranks=len(request.ranks))
        except OSError as error:
            self._stop_job(entry, "start failed")
            raise HTTPError(500, f"cannot start rank processes: {error}") from None

    def _start_rank(self, entry: Job, rank: int, argv: list[str], *, local_ranks: int) -> None:
        settings, directory = self.settings, entry.directory
        env = stage_environment(
            directory, interface=settings.interface, local_ranks=local_ranks, cache_dir=settings.cache_dir
        )
        log_fd = open_log(directory / f"rank-{rank}.log")

        def spawn() -> subprocess.Popen[bytes]:
            return popen_as(
                settings.run_as, argv, env=env, cwd=directory,
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

    def delete(self, job_id: str, requester: Member) -> dict[str, Any]:
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
        return tail(record.log_fd, lines)

    def stop_all(self) -> None:
        """Stop every running job at once (SIGTERM all, then SIGKILL whatever is left after 5 s)."""
        with self._lock:
            running = [job for job in self._jobs.values() if job.running]
        terminate([r for job in running for r in job.ranks.values()], "agent shutdown", running)

    def _stop_job(self, entry: Job, reason: str) -> None:
        terminate(list(entry.ranks.values()), reason, [entry])

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


def _write_private(path: Path, data: bytes, owner: RunAs) -> None:
    """Write ``path`` atomically, 0600 and owned by ``owner``, never following a link a stage planted.

    The job directory belongs to the run-as account, so anything in it may be a trap:
    :func:`mesh.files.atomic_write` creates the file with O_EXCL under a random name and chowns it
    through its descriptor before the rename.
    """
    atomic_write(path, data, 0o600, owner=(owner.uid, owner.gid))
