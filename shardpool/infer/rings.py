"""Where an inference ring's stages run: processes on this machine, or mesh members' agents.

The engine (:mod:`shardpool.infer.engine`) drives a ring the same way wherever its stages are; a
:class:`Stages` decides where they go and starts them, and the :class:`Ring` it returns says when
one has failed (the one line naming it) and stops them all.

* :class:`LocalStages`: one ``python -m shardpool.infer.stage_process`` per stage, children of
  this process (they die with it), the job file and logs in a private directory, the control
  secret in their environment, gloo on loopback.
* :class:`MeshStages`: the driver's rendezvous store and file server on this member's mesh address
  (the file server holds the model's and adapter's files, for the ring's stages only), the stages
  started with one ``POST /v1/jobs`` per member through this machine's agent, as training's mesh
  stages are (run-as account, job directory, Landlock), and followed by long-polling each agent,
  which is also the heartbeat that stops them if this process goes away. Each start places the
  stages again over the members online then, so a ring started after a lost member leaves it out.
* :class:`TorchrunStages`: the processes torchrun started beside the driver on this machine; the
  job file is written as for local stages and its path handed to them (through torchrun's store).
  torchrun owns those processes: a stage that fails ends the whole launch, as in training.
"""

from __future__ import annotations

import queue
import secrets
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shardpool.agent.client import AgentRefused, AgentUnreachable
from shardpool.contract.inference import InferenceJob
from shardpool.contract.job import StagePlacement
from shardpool.errors import ShardpoolError
from shardpool.files.server import FileServer
from shardpool.launch.local_launcher import spawn_stage, stage_environment, stop_processes
from shardpool.launch.mesh_follow import Follow, poll, stop_everywhere
from shardpool.launch.mesh_launcher import LOST_AFTER_S, new_job_id, ranks_by_member
from shardpool.launch.mesh_members import MeshMember, launcher_member

__all__ = ["LocalStages", "MeshStages", "Ring", "Stages", "TorchrunStages", "last_error_line"]


class Ring(Protocol):
    """The stage processes of one started ring."""

    #: How long after the ring broke its root cause may take to show (a stage's last line reaching
    #: its log; a vanished member's agent staying silent long enough to be called lost).
    settle_s: float

    def failure(self) -> str | None:
        """The failed stage's one line (a stage killed or lost first: its neighbours only lost a
        peer), or None while none has failed."""

    def stop(self) -> None:
        """Stop every stage of the ring; nothing is left running."""


class Stages(Protocol):
    """Where a ring's stages run, and how they are started."""

    #: The driver's address: where the rendezvous store listens and gloo binds.
    address: str
    #: The network interface the driver's gloo binds to (None: torch's default).
    interface: str | None
    #: Where the stages fetch their inputs from (None: they open the job's paths).
    files_url: str | None

    def place(self) -> list[StagePlacement]:
        """The stages' places for the next ring."""

    def control_secret(self) -> str:
        """The secret the next ring's control key derives from."""

    def start(self, job: InferenceJob, secret: str) -> Ring:
        """Start every stage of ``job``."""

    def close(self) -> None:
        """Release what the stages were served with (the file server)."""


class LocalStages:
    """Every stage a child process of this one, on the places given; the job file in ``work_dir``
    (a fresh private directory by default), each stage's log in ``log_dir`` (default: the same)."""

    address = "127.0.0.1"
    interface: str | None = None
    files_url: str | None = None

    def __init__(
        self,
        placements: Sequence[StagePlacement],
        *,
        work_dir: Path | None = None,
        log_dir: Path | None = None,
    ) -> None:
        self.placements = list(placements)
        self.work_dir = work_dir or Path(tempfile.mkdtemp(prefix="shardpool-infer-"))
        self.log_dir = log_dir or self.work_dir

    def place(self) -> list[StagePlacement]:
        """The places given."""
        return list(self.placements)

    def control_secret(self) -> str:
        """A fresh secret, handed to the stages in their environment."""
        return secrets.token_hex(32)

    def write_job(self, job: InferenceJob) -> Path:
        """Write the job file (0600) the stages read; its path."""
        job_file = self.work_dir / "job.json"
        job.write(job_file)
        return job_file

    def start(self, job: InferenceJob, secret: str) -> LocalRing:
        """Write the job file and start one process per stage."""
        job_file = self.write_job(job)
        ring = LocalRing([], self.log_dir)
        try:
            for rank in range(job.num_stages):
                ring.processes.append(
                    _start_local_stage(job_file, rank, self.log_dir, secret, job.threads_per_process)
                )
        except BaseException:
            ring.stop()
            raise
        return ring

    def close(self) -> None:
        """Nothing to release."""


