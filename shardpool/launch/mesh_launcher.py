"""Run a job's stage processes on mesh members through their agents, and stop them all on failure.

:class:`MeshLauncher` is the launcher of a ``placement: mesh`` run: it finds the members
(:mod:`shardpool.launch.mesh_members`), plans over their devices, serves the run's inputs from a
file server on this member's mesh address, and starts each member's ranks with one
``POST /v1/jobs`` through this machine's agent, then follows them by long-polling their events.
The polls double as the launcher's heartbeat: an agent that stops hearing from the launcher stops
its stages. A member whose agent stops answering for ``lost_after_s`` seconds, or whose stage
exits non-zero, ends the run: every other member's stages are stopped and the error names the
member and the step. A member whose agent went silent, whose stage was killed by a signal or
(with a :class:`~shardpool.launch.beats.BeatWatch`) stopped beating is :class:`MemberLost`, which
a supervised run survives (:mod:`shardpool.launch.supervise`); a stage's own error is not.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardpool.agent.client import AgentRefused, AgentUnreachable
from shardpool.agent.local_client import LocalAgentClient, agent_socket_path
from shardpool.config import Config
from shardpool.contract.events import StageEvent, parse_stage_event
from shardpool.contract.job import Job
from shardpool.contract.names import ContractError
from shardpool.files.server import FileServer
from shardpool.launch.beats import BeatWatch
from shardpool.launch.local_launcher import StageFailed
from shardpool.launch.mesh_members import (
    MeshMember,
    launcher_member,
    mesh_planner,
    online_members,
    plans_with_and_without,
)
from shardpool.plan.result import Plan

__all__ = [
    "GrowOrder",
    "Interrupted",
    "MemberLost",
    "MeshLauncher",
    "new_job_id",
    "ranks_by_member",
    "run_mesh_job",
]

LOST_AFTER_S = 10.0
_POLL_WAIT_S = 1.0
_NEIGHBOUR_GRACE_S = 15.0  # a forwarded poll of a vanished member takes up to ~11 s to fail


class MemberLost(StageFailed):
    """A member was lost mid-run: its agent stopped answering, its stage was killed by a signal or
    stopped beating. ``member`` names it and ``step`` is the last step the launcher saw completed;
    ``agent_answered`` says its agent was still there (a stall or a killed stage, not a machine gone),
    so it looks healthy again as soon as its stage is stopped."""

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        stage: int,
        member: str = "",
        step: int = 0,
        agent_answered: bool = False,
    ) -> None:
        super().__init__(message, rank=rank, stage=stage)
        self.member = member
        self.step = step
        self.agent_answered = agent_answered


class Interrupted(Exception):  # noqa: N818 - not an error: the launcher asked for it
    """The launcher stopped the job on purpose (a member joined and the run re-plans with it)."""


@dataclass
class GrowOrder:
    """A job growing in place (:mod:`shardpool.contract.grow`), between the supervisor and the event loop.

    ``job`` is the grown job (its new ranks start it ``joining``), ``joined`` the ranks to start on
    each joining member, ``renumber`` each running rank's rank in it. The event loop starts the
    joining ranks (``started``, or ``failed`` with why); the supervisor sets ``grown`` and
    ``watch`` once the stages moved; the loop then follows the grown job (``applied``).
    """

    job: Job
    joined: dict[str, tuple[MeshMember, list[int]]]
    renumber: dict[int, int]
    started: bool = False
    failed: str | None = None
    grown: bool = False
    watch: BeatWatch | None = None
    applied: bool = False


class MeshLauncher:
    """Stages on mesh members, started through this machine's agent; inputs served by a file server."""

    port = 0  # the rendezvous store takes any free port on the mesh address

    def __init__(
        self,
        members: list[MeshMember],
        *,
        say: Callable[[str], None],
        files_secret: str | None = None,
    ) -> None:
        self.members = members
        self.address = launcher_member(members).address
        self._planner = mesh_planner(members, say=say)
        self._say = say
        self._files_secret = files_secret or secrets.token_hex(32)
        #: Set by the launcher's supervisor: the stall watch, the agent-silence bound, a check
        #: that asks for the job to stop on purpose (a joined member), and what to do on every
        #: turn of the event loop (release the steps whose copies are complete), each attempt.
        self.watch: Callable[[Job], BeatWatch | None] | None = None
        self.lost_after_s: float = LOST_AFTER_S
        self.interrupt: Callable[[], bool] | None = None
        self.tick: Callable[[], None] | None = None
        #: Asked on every turn of the event loop: a growth in place to carry out (the supervisor's).
        self.grow: Callable[[], GrowOrder | None] | None = None
        self.job_id: str | None = None
        self.previous_job_ids: list[str] = []
        #: The members online now, as this machine's agent lists them (None: not known here).
        self.list_members: Callable[[], list[MeshMember]] | None = None

    def over(self, members: list[MeshMember], *, say: Callable[[str], None]) -> MeshLauncher:
        """The next attempt's launcher over ``members`` (a lost one left out, or joined ones added),
        keeping this one's hooks and file secret and its job ids as the run's history."""
        successor = type(self)(members, say=say, files_secret=self._files_secret)
        successor.watch, successor.interrupt, successor.tick = self.watch, self.interrupt, self.tick
        successor.grow = self.grow
        successor.lost_after_s, successor.list_members = self.lost_after_s, self.list_members
        successor.previous_job_ids = [*self.previous_job_ids, *([self.job_id] if self.job_id else [])]
        return successor

    @classmethod
    def connect(cls, *, say: Callable[[str], None], agent_socket: str | None = None) -> MeshLauncher:
        """Ask this machine's agent for the members online (a user it refuses stops here, with the fix).

        ``agent_socket`` is the agent's socket (default: :func:`agent_socket_path`).
        """
        local = LocalAgentClient(agent_socket_path(agent_socket))
        members = online_members(local)
        launcher = cls(members, say=say)
        launcher.list_members = lambda: online_members(local)
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
        run_mesh_job(
            job,
            self.job_id,
            ranks,
            on_event=on_event,
            lost_after_s=self.lost_after_s,
            files_secret=self._files_secret,
            watch=self.watch(job) if self.watch is not None else None,
            interrupt=self.interrupt,
            tick=self.tick,
            previous=self.previous_job_ids[-1] if self.previous_job_ids else None,
            grow=self.grow,
        )


