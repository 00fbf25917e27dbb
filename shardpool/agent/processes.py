"""Starting the agent's children (stage processes, the device profiler) unprivileged.

Every child runs unprivileged, never root (a job's stages under the job's own uid and the run-as
account's group, the device profiler as the run-as account), with an environment the agent
builds itself (:func:`stage_environment`), in its own process group, fenced by Landlock where
the kernel has it (:mod:`shardpool.agent.confine`), and dies with the agent (``PR_SET_PDEATHSIG``).

Why not ``torch.distributed.elastic.multiprocessing.start_processes``: it takes no user, group,
``preexec_fn`` or ``pass_fds``, so it cannot drop to the run-as account, apply Landlock before
exec, or set a death signal (it puts each child in a new session, so a killed agent would leave
stages running); it writes stdout into its own log tree instead of a pipe the agent relays events
from; and it would import torch into the agent, which stays torch-free. The local launcher gives
the same reasons (:mod:`shardpool.launch.local_launcher`).
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

from shardpool.agent.accounts import DEFAULT_JOB_UIDS, RunAs
from shardpool.agent.confine import restrict_writes
from shardpool.errors import ShardpoolError
from shardpool.host.cpu_quota import available_cpus

__all__ = ["Spawner", "StageSettings", "check_reachable", "popen_as", "signal_group", "stage_environment"]

_T = TypeVar("_T")

#: The agent's own variables a child inherits; everything else it gets is set by the agent.
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


@dataclass(frozen=True)
class StageSettings:
    """How this agent starts stages: as whom, which command (the job file and rank are appended;
    ``inference_command`` for an inference job's stages), on which mesh interface, under which
    work directory, and with which Landlock ABI (0: none).

    ``job_uids`` is the range each job's own uid comes from (with ``run_as``'s group); an agent
    that is not root, or an empty range, runs every job as ``run_as`` itself.
    """

    run_as: RunAs
    worker_command: list[str]
    interface: str | None
    work_dir: Path
    landlock_abi: int
    job_uids: range = DEFAULT_JOB_UIDS
    inference_command: tuple[str, ...] = (sys.executable, "-m", "shardpool.infer.stage_process")

    @property
    def cache_dir(self) -> Path:
        """The stages' shared content-addressed cache: the run-as account's, setgid 2770 for its
        group, which every job's uid has."""
        return self.work_dir / "cache"

    @property
    def uid_per_job(self) -> bool:
        """Whether each job gets a uid of its own (root agents with a non-empty range)."""
        return os.geteuid() == 0 and len(self.job_uids) > 0


def stage_environment(
    job_dir: Path, *, interface: str | None, local_ranks: int, cache_dir: Path
) -> dict[str, str]:
    """The whole environment of a stage process: a few of the agent's variables plus what it needs.

    Nothing comes from the launcher, and the agent's own environment is not passed on (it may hold
    credentials or ``LD_PRELOAD``). ``HOME`` and ``TMPDIR`` are the job directory, so whatever a
    stage writes stays there; gloo and NCCL are pinned to the mesh interface and InfiniBand is off,
    so training traffic stays inside WireGuard; threads are this machine's usable CPUs (its cores, capped
    by its cgroup CPU quota) over its ranks.
    ``SHARDPOOL_CACHE`` is ``cache_dir``, one content-addressed cache shared by all jobs through the
    run-as account's group, so a resumed or repeated run downloads nothing it already has (a cached byte is
    used only if it hashes to the digest the launcher's file server publishes for the job).
    """
    threads = str(max(1, available_cpus() // max(1, local_ranks)))
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
            "SHARDPOOL_THREADS": threads,
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


def _die_with_parent(parent: int, writable: list[str], abi: int) -> Callable[[], None]:
    """A ``preexec_fn``: SIGKILL the child when the agent dies (and exit if it already has); where
    the kernel has Landlock (``abi`` > 0), forbid it every write outside ``writable``. The umask
    keeps what it makes in the shared cache writable for the run-as group (its own directory is
    0700, so nothing else there is exposed)."""

    def preexec() -> None:
        os.umask(0o007)
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if abi > 0:
            restrict_writes(writable, abi)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def popen_as(
    account: RunAs,
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: Path,
    writable: list[str],
    landlock_abi: int,
    stdin: int | IO[bytes] | None,
    stderr: int,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as ``account`` in a new session, stdout piped, fenced to ``writable``.

    Call it on the :class:`Spawner` thread, so that the child is tied to the agent's life.
    """
    return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
        argv,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=stderr,
        env=env,
        cwd=cwd,
        start_new_session=True,
        preexec_fn=_die_with_parent(os.getpid(), writable, landlock_abi),
        **account.popen_kwargs(),
    )


def signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Send ``sig`` to the process group a child leads (it may be gone already)."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Spawner:
    """Starts every child from one long-lived thread.

    Linux delivers ``PR_SET_PDEATHSIG`` when the *thread* that forked the child exits, so a
    process forked from a short-lived HTTP request thread would be killed as soon as the request
    ended. Forking from this thread, which lives as long as the agent, ties children to the agent.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[Callable[[], Any], Future[Any]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """Whether the thread runs (between :meth:`start` and :meth:`close`)."""
        return self._thread is not None

    def start(self) -> None:
        """Start the thread (with a fresh queue)."""
        with self._lock:
            if self._thread is None:
                self._queue = queue.Queue()
                self._thread = threading.Thread(
                    target=self._run, args=(self._queue,), name="agent-spawner", daemon=True
                )
                self._thread.start()

    def call(self, action: Callable[[], _T]) -> _T:
        """Run ``action`` on the spawner thread and return its result (or raise its exception)."""
        future: Future[_T] = Future()
        with self._lock:
            if self._thread is None:
                raise ShardpoolError("the agent is shutting down")
            self._queue.put((action, future))
        return future.result()

    def close(self) -> None:
        """Stop the thread once it has run every action queued before."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            self._queue.put(None)
        thread.join(timeout=5)

    @staticmethod
    def _run(actions: queue.Queue[tuple[Callable[[], Any], Future[Any]] | None]) -> None:
        while (item := actions.get()) is not None:
            action, future = item
            try:
                future.set_result(action())
            except BaseException as error:  # noqa: BLE001 - handed back to the caller
                future.set_exception(error)
