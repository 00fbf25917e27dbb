"""Start the stage processes of a job on this machine, relay their events, and stop them all on failure.

:class:`LocalLauncher` is the launcher of a ``placement: local`` run: it plans on this machine's
devices and the stages read the inputs where they are.

Each stage process reports JSON events on its stdout (lines starting with ``@shardpool ``); every
other line, and its stderr, goes to ``logs/rank-N.log``. If any process exits non-zero, the others
are terminated at once and the run fails with that stage's error. Children die with the launcher
(``PR_SET_PDEATHSIG`` on Linux), so no stage outlives a killed run.

While the stages compute, the launcher sleeps: its loop wakes for an event, for a stage's stdout
closing (a stage that ends or dies closes it), and otherwise only every
``_IDLE_WAKE_S`` seconds. It shares the cores with the stages, so it must not poll.

Why not ``torch.distributed.elastic.multiprocessing.start_processes``: it does give per-rank
environments and stop-all-on-first-failure, but (torch 2.13) it starts each binary with
``start_new_session=True`` and no ``preexec_fn``, so a stage can neither be tied to the launcher
with ``PR_SET_PDEATHSIG`` nor reached by the terminal's Ctrl-C: a SIGKILLed launcher would leave
every stage running. It also sends stdout to files under ``<log_dir>/<run_id>/attempt_N/<rank>/``
(read back by polling, for ``tee``), where events need a live pipe and one ``rank-N.log`` that holds
no events. And it would import torch into :mod:`shardpool.launch`, which stays torch-free. This
module is the small part of it we need: ``Popen`` per rank, a reader thread per stdout, one poll loop.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from shardpool.config import Config
from shardpool.contract.events import EVENT_PREFIX, StageEvent, parse_stage_event
from shardpool.contract.job import CONTROL_SECRET_ENV, Job
from shardpool.contract.names import ContractError
from shardpool.errors import ShardpoolError
from shardpool.plan.config_plan import plan_for_config
from shardpool.plan.local_fleet import DeviceProbe
from shardpool.plan.result import Plan

__all__ = ["LocalLauncher", "die_with_parent", "free_port", "interface_names", "loopback_pinning", "run_local_job", "spawn_stage", "stage_environment", "stop_processes", "StageFailed"]

_TERMINATE_GRACE_S = 5.0
_IDLE_WAKE_S = 2.0  # the loop's wake-up when nothing happens (a stage's exit wakes it at once)
_EXIT_WAKE_S = 0.05  # while a stage's stdout has closed and its exit status is not in yet


class StageFailed(ShardpoolError):
    """A stage process failed; the message names the stage and its error."""

    def __init__(self, message: str, *, rank: int, stage: int) -> None:
        super().__init__(message)
        self.rank = rank
        self.stage = stage


class LocalLauncher:
    """Stages as processes on this machine, meeting on loopback; they read the inputs where they are.

    The stages take the run's control secret (what seals the rendezvous store's values) from their
    environment, which other users cannot read (``/proc/PID/environ`` is the owner's alone).
    """

    address = "127.0.0.1"

    def __init__(self, *, probe: DeviceProbe, port: int = 0) -> None:
        self.probe = probe  # measures this machine's devices for the planner
        self.port = port  # of the rendezvous store (0: any free port)
        self.control_secret = secrets.token_hex(32)

    def plan(self, config: Config) -> Plan:
        """Place the stages on this machine's devices (``shardpool.devices``), or as ``shardpool.layers`` says."""
        return plan_for_config(config, probe=self.probe)

    @contextmanager
    def serving(self, inputs: dict[str, str], output_dir: Path) -> Iterator[str | None]:
        """Nothing to serve: local stages open the inputs' paths directly."""
        yield None

    def start(self, job: Job, job_file: Path, on_event: Callable[[dict[str, Any]], None]) -> None:
        """Run every rank here until all finish, logging to ``logs/`` next to the job file."""
        run_local_job(
            job, job_file, log_dir=job_file.parent / "logs", on_event=on_event, secret=self.control_secret
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, for the torch.distributed rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def run_local_job(
    job: Job, job_file: Path, *, log_dir: Path, on_event: Callable[[dict[str, Any]], None], secret: str
) -> None:
    """Run every rank of ``job`` as a local process until all finish; raise StageFailed on the first failure.

    ``secret`` is the run's control secret, handed to each rank in its environment.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    events: queue.Queue[tuple[int, dict[str, Any] | None]] = queue.Queue()
    processes: list[subprocess.Popen[bytes]] = []
    readers: list[threading.Thread] = []
    errors: dict[int, str] = {}
    closed: set[int] = set()  # ranks whose stdout has closed
    try:
        for rank in range(job.world_size):
            log_path = log_dir / f"rank-{rank}.log"
            process = _start_rank(job, job_file, rank, log_path, secret=secret)
            processes.append(process)
            reader = threading.Thread(
                target=_relay, args=(rank, process.stdout, log_path, events), daemon=True
            )
            reader.start()
            readers.append(reader)
        while True:
            exiting = any(processes[rank].poll() is None for rank in closed)
            _dispatch(events, on_event, errors, closed, timeout=_EXIT_WAKE_S if exiting else _IDLE_WAKE_S)
            codes = [process.poll() for process in processes]
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                stop_processes(processes)
                for reader in readers:
                    reader.join(timeout=2.0)
                _dispatch(events, on_event, errors, closed, timeout=0.0)
                raise _failure(job, failed, codes, errors, log_dir)
            if all(code == 0 for code in codes):
                for reader in readers:
                    reader.join(timeout=5.0)
                _dispatch(events, on_event, errors, closed, timeout=0.0)
                return
    finally:
        stop_processes(processes)


def _start_rank(
    job: Job, job_file: Path, rank: int, log_path: Path, *, secret: str
) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "shardpool.elastic.rank", str(job_file), str(rank)]
    return spawn_stage(argv, log_path, stage_environment(secret, job.threads_per_process), pipe_stdout=True)


def spawn_stage(
    argv: list[str], log_path: Path, env: dict[str, str], *, pipe_stdout: bool
) -> subprocess.Popen[bytes]:
    """A local stage process: stderr (and stdout, unless ``pipe_stdout`` hands it to the caller)
    appended to ``log_path``, no stdin, ``env`` as its whole environment, killed with this thread."""
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed with it
    try:
        return subprocess.Popen(
            argv,
            stdout=subprocess.PIPE if pipe_stdout else log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=die_with_parent,
        )
    finally:
        log.close()


def stage_environment(secret: str, threads: int) -> dict[str, str]:
    """A local stage process's environment: this one's, plus the run's control secret, gloo and
    NCCL pinned to loopback, ``threads`` OpenMP/MKL threads, unbuffered output."""
    env = dict(os.environ)
    env.update(
        {
            CONTROL_SECRET_ENV: secret,
            **loopback_pinning(interface_names()),
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    return env


def interface_names() -> list[str]:
    """This machine's network interface names (empty where the OS cannot list them)."""
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def loopback_pinning(names: list[str]) -> dict[str, str]:
    """The environment that keeps a local run's gloo and NCCL sockets on loopback: its ranks all run
    on this machine, so nothing on the network need reach them. Linux names loopback ``lo``, macOS
    ``lo0``; where neither exists the libraries choose as they would."""
    loopback = next((name for name in ("lo", "lo0") if name in names), None)
    return {} if loopback is None else {"GLOO_SOCKET_IFNAME": loopback, "NCCL_SOCKET_IFNAME": loopback}


def die_with_parent() -> None:
    """In a child before exec: be killed when the parent dies (Linux), so no stage outlives its launcher."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _relay(
    rank: int,
    stream: IO[bytes] | None,
    log_path: Path,
    events: queue.Queue[tuple[int, dict[str, Any] | None]],
) -> None:
    """Pass a stage's events on and log its other lines; ``(rank, None)`` last, when its stdout closes."""
    try:
        if stream is None:
            return
        with open(log_path, "ab") as log:
            for raw in stream:
                line = raw.decode("utf-8", errors="replace")
                if line.startswith(EVENT_PREFIX):
                    try:
                        event = parse_stage_event(json.loads(line[len(EVENT_PREFIX) :]))
                        events.put((rank, event.model_dump(mode="json")))
                        continue
                    except (json.JSONDecodeError, ContractError):
                        pass
                log.write(raw)
                log.flush()
    finally:
        events.put((rank, None))


def _dispatch(
    events: queue.Queue[tuple[int, dict[str, Any] | None]],
    on_event: Callable[[dict[str, Any]], None],
    errors: dict[int, str],
    closed: set[int],
    *,
    timeout: float,
) -> None:
    """Handle events for up to ``timeout`` seconds; return early when a stage's stdout closes."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        try:
            rank, event = events.get(timeout=remaining) if remaining > 0 else events.get_nowait()
        except queue.Empty:
            return
        if event is None:
            closed.add(rank)
            deadline = 0.0  # drain what is queued, then let the caller look at the exit codes
        elif event.get("event") == StageEvent.ERROR:
            errors.setdefault(rank, str(event.get("message", "unknown error")))
        else:
            on_event(event)


def stop_processes(processes: list[subprocess.Popen[bytes]]) -> None:
    """Terminate every process still running, give them a grace period together, then kill the rest."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _failure(
    job: Job, failed: list[int], codes: list[int | None], errors: dict[int, str], log_dir: Path
) -> StageFailed:
    # The root cause is a rank killed by a signal, else the first rank to report an error; ranks
    # that merely lost a peer report later.
    killed = [rank for rank in failed if (codes[rank] or 0) < 0]
    rank = killed[0] if killed else next(iter(errors), failed[0])
    stage = job.stage_index(rank)
    if killed:
        message = f"killed by signal {-(codes[rank] or 0)}"
    else:
        message = errors.get(rank) or _last_line(log_dir / f"rank-{rank}.log") or "exited without a message"
    return StageFailed(
        f"stage {stage} (rank {rank}) failed: {message} (log: {log_dir / f'rank-{rank}.log'})",
        rank=rank,
        stage=stage,
    )


def _last_line(path: Path) -> str:
    try:
        lines = [
            line.strip()
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines()
            if line.strip()
        ]
    except OSError:
        return ""
    return lines[-1] if lines else ""
