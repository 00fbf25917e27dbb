"""Following a mesh job's stages on their members: one poll per member, and what a failure means.

Each member's agent is long-polled for its stages' events (:func:`poll`, one thread per member);
:func:`first_failure` turns what the polls saw into the first failure (a lost member, or a stage's own
error), :func:`stall` a stage that stopped beating into a lost member. The helpers of a growth in
place start the joining ranks on their members and stop them again when the growth fails. Torch-free.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shardpool.agent.client import AgentRefused, AgentUnreachable
from shardpool.contract.events import parse_stage_event
from shardpool.contract.job import Job
from shardpool.contract.names import ContractError
from shardpool.launch.local_launcher import StageFailed
from shardpool.launch.mesh_members import MeshMember
from shardpool.launch.supervision import GrowthOrder, StallWatch

__all__ = [
    "Follow",
    "Interrupted",
    "MemberLost",
    "abandon_growth",
    "first_failure",
    "joiner_failure",
    "only_joiners_run",
    "poll",
    "stall",
    "start_joining",
    "stop_everywhere",
    "stop_quietly",
]

_POLL_WAIT_S = 1.0


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
class Follow:
    member: MeshMember
    ranks: list[int]
    seq: int = 0
    exited: dict[int, int] = field(default_factory=dict)
    running: bool = True
    lost: str | None = None
    #: The agent's rank numbers -> the job's, once the job grew in place and renumbered its ranks.
    renumber: dict[int, int] = field(default_factory=dict)


def joiner_failure(order: GrowthOrder, follows: dict[str, Follow], errors: dict[int, str]) -> str | None:
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


def abandon_growth(
    order: GrowthOrder,
    reason: str,
    job_id: str,
    ranks_by_member: dict[str, tuple[MeshMember, list[int]]],
    follows: dict[str, Follow],
    started: list[str],
) -> None:
    """Stop the joining ranks of ``order`` and forget them: the job goes on as it was."""
    for name in order.joined:
        if name in follows:
            stop_quietly(ranks_by_member.pop(name)[0], job_id, set())
            del follows[name]
            started.remove(name)
    order.abandon(reason)


def only_joiners_run(order: GrowthOrder, follows: dict[str, Follow]) -> bool:
    """Whether every member of the running job has finished while the joining ones wait."""
    return all(not follow.running for name, follow in follows.items() if name not in order.joined)


def start_joining(
    order: GrowthOrder,
    job_id: str,
    files_secret: str | None,
    previous: str | None,
    ranks_by_member: dict[str, tuple[MeshMember, list[int]]],
    follows: dict[str, Follow],
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
            abandon_growth(order, reason, job_id, ranks_by_member, follows, started)
            return
        started.append(name)
        ranks_by_member[name] = (member, ranks)
        follows[name] = Follow(member, ranks)
    order.joiners_started()


def stop_quietly(member: MeshMember, job_id: str, answered: set[str]) -> None:
    """Ask one agent to stop the job, noting in ``answered`` that it answered; a member that does
    not answer is already gone."""
    try:
        member.agent.stop_job(job_id, timeout=10.0)
    except AgentUnreachable:
        return
    except AgentRefused:
        pass
    answered.add(member.name)


def stop_everywhere(members: Sequence[MeshMember], job_id: str, *, timeout: float = 15.0) -> set[str]:
    """Ask every member's agent at once to stop the job; the names of those that answered (a
    member that does not answer within ``timeout`` is gone, and its agent, if any, stops the job
    itself once nobody polls it)."""
    answered: set[str] = set()
    stoppers = [
        threading.Thread(target=stop_quietly, args=(member, job_id, answered), daemon=True)
        for member in members
    ]
    for thread in stoppers:
        thread.start()
    for thread in stoppers:
        thread.join(timeout=timeout)
    return answered


def poll(
    follow: Follow,
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


def first_failure(
    job: Job, follows: dict[str, Follow], errors: dict[int, str], last_step: int
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


def stall(job: Job, follows: dict[str, Follow], watch: StallWatch, last_step: int) -> MemberLost | None:
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