def ranks_by_member(job: Job, members: list[MeshMember]) -> dict[str, tuple[MeshMember, list[int]]]:
    """The ranks each member runs (the member hosting their stage), by member name."""
    by_name = {member.name: member for member in members}
    assignments: dict[str, tuple[MeshMember, list[int]]] = {}
    for rank in range(job.world_size):
        host = job.placement(rank).host
        assignments.setdefault(host, (by_name[host], []))[1].append(rank)
    return assignments


def new_job_id() -> str:
    """A unique, filesystem-safe job id."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"


@dataclass
class _Follow:
    member: MeshMember
    ranks: list[int]
    seq: int = 0
    exited: dict[int, int] = field(default_factory=dict)
    running: bool = True
    lost: str | None = None
    #: The agent's rank numbers -> the job's, once the job grew in place and renumbered its ranks.
    renumber: dict[int, int] = field(default_factory=dict)


def run_mesh_job(
    job: Job,
    job_id: str,
    ranks_by_member: dict[str, tuple[MeshMember, list[int]]],
    *,
    on_event: Callable[[dict[str, Any]], None],
    lost_after_s: float = LOST_AFTER_S,
    files_secret: str | None = None,
    watch: BeatWatch | None = None,
    interrupt: Callable[[], bool] | None = None,
    tick: Callable[[], None] | None = None,
    previous: str | None = None,
    neighbour_grace_s: float = _NEIGHBOUR_GRACE_S,
    grow: Callable[[], GrowOrder | None] | None = None,
) -> None:
    """Run every rank on its member until all finish; raise StageFailed/MemberLost on the first failure.

    ``files_secret`` is the launcher's file-server secret; each agent hands it to its stages.
    ``watch`` follows the stages' beats (a stage that stopped beating is a lost member);
    ``interrupt`` is asked after each event: True stops the job on purpose (:class:`Interrupted`).
    ``tick`` is called on every turn of the event loop (at least five times a second).
    ``previous`` is the job this one continues (after a lost or joined member): the local agent
    keeps it for ``shardpool jobs show``. ``grow`` is asked every turn for a :class:`GrowOrder`:
    the loop starts its joining ranks, and follows the grown job once the order says it grew.
    With a ``watch``, a stage error waits ``lost_after_s + neighbour_grace_s`` for a lost member
    behind it (a neighbour of a vanished member fails first).

    Each member's agent derives its stages' environment (threads from its own cores over the ranks
    it runs, the mesh interface for gloo and NCCL) itself; nothing but the job crosses.
    """
    ranks_by_member = dict(ranks_by_member)  # joining members are added to it
    follows = {name: _Follow(member, ranks) for name, (member, ranks) in ranks_by_member.items()}
    events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
    stop = threading.Event()
    errors: dict[int, str] = {}
    last_step = job.resume_step
    failed_at: float | None = None
    started: list[str] = []
    lost: MemberLost | None = None
    order: GrowOrder | None = None  # a growth in place under way, as ``grow`` last returned it
    try:
        payload = job.model_dump(mode="json")
        for name, (member, ranks) in ranks_by_member.items():
            member.agent.start_job(job_id, payload, ranks, files_secret=files_secret, previous=previous)
            started.append(name)
        threads = [
            threading.Thread(target=_poll, args=(follow, job_id, events, stop, lost_after_s), daemon=True)
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
                joiner_failed = _joiner_failure(order, follows, errors)
                if joiner_failed is not None:  # the running stages never depended on it: they go on
                    _abandon_growth(order, joiner_failed, job_id, ranks_by_member, follows, started)
            failure = _failure(job, follows, errors, last_step)
            if failure is None and watch is not None:
                failure = _stall(job, follows, watch, last_step)
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
                _start_joining(order, job_id, files_secret, previous, ranks_by_member, follows, started)
                for name in order.joined:
                    if name in started:
                        threading.Thread(
                            target=_poll,
                            args=(follows[name], job_id, events, stop, lost_after_s),
                            daemon=True,
                        ).start()
            elif (
                order is not None
                and order.started
                and order.failed is None
                and not order.grown
                and _only_joiners_run(order, follows)
            ):
                # the running ranks finished before they could grow: the joining ones have nothing to join
                reason = "the run finished before its stages could grow"
                _abandon_growth(order, reason, job_id, ranks_by_member, follows, started)
            elif order is not None and order.grown and not order.applied:
                job, watch = order.job, order.watch
                for name, follow in follows.items():
                    if name not in order.joined:
                        follow.renumber = dict(order.renumber)
                        follow.ranks = [order.renumber[rank] for rank in follow.ranks]
                order.applied = True
            if all(not follow.running for follow in follows.values()) and events.empty():
                return
    finally:
        stop.set()
        reachable = [name for name in started if follows[name].lost is None]
        answered: set[str] = set()
        stoppers = [
            threading.Thread(
                target=_stop_quietly, args=(ranks_by_member[name][0], job_id, answered), daemon=True
            )
            for name in reachable
        ]
        for thread in stoppers:
            thread.start()
        for thread in stoppers:
            thread.join(timeout=15.0)
        if lost is not None and lost.agent_answered and lost.member not in answered:
            # found by its silent beat first, but its agent does not answer the stop either: the
            # machine went (a kill -9, a power cut), it did not just stall
            lost.agent_answered = False


def _joiner_failure(order: GrowOrder, follows: dict[str, _Follow], errors: dict[int, str]) -> str | None:
    """Why a joining member's rank failed before the job grew (lost, or exited), or None."""
    for name in order.joined:
        follow = follows.get(name)
        if follow is None:
            continue
        if follow.lost is not None:
            return f"member {name!r} was lost while joining: {follow.lost}"
        for rank, code in follow.exited.items():
            if code != 0:
                return f"member {name!r}'s joining stage (rank {rank}) failed: {_exit_reason(rank, code, errors)}"
    return None