class TorchrunStages(LocalStages):
    """Stages torchrun already started on this machine (ranks 1..N-1 of the launch; this process,
    rank 0, drives): :meth:`start` writes the job file (0600) and hands its path to them through
    ``publish``. The ring it returns has no process of this one's to watch or stop: torchrun stops
    the launch when any of them fails."""

    def __init__(
        self, placements: Sequence[StagePlacement], *, secret: str, publish: Callable[[Path], None]
    ) -> None:
        super().__init__(placements)
        self._secret = secret
        self._publish = publish

    def control_secret(self) -> str:
        """The launch's secret (``SHARDPOOL_CONTROL_SECRET``, which every process of it holds)."""
        return self._secret

    def start(self, job: InferenceJob, secret: str) -> LocalRing:
        """Write the job file and publish its path to the waiting stage ranks."""
        self._publish(self.write_job(job))
        return LocalRing([], self.log_dir)


@dataclass
class LocalRing:
    """A ring's stage processes on this machine, their logs in ``log_dir``."""

    processes: list[subprocess.Popen[bytes]]
    log_dir: Path
    settle_s: float = 0.2

    def failure(self) -> str | None:
        """The failed stage's line: killed by a signal first, else the first to exit non-zero."""
        codes = [process.poll() for process in self.processes]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if not failed:
            return None
        killed = [rank for rank in failed if (codes[rank] or 0) < 0]
        rank = (killed or failed)[0]
        log = self.log_dir / f"infer-rank-{rank}.log"
        code = codes[rank] or 0
        how = f"killed by signal {-code}" if code < 0 else (_log_error(log) or f"exited with {code}")
        return f"stage {rank} failed: {how} (log: {log})"

    def stop(self) -> None:
        """Terminate the stages, a grace period, then kill."""
        stop_processes(self.processes)


def _start_local_stage(
    job_file: Path, rank: int, log_dir: Path, secret: str, threads: int
) -> subprocess.Popen[bytes]:
    log_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "shardpool.infer.stage_process", str(job_file), str(rank)]
    return spawn_stage(
        argv, log_dir / f"infer-rank-{rank}.log", stage_environment(secret, threads), pipe_stdout=False
    )


