"""The roster sync daemon of one machine: keeps its WireGuard peers equal to the roster.

On a member it reports its path candidates and try outcomes, then pulls the authenticated
roster and its path instructions from the coordinator over the mesh every ``sync_interval``
seconds, caches the roster atomically, applies both, and wakes on time for the hole-punch tries
it was given (:mod:`mesh.node.punch`); when the coordinator is unreachable it keeps the cached
roster. On the coordinator it also serves joins on the underlay endpoint and rosters on the mesh
address, reads the roster from SQLite, and plans every pair's path (:mod:`mesh.node.pathing`).

Run as ``python -m mesh.node.syncd --state-dir DIR``; normally started by ``shardpool mesh``.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from mesh.addresses import parse_endpoint
from mesh.control.client import Revoked, SyncReply, check_membership, send_report, sync_roster
from mesh.control.coordinator import CoordinatorService, start_join_server, start_roster_server
from mesh.control.model import Roster
from mesh.control.roster import RosterStore
from mesh.errors import MeshError
from mesh.files import write_json
from mesh.http.server import HTTPServer
from mesh.node.candidates import local_candidates
from mesh.node.config import MeshConfig, load_config
from mesh.node.member import apply_roster, backend_for, load_cached_roster, run_tries, save_cached_roster
from mesh.node.pathing import CoordinatorPaths, MemberRelay, ServiceRelay, start_relay
from mesh.node.punch import PathFollower
from mesh.relay.service import RelayService
from mesh.state import StatePaths
from mesh.wireguard.backend import WireGuardBackend
from mesh.wireguard.keys import read_private_key

__all__ = ["SyncDaemon", "main"]

log = logging.getLogger("shardpool.mesh.syncd")


class SyncDaemon:
    """One machine's sync loop, plus the coordinator's servers when this machine is the coordinator."""

    def __init__(self, paths: StatePaths) -> None:
        self.paths = paths
        self.config: MeshConfig = load_config(paths)
        self.private_key = read_private_key(paths.private_key)
        self.backend: WireGuardBackend = backend_for(paths, self.config)
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.servers: list[HTTPServer] = []
        self.applied: Roster | None = None
        self.follower = PathFollower(self.config.keepalive)
        self.planning: CoordinatorPaths | None = None
        self.relay_service: RelayService | None = None
        self.member_relay: MemberRelay | None = None
        if self.config.relay and not self.config.is_coordinator and self.config.endpoint:
            self.member_relay = MemberRelay(self.config.endpoint, self.config.relay_port_range)
        self._last_membership_check = -1e9
        self._report_error = ""
        self.status: dict[str, object] = {
            "pid": 0,
            "ready": False,
            "last_sync": None,
            "last_error": None,
            "revision": None,
        }

    def _start_servers(self) -> None:
        store = RosterStore(self.paths.database)
        settings = {
            "mtu": self.config.mtu,
            "keepalive": self.config.keepalive,
            "api_port": self.config.api_port,
        }
        service = CoordinatorService(store, self.private_key, settings, on_change=self.wake.set)
        self.planning = CoordinatorPaths(service.board, self.config.sync_interval, self._relay())
        host, _ = parse_endpoint(self.config.coordinator_endpoint)
        self.servers.append(start_join_server(service, host, self.config.listen_port))
        self.servers.append(start_roster_server(service, self.config.address, self.config.api_port))
        log.info(
            "coordinator serving joins on TCP %d and rosters on %s:%d",
            self.config.listen_port,
            self.config.address,
            self.config.api_port,
        )

    def _relay(self) -> ServiceRelay | None:
        """Start the relay this coordinator serves member pairs through (unless ``--no-relay``)."""
        if not self.config.relay:
            return None
        relay = start_relay(self.config.coordinator_endpoint, self.config.relay_port_range)
        self.relay_service = relay.service if relay is not None else None
        return relay

    def _fetch(self) -> SyncReply:
        if self.config.is_coordinator:
            return SyncReply(RosterStore(self.paths.database).roster(), {})
        return sync_roster(
            self.config.coordinator_address,
            self.config.api_port,
            self.private_key,
            self.config.coordinator_key,
            self.config.mesh_id,
            timeout=max(2.0, self.config.sync_interval * 2),
        )

    def _report(self) -> None:
        """Send this member's path report after a good sync; a coordinator without path planning (404) is fine."""
        try:
            device = self.backend.show(self.config.interface)
            lan = local_candidates(self.config.interface, self.config.cidr, self.config.listen_port)
            relaying = self.member_relay is not None
            opened = self.member_relay.opened if self.member_relay is not None else {}
            report = self.follower.report(device, lan, relaying, opened)
            send_report(
                self.config.coordinator_address, self.config.api_port, self.private_key,
                self.config.coordinator_key, self.config.mesh_id, report,
                timeout=max(2.0, self.config.sync_interval * 2),
            )  # fmt: skip
        except (MeshError, OSError) as error:  # a removal shows in the next roster pull
            if str(error) != self._report_error:
                log.warning("path report not taken (paths stay as they are): %s", error)
            self._report_error = str(error)
        else:
            self._report_error = ""

    def _write_status(self) -> None:
        self.status["pid"] = os.getpid()
        write_json(self.paths.syncd_status, self.status)

    def step(self) -> bool:
        """Sync once; return ``False`` when the daemon should stop (this machine was removed).

        Only a reply signed with the coordinator's pairwise key can say "removed"; an unsigned or
        mis-signed refusal is treated like an unreachable coordinator, and the cached roster stays.
        """
        try:
            reply = self._fetch()
        except Revoked as error:
            log.warning("%s", error)
            self._drop_all_peers()
            self.status.update(revoked=True, last_error=str(error))
            return False
        except (MeshError, OSError) as error:
            self.status["last_error"] = f"coordinator unreachable, using the cached roster: {error}"
            if self._removed():
                return False
            roster = self.applied or load_cached_roster(self.paths)
            if roster is None:
                return True
        else:
            roster = reply.roster
            self.follower.follow(reply.paths, (m.public_key for m in roster.members))
            if self.member_relay is not None:
                self.member_relay.serve(reply.relay_allocations)
            self.status.update(last_sync=time.time(), last_error=None)
            if self.applied is None or roster != self.applied:
                save_cached_roster(self.paths, roster)
        try:
            changes = apply_roster(self.backend, self.config, roster, self.applied, self.follower)
            self._paths_step(roster)
        except MeshError as error:
            self.status["last_error"] = f"cannot apply the roster: {error}"
            log.error("%s", error)
            return True
        if changes:
            log.info("applied roster revision %d (%d peer changes)", roster.revision, changes)
        if self.status["last_error"] is None and not self.config.is_coordinator:
            self._report()
        self.applied = roster
        self.status["revision"] = roster.revision
        return True

    def _paths_step(self, roster: Roster) -> None:
        """Plan paths (coordinator) or run the due tries (member), and note each peer's path in the status."""
        if self.planning is not None:
            self.planning.step(roster, self.backend.show(self.config.interface))
        self._punch()
        self.status["paths"] = {
            key: instruction.path for key, instruction in self.follower.instructions.items()
        }

    def _punch(self) -> None:
        try:
            changes = run_tries(self.backend, self.config, self.follower, time.time())
        except MeshError as error:
            log.error("cannot run a hole-punch try: %s", error)
            return
        if changes:
            log.info("hole punching: %d peer changes", changes)

    def _wait(self, next_sync: float) -> bool:
        """Sleep until the next sync or try event; return whether a full sync step is due."""
        timeout = next_sync - time.monotonic()
        event = self.follower.next_event()
        if event is not None:
            timeout = min(timeout, event - time.time())
        woken = self.wake.wait(max(0.0, timeout))
        self.wake.clear()
        return woken or time.monotonic() >= next_sync

    def _removed(self) -> bool:
        """After a failed sync, ask the coordinator's underlay endpoint (at most every 10 s) if we were removed.

        A removed member is cut off from the mesh, so this is how it learns of its removal.
        """
        now = time.monotonic()
        if self.config.is_coordinator or now - self._last_membership_check < 10.0:
            return False
        self._last_membership_check = now
        try:
            check_membership(
                self.config.coordinator_endpoint, self.private_key, self.config.coordinator_key,
                self.config.mesh_id, timeout=3.0,
            )  # fmt: skip
        except Revoked as error:
            log.warning("%s", error)
            self._drop_all_peers()
            self.status.update(revoked=True, last_error=str(error))
            return True
        except (MeshError, OSError):
            pass
        return False

    def _drop_all_peers(self) -> None:
        try:
            empty = Roster(self.config.mesh_id, self.config.cidr, 0, ())
            apply_roster(self.backend, self.config, empty, None)
        except MeshError as error:
            log.error("cannot remove peers: %s", error)

    def run(self) -> int:
        """Serve (on the coordinator) and sync until SIGTERM or removal from the mesh."""
        if self.config.is_coordinator:
            self._start_servers()
        keep_going = self.step()
        self.status["ready"] = True
        self._write_status()
        next_sync = time.monotonic() + self.config.sync_interval
        while keep_going and not self.stop.is_set():
            full = self._wait(next_sync)
            if self.stop.is_set():
                break
            if not full:
                self._punch()
                continue
            keep_going = self.step()
            self._write_status()
            next_sync = time.monotonic() + self.config.sync_interval
        for server in self.servers:
            server.stop()
        if self.relay_service is not None:
            self.relay_service.stop()
        if self.member_relay is not None:
            self.member_relay.stop()
        return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the daemon process."""
    parser = argparse.ArgumentParser(prog="python -m mesh.node.syncd", description=__doc__)
    parser.add_argument("--state-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr
    )
    try:
        daemon = SyncDaemon(StatePaths(Path(args.state_dir)))

        def _stop(signum: int, frame: FrameType | None) -> None:
            daemon.stop.set()
            daemon.wake.set()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        return daemon.run()
    except MeshError as error:
        log.error("%s", error)
        return 2
    except OSError as error:
        log.error("daemon stopped: %s", error)
        return 1 if error.errno != errno.EINTR else 0


if __name__ == "__main__":
    sys.exit(main())
