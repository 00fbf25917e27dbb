"""The NAT grid's addressing and firewall rules, as plain data (no namespaces, no root; unit-tested).

The grid (:meth:`shardpool_dev.lab.Lab.add_internet`, :meth:`~shardpool_dev.lab.Lab.add_router`) has a public
"internet" segment 203.0.113.0/24 (TEST-NET-3) and behind each router ``k`` (1..15) a LAN
198.51.100.(16k)/28 (TEST-NET-2 cut in sixteen), the router at .(16k+1) and its hosts at
.(16k+2) .. .(16k+14). The sixteenth no router takes, 198.51.100.0/28, is the lab's mesh CIDR
(:data:`shardpool_dev.lab.hosts.MESH_CIDR`). A router masquerades its LAN behind its ``wan`` address in one
of two ways:

- ``cone``, a *full-cone* router: endpoint-independent mapping and filtering. Linux MASQUERADE
  keeps a flow's source port when it is free, so one local socket appears as the same public
  ``IP:PORT`` to every destination (the mapping); a DNAT rule per member sends any UDP datagram
  arriving on ``wan:PORT`` to the member listening on ``PORT``, whoever sends it (the filtering).
  Members behind one router therefore need distinct listen ports.
- ``symmetric``: ``MASQUERADE --random-fully``, a fresh random public port for every new
  destination, and no inbound rule: only replies to a flow the member started get in.

A *UDP-blocked* host drops every outgoing UDP datagram except to one address (the relay), its
loopback and its WireGuard interface: a network that lets only the relay through.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "INTERNET",
    "LAN",
    "NAT_KINDS",
    "NatKind",
    "lan_address",
    "lan_gateway",
    "lan_subnet",
    "router_nat_rules",
    "udp_block_rules",
]

INTERNET = "203.0.113"
"""The first three octets of the public segment (TEST-NET-3)."""
LAN = "198.51.100"
"""The first three octets of the routers' LANs (TEST-NET-2, a /28 per router)."""
NatKind = Literal["cone", "symmetric"]
NAT_KINDS: tuple[NatKind, ...] = ("cone", "symmetric")
LAN_PREFIX = 28
MAX_ROUTERS = 15
FIRST_HOST, LAST_HOST = 2, 14


def _check_router(index: int) -> None:
    if not 1 <= index <= MAX_ROUTERS:
        raise ValueError(f"router index {index} is outside 1..{MAX_ROUTERS}")


def lan_subnet(index: int) -> str:
    """The LAN of router ``index`` in CIDR form: 198.51.100.(16·index)/28."""
    _check_router(index)
    return f"{LAN}.{16 * index}/{LAN_PREFIX}"


def lan_gateway(index: int) -> str:
    """The LAN address of router ``index`` itself (its hosts' default gateway)."""
    _check_router(index)
    return f"{LAN}.{16 * index + 1}"


def lan_address(index: int, host: int) -> str:
    """The address of host number ``host`` (2..14) behind router ``index``."""
    _check_router(index)
    if not FIRST_HOST <= host <= LAST_HOST:
        raise ValueError(f"host number {host} behind a router is outside {FIRST_HOST}..{LAST_HOST}")
    return f"{LAN}.{16 * index + host}"


def router_nat_rules(kind: str, forwards: list[tuple[str, int]]) -> list[list[str]]:
    """``iptables`` argument lists that make a router of ``kind``, in order.

    ``forwards`` are the (LAN address, UDP listen port) of the members behind it; a cone router
    forwards each port to its member (full cone), a symmetric one ignores them.
    """
    if kind == "symmetric":
        return [["-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE", "--random-fully"]]
    if kind != "cone":
        raise ValueError(f"unknown NAT kind {kind!r}; expected one of {', '.join(NAT_KINDS)}")
    ports = [port for _, port in forwards]
    if len(set(ports)) != len(ports):
        raise ValueError(f"members behind one cone router need distinct listen ports, got {sorted(ports)}")
    rules = [["-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"]]
    for address, port in forwards:
        rules.append(
            ["-t", "nat", "-A", "PREROUTING", "-i", "wan", "-p", "udp", "--dport", str(port)]
            + ["-j", "DNAT", "--to-destination", f"{address}:{port}"]
        )
    return rules


def udp_block_rules(allowed_ip: str, interface: str) -> list[list[str]]:
    """``iptables`` argument lists that drop a host's outgoing UDP except to ``allowed_ip``.

    Loopback and the WireGuard ``interface`` stay open: what the mesh carries inside the tunnel is
    not the underlay's business.
    """
    return [
        ["-A", "OUTPUT", "-o", "lo", "-j", "ACCEPT"],
        ["-A", "OUTPUT", "-o", interface, "-j", "ACCEPT"],
        ["-A", "OUTPUT", "-p", "udp", "!", "-d", allowed_ip, "-j", "DROP"],
    ]
