"""This machine's LAN candidates: its IPv4 interface addresses with its WireGuard listen port.

Members on one site reach each other over these when the coordinator sees them behind one
public IP. Read through pyroute2's rtnetlink, like :mod:`mesh.wireguard.links`; the choice of
which addresses count is the pure :func:`lan_candidates`, tested without any interface.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable

from mesh.control.report import MAX_LAN

__all__ = ["interface_addresses", "lan_candidates", "local_candidates"]

log = logging.getLogger("shardpool.mesh.candidates")


def lan_candidates(
    addresses: Iterable[tuple[str, str]], wireguard_interface: str, mesh_cidr: str, port: int
) -> tuple[str, ...]:
    """``IP:PORT`` for each (interface, IPv4) pair worth trying, at most :data:`MAX_LAN`.

    Loopback, link-local, multicast and unspecified addresses are left out, and so are the mesh
    interface and any address inside the mesh CIDR: those only work once the path already does.
    """
    mesh = ipaddress.IPv4Network(mesh_cidr)
    found: list[str] = []
    for interface, text in addresses:
        try:
            address = ipaddress.IPv4Address(text)
        except ValueError:
            continue
        if interface == wireguard_interface or address in mesh:
            continue
        if address.is_loopback or address.is_link_local or address.is_multicast or address.is_unspecified:
            continue
        candidate = f"{address}:{port}"
        if candidate not in found:
            found.append(candidate)
    return tuple(found[:MAX_LAN])


def interface_addresses() -> list[tuple[str, str]]:
    """Every (interface name, IPv4 address) of this network namespace, from rtnetlink."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        names = {link["index"]: link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}
        return [
            (names.get(entry["index"], ""), entry.get_attr("IFA_ADDRESS")) for entry in ipr.get_addr(family=2)
        ]


def local_candidates(wireguard_interface: str, mesh_cidr: str, port: int) -> tuple[str, ...]:
    """This machine's LAN candidates; none (logged) when the addresses cannot be read."""
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        return lan_candidates(interface_addresses(), wireguard_interface, mesh_cidr, port)
    except (OSError, NetlinkError) as error:
        log.warning("cannot list this machine's addresses for LAN candidates: %s", error)
        return ()
