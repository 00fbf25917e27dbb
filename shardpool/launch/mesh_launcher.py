"""Run a job's stage processes on mesh members through their agents, and stop them all on failure.

The launcher speaks only to its own member's agent, over that agent's Unix socket: it lists the
members there and has every request to a member's agent forwarded (signed by the local agent,
which alone can read the WireGuard key). It asks each online member's agent for its devices
(profiled for this model), plans over them, then starts each member's ranks with one ``POST /v1/jobs`` and follows them by
long-polling their events. The polls double as the launcher's heartbeat: an agent that stops
hearing from the launcher stops its stages. A member whose agent stops answering for
``lost_after_s`` seconds, or whose stage exits non-zero, ends the run: every other member's
stages are stopped and the error names the member and the step.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from shardpool.agent.client import AgentRefused, AgentUnreachable
from shardpool.agent.local_client import LocalAgentClient
from shardpool.contract.events import StageEvent, parse_stage_event
from shardpool.contract.job import Job
from shardpool.contract.names import ContractError
from shardpool.errors import ShardpoolError
from shardpool.launch.local_launcher import StageFailed
from shardpool.plan.costmodel import Workload
from shardpool.plan.fleet import Device, Fleet, LinkSpec

__all__ = [
    "MemberAgent",
    "MeshMember",
    "online_members",
    "mesh_fleet",
    "measure_links",
    "run_mesh_job",
    "new_job_id",
    "MemberLost",
]

LOST_AFTER_S = 10.0
_POLL_WAIT_S = 1.0


class MemberLost(StageFailed):
    """A member stopped answering mid-run."""


class MemberAgent(Protocol):
    """What the launcher asks of one member's agent (a ForwardedAgent in production)."""

    @property
    def url(self) -> str: ...
    def devices(
        self, model_config: dict[str, Any], workload: dict[str, Any], *, timeout: float = ...
    ) -> list[dict[str, Any]]: ...
    def probe(self, targets: dict[str, str], *, nbytes: int = ...) -> dict[str, dict[str, Any]]: ...
    def start_job(
        self, job_id: str, job: dict[str, Any], ranks: list[int], *, files_secret: str | None = ...
    ) -> dict[str, Any]: ...
    def events(self, job_id: str, *, after: int, wait: float = ...) -> dict[str, Any]: ...
    def stop_job(self, job_id: str, *, timeout: float = ...) -> dict[str, Any]: ...


@dataclass(frozen=True)
class MeshMember:
    """An online mesh member and the client of its agent."""

    name: str
    address: str
    is_self: bool
    agent: MemberAgent


def online_members(local: LocalAgentClient | None = None) -> list[MeshMember]:
    """The members that answer over the mesh now (this machine included), as the local agent sees them.

    The first call of a launch: a user outside the launch group is refused here, with the fix,
    before anything is prepared or started anywhere.
    """
    local = local or LocalAgentClient()
    return [
        MeshMember(member.name, member.address, member.is_self, local.member(member.name, member.address))
        for member in local.members()
        if member.online
    ]


def mesh_fleet(
    members: list[MeshMember], *, model_config: dict[str, Any], workload: Workload, say: Callable[[str], None]
) -> Fleet:
    """Devices of every member whose agent answers, profiled there, and the measured links between them."""
    devices: list[Device] = []
    answering: list[MeshMember] = []
    for member in members:
        try:
            reported = member.agent.devices(model_config, asdict(workload))
        except (AgentUnreachable, AgentRefused) as error:
            say(f"skipping member {member.name!r}: {error}")
            continue
        answering.append(member)
        for info in reported:
            devices.append(
                Device(
                    name=f"{member.name}/{info['name']}",
                    memory_bytes=int(info["free_bytes"]),
                    host=member.name,
                    seconds_per_layer=float(info["seconds_per_layer"]),
                    kind=str(info["kind"]),
                    torch_device=str(info["name"]),
                    activation_bytes_per_layer=info.get("activation_bytes"),
                )
            )
    if not devices:
        raise ShardpoolError(
            "no mesh member's agent answered; start `shardpool agent` on the members (see docs/agent.md)"
        )
    return Fleet(devices=tuple(devices), links=measure_links(answering, say=say))


