"""Run a job's stage processes on mesh members through their agents, and stop them all on failure.

:class:`MeshLauncher` is the launcher of a ``placement: mesh`` run: it finds the members
(:mod:`shardpool.launch.mesh_members`), plans over their devices, serves the run's inputs from a
file server on this member's mesh address, and starts each member's ranks with one
``POST /v1/jobs`` through this machine's agent, then follows them by long-polling their events.
The polls double as the launcher's heartbeat: an agent that stops hearing from the launcher stops
its stages. A member whose agent stops answering for ``lost_after_s`` seconds, or whose stage
exits non-zero, ends the run: every other member's stages are stopped and the error names the
member and the step. A member whose agent went silent, whose stage was killed by a signal or
(with a stall watch) stopped beating is :class:`MemberLost`, which a supervised run survives; a
stage's own error is not. A supervised launcher is given its supervisor at construction
(:class:`~shardpool.launch.supervision.Supervision`): the loop asks it, and nothing else, for the
stall watch, the loss bound, an interrupt, a growth in place and what to do every turn.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shardpool.agent.local_client import LocalAgentClient, agent_socket_path
from shardpool.config import Config
from shardpool.contract.events import StageEvent
from shardpool.contract.inference import InferenceJob
from shardpool.contract.job import Job
from shardpool.files.server import FileServer
from shardpool.launch.mesh_follow import (
    Follow,
    Interrupted,
    MemberLost,
    abandon_growth,
    first_failure,
    joiner_failure,
    only_joiners_run,
    poll,
    stall,
    start_joining,
    stop_everywhere,
)
from shardpool.launch.mesh_members import (
    MeshMember,
    launcher_member,
    mesh_planner,
    online_members,
    plans_with_and_without,
)
from shardpool.launch.supervision import GrowthOrder, StallWatch, Supervision
from shardpool.plan.result import Plan

__all__ = [
    "LOST_AFTER_S",
    "Interrupted",
    "MemberLost",
    "MeshLauncher",
    "new_job_id",
    "ranks_by_member",
    "run_mesh_job",
]

LOST_AFTER_S = 10.0


_NEIGHBOUR_GRACE_S = 15.0  # a forwarded poll of a vanished member takes up to ~11 s to fail


class MeshLauncher:
    """Stages on mesh members, started through this machine's agent; inputs served by a file server."""

    port = 0  # the rendezvous store takes any free port on the mesh address

    def __init__(
        self,
        members: list[MeshMember],
        *,
        say: Callable[[str], None],
        files_secret: str | None = None,
        supervision: Supervision | None = None,
        list_members: Callable[[], list[MeshMember]] | None = None,
        previous_job_ids: Sequence[str] = (),
    ) -> None:
        self.members = members
        self.address = launcher_member(members).address
        self._planner = mesh_planner(members, say=say)
        self._say = say
        self._files_secret = files_secret or secrets.token_hex(32)
        #: What a supervised run's event loop asks (None: the first failure stops the run).
        self.supervision = supervision
        self.job_id: str | None = None
        #: The jobs of the run's earlier attempts, oldest first.
        self.previous_job_ids: list[str] = list(previous_job_ids)
        #: The members online now, as this machine's agent lists them (None: not known here).
        self.list_members = list_members

    def over(self, members: list[MeshMember], *, say: Callable[[str], None]) -> MeshLauncher:
        """The next attempt's launcher over ``members`` (a lost one left out, or joined ones added),
        with this one's supervisor, member listing and file secret, and its job ids as the run's history."""
        return type(self)(
            members,
            say=say,
            files_secret=self._files_secret,
            supervision=self.supervision,
            list_members=self.list_members,
            previous_job_ids=[*self.previous_job_ids, *([self.job_id] if self.job_id else [])],
        )

    def supervised_by(self, supervision: Supervision) -> MeshLauncher:
        """This launcher (same members, listing, secret and history), its run kept going by ``supervision``."""
        return type(self)(
            self.members,
            say=self._say,
            files_secret=self._files_secret,
            supervision=supervision,
            list_members=self.list_members,
            previous_job_ids=self.previous_job_ids,
        )

    @property
    def control_secret(self) -> str:
        """What the key sealing the rendezvous store's values derives from: the file-server secret,
        which every stage already holds (its agent writes it 0600 into the job directory)."""
        return self._files_secret

    @classmethod
    def connect(cls, *, say: Callable[[str], None], agent_socket: str | None = None) -> MeshLauncher:
        """Ask this machine's agent for the members online (a user it refuses stops here, with the fix).

        ``agent_socket`` is the agent's socket (default: :func:`agent_socket_path`).
        """
        local = LocalAgentClient(agent_socket_path(agent_socket))
        members = online_members(local)
        launcher = cls(members, say=say, list_members=lambda: online_members(local))
        say(f"mesh members online: {', '.join(member.name for member in members)}")
        return launcher

    def plan(self, config: Config) -> Plan:
        """Place the stages on the members' devices, profiled there for this model."""
        return self._planner(config)

    def plans_with_and_without(self, config: Config, left_out: set[str]) -> tuple[Plan, Plan]:
        """Plans over every member and over all but ``left_out``, from one measurement of the fleet
        (a join check's comparison: see :func:`~shardpool.launch.mesh_members.plans_with_and_without`)."""
        return plans_with_and_without(self.members, config, left_out=left_out, say=self._say)

    @contextmanager
    def serving(self, inputs: dict[str, str], output_dir: Path) -> Iterator[str | None]:
        """Serve ``inputs`` (and take uploads into ``output_dir``) to this run's stages only; yield the URL."""
        files = {name: Path(path) for name, path in inputs.items()}
        with FileServer(
            self.address, 0, files=files, upload_root=output_dir, secret=self._files_secret
        ) as server:
            yield server.url

    def start(self, job: Job, job_file: Path, on_event: Callable[[dict[str, Any]], None]) -> None:
        """Run every rank on the member hosting its stage until all finish (see :func:`run_mesh_job`)."""
        ranks = ranks_by_member(job, self.members)
        self.job_id = new_job_id()
        previous = self.previous_job_ids[-1] if self.previous_job_ids else None
        supervision = self.supervision
        if supervision is None:
            run_mesh_job(
                job, self.job_id, ranks, on_event=on_event, files_secret=self._files_secret, previous=previous
            )
            return
        run_mesh_job(
            job,
            self.job_id,
            ranks,
            on_event=on_event,
            lost_after_s=supervision.lost_after_s,
            files_secret=self._files_secret,
            watch=supervision.watch(job),
            interrupt=supervision.interrupt,
            tick=supervision.tick,
            previous=previous,
            grow=supervision.grow,
        )