def _log_error(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return last_error_line(text)


def last_error_line(text: str) -> str:
    """A stage log's last ``error: …`` line (what the stage said when it failed), else its last line."""
    lines = [line.strip() for line in text.splitlines()]
    errors = [line[len("error: ") :] for line in lines if line.startswith("error: ")]
    if errors:
        return errors[-1]
    return next((line for line in reversed(lines) if line), "")


class MeshStages:
    """Stages on mesh members, started through this machine's agent; see the module's docstring.

    ``members`` lists the members online now (called at each start); ``place`` places a ring's
    stages over them (each placement's ``host`` a member's name). ``inputs`` are the job's inputs
    by name (the model's and adapter's files), served to the ring's stages only.
    """

    files_url: str | None

    def __init__(
        self,
        members: Callable[[], list[MeshMember]],
        place: Callable[[list[MeshMember]], list[StagePlacement]],
        inputs: dict[str, str],
        *,
        interface_of: Callable[[str], str | None],
        lost_after_s: float = LOST_AFTER_S,
    ) -> None:
        self._members = members
        self._place = place
        self._online = members()
        self.address = launcher_member(self._online).address
        self.interface = interface_of(self.address)
        self._secret = secrets.token_hex(32)
        self._lost_after_s = lost_after_s
        self._uploads = Path(tempfile.mkdtemp(prefix="shardpool-ring-uploads-"))
        self._server = FileServer(
            self.address,
            0,
            files={name: Path(path) for name, path in inputs.items()},
            upload_root=self._uploads,
            secret=self._secret,
        )
        self._server.start()
        self.files_url = self._server.url

    def place(self) -> list[StagePlacement]:
        """The stages placed over the members online now."""
        self._online = self._members()
        return self._place(self._online)

    def control_secret(self) -> str:
        """The file server's secret, which every stage's agent hands it 0600 in its job directory."""
        return self._secret

    def start(self, job: InferenceJob, secret: str) -> MeshRing:
        """Start each member's stages of ``job`` with one request to its agent, and follow them."""
        online = {member.name for member in self._online}
        for rank, placement in enumerate(job.stages):
            if placement.host not in online:
                raise ShardpoolError(f"stage {rank} is placed on {placement.host!r}, which is not online")
        ring = MeshRing(new_job_id(), job, lost_after_s=self._lost_after_s)
        payload = job.model_dump(mode="json")
        try:
            for member, member_ranks in ranks_by_member(job, self._online).values():
                member.agent.start_job(ring.job_id, payload, member_ranks, files_secret=secret)
                ring.follow(Follow(member, member_ranks))
        except (AgentUnreachable, AgentRefused) as error:
            ring.stop()
            raise ShardpoolError(
                f"could not start the ring's stages on member {member.name!r}: {error}"
            ) from None
        except BaseException:
            ring.stop()
            raise
        return ring

    def close(self) -> None:
        """Stop the file server."""
        self._server.stop()


@dataclass
class MeshRing:
    """A ring's stages on mesh members, each member's long-polled by a thread of its own."""

    job_id: str
    job: InferenceJob
    lost_after_s: float = LOST_AFTER_S
    follows: dict[str, Follow] = field(default_factory=dict)

    @property
    def settle_s(self) -> float:
        """Long enough for a member that vanished (its neighbours fail first) to be called lost."""
        return self.lost_after_s + 2.0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self._stopped = False

    def follow(self, follow: Follow) -> None:
        """Follow one member's stages from now on (its agent stops them once nobody polls)."""
        self.follows[follow.member.name] = follow
        threading.Thread(
            target=poll,
            args=(follow, self.job_id, self._events, self._stop, self.lost_after_s),
            name=f"shardpool-ring-{follow.member.name}",
            daemon=True,
        ).start()

    def failure(self) -> str | None:
        """A lost member first, then a stage killed by a signal, then one that exited non-zero
        (with the error line from its log on the member)."""
        for name, follow in self.follows.items():
            if follow.lost is not None:
                return f"member {name!r} was lost while serving: {follow.lost}"
        failed = [
            (name, rank, code)
            for name, follow in self.follows.items()
            for rank, code in follow.exited.items()
            if code != 0
        ]
        if not failed:
            return None
        killed = [item for item in failed if item[2] < 0]
        name, rank, code = (killed or failed)[0]
        if code < 0:
            how = f"killed by signal {-code}"
        else:
            how = self._error_line(name, rank) or f"exited with {code}"
        return f"stage {rank} on member {name!r} failed: {how}"

    def _error_line(self, name: str, rank: int) -> str:
        try:
            return last_error_line(self.follows[name].member.agent.log_tail(self.job_id, rank, 20))
        except (AgentUnreachable, AgentRefused):
            return ""

    def stop(self) -> None:
        """Ask every member's agent to stop the ring's stages (a member that does not answer is gone,
        and its agent stops them itself once the polls stop)."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        stop_everywhere(
            [follow.member for follow in self.follows.values() if follow.lost is None], self.job_id
        )
