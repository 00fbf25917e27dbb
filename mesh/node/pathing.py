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
from collections.abc import Callable
from dataclasses import asdict
from typing import Protocol

from mesh.control.board import PathBoard
from mesh.control.model import Roster
from mesh.control.paths import AllocationWant, PathPlanner
from mesh.errors import MeshError
from mesh.relay.allocations import AllocationRequest
from mesh.relay.service import RelayService
from mesh.wireguard.backend import DeviceStatus

__all__ = ["CoordinatorPaths", "RelayPorts", "ServiceRelay", "bind_host"]

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
        """Apply ``wanted`` to the relay; a relay that fails to answer grants nothing (logged)."""
        try:
            granted = self.service.apply([AllocationRequest(**asdict(want)) for want in wanted])
        except MeshError as error:
            log.error("relay: %s", error)
            return {}
        return {pair: (allocation.port_a, allocation.port_b) for pair, allocation in granted.items()}


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
        """Plan every member pair from ``device``'s observed endpoints and the members' reports."""
        observed = {peer.public_key: peer.endpoint for peer in device.peers}
        reports = self.board.reports(member.public_key for member in roster.members)
        before = self.modes()
        wanted = self.planner.step(self.clock(), roster.members, observed, reports, self.relay is not None)
        names = {member.public_key: member.name for member in roster.members}
        for pair, mode in self.modes().items():
            if before.get(pair) != mode:
                key_a, key_b = pair.split("|")
                log.info("path %s <-> %s: %s", names.get(key_a), names.get(key_b), mode)
        granted: dict[str, tuple[int, int]] = {}
        if self.relay is not None:
            granted = self.relay.grant(wanted)
            if len(granted) < len(wanted):
                log.warning("the relay granted %d of %d wanted allocations", len(granted), len(wanted))
        self.board.publish(self.planner.instructions(granted, self.relay.host if self.relay else None))

    def modes(self) -> dict[str, str]:
        """Pair id -> mode, for the daemon's status file."""
        return {pair: state.mode for pair, state in self.planner.pairs.items()}