def _exit_reason(rank: int, code: int, errors: dict[int, str]) -> str:
    """Why a stage exited with non-zero ``code``: the signal, its reported error, or the status."""
    return f"killed by signal {-code}" if code < 0 else errors.get(rank, f"exited with status {code}")


def _abandon_growth(
    order: GrowOrder,
    reason: str,
    job_id: str,
    ranks_by_member: dict[str, tuple[MeshMember, list[int]]],
    follows: dict[str, _Follow],
    started: list[str],
) -> None:
    """Stop the joining ranks of ``order`` and forget them: the job goes on as it was."""
    for name in order.joined:
        if name in follows:
            _stop_quietly(ranks_by_member.pop(name)[0], job_id, set())
            del follows[name]
            started.remove(name)
    order.failed = reason


def _only_joiners_run(order: GrowOrder, follows: dict[str, _Follow]) -> bool:
    """Whether every member of the running job has finished while the joining ones wait."""
    return all(not follow.running for name, follow in follows.items() if name not in order.joined)


def _start_joining(
    order: GrowOrder,
    job_id: str,
    files_secret: str | None,
    previous: str | None,
    ranks_by_member: dict[str, tuple[MeshMember, list[int]]],
    follows: dict[str, _Follow],
    started: list[str],
) -> None:
    """Start the joining ranks of ``order`` on their members, under the running job's id; a
    member that refuses or does not answer fails the order (the run goes on as it is)."""
    payload = order.job.model_dump(mode="json")
    for name, (member, ranks) in order.joined.items():
        try:
            member.agent.start_job(job_id, payload, ranks, files_secret=files_secret, previous=previous)
        except (AgentRefused, AgentUnreachable) as error:  # those already started are stopped
            reason = f"member {name!r} did not start its stages: {error}"
            _abandon_growth(order, reason, job_id, ranks_by_member, follows, started)
            return
        started.append(name)
        ranks_by_member[name] = (member, ranks)
        follows[name] = _Follow(member, ranks)
    order.started = True


