"""Mesh addresses, underlay endpoints and interface names: parsing, checking and allocation.

Mesh addresses come from one IPv4 CIDR. The coordinator takes the first host address; each
joiner gets the lowest address never handed out before, so a revoked member's address is
never given to someone else.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable

from mesh.errors import MeshError

__all__ = [
    "literal_endpoint",
    "DEFAULT_CIDR",
    "allocate_address",
    "first_address",
    "format_endpoint",
    "parse_cidr",
    "parse_endpoint",
    "parse_interface_name",
    "resolve_endpoint",
]

DEFAULT_CIDR = "10.77.0.0/24"
_IFNAME = re.compile(r"[A-Za-z0-9_.=+-]{1,15}")


def parse_cidr(text: str) -> ipaddress.IPv4Network:
    """Parse the mesh CIDR, which must be IPv4 with room for at least two machines."""
    try:
        network = ipaddress.ip_network(text.strip(), strict=True)
    except ValueError as error:
        raise MeshError(
            f"--cidr {text!r} is not a network ({error}): use a form like {DEFAULT_CIDR}"
        ) from None
    if not isinstance(network, ipaddress.IPv4Network):
        raise MeshError(f"--cidr {text!r} is IPv6; the mesh uses IPv4 only: use a form like {DEFAULT_CIDR}")
    if network.prefixlen > 30:
        raise MeshError(
            f"--cidr {text!r} has room for fewer than two machines: use a prefix of /30 or shorter"
        )
    return network


def first_address(network: ipaddress.IPv4Network) -> str:
    """Return the first host address of the mesh, which the coordinator takes."""
    return str(next(network.hosts()))


def allocate_address(network: ipaddress.IPv4Network, ever_used: Iterable[str]) -> str:
    """Return the lowest host address that was never handed out, or fail when the CIDR is exhausted.

    ``ever_used`` must include revoked members' addresses, so those are never reused.
    """
    taken = {ipaddress.IPv4Address(address) for address in ever_used}
    for host in network.hosts():
        if host not in taken:
            return str(host)
    raise MeshError(
        f"no free address left in {network} ({len(taken)} used, revoked ones are never reused): "
        "create a new mesh with a larger --cidr"
    )


def parse_endpoint(text: str, what: str = "--endpoint") -> tuple[str, int]:
    """Split ``HOST:PORT`` or ``[IPV6]:PORT`` into host and port, checking both."""
    cleaned = text.strip()
    if cleaned.startswith("["):
        host, sep, port_text = cleaned[1:].partition("]:")
        if not sep:
            raise MeshError(f"{what} {text!r} is not [IPV6]:PORT")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise MeshError(f"{what} {text!r} has no valid IPv6 address inside the brackets") from None
    else:
        host, sep, port_text = cleaned.rpartition(":")
        if not sep or not host or ":" in host:
            raise MeshError(
                f"{what} {text!r} is not HOST:PORT (e.g. 203.0.113.5:51820 or [2001:db8::1]:51820)"
            )
        if not re.fullmatch(r"[A-Za-z0-9.-]+", host):
            raise MeshError(f"{what} {text!r} has an invalid host name")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise MeshError(f"{what} {text!r} needs a port between 1 and 65535")
    return host, int(port_text)


def literal_endpoint(value: object, what: str, *, error: type[MeshError] = MeshError) -> str:
    """Check untrusted ``value`` is literal ``IPv4:PORT`` text (no name to resolve); return it.

    Raises ``error`` (a :class:`MeshError`), so a caller can pick the kind its server maps to a status.
    """
    if not isinstance(value, str) or len(value) > 64:
        raise error(f"{what} is not IP:PORT text")
    host, _ = parse_endpoint(value, what)
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise error(f"{what} {value!r} is not a literal IPv4 endpoint") from None
    return value


def format_endpoint(host: str, port: int) -> str:
    """Join host and port, bracketing IPv6 addresses."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def resolve_endpoint(text: str) -> str:
    """Resolve ``HOST:PORT`` to ``IP:PORT`` for WireGuard, which accepts only literal addresses."""
    host, port = parse_endpoint(text, "endpoint")
    try:
        ipaddress.ip_address(host)
        return format_endpoint(host, port)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as error:
        raise MeshError(
            f"cannot resolve endpoint host {host!r} ({error.strerror}): check DNS or use an IP address"
        ) from None
    family, _, _, _, sockaddr = infos[0]
    return format_endpoint(str(sockaddr[0]), port) if family in (socket.AF_INET, socket.AF_INET6) else text


def parse_interface_name(text: str) -> str:
    """Check a network interface name: 1 to 15 characters of letters, digits and ``_.=+-``."""
    if not isinstance(text, str) or not _IFNAME.fullmatch(text) or text in (".", ".."):
        raise MeshError(
            f"--interface {text!r} is not a valid interface name: use 1-15 letters or digits, e.g. shardpool0"
        )
    return text
