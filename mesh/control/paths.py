"""How each pair of members is connected: LAN, direct (hole-punched) or relayed. Pure; time is passed in.

The coordinator runs :class:`PathPlanner` once per sync step with what it knows: the roster, the
endpoint its own WireGuard device shows for each member (that member's *observed* endpoint, the
NAT mapping of its WireGuard socket) and each member's latest :class:`MemberReport`. The rules:

* Pairs where either side has a roster endpoint (``--endpoint``) or is the coordinator get no
  instruction: WireGuard roaming connects them, as before.
* A new pair starts relayed (``pending`` when no relay serves) and gets a try at once: both
  sides set each other's candidate endpoint at the same moment ``at`` and send keepalives,
  which punches both NATs. Members behind one public IP that both report LAN candidates try
  ``lan`` first (alternating with ``direct`` on retries); the others try ``direct`` with the
  observed endpoints. Starting relayed and upgrading is what Tailscale does with DERP.
* Both sides report ok for the try: the pair takes the tried path and its relay is freed.
  Either reports not ok, or no answer by ``at + window + 3 * sync_interval``: the pair stays
  relayed and tries again :data:`RETRY_S` later, forever, or at once when an observed
  endpoint changes (a router rebooted or changed its kind of NAT).
* A direct or LAN pair whose observed endpoint changes (a laptop moved, a router rebooted) or
  whose sides both report no handshake for :data:`STALE_HANDSHAKE_S` goes back to the relay and
  punches again at once.
* Pairs of members no longer in the roster (or that lost their observed endpoint's member) are
  dropped at once, with their relay allocations.

:meth:`PathPlanner.step` returns the relay allocations the pairs need;
:meth:`PathPlanner.instructions` turns the ports the relay granted into per-member instructions.
"""

from __future__ import annotations

import ipaddress
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from mesh.addresses import parse_endpoint
from mesh.control.model import PathInstruction, PunchTry, RosterEntry
from mesh.control.report import MemberReport, PeerReport

__all__ = [
    "RETRY_S",
    "SESSION_S",
    "STALE_HANDSHAKE_S",
    "TRY_WINDOW_S",
    "AllocationWant",
    "PairState",
    "PathPlanner",
    "pair_id",
    "place_on_members",
]

RETRY_S = 20.0
"""Seconds between hole-punch tries of a relayed pair."""
STALE_HANDSHAKE_S = 180.0
"""A direct pair whose both sides saw no handshake for this long is punched again."""
TRY_WINDOW_S = 3.0
"""Seconds a try sends keepalives before its sides judge it."""
SESSION_S = 180.0
"""A handshake at most this old means a live WireGuard session (keys are renewed every 120 s)."""
_CONNECTED = ("lan", "direct")


def pair_id(key_a: str, key_b: str) -> str:
    """The stable id of an unordered pair of members: their public keys, sorted, joined by ``|``."""
    first, second = sorted((key_a, key_b))
    return f"{first}|{second}"


@dataclass(frozen=True)
class AllocationWant:
    """A relay allocation a pair needs (the fields of ``mesh.relay.allocations.AllocationRequest``)."""

    pair: str
    key_a: str
    ip_a: str
    key_b: str
    ip_b: str


@dataclass
class PairState:
    """Where one pair stands: its mode, its running try, and what it was connected with."""

    key_a: str
    key_b: str
    mode: str
    next_try_at: float
    observed: tuple[str, str]
    tries: int = 0
    punch: PunchTry | None = None
    punch_for: tuple[str, str] = ("", "")
    results: dict[str, bool] = field(default_factory=dict)
    connected_with: tuple[str, str] = ("", "")
    last_tried: str = ""

    @property
    def pair(self) -> str:
        """This pair's id."""
        return pair_id(self.key_a, self.key_b)


def _live_both(state: PairState, now: float, reports: Mapping[str, MemberReport]) -> bool:
    """Whether both sides report a handshake with each other within :data:`SESSION_S`.

    A try then keeps the session (a relayed pair upgrades without dropping its tunnel); otherwise
    both sides start afresh together. One side alone starting afresh would leave the other
    sending under keys nobody holds any more, until WireGuard's 15 s silence timer re-handshakes:
    past the try's window (a cone-to-symmetric first try failed that way about once in three).
    """
    return all(
        view is not None and view.last_handshake is not None and now - view.last_handshake <= SESSION_S
        for view in _views(state, reports)
    )