def _stop_quietly(member: MeshMember, job_id: str, answered: set[str]) -> None:
    """Ask one agent to stop the job, noting in ``answered`` that it answered; a member that does
    not answer is already gone."""
    try:
        member.agent.stop_job(job_id, timeout=10.0)
    except AgentUnreachable:
        return
    except AgentRefused:
        pass
    answered.add(member.name)


def _poll(
    follow: _Follow,
    job_id: str,
    events: queue.Queue[tuple[str, dict[str, Any]]],
    stop: threading.Event,
    lost_after_s: float,
) -> None:
    last_answer = time.monotonic()
    while not stop.is_set() and follow.running:
        try:
            reply = follow.member.agent.events(job_id, after=follow.seq, wait=_POLL_WAIT_S)
        except AgentUnreachable as error:
            silent = time.monotonic() - last_answer
            if silent > lost_after_s:
                follow.lost = f"its agent stopped answering for {silent:.0f} s ({error})"
                return
            time.sleep(0.5)
            continue
        except AgentRefused as error:
            follow.lost = str(error)
            return
        last_answer = time.monotonic()
        for item in reply.get("events", []):
            follow.seq = max(follow.seq, int(item["seq"]))
            try:
                event = parse_stage_event(item["event"]).model_dump(mode="json")
            except ContractError as error:
                follow.lost = f"it relayed an event that breaks the contract ({error})"
                return
            event.setdefault("rank", item.get("rank"))
            events.put((follow.member.name, event))
        follow.exited = {
            follow.renumber.get(int(rank), int(rank)): int(code)
            for rank, code in reply.get("exited", {}).items()
        }
        follow.running = bool(reply.get("running", True))


def _failure(
    job: Job, follows: dict[str, _Follow], errors: dict[int, str], last_step: int
) -> StageFailed | None:
    for name, follow in follows.items():
        if follow.lost is not None:
            stage = job.stage_index(follow.ranks[0])
            return MemberLost(
                f"member {name!r} was lost at step {last_step}: {follow.lost}",
                rank=follow.ranks[0],
                stage=stage,
                member=name,
                step=last_step,
            )
    failed = [
        (name, rank, code)
        for name, follow in follows.items()
        for rank, code in follow.exited.items()
        if code != 0
    ]
    if not failed:
        return None
    killed = [item for item in failed if item[2] < 0]
    reporting = [item for item in failed if item[1] in errors]
    name, rank, code = (killed or reporting or failed)[0]
    stage = job.stage_index(rank)
    message = _exit_reason(rank, code, errors)
    text = f"stage {stage} (rank {rank}) on member {name!r} failed at step {last_step}: {message}"
    if code < 0:
        return MemberLost(text, rank=rank, stage=stage, member=name, step=last_step, agent_answered=True)
    return StageFailed(text, rank=rank, stage=stage)


def _stall(job: Job, follows: dict[str, _Follow], watch: BeatWatch, last_step: int) -> MemberLost | None:
    """A member whose stage stopped beating, as a lost member; None while every stage beats."""
    finished = [rank for follow in follows.values() for rank in follow.exited]
    stalled = watch.stalled(finished)
    if stalled is None:
        return None
    name, reason = stalled
    rank = follows[name].ranks[0]
    return MemberLost(
        f"member {name!r} was lost at step {last_step}: {reason}",
        rank=rank,
        stage=job.stage_index(rank),
        member=name,
        step=last_step,
        agent_answered=True,
    )