def measure_links(members: list[MeshMember], *, say: Callable[[str], None]) -> dict[frozenset[str], LinkSpec]:
    """Latency and bandwidth between every pair of members, each measured by one end's agent.

    A pair whose probe fails keeps the planner's default link (1 Gbit/s, 1 ms).
    """
    links: dict[frozenset[str], LinkSpec] = {}
    for index, member in enumerate(members):
        targets = {other.name: other.agent.url for other in members[index + 1 :]}
        if not targets:
            continue
        try:
            measured = member.agent.probe(targets)
        except (AgentUnreachable, AgentRefused) as error:
            say(f"could not measure links from {member.name!r}: {error}")
            continue
        for name, result in measured.items():
            if "error" in result:
                say(f"link {member.name} - {name}: {result['error']}")
                continue
            links[frozenset((member.name, name))] = LinkSpec(
                bandwidth=float(result["bandwidth"]), latency=float(result["latency"])
            )
    for pair, link in sorted(links.items(), key=lambda item: sorted(item[0])):
        say(
            f"link {' - '.join(sorted(pair))}: {link.bandwidth * 8 / 1e9:.2f} Gbit/s, {link.latency * 1e3:.2f} ms"
        )
    return links


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


def run_mesh_job(
    job: Job,
    job_id: str,
    ranks_by_member: dict[str, tuple[MeshMember, list[int]]],
    *,
    on_event: Callable[[dict[str, Any]], None],
    lost_after_s: float = LOST_AFTER_S,
    files_secret: str | None = None,
) -> None:
    """Run every rank on its member until all finish; raise StageFailed/MemberLost on the first failure.

    ``files_secret`` is the launcher's file-server secret; each agent hands it to its stages.

    Each member's agent derives its stages' environment (threads from its own cores over the ranks
    it runs, the mesh interface for gloo and NCCL) itself; nothing but the job crosses.
    """
    follows = {name: _Follow(member, ranks) for name, (member, ranks) in ranks_by_member.items()}
    events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
    stop = threading.Event()
    errors: dict[int, str] = {}
    last_step = job.resume_step
    started: list[str] = []
    try:
        payload = job.model_dump(mode="json")
        for name, (member, ranks) in ranks_by_member.items():
            member.agent.start_job(job_id, payload, ranks, files_secret=files_secret)
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
                    on_event(event)
            except queue.Empty:
                pass
            failure = _failure(job, follows, errors, last_step)
            if failure is not None:
                raise failure
            if all(not follow.running for follow in follows.values()) and events.empty():
                return
    finally:
        stop.set()
        reachable = [name for name in started if follows[name].lost is None]
        stoppers = [
            threading.Thread(target=_stop_quietly, args=(ranks_by_member[name][0], job_id), daemon=True)
            for name in reachable
        ]
        for thread in stoppers:
            thread.start()
        for thread in stoppers:
            thread.join(timeout=15.0)


def _stop_quietly(member: MeshMember, job_id: str) -> None:
    """Ask one agent to stop the job; a member that does not answer is already gone."""
    try:
        member.agent.stop_job(job_id, timeout=10.0)
    except (AgentUnreachable, AgentRefused):
        pass


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
        follow.exited = {int(rank): int(code) for rank, code in reply.get("exited", {}).items()}
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
    message = f"killed by signal {-code}" if code < 0 else errors.get(rank, f"exited with status {code}")
    failure = MemberLost if code < 0 else StageFailed
    return failure(
        f"stage {stage} (rank {rank}) on member {name!r} failed at step {last_step}: {message}",
        rank=rank,
        stage=stage,
    )
