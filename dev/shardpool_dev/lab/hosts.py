"""What the lab is made of: its address plan, its hosts and routers, and the commands that build them.

Hosts sit on a flat segment in TEST-NET-1 (:data:`UNDERLAY`), on the NAT grid's internet, or on a
router's LAN (:mod:`shardpool_dev.lab.nat`); the meshes the lab forms take their addresses from
:data:`MESH_CIDR`, which none of those overlaps. :class:`~shardpool_dev.lab.base.Lab` builds them
with ``ip`` through :func:`run_ip`, and a failing command raises :class:`LabError`.
"""

from __future__ import annotations

import ipaddress
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from mesh.constants import WIREGUARD_PORT
from shardpool_dev.lab.nat import lan_gateway

__all__ = [
    "MESH_CIDR",
    "UNDERLAY",
    "Host",
    "LabError",
    "Router",
    "mesh_address",
    "run_checked",
    "run_in_netns",
    "run_ip",
]

UNDERLAY = "192.0.2"
"""The first three octets of every host's underlay address (TEST-NET-1)."""
MESH_CIDR = "198.51.100.0/28"
"""The mesh CIDR of the lab's meshes: the sixteenth of TEST-NET-2 that no router LAN uses (router
``k`` takes 198.51.100.(16k)/28 for k = 1..15, :mod:`shardpool_dev.lab.nat`), so it overlaps none
of the hosts' own networks. Its host addresses .1 to .14 hold a coordinator and 13 members."""


def mesh_address(number: int) -> str:
    """Host address ``number`` (1..14) of :data:`MESH_CIDR`: 1 is the coordinator's, and joiners
    get 2, 3, ... in the order they join (no address is ever handed out twice)."""
    network = ipaddress.IPv4Network(MESH_CIDR)
    if not 1 <= number < network.num_addresses - 1:
        raise ValueError(f"mesh address number {number} is outside 1..{network.num_addresses - 2}")
    return str(network[number])


class LabError(RuntimeError):
    """A lab command failed; the message has its exit code and output."""


def run_ip(*argv: str) -> None:
    """Run ``ip ARGV``; :class:`LabError` with its output when it fails."""
    run_checked(["ip", *argv])


def run_checked(argv: list[str]) -> None:
    """Run ``argv`` (at most 30 s); :class:`LabError` with its exit code and stderr when it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise LabError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")


def run_in_netns(netns: str, *argv: str) -> None:
    """Run ``argv`` inside namespace ``netns`` as :func:`run_checked` does."""
    run_checked(["ip", "netns", "exec", netns, *argv])


@dataclass
class Host:
    """One machine of the lab."""

    label: str
    netns: str
    underlay: str
    home: Path
    interface: str
    agent_socket: Path
    listen_port: int = WIREGUARD_PORT
    router: str | None = None
    """The label of the router this host sits behind, or ``None`` on the flat lab or the internet."""

    @property
    def endpoint(self) -> str:
        """This host's WireGuard endpoint on its own segment (reachable from outside only without a router)."""
        return f"{self.underlay}:{self.listen_port}"


@dataclass
class Router:
    """A NAT router of the grid: ``wan`` on the internet, ``lan`` on a bridge of its own."""

    label: str
    netns: str
    index: int
    wan: str
    kind: str
    bridge: str
    forwards: list[tuple[str, int]] = field(default_factory=list)
    """(LAN address, UDP listen port) of each host behind it, which a cone router forwards."""

    @property
    def gateway(self) -> str:
        """The router's LAN address, its hosts' default route."""
        return lan_gateway(self.index)
