"""The mesh as a launcher sees it: the members online, their devices and the links between them.

The launcher speaks only to its own member's agent, over that agent's Unix socket: it lists the
members there and has every request to a member's agent forwarded (signed by the local agent,
which alone can read the WireGuard key). It asks each online member's agent for its devices
(profiled for this model) and for the links to the others, and plans the stages over them.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from shardpool.agent.client import AgentRefused, AgentUnreachable
from shardpool.agent.local_client import LocalAgentClient
from shardpool.config import Config
from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.device_facts import Measurement, nf4_probe_refusal
from shardpool.plan.fleet import Device, Fleet, LinkSpec
from shardpool.plan.planner import plan_pipeline
from shardpool.plan.precision import (
    DeviceFacts,
    NF4Choice,
    NF4Setting,
    choose_nf4_backend,
    parse_capability,
)
from shardpool.plan.result import Plan

__all__ = [
    "PROFILE_CONCURRENCY",
    "MemberAgent",
    "MeshMember",
    "launcher_member",
    "measure_links",
    "member_device",
    "member_nf4_choice",
    "mesh_fleet",
    "mesh_planner",
    "member_profiles",
    "online_members",
    "plans_with_and_without",
]


class MemberAgent(Protocol):
    """What the launcher asks of one member's agent (a ForwardedAgent in production)."""

    @property
    def url(self) -> str: ...
    def health(self) -> dict[str, Any]: ...
    def devices(
        self, model_config: dict[str, Any], workload: dict[str, Any], *, timeout: float = ...
    ) -> list[dict[str, Any]]: ...
    def probe(self, targets: dict[str, str], *, nbytes: int = ...) -> dict[str, dict[str, Any]]: ...
    def start_job(
        self,
        job_id: str,
        job: dict[str, Any],
        ranks: list[int],
        *,
        files_secret: str | None = ...,
        previous: str | None = ...,
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


def launcher_member(members: list[MeshMember]) -> MeshMember:
    """This machine among the online members; refused when its mesh interface is down."""
    me = next((member for member in members if member.is_self), None)
    if me is None:
        raise ShardpoolError("this machine's mesh interface is down; run `shardpool mesh up` first")
    return me


def mesh_planner(members: list[MeshMember], *, say: Callable[[str], None]) -> Callable[[Config], Plan]:
    """A planner that places a config's stages on the members' devices, profiled there for its model.

    With more stages asked for than devices online, it plans one stage per device.
    """

    def plan_on_mesh(config: Config) -> Plan:
        shape, workload, fleet = _measured(members, config, say=say)
        return _plan_on(shape, workload, fleet, say=say)

    return plan_on_mesh


def plans_with_and_without(
    members: list[MeshMember], config: Config, *, left_out: set[str], say: Callable[[str], None]
) -> tuple[Plan, Plan]:
    """Plans over all ``members`` and over those not named in ``left_out``, from ONE measurement of
    the fleet (the same device profiles and the same link probes).

    A join check compares the two: a plan made minutes earlier, from links probed then (they vary
    by tens of percent on a busy host), says little about what a member that came back adds.
    """
    shape, workload, fleet = _measured(members, config, say=say)
    kept = replace(
        fleet,
        devices=tuple(device for device in fleet.devices if device.host not in left_out),
        links={pair: link for pair, link in fleet.links.items() if not pair & left_out},
    )
    # "only N devices online" is the point of the plan without them: not a note for the user
    return _plan_on(shape, workload, fleet, say=say), _plan_on(shape, workload, kept, say=lambda line: None)


def _measured(
    members: list[MeshMember], config: Config, *, say: Callable[[str], None]
) -> tuple[ModelShape, Workload, Fleet]:
    """A config's model shape and workload, and the members' fleet measured for them."""
    model_config = json.loads((Path(config.base_model) / "config.json").read_text(encoding="utf-8"))
    shape, workload = ModelShape.from_config_dir(config.base_model), Workload.from_config(config)
    return shape, workload, mesh_fleet(members, model_config=model_config, workload=workload, say=say)


def _plan_on(shape: ModelShape, workload: Workload, fleet: Fleet, *, say: Callable[[str], None]) -> Plan:
    """The plan of ``workload`` on ``fleet``: one stage per device when more stages are asked for."""
    if workload.stages is not None and workload.stages > len(fleet.devices):
        say(f"only {len(fleet.devices)} devices online: planning {len(fleet.devices)} stages")
        workload = replace(workload, stages=len(fleet.devices))
    return plan_pipeline(shape, workload, fleet)


def mesh_fleet(
    members: list[MeshMember], *, model_config: dict[str, Any], workload: Workload, say: Callable[[str], None]
) -> Fleet:
    """Devices of every member whose agent answers, profiled there, and the measured links between them.

    The members profile at once (:func:`member_profiles`); their devices keep the members' order.
    A device whose 4-bit probe failed there computes its NF4 layers as :func:`member_nf4_choice`
    says (said once here), or is left out with one line.
    """
    devices: list[Device] = []
    answering: list[MeshMember] = []
    for member, reported in zip(members, member_profiles(members, model_config, workload), strict=True):
        if isinstance(reported, (AgentUnreachable, AgentRefused)):
            say(f"skipping member {member.name!r}: {reported}")
            continue
        answering.append(member)
        for info in reported:
            nf4 = member_nf4_choice(member.name, info, workload)
            if nf4 is not None:
                say(nf4.reason)
                if nf4.backend is None:
                    continue
            device = member_device(member.name, info)
            if nf4 is not None:
                device = replace(device, nf4_backend=nf4.backend, nf4_reason=nf4.reason)
            devices.append(device)
    if not devices:
        raise ShardpoolError(
            "no mesh member's agent answered; start `shardpool agent` on the members (see docs/agent.md)"
        )
    return Fleet(devices=tuple(devices), links=measure_links(answering, say=say))


#: Members whose agents profile at the same time. Each profiles on its own machine, so planning
#: waits for the slowest member rather than for the sum of them, and each member is measured while
#: the others are busy too, as its stage will train. Each request holds one of the local agent's
#: handler threads for as long as its profile takes, hence the bound.
PROFILE_CONCURRENCY = 4


def member_profiles(
    members: Sequence[MeshMember], model_config: dict[str, Any], workload: Workload
) -> list[list[dict[str, Any]] | AgentUnreachable | AgentRefused]:
    """Each member's device rows for this model (``POST /v1/devices``), or the error that skips it,
    in the members' order; up to :data:`PROFILE_CONCURRENCY` members are asked at once.

    Any other error is raised here, the first member's first. The requests run in daemon threads,
    so a launcher stopped while members profile (Ctrl-C) exits without waiting for their answers.
    """
    request = workload.profile_request()
    answers: list[Any] = [None] * len(members)
    slots = threading.BoundedSemaphore(PROFILE_CONCURRENCY)

    def ask(index: int, member: MeshMember) -> None:
        with slots:
            try:
                # A member that went away in the last minutes still counts as online (its last
                # WireGuard handshake is recent); a quick health call finds it in seconds, where the
                # profile request would wait for TCP to give up on it (about two minutes).
                member.agent.health()
                answers[index] = member.agent.devices(model_config, request)
            except BaseException as error:  # handed to the caller's thread below
                answers[index] = error

    threads = [
        threading.Thread(target=ask, args=(index, member), name=f"profile-{member.name}", daemon=True)
        for index, member in enumerate(members)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for answer in answers:
        if isinstance(answer, BaseException) and not isinstance(answer, (AgentUnreachable, AgentRefused)):
            raise answer
    return answers


def member_nf4_choice(member: str, info: dict[str, Any], workload: Workload) -> NF4Choice | None:
    """How a member's device whose bitsandbytes 4-bit probe failed there (its row's ``nf4_error``)
    computes with NF4 weights, and why in one line; None where there is nothing to choose here (a
    probe that passed, where the planner chooses from the compute capability, or an unquantized base).

    A row with a profile was measured in plain PyTorch (``plan.report``): under ``auto`` or ``torch``
    the device computes there; under ``bitsandbytes`` it is refused. A row without one (the member's
    torch cannot run the device) is refused whatever the workload. A refusal's reason is the line
    that says the device gets no layers. The choice holds wherever the planner places the device,
    so a per-stage ``shardpool.nf4_backend`` list is judged as ``auto``, or as ``bitsandbytes`` where
    it forces that on some stage (the device could otherwise take that stage in PyTorch).
    """
    error = info.get("nf4_error")
    if error is None:
        return None
    refusal = nf4_probe_refusal(
        f"{member}/{info['name']}", info["label"], info.get("compute_capability"), error
    )
    if "seconds_per_layer" not in info:
        return NF4Choice(None, refusal)
    if not workload.quantize:
        return None
    settings = workload.nf4_backend
    setting: NF4Setting = settings if not isinstance(settings, tuple) else _list_setting(settings)
    kind = str(info["kind"])
    facts = DeviceFacts(
        kind=kind,
        name=f"{member}/{info['name']}, {info['label']}",  # the reason names the card too
        capability=_capability(info) if kind == "cuda" else None,
        bf16=info["bf16"] if isinstance(info.get("bf16"), bool) else None,
    )
    choice = choose_nf4_backend(setting, facts, nf4_error=error)
    return choice if choice.backend is not None else NF4Choice(None, refusal)


def _list_setting(settings: tuple[NF4Setting, ...]) -> NF4Setting:
    """The one setting a device with a fixed NF4 backend is judged under for a per-stage list."""
    return "bitsandbytes" if "bitsandbytes" in settings else "auto"


def member_device(member: str, info: dict[str, Any]) -> Device:
    """A planner device from one row of a member's ``/v1/devices`` (checked by its agent).

    The measured forward, embedding, ``lm_head`` + loss and optimizer times are used where the row
    has them; a row from an older agent lacks them, and the planner models them instead.
    """
    kind = str(info["kind"])
    seconds_per_layer = float(info["seconds_per_layer"])
    return Device(
        name=f"{member}/{info['name']}",
        memory_bytes=int(info["free_bytes"]),
        host=member,
        seconds_per_layer=seconds_per_layer,
        kind=kind,
        torch_device=str(info["name"]),
        activation_bytes_per_layer=info.get("activation_bytes"),
        forward_seconds_per_layer=_number(info, "forward_seconds"),
        embed_seconds=_number(info, "embed_seconds"),
        head_forward_seconds=_number(info, "head_forward_seconds"),
        head_backward_seconds=_number(info, "head_backward_seconds"),
        optimizer_seconds_per_layer=_number(info, "optimizer_seconds"),
        compute_capability=_capability(info),
        bf16=info["bf16"] if isinstance(info.get("bf16"), bool) else None,
        measurement=Measurement(
            label=str(info["label"]),
            threads=int(info["threads"]) if kind == "cpu" else None,
            cpu_quota=_number(info, "cpu_quota"),
            runs=None if info.get("runs") is None else int(info["runs"]),
            seconds_min=_number(info, "seconds_min"),
            seconds_median=seconds_per_layer,
            seconds_max=_number(info, "seconds_max"),
            ci95_rel=_number(info, "ci95_rel"),
        ),
    )


def _number(info: dict[str, Any], name: str) -> float | None:
    """An optional number of a device row (None where the member's agent did not report it)."""
    value = info.get(name)
    return None if value is None else float(value)


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


def _capability(info: dict[str, Any]) -> tuple[int, int] | None:
    """A row's compute capability (agents from before it was reported send none)."""
    try:
        return parse_capability(info.get("compute_capability"))
    except ShardpoolError:
        return None
