"""The coordinator's path planning step: observed endpoints and reports in, relay and instructions out.

Each sync step the coordinator reads its own WireGuard device (the endpoint it shows for a
member is that member's observed endpoint, the NAT mapping of its WireGuard socket), runs
:class:`mesh.control.paths.PathPlanner`, asks the relay (when one serves) for the allocations
the relayed pairs need, and publishes every member's instructions on the
:class:`mesh.control.board.PathBoard` that the roster service answers from.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Protocol

from mesh.addresses import parse_endpoint, resolve_endpoint
from mesh.control.board import PathBoard
from mesh.control.model import Roster
from mesh.control.paths import AllocationWant, PathPlanner, place_on_members
from mesh.control.report import MemberReport
from mesh.errors import MeshError
from mesh.relay.allocations import AllocationRequest
from mesh.relay.service import RelayService
from mesh.wireguard.backend import DeviceStatus

__all__ = [
    "CoordinatorPaths",
    "MemberRelay",
    "RelayPorts",
    "ServiceRelay",
    "bind_host",
    "member_relays",
    "start_relay",
]

log = logging.getLogger("shardpool.mesh.pathing")


class RelayPorts(Protocol):
    """What path planning needs from a relay: its host, and ports for the wanted allocations."""

    host: str

    def grant(self, wanted: list[AllocationWant]) -> dict[str, tuple[int, int]]:
        """Make the live allocations equal ``wanted``; return pair -> (port_a, port_b) of those granted."""


def bind_host(host: str) -> str:
    """``host`` when it is an address of this machine, else the wildcard (a port forward, or NAT in front)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind((host, 0))
    except OSError:
        return "0.0.0.0"
    return host


class ServiceRelay:
    """:class:`RelayPorts` over a started :class:`mesh.relay.service.RelayService`; ``host`` is the IP members send to."""

    def __init__(self, service: RelayService, host: str) -> None:
        self.service = service
        self.host = host

    def grant(self, wanted: list[AllocationWant]) -> dict[str, tuple[int, int]]:
        """Apply ``wanted`` to the relay; a relay that fails to answer grants nothing (logged).

        Pairs over its bounds are left out; the coordinator then places them on relaying members.
        """
        try:
            granted = self.service.apply([AllocationRequest(**asdict(want)) for want in wanted])
        except MeshError as error:
            log.error("relay: %s", error)
            return {}
        return {pair: (allocation.port_a, allocation.port_b) for pair, allocation in granted.items()}


def member_relays(roster: Roster, reports: Mapping[str, MemberReport]) -> dict[str, str]:
    """Members that relay: they report ``relay`` and have a roster endpoint; key -> the IP to send to."""
    found: dict[str, str] = {}
    for member in roster.members:
        report = reports.get(member.public_key)
        if member.coordinator or member.endpoint is None or report is None or not report.relay:
            continue
        try:
            found[member.public_key] = parse_endpoint(resolve_endpoint(member.endpoint))[0]
        except MeshError as error:
            log.warning("relay member %s: %s", member.name, error)
    return found


def start_relay(endpoint: str, ports: range) -> ServiceRelay | None:
    """Start a relay for the machine whose endpoint is ``endpoint``; ``None`` (logged) when it cannot resolve.

    It binds the endpoint host when that is an address of this machine (else every address),
    and members send to the endpoint's IP.
    """
    try:
        announced = parse_endpoint(resolve_endpoint(endpoint))[0]
    except MeshError as error:
        log.error("not relaying: %s", error)
        return None
    service = RelayService(bind_host(announced), ports)
    service.start()
    log.info("relaying member pairs on %s, UDP ports %d-%d", announced, ports[0], ports[-1])
    return ServiceRelay(service, announced)


class CoordinatorPaths:
    """Runs the planner once per coordinator sync step and publishes the result."""

    def __init__(
        self,
        board: PathBoard,
        sync_interval: float,
        relay: RelayPorts | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.board = board
        self.relay = relay
        self.clock = clock
        self.planner = PathPlanner(sync_interval=sync_interval)

    def step(self, roster: Roster, device: DeviceStatus) -> None:
        """Plan every member pair from ``device``'s observed endpoints and the members' reports.

        Relayed pairs go to this coordinator's relay first; those it does not take go to members
        that relay (``--relay``), which learn them from their roster reply and report the ports
        they opened in their next report.
        """
        observed = {peer.public_key: peer.endpoint for peer in device.peers}
        reports = self.board.reports(member.public_key for member in roster.members)
        before = self.modes()
        relaying = member_relays(roster, reports)
        offered = self.relay is not None or bool(relaying)
        wanted = self.planner.step(self.clock(), roster.members, observed, reports, offered)
        self._log_changes(roster, before)
        relays: dict[str, tuple[str, int, int]] = {}
        if self.relay is not None:
            for pair, (port_a, port_b) in self.relay.grant(wanted).items():
                relays[pair] = (self.relay.host, port_a, port_b)
        placed = place_on_members([want for want in wanted if want.pair not in relays], relaying)
        for relay_key, wants in placed.items():
            opened = reports[relay_key].relay_ports
            for want in wants:
                if want.pair in opened:
                    relays[want.pair] = (relaying[relay_key], *opened[want.pair])
        if len(relays) < len(wanted):
            log.warning("%d relayed pair(s) have no relay ports yet", len(wanted) - len(relays))
        requests = {
            key: [AllocationRequest(**asdict(want)) for want in wants] for key, wants in placed.items()
        }
        self.board.publish(self.planner.instructions(relays), requests)

    def _log_changes(self, roster: Roster, before: dict[str, str]) -> None:
        names = {member.public_key: member.name for member in roster.members}
        for pair, mode in self.modes().items():
            if before.get(pair) != mode:
                key_a, key_b = pair.split("|")
                log.info("path %s <-> %s: %s", names.get(key_a), names.get(key_b), mode)

    def modes(self) -> dict[str, str]:
        """Pair id -> mode, for the daemon's status file."""
        return {pair: state.mode for pair, state in self.planner.pairs.items()}


class MemberRelay:
    """The relay of a member started with ``--relay``: it serves the pairs its signed roster reply lists.

    The relay service starts with the first allocation; :attr:`opened` (pair -> ports) goes back
    to the coordinator in the member's next report.
    """

    def __init__(self, endpoint: str, ports: range) -> None:
        self.endpoint = endpoint
        self.ports = ports
        self.service: RelayService | None = None
        self.opened: dict[str, tuple[int, int]] = {}

    def serve(self, requests: list[AllocationRequest]) -> None:
        """Make the live allocations equal ``requests``; a failing relay serves nothing (logged)."""
        try:
            if self.service is None:
                relay = start_relay(self.endpoint, self.ports) if requests else None
                if relay is None:
                    return
                self.service = relay.service
            granted = self.service.apply(requests)
        except MeshError as error:
            log.error("relay: %s", error)
            self.opened = {}
            return
        self.opened = {pair: (allocation.port_a, allocation.port_b) for pair, allocation in granted.items()}

    def stop(self) -> None:
        """Close every relay port."""
        if self.service is not None:
            self.service.stop()
            self.service = None
