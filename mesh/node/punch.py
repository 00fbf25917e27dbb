"""The member side of hole punching: run the coordinator's tries and follow its path instructions.

A try (:class:`mesh.control.model.PunchTry`) reaches both sides of a pair with the same start
time ``at``. At ``at`` each side points the peer at ``try.endpoint`` with a 1 s persistent
keepalive: the keepalives (or handshake initiations) sent by both at once open both NATs. After
``window`` seconds each side reads its device and judges the try with :func:`judge_try`:

* success when the endpoint the device shows is *not* the relay endpoint (the fallback) and
  packets arrived since ``at`` (``rx_bytes`` grew, or a handshake completed after ``at``). The
  endpoint need not equal the try endpoint: behind a symmetric NAT the peer's packets come from
  a new port and WireGuard roams to it, which is a working direct path. A handshake alone is not
  enough, as a relayed session may rekey through the relay during the window; and if packets
  still came through the relay, WireGuard roams back to the relay address and the check fails.
* on success the device keeps the endpoint it shows, the keepalive goes back to the configured
  value, and the try endpoint is remembered as *pushed*, so the instruction that names it next
  does not overwrite the roamed endpoint; on failure the fallback endpoint is put back.

The outcome is reported to the coordinator in the next ``/v1/report``.
:class:`PathFollower` keeps this state between sync steps; :func:`judge_try` is pure.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from mesh.control.model import PathInstruction, PunchTry
from mesh.control.paths import SESSION_S
from mesh.control.report import MemberReport, PeerReport
from mesh.wireguard.backend import DeviceStatus, PeerConfig, PeerStatus

__all__ = [
    "PREPARE_S",
    "PUNCH_KEEPALIVE",
    "SESSION_S",
    "PathFollower",
    "TryRun",
    "judge_try",
    "needs_fresh",
    "prepare_changes",
    "start_changes",
]

log = logging.getLogger("shardpool.mesh.punch")

PUNCH_KEEPALIVE = 1
"""Persistent keepalive (seconds) during a try: every keepalive is a punch."""


@dataclass
class TryRun:
    """One try this member was given for ``peer``; ``at_start`` is the peer's status when it began."""

    peer: str
    punch: PunchTry
    at_start: PeerStatus | None = None
    prepared: bool = False

    @property
    def started(self) -> bool:
        """Whether the try's endpoint was set on the device."""
        return self.at_start is not None


PREPARE_S = 1.0
"""Seconds before a fresh try's time that its peer is made anew (see :func:`prepare_changes`)."""


def needs_fresh(punch: PunchTry, peer: PeerStatus) -> bool:
    """Whether the try starts a new session: the coordinator's call for both sides (``punch.fresh``),
    or, from a coordinator that predates it, whether this side has no live session."""
    if punch.fresh is not None:
        return punch.fresh
    return peer.last_handshake is None or punch.at - peer.last_handshake > SESSION_S


def prepare_changes(punch: PunchTry, peer: PeerStatus) -> list[PeerConfig]:
    """Make the peer anew :data:`PREPARE_S` before a fresh try: removed, and added back with the try
    endpoint and no keepalive, so nothing is sent yet.

    Removing resets WireGuard's one-initiation-per-5-s clock (there is no session to lose).
    Doing it ahead of ``at`` on both sides matters: a side that removed its peer *after* the
    other side's initiation arrived would throw away the session just made, and the other
    side, believing it live, would not initiate again for 15 s.
    """
    return [
        PeerConfig(peer.public_key, remove=True),
        PeerConfig(peer.public_key, peer.allowed_ips, punch.endpoint, 0),
    ]


def start_changes(
    punch: PunchTry, peer: PeerStatus, *, prepared: bool = False
) -> tuple[list[PeerConfig], PeerStatus]:
    """The changes that start ``punch`` on ``peer`` at ``at``, and the status to judge the try against.

    WireGuard sends a keepalive at once only when the persistent keepalive goes from 0 to
    non-zero, so it goes from 0 to :data:`PUNCH_KEEPALIVE` with the try endpoint: the first punch
    leaves at ``at``, not at the next 25 s tick. A fresh try whose peer was not ``prepared``
    (pulled late) is made anew here, at once.
    """
    punching = PeerConfig(peer.public_key, peer.allowed_ips, punch.endpoint, PUNCH_KEEPALIVE)
    if not needs_fresh(punch, peer):
        quiet = PeerConfig(peer.public_key, peer.allowed_ips, punch.endpoint, 0)
        return [quiet, punching], peer
    fresh = replace(peer, endpoint=None, last_handshake=None, rx_bytes=0, tx_bytes=0)
    return ([] if prepared else prepare_changes(punch, peer)) + [punching], fresh


def judge_try(
    punch: PunchTry, fallback: str | None, at_start: PeerStatus, after: PeerStatus | None, keepalive: int
) -> tuple[bool, PeerConfig]:
    """Judge a finished try from the peer's status at its start and after its window.

    Returns whether it worked and the change to apply now: the configured keepalive, plus the
    fallback endpoint when it failed (``None`` keeps the device's endpoint).
    """
    if after is None:
        return False, PeerConfig(at_start.public_key, at_start.allowed_ips, fallback, keepalive)
    heard = after.rx_bytes > at_start.rx_bytes or (
        after.last_handshake is not None and after.last_handshake >= punch.at
    )
    ok = heard and after.endpoint is not None and after.endpoint != fallback
    return ok, PeerConfig(after.public_key, after.allowed_ips, None if ok else fallback, keepalive)