def _views(state: PairState, reports: Mapping[str, MemberReport]) -> list[PeerReport | None]:
    """What each side of the pair last reported about the other (None: no report, or no such peer)."""
    views: list[PeerReport | None] = []
    for own, other in ((state.key_a, state.key_b), (state.key_b, state.key_a)):
        report = reports.get(own)
        views.append(report.peers.get(other) if report is not None else None)
    return views


def _ip(endpoint: str) -> str:
    return parse_endpoint(endpoint, "observed endpoint")[0]


def _common_prefix(first: str, second: str) -> int:
    a, b = int(ipaddress.IPv4Address(first)), int(ipaddress.IPv4Address(second))
    return 32 - (a ^ b).bit_length()


def lan_candidate(theirs: tuple[str, ...], ours: tuple[str, ...]) -> str:
    """Their LAN candidate that shares the longest address prefix with one of ours (their first on ties).

    Reports carry no prefix lengths, so a shared prefix of at least 16 bits stands in for "same subnet".
    """

    def closeness(candidate: str) -> int:
        best = max((_common_prefix(_ip(candidate), _ip(mine)) for mine in ours), default=0)
        return best if best >= 16 else 0

    return max(theirs, key=closeness)


class PathPlanner:
    """The coordinator's per-pair state machine; feed it with :meth:`step`, read it with :meth:`instructions`."""

    def __init__(
        self,
        sync_interval: float = 2.0,
        retry_s: float = RETRY_S,
        window: float = TRY_WINDOW_S,
        stale_s: float = STALE_HANDSHAKE_S,
    ) -> None:
        self.sync_interval = sync_interval
        self.retry_s = retry_s
        self.window = window
        self.stale_s = stale_s
        self.pairs: dict[str, PairState] = {}
        self._next_id = 1

    def step(
        self,
        now: float,
        members: Iterable[RosterEntry],
        observed: Mapping[str, str | None],
        reports: Mapping[str, MemberReport],
        relay: bool,
    ) -> list[AllocationWant]:
        """Advance every pair to ``now``; return the relay allocations wanted (empty when ``relay`` is off)."""
        managed = sorted(m.public_key for m in members if m.endpoint is None and not m.coordinator)
        current = {pair_id(a, b): (a, b) for i, a in enumerate(managed) for b in managed[i + 1 :]}
        for gone in set(self.pairs) - set(current):
            del self.pairs[gone]
        fallback = "relay" if relay else "pending"
        for pair, (a, b) in current.items():
            seen_a, seen_b = observed.get(a), observed.get(b)
            state = self.pairs.get(pair)
            if seen_a is None or seen_b is None:
                continue
            if state is None:
                state = self.pairs[pair] = PairState(a, b, fallback, now, (seen_a, seen_b))
            self._advance(state, now, (seen_a, seen_b), reports, fallback)
        if not relay:
            return []
        return [
            AllocationWant(s.pair, s.key_a, _ip(s.observed[0]), s.key_b, _ip(s.observed[1]))
            for s in self.pairs.values()
            if s.mode not in _CONNECTED
        ]

    def _advance(
        self,
        state: PairState,
        now: float,
        seen: tuple[str, str],
        reports: Mapping[str, MemberReport],
        fallback: str,
    ) -> None:
        if state.punch is not None:
            self._judge(state, now, reports, fallback)
            return
        if state.mode in _CONNECTED:
            if seen == state.observed and not self._stale(state, now, reports):
                return
            state.mode, state.next_try_at = fallback, now
        else:
            state.mode = fallback  # the same, unless the relay was switched on or off
            if seen != state.observed:
                state.next_try_at = now  # a NAT changed (rebooted, or a new kind): try again at once
        state.observed = seen
        if now >= state.next_try_at:
            self._start_try(state, now, reports)

    def _stale(self, state: PairState, now: float, reports: Mapping[str, MemberReport]) -> bool:
        """Whether both sides report no handshake with each other for :attr:`stale_s`."""
        return all(
            view is not None and (view.last_handshake is None or now - view.last_handshake > self.stale_s)
            for view in _views(state, reports)
        )

    def _start_try(self, state: PairState, now: float, reports: Mapping[str, MemberReport]) -> None:
        """Schedule the next try: lan and direct in turn for two members behind one public IP, else direct.

        Behind one public IP the first try waits until both members have reported their LAN
        addresses, so it is not spent on a direct try (which needs hairpinning) while a report is
        still on its way.
        """
        empty = MemberReport()
        lan_a, lan_b = (reports.get(key, empty).lan for key in (state.key_a, state.key_b))
        same_ip = _ip(state.observed[0]) == _ip(state.observed[1])
        if same_ip and state.tries == 0 and not (state.key_a in reports and state.key_b in reports):
            return
        if same_ip and lan_a and lan_b and state.last_tried != "lan":
            path, for_a, for_b = "lan", lan_candidate(lan_b, lan_a), lan_candidate(lan_a, lan_b)
        else:
            path, for_a, for_b = "direct", state.observed[1], state.observed[0]
        at = now + 2 * self.sync_interval + 0.5
        state.punch = PunchTry(
            self._next_id, "", path, at, self.window, fresh=not _live_both(state, now, reports)
        )
        state.punch_for = (for_a, for_b)
        state.results = {}
        state.tries += 1
        state.last_tried = path
        self._next_id += 1

    def _judge(
        self, state: PairState, now: float, reports: Mapping[str, MemberReport], fallback: str
    ) -> None:
        punch = state.punch
        assert punch is not None
        for own, other in ((state.key_a, state.key_b), (state.key_b, state.key_a)):
            report = reports.get(own)
            outcome = report.tries.get(other) if report is not None else None
            if outcome is not None and outcome[0] == punch.id:
                state.results[own] = outcome[1]
        if len(state.results) == 2 and all(state.results.values()):
            state.mode, state.connected_with = punch.path, state.punch_for
        elif False in state.results.values() or now > punch.at + punch.window + 3 * self.sync_interval:
            state.mode, state.next_try_at = fallback, now + self.retry_s
        else:
            return
        state.punch, state.results = None, {}

    def instructions(
        self, relays: Mapping[str, tuple[str, int, int]]
    ) -> dict[str, dict[str, PathInstruction]]:
        """Per member, per peer: the path, the endpoint to use, and the running try for that side.

        ``relays`` maps a pair id to the relay that carries it: ``(host, port_a, port_b)``, where
        ``port_a`` is where the pair's first key sends; a relayed pair without one is ``pending``.
        """
        plan: dict[str, dict[str, PathInstruction]] = {}
        for state in self.pairs.values():
            relay = relays.get(state.pair)
            sides = ((state.key_a, state.key_b, 0), (state.key_b, state.key_a, 1))
            for own, other, side in sides:
                plan.setdefault(own, {})[other] = self._instruction(state, side, relay)
        return plan

    @staticmethod
    def _instruction(state: PairState, side: int, relay: tuple[str, int, int] | None) -> PathInstruction:
        punch = None
        if state.punch is not None:
            punch = replace(state.punch, endpoint=state.punch_for[side])
        if state.mode in _CONNECTED:
            return PathInstruction(state.mode, state.connected_with[side], punch)
        if relay is None:
            return PathInstruction("pending", None, punch)
        host, port_a, port_b = relay
        return PathInstruction("relay", f"{host}:{port_b if side else port_a}", punch)


def place_on_members(
    wanted: Iterable[AllocationWant], relays: Iterable[str]
) -> dict[str, list[AllocationWant]]:
    """Spread allocations over the members that relay (``--relay``), never onto one of the pair.

    The choice is a hash of the pair id, so a pair stays on the same relay from step to step
    while the set of relays stays the same.
    """
    hosts = sorted(relays)
    placed: dict[str, list[AllocationWant]] = {}
    for want in wanted:
        choices = [key for key in hosts if key not in (want.key_a, want.key_b)]
        if choices:
            chosen = choices[zlib.crc32(want.pair.encode()) % len(choices)]
            placed.setdefault(chosen, []).append(want)
    return placed