def ranks_by_member(
    job: Job | InferenceJob, members: list[MeshMember]
) -> dict[str, tuple[MeshMember, list[int]]]:
    """The ranks each member runs (the member hosting their stage), by member name."""
    by_name = {member.name: member for member in members}
    assignments: dict[str, tuple[MeshMember, list[int]]] = {}
    for rank in range(job.world_size):
        host = job.placement(rank).host
        assignments.setdefault(host, (by_name[host], []))[1].append(rank)
    return assignments


def new_job_id() -> str:
    """A unique, filesystem-safe job id nobody can guess ahead (128 random bits), so no one can
    take it first on a member the run reaches later."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(16)}"


def run_mesh_job(
    job: Job,
    job_id: str,
    ranks_by_member: dict[str, tuple[MeshMember, list[int]]],
    *,
    on_event: Callable[[dict[str, Any]], None],
    lost_after_s: float = LOST_AFTER_S,
    files_secret: str | None = None,
    watch: StallWatch | None = None,
    interrupt: Callable[[], bool] | None = None,
    tick: Callable[[], None] | None = None,
    previous: str | None = None,
    neighbour_grace_s: float = _NEIGHBOUR_GRACE_S,
    grow: Callable[[], GrowthOrder | None] | None = None,
) -> None:
    """Run every rank on its member until all finish; raise StageFailed/MemberLost on the first failure.

    ``files_secret`` is the launcher's file-server secret; each agent hands it to its stages.
    ``watch`` follows the stages' beats (a stage that stopped beating is a lost member);
    ``interrupt`` is asked after each event: True stops the job on purpose (:class:`Interrupted`).
    ``tick`` is called on every turn of the event loop (at least five times a second).
    ``previous`` is the job this one continues (after a lost or joined member): the local agent
    keeps it for ``shardpool jobs show``. ``grow`` is asked every turn for a growth order:
    the loop starts its joining ranks, and follows the grown job once the order says it grew.
    With a ``watch``, a stage error waits ``lost_after_s + neighbour_grace_s`` for a lost member
    behind it (a neighbour of a vanished member fails first).

    Each member's agent derives its stages' environment (threads from its own cores over the ranks
    it runs, the mesh interface for gloo and NCCL) itself; nothing but the job crosses.
    """
    ranks_by_member = dict(ranks_by_member)  # joining members are added to it
    follows = {name: Follow(member, ranks) for name, (member, ranks) in ranks_by_member.items()}
    events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
    stop = threading.Event()
    errors: dict[int, str] = {}
    last_step = job.resume_step
    failed_at: float | None = None
    started: list[str] = []
    lost: MemberLost | None = None
    order: GrowthOrder | None = None  # a growth in place under way, as ``grow`` last returned it
    try:
        payload = job.model_dump(mode="json")
        for name, (member, ranks) in ranks_by_member.items():
            member.agent.start_job(job_id, payload, ranks, files_secret=files_secret, previous=previous)
            started.append(name)
        threads = [
            threading.Thread(target=poll, args=(follow, job_id, events, stop, lost_after_s), daemon=True)
            for follow in follows.values()
        ]
        for thread in threads:
            thread.start()
        while True:
            try:
                name, event = events.get(timeout=0.2)
                kind = event.get("event")
                if kind == StageEvent.ERROR:
                    errors.setdefault(int(event.get("rank", -1)), str(event.get("message", "unknown error")))
                else:
                    if kind == StageEvent.STEP:
                        last_step = int(event["step"])
                        if watch is not None:
                            watch.on_step(event)
                    on_event(event)
            except queue.Empty:
                pass
            if tick is not None:
                tick()
            if order is not None and order.started and not order.grown and order.failed is None:
                joiner_failed = joiner_failure(order, follows, errors)
                if joiner_failed is not None:  # the running stages never depended on it: they go on
                    abandon_growth(order, joiner_failed, job_id, ranks_by_member, follows, started)
            failure = first_failure(job, follows, errors, last_step)
            if failure is None and watch is not None:
                failure = stall(job, follows, watch, last_step)
            if failure is not None and watch is not None and not isinstance(failure, MemberLost):
                # A lost member makes its neighbours fail too (a broken connection), often first:
                # wait up to the loss bound for the member behind it before calling it a stage error.
                failed_at = failed_at if failed_at is not None else time.monotonic()
                if time.monotonic() - failed_at <= lost_after_s + neighbour_grace_s:
                    failure = None
            if failure is not None:
                lost = failure if isinstance(failure, MemberLost) else None
                raise failure
            if interrupt is not None and interrupt():
                raise Interrupted(f"stopped after step {last_step} to re-plan")
            order = grow() if grow is not None else None
            if order is not None and not order.started and order.failed is None:
                start_joining(order, job_id, files_secret, previous, ranks_by_member, follows, started)
                for name in order.joined:
                    if name in started:
                        threading.Thread(
                            target=poll,
                            args=(follows[name], job_id, events, stop, lost_after_s),
                            daemon=True,
                        ).start()
            elif (
                order is not None
                and order.started
                and order.failed is None
                and not order.grown
                and only_joiners_run(order, follows)
            ):
                # the running ranks finished before they could grow: the joining ones have nothing to join
                reason = "the run finished before its stages could grow"
                abandon_growth(order, reason, job_id, ranks_by_member, follows, started)
            elif order is not None and order.grown and not order.applied:
                job, watch = order.job, order.watch
                for name, follow in follows.items():
                    if name not in order.joined:
                        follow.renumber = dict(order.renumber)
                        follow.ranks = [order.renumber[rank] for rank in follow.ranks]
                order.followed()
            if all(not follow.running for follow in follows.values()) and events.empty():
                return
    finally:
        stop.set()
        reachable = [name for name in started if follows[name].lost is None]
        answered = stop_everywhere([ranks_by_member[name][0] for name in reachable], job_id)
        if lost is not None and lost.agent_answered and lost.member not in answered:
            # found by its silent beat first, but its agent does not answer the stop either: the
            # machine went (a kill -9, a power cut), it did not just stall
            lost.agent_answered = False