class PathFollower:
    """This member's path state across sync steps: instructions, running tries, outcomes, pushed endpoints."""

    def __init__(self, keepalive: int) -> None:
        self.keepalive = keepalive
        self.instructions: dict[str, PathInstruction] = {}
        self.runs: dict[str, TryRun] = {}
        self.results: dict[str, tuple[int, bool]] = {}
        self.pushed: dict[str, str | None] = {}

    def follow(self, paths: Mapping[str, PathInstruction], peers: Iterable[str]) -> None:
        """Take the latest instructions; schedule their new tries; forget peers that are gone."""
        current = set(peers)
        self.instructions = {key: value for key, value in paths.items() if key in current}
        for table in (self.runs, self.results, self.pushed):
            for gone in set(table) - current:
                del table[gone]
        for peer, run in list(self.runs.items()):
            instruction = self.instructions.get(peer)
            if not run.started and (instruction is None or instruction.punch != run.punch):
                del self.runs[peer]  # the coordinator dropped or replaced this try before it began
                if run.prepared:
                    self.pushed.pop(peer, None)  # made anew for it: let the reconcile push the path again
        for peer, instruction in self.instructions.items():
            punch = instruction.punch
            if punch is None or peer in self.runs or self.results.get(peer, (None, False))[0] == punch.id:
                continue
            self.runs[peer] = TryRun(peer, punch)

    def busy(self) -> frozenset[str]:
        """Peers the roster reconcile must leave alone: a try is on the device, or judged here but open at the coordinator.

        The second matters: between this side's verdict and the coordinator's, the instruction
        still names the relay, and pushing it would undo the punched (maybe roamed) endpoint.
        """
        running = {peer for peer, run in self.runs.items() if run.started or run.prepared}
        waiting = {
            peer
            for peer, instruction in self.instructions.items()
            if instruction.punch is not None
            and self.results.get(peer, (None, False))[0] == instruction.punch.id
        }
        return frozenset(running | waiting)

    def next_event(self) -> float | None:
        """The unix time of the next try start or judgement, if any, so the sync loop wakes for it."""
        return min((self._next_time(run) for run in self.runs.values()), default=None)

    @staticmethod
    def _next_time(run: TryRun) -> float:
        if run.started:
            return run.punch.at + run.punch.window
        if run.prepared or run.punch.fresh is False:
            return run.punch.at
        return run.punch.at - PREPARE_S

    def due(self, now: float, device: DeviceStatus) -> list[PeerConfig]:
        """Start the tries whose time came and judge those whose window ended; return the changes."""
        changes: list[PeerConfig] = []
        for peer, run in list(self.runs.items()):
            status = device.peer(peer)
            end = run.punch.at + run.punch.window
            if not run.started:
                if status is not None and not run.prepared and now >= run.punch.at - PREPARE_S:
                    if now < run.punch.at and needs_fresh(run.punch, status):
                        changes.extend(prepare_changes(run.punch, status))
                        run.prepared = True
                if now < run.punch.at:
                    continue
                if now > end or status is None:  # pulled too late, or the peer is not on the device
                    self._finish(run, False)
                    continue
                started, run.at_start = start_changes(run.punch, status, prepared=run.prepared)
                changes.extend(started)
            elif now >= end:
                assert run.at_start is not None
                ok, change = judge_try(run.punch, self._fallback(run), run.at_start, status, self.keepalive)
                changes.append(change)
                self._finish(run, ok)
        return changes

    def _fallback(self, run: TryRun) -> str | None:
        instruction = self.instructions.get(run.peer)
        return instruction.endpoint if instruction is not None and instruction.path == "relay" else None

    def _finish(self, run: TryRun, ok: bool) -> None:
        log.info(
            "%s try %d to %s: %s", run.punch.path, run.punch.id, run.punch.endpoint, "ok" if ok else "failed"
        )
        self.results[run.peer] = (run.punch.id, ok)
        del self.runs[run.peer]
        if not run.started:
            return
        self.pushed[run.peer] = run.punch.endpoint if ok else self._fallback(run)

    def remember(self, changes: Iterable[PeerConfig]) -> None:
        """Note the instruction endpoints that the roster reconcile pushed to the device."""
        for change in changes:
            instruction = self.instructions.get(change.public_key)
            if (
                change.endpoint is not None
                and instruction is not None
                and change.endpoint == instruction.endpoint
            ):
                self.pushed[change.public_key] = change.endpoint

    def report(
        self,
        device: DeviceStatus,
        lan: tuple[str, ...],
        relay: bool,
        relay_ports: Mapping[str, tuple[int, int]] | None = None,
    ) -> MemberReport:
        """This member's ``/v1/report``: LAN candidates, the device's view of each peer, try outcomes.

        Only peers the coordinator gives instructions for are listed: it plans no others, and the
        report stays well under its 16 KiB cap.
        """
        peers = {
            peer.public_key: PeerReport(peer.endpoint, peer.last_handshake, peer.rx_bytes, peer.tx_bytes)
            for peer in device.peers
            if peer.public_key in self.instructions
        }
        return MemberReport(
            lan=lan, relay=relay, peers=peers, tries=dict(self.results), relay_ports=dict(relay_ports or {})
        )
