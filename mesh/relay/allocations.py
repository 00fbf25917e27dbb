"""Relay allocations: which member pairs get a pair of relay ports, and the bounds on them.

An allocation for pair (A, B) is two UDP ports on the relay host, ``port_a`` for A and ``port_b``
for B, each accepting datagrams only from its member's permitted IP (a TURN permission). Which
requests become allocations is decided here, without sockets: :func:`plan_allocations` keeps the
live allocations that are still wanted and admits new ones while the bounds allow (total, per
member, new per minute), leaving the rest out rather than failing.
"""

from __future__ import annotations

import ipaddress
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "LEG_BYTES_PER_S",
    "LEG_PACKETS_PER_S",
    "Allocation",
    "AllocationPlan",
    "AllocationRequest",
    "Limits",
    "NewAllocationRate",
    "plan_allocations",
    "request_problem",
]

MAX_PAIR_LENGTH = 200
"""Longest accepted pair id (two base64 keys and a separator are 89 characters)."""


@dataclass(frozen=True)
class AllocationRequest:
    """Relay the pair ``pair``: member ``key_a`` sends from ``ip_a``, member ``key_b`` from ``ip_b``.

    ``pair`` is a stable id (e.g. the two keys sorted and joined with ``|``); the IPs are the
    members' observed underlay IPs, the only sources each side's port accepts.
    """

    pair: str
    key_a: str
    ip_a: str
    key_b: str
    ip_b: str


@dataclass(frozen=True)
class Allocation:
    """The two relay ports of a pair: A sends to ``port_a``, B to ``port_b``."""

    pair: str
    port_a: int
    port_b: int


LEG_PACKETS_PER_S = 50_000
"""Datagrams a relay port forwards per second, sustained (a full-size WireGuard stream at the byte
rate below is about 46,000 a second)."""
LEG_BYTES_PER_S = 64 * 2**20
"""Bytes a relay port forwards per second, sustained: 64 MiB/s (537 Mbit/s), about six times the
10 MB/s the NAT benchmark measures through the relay (docs/performance.md) and well above what one
pair's pipeline traffic needs; a port may send one second's worth at once."""


@dataclass(frozen=True)
class Limits:
    """Bounds on a relay's allocations, so a coordinator bug or a flood cannot exhaust the host.

    ``leg_packets_per_s`` and ``leg_bytes_per_s`` bound what each port forwards (a token bucket
    each, one second deep), so one member, or a host behind its NAT, cannot take the relay's loop
    and uplink from the other pairs, nor use the relay to flood the member on the other side.
    """

    max_allocations: int = 128
    max_per_member: int = 32
    max_new_per_minute: int = 60
    leg_packets_per_s: float = LEG_PACKETS_PER_S
    leg_bytes_per_s: float = LEG_BYTES_PER_S


@dataclass
class NewAllocationRate:
    """A sliding one-minute window of the times new allocations were made."""

    per_minute: int
    clock: Callable[[], float] = time.monotonic
    _times: deque[float] = field(default_factory=deque)

    def allows_one(self) -> bool:
        """Whether one more allocation fits in the last minute's budget; if so, count it."""
        now = self.clock()
        while self._times and now - self._times[0] >= 60.0:
            self._times.popleft()
        if len(self._times) >= self.per_minute:
            return False
        self._times.append(now)
        return True

    def refund(self) -> None:
        """Give back the latest allocation's place: it could not be opened after all."""
        if self._times:
            self._times.pop()


@dataclass(frozen=True)
class AllocationPlan:
    """What :func:`plan_allocations` decided: keep, change permissions of, open, close, leave out."""

    keep: list[AllocationRequest]
    """Live allocations that stay as they are, or with new permitted IPs (same ports)."""
    open: list[AllocationRequest]
    """New allocations to open, within the bounds."""
    close: list[str]
    """Pairs of live allocations that are no longer wanted (or whose members changed)."""
    refused: dict[str, str]
    """Pair -> why it was left out (a bound, a duplicate, a malformed request)."""


def request_problem(request: AllocationRequest) -> str | None:
    """Why a request cannot be served (one line), or ``None`` when it is well formed."""
    if not isinstance(request, AllocationRequest):
        return "not an AllocationRequest"
    texts = (request.pair, request.key_a, request.ip_a, request.key_b, request.ip_b)
    if not all(isinstance(text, str) and text for text in texts):
        return "empty or non-text field"
    if len(request.pair) > MAX_PAIR_LENGTH:
        return f"pair id longer than {MAX_PAIR_LENGTH} characters"
    if request.key_a == request.key_b:
        return "a member cannot be relayed to itself"
    for ip in (request.ip_a, request.ip_b):
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            return f"{ip!r} is not an IP address"
    return None


def plan_allocations(
    wanted: Iterable[AllocationRequest],
    live: Mapping[str, AllocationRequest],
    limits: Limits,
    rate: NewAllocationRate,
) -> AllocationPlan:
    """Decide how to make the live allocations equal ``wanted``, within ``limits``.

    Live allocations still wanted come first (a relayed pair never loses its ports to a newcomer);
    new ones are admitted in the order given while the total, per-member and per-minute bounds
    allow. A live pair whose member keys changed is closed and opened again as new.
    """
    keep: list[AllocationRequest] = []
    candidates: list[AllocationRequest] = []
    refused: dict[str, str] = {}
    seen: set[str] = set()
    for request in wanted:
        problem = request_problem(request)
        pair = getattr(request, "pair", "?")
        if problem is None and pair in seen:
            problem = "requested twice"
        if problem is not None:
            refused.setdefault(str(pair)[:MAX_PAIR_LENGTH], problem)
            continue
        seen.add(pair)
        old = live.get(pair)
        same_members = old is not None and (old.key_a, old.key_b) == (request.key_a, request.key_b)
        (keep if same_members else candidates).append(request)
    kept_pairs = {request.pair for request in keep}
    close = [pair for pair in live if pair not in kept_pairs]
    per_member: Counter[str] = Counter()
    for request in keep:
        per_member.update((request.key_a, request.key_b))
    opened: list[AllocationRequest] = []
    for request in candidates:
        reason = _over_bound(request, len(keep) + len(opened), per_member, limits)
        if reason is None and not rate.allows_one():
            reason = f"more than {limits.max_new_per_minute} new allocations in a minute"
        if reason is not None:
            refused[request.pair] = reason
            continue
        opened.append(request)
        per_member.update((request.key_a, request.key_b))
    return AllocationPlan(keep, opened, close, refused)


def _over_bound(
    request: AllocationRequest, count: int, per_member: Counter[str], limits: Limits
) -> str | None:
    if count >= limits.max_allocations:
        return f"the relay already holds {limits.max_allocations} allocations"
    for key in (request.key_a, request.key_b):
        if per_member[key] >= limits.max_per_member:
            return f"member {key[:8]}... already has {limits.max_per_member} allocations"
    return None
