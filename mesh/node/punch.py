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
from mesh.control.report import MemberReport, PeerReport
from mesh.wireguard.backend import DeviceStatus, PeerConfig, PeerStatus

__all__ = ["PUNCH_KEEPALIVE", "SESSION_S", "PathFollower", "TryRun", "judge_try", "start_changes"]

log = logging.getLogger("shardpool.mesh.punch")

PUNCH_KEEPALIVE = 1
"""Persistent keepalive (seconds) during a try: every keepalive is a punch."""
SESSION_S = 180.0
"""WireGuard drops a session's keys this long after its handshake."""


@dataclass
class TryRun:
    """One try this member was given for ``peer``; ``at_start`` is the peer's status when it began."""

    peer: str
    punch: PunchTry
    at_start: PeerStatus | None = None

    @property
    def started(self) -> bool:
        """Whether the try's endpoint was set on the device."""
        return self.at_start is not None


def start_changes(punch: PunchTry, peer: PeerStatus) -> tuple[list[PeerConfig], PeerStatus]:
    """The changes that start ``punch`` on ``peer``, and the status to judge the try against.

    WireGuard sends a keepalive at once only when the persistent keepalive goes from 0 to
    non-zero, so it is set to 0 and then to :data:`PUNCH_KEEPALIVE` with the try endpoint: the
    first punch leaves at ``at``, not at the next 25 s tick. Without a live session (no handshake
    for :data:`SESSION_S`) that keepalive is a handshake initiation, which WireGuard sends at most
    every 5 s per peer, and failed attempts without an endpoint count too; so such a peer is
    removed and added again, which resets that clock (there is no session to lose).
    """
    punching = PeerConfig(peer.public_key, peer.allowed_ips, punch.endpoint, PUNCH_KEEPALIVE)
    live = peer.last_handshake is not None and punch.at - peer.last_handshake <= SESSION_S
    if live:
        quiet = PeerConfig(peer.public_key, peer.allowed_ips, punch.endpoint, 0)
        return [quiet, punching], peer
    fresh = replace(peer, endpoint=None, last_handshake=None, rx_bytes=0, tx_bytes=0)
    return [PeerConfig(peer.public_key, remove=True), punching], fresh


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
        running = {peer for peer, run in self.runs.items() if run.started}
        waiting = {
            peer
            for peer, instruction in self.instructions.items()
            if instruction.punch is not None
            and self.results.get(peer, (None, False))[0] == instruction.punch.id
        }
        return frozenset(running | waiting)

    def next_event(self) -> float | None:
        """The unix time of the next try start or judgement, if any, so the sync loop wakes for it."""
        times = [run.punch.at + (run.punch.window if run.started else 0.0) for run in self.runs.values()]
        return min(times, default=None)

    def due(self, now: float, device: DeviceStatus) -> list[PeerConfig]:
        """Start the tries whose time came and judge those whose window ended; return the changes."""
        changes: list[PeerConfig] = []
        for peer, run in list(self.runs.items()):
            status = device.peer(peer)
            end = run.punch.at + run.punch.window
            if not run.started:
                if now < run.punch.at:
                    continue
                if now > end or status is None:  # pulled too late, or the peer is not on the device
                    self._finish(run, False)
                    continue
                started, run.at_start = start_changes(run.punch, status)
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
