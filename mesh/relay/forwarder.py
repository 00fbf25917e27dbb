"""The relay's datagram forwarding: two asyncio UDP endpoints per allocation, each passing the
WireGuard datagrams of its member to the other member, unchanged.

Why a forwarder of our own rather than a TURN server (coturn): a TURN server needs its own
authentication realm and long-term credentials, which we would have to derive from the members'
WireGuard keys and keep in step with the roster, plus a separate daemon with its own config to
install, run and watch. Our allocations already come from the coordinator's signed roster over the
authenticated control channel, so the relay needs no authentication of its own, only per-IP
permissions (as TURN has) and bounds; that is about 150 lines of asyncio. It never parses more than
the WireGuard message type and length, never changes a payload, and holds no key: it sees only
ciphertext, and a datagram it could forge would fail WireGuard's authentication at the receiver.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

__all__ = [
    "MAX_DATAGRAM",
    "MAX_QUEUED_BYTES",
    "Leg",
    "LegProtocol",
    "LegRate",
    "TokenBucket",
    "is_wireguard_message",
    "source_forms",
]

log = logging.getLogger("shardpool.mesh.relay")

MAX_DATAGRAM = 65535
"""No UDP datagram is larger; WireGuard's own data messages are at most the MTU plus 32 bytes."""
MAX_QUEUED_BYTES = 1 << 20
"""Bytes a leg may have waiting in the kernel-refused send queue before it drops (no unbounded buffer)."""

_HANDSHAKE_SIZES = {1: 148, 2: 92, 3: 64}
"""WireGuard message type -> exact size: initiation, response, cookie reply."""
_TRANSPORT_TYPE = 4
_TRANSPORT_MIN = 32
"""A transport data message: 16-byte header, payload, 16-byte tag (keepalive: 32). The payload is padded
to a multiple of 16 only up to the interface MTU, so a full-MTU packet (1420 bytes in 1452) is not one."""


def is_wireguard_message(data: bytes) -> bool:
    """Whether ``data`` has the type and length of a WireGuard message (nothing else is checked).

    The type is a little-endian 32-bit field whose upper three bytes are reserved zeros.
    """
    size = len(data)
    if size < 4 or size > MAX_DATAGRAM or data[1:4] != b"\0\0\0":
        return False
    kind = data[0]
    if kind == _TRANSPORT_TYPE:
        return size >= _TRANSPORT_MIN
    return _HANDSHAKE_SIZES.get(kind) == size


def source_forms(ip: str) -> frozenset[str]:
    """The spellings of ``ip`` a socket may report as a sender: canonical, and IPv4-mapped IPv6
    for an IPv4 sender reaching a dual-stack socket."""
    address = ipaddress.ip_address(ip)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    forms = {str(address)}
    if isinstance(address, ipaddress.IPv4Address):
        forms.add(f"::ffff:{address}")
    return frozenset(forms)


@dataclass
class TokenBucket:
    """``rate`` tokens a second, at most ``depth`` held; starts full."""

    rate: float
    depth: float
    tokens: float = field(init=False)
    stamp: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not (self.rate > 0 and self.depth > 0):
            raise ValueError(f"a token bucket needs a positive rate and depth, not {self.rate}, {self.depth}")
        self.tokens = self.depth

    def refill(self, now: float) -> None:
        """Add what ``rate`` earned since the last refill, up to ``depth``."""
        if self.stamp is not None and now > self.stamp:
            self.tokens = min(self.depth, self.tokens + (now - self.stamp) * self.rate)
        if self.stamp is None or now > self.stamp:
            self.stamp = now


@dataclass
class LegRate:
    """A port's forwarding budget: datagrams and bytes a second, each a bucket one second deep."""

    packets_per_s: float
    bytes_per_s: float
    clock: Callable[[], float] = time.monotonic
    packets: TokenBucket = field(init=False)
    octets: TokenBucket = field(init=False)

    def __post_init__(self) -> None:
        self.packets = TokenBucket(self.packets_per_s, self.packets_per_s)
        self.octets = TokenBucket(self.bytes_per_s, max(self.bytes_per_s, MAX_DATAGRAM))

    def admits(self, size: int) -> bool:
        """Whether one datagram of ``size`` bytes fits both budgets now; if so, spend it."""
        now = self.clock()
        self.packets.refill(now)
        self.octets.refill(now)
        if self.packets.tokens < 1 or self.octets.tokens < size:
            return False
        self.packets.tokens -= 1
        self.octets.tokens -= size
        return True


@dataclass(eq=False)
class Leg:
    """One side of an allocation: the port its member sends to, and what the relay knows of it.

    ``learned`` is the source address of the latest accepted datagram (a NAT may rebind the port,
    so it follows; the IP must stay ``permitted_ip``). ``other`` is the opposite leg, whose port
    forwards to this leg's member. ``rate`` bounds what this port forwards (None: unbounded).
    """

    port: int
    permitted_ip: str
    counters: Counter[str]
    rate: LegRate | None = None
    learned: tuple[str, int] | None = None
    other: Leg | None = None
    transport: asyncio.DatagramTransport | None = None
    closed: asyncio.Future[None] | None = field(default=None, repr=False)
    sources: frozenset[str] = field(default=frozenset(), repr=False)

    def __post_init__(self) -> None:
        self.sources = source_forms(self.permitted_ip)

    def permit(self, ip: str) -> None:
        """Accept datagrams from ``ip`` from now on; forget the learned address if the IP changed."""
        forms = source_forms(ip)
        if forms != self.sources:
            self.permitted_ip, self.sources, self.learned = ip, forms, None

    def close(self) -> None:
        """Close the port now (pending sends are dropped); :attr:`closed` completes when it is shut."""
        if self.transport is not None:
            self.transport.abort()


class LegProtocol(asyncio.DatagramProtocol):
    """The asyncio protocol of one leg: check, learn the sender, forward out of the other leg."""

    def __init__(self, leg: Leg) -> None:
        self.leg = leg

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Remember the leg's transport and arm the future that says when it is closed."""
        self.leg.transport = cast(asyncio.DatagramTransport, transport)
        self.leg.closed = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        """The socket is closed: tell whoever waits for it."""
        if self.leg.closed is not None and not self.leg.closed.done():
            self.leg.closed.set_result(None)

    def datagram_received(self, data: bytes, addr: tuple[str | object, ...]) -> None:
        """Forward ``data`` to the other member if it comes from this leg's member, looks like WireGuard
        and fits the leg's rate (a datagram over it is dropped before its sender is learned)."""
        leg = self.leg
        counters = leg.counters
        if addr[0] not in leg.sources:
            counters["dropped_foreign"] += 1
            return
        if not is_wireguard_message(data):
            counters["dropped_malformed"] += 1
            return
        if leg.rate is not None and not leg.rate.admits(len(data)):
            counters["dropped_rate"] += 1
            return
        source = (str(addr[0]), int(addr[1]))  # type: ignore[call-overload]
        leg.learned = source
        other = leg.other
        if other is None or other.transport is None or other.learned is None:
            counters["dropped_unlearned"] += 1
            return
        if other.transport.get_write_buffer_size() > MAX_QUEUED_BYTES:
            counters["dropped_congested"] += 1
            return
        counters["forwarded"] += 1
        counters["forwarded_bytes"] += len(data)
        other.transport.sendto(data, other.learned)

    def error_received(self, exc: Exception) -> None:
        """A send failed (e.g. ICMP port unreachable from a member that went away): count it."""
        self.leg.counters["send_errors"] += 1
        log.debug("relay port %d: %s", self.leg.port, exc)
