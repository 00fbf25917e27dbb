"""This machine's side of the mesh: bring the interface up or down, apply rosters, run the sync daemon.

Used by the commands (``init``, ``join``, ``up``, ``down``, ``leave``) and by the background
sync daemon, so both act on the interface in exactly the same way.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from mesh.addresses import resolve_endpoint
from mesh.control.model import Roster
from mesh.daemon import log_tail, read_pid, spawn_detached, stop_process
from mesh.errors import MeshError
from mesh.files import write_json
from mesh.node.config import MeshConfig
from mesh.node.punch import PathFollower
from mesh.node.reconcile import plan_peer_changes
from mesh.state import StatePaths, read_json
from mesh.wireguard.backend import WireGuardBackend
from mesh.wireguard.choice import make_backend
from mesh.wireguard.links import set_address, set_link_up

__all__ = [
    "syncd_running",
    "apply_roster",
    "run_tries",
    "backend_for",
    "bring_down",
    "bring_up",
    "load_cached_roster",
    "save_cached_roster",
    "start_syncd",
    "stop_syncd",
]


def backend_for(paths: StatePaths, config: MeshConfig) -> WireGuardBackend:
    """Build the backend this machine was set up with."""
    return make_backend(config.backend, paths.run, paths.logs)


def load_cached_roster(paths: StatePaths) -> Roster | None:
    """Read the cached roster, if there is one."""
    if not paths.roster.exists():
        return None
    return Roster.from_json(read_json(paths.roster))


def save_cached_roster(paths: StatePaths, roster: Roster) -> None:
    """Cache the roster atomically, so this machine keeps working while the coordinator is down."""
    write_json(paths.roster, roster.to_json(), mode=0o644)


def apply_roster(
    backend: WireGuardBackend,
    config: MeshConfig,
    roster: Roster,
    applied: Roster | None,
    follower: PathFollower | None = None,
) -> int:
    """Make the interface's peers match ``roster`` (and ``follower``'s path instructions); return the change count."""
    device = backend.show(config.interface)
    if follower is None:
        follower = PathFollower(config.keepalive)
    changes = plan_peer_changes(
        device,
        roster,
        config.public_key,
        config.keepalive,
        applied,
        resolve_endpoint,
        follower.instructions,
        follower.pushed,
        follower.busy(),
    )
    if changes:
        backend.update_peers(config.interface, changes)
    follower.remember(changes)
    return len(changes)


def run_tries(backend: WireGuardBackend, config: MeshConfig, follower: PathFollower, now: float) -> int:
    """Start and judge the hole-punch tries that are due at ``now``; return the change count."""
    if not follower.runs:
        return 0
    changes = follower.due(now, backend.show(config.interface))
    if changes:
        backend.update_peers(config.interface, changes)
    return len(changes)


def bring_up(paths: StatePaths, config: MeshConfig, private_key: str, roster: Roster | None) -> None:
    """Create and configure the interface: key, port, address, MTU, up, and peers from ``roster``.

    On any failure the half-made interface is removed again, so nothing is left behind.
    """
    backend = backend_for(paths, config)
    backend.create(config.interface)
    try:
        backend.configure(config.interface, private_key, config.listen_port)
        set_address(config.interface, config.address, config.prefixlen)
        set_link_up(config.interface, config.mtu)
        if roster is not None:
            apply_roster(backend, config, roster, None)
    except BaseException:
        backend.destroy(config.interface)
        raise


def _syncd_env() -> dict[str, str]:
    package_parent = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=package_parent + (os.pathsep + path if path else ""))


def syncd_running(paths: StatePaths) -> int | None:
    """Return the pid of this machine's sync daemon if it runs."""
    return read_pid(paths.syncd_pid)


def start_syncd(paths: StatePaths, timeout: float = 15.0) -> int:
    """Start the background sync daemon and wait until it reports ready (servers bound, roster applied)."""
    if syncd_running(paths):
        raise MeshError(
            f"the mesh sync daemon already runs (pid {syncd_running(paths)}): run `shardpool mesh down` first"
        )
    paths.syncd_status.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "mesh.node.syncd", "--state-dir", str(paths.root)]
    pid = spawn_detached(argv, paths.syncd_pid, paths.syncd_log, env=_syncd_env())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if read_pid(paths.syncd_pid) != pid:
            raise MeshError(f"the mesh sync daemon exited at start: {log_tail(paths.syncd_log)}")
        if paths.syncd_status.exists():
            status = read_json(paths.syncd_status)
            if status.get("pid") == pid and status.get("ready"):
                return pid
        time.sleep(0.05)
    stop_process(paths.syncd_pid)
    raise MeshError(
        f"the mesh sync daemon did not get ready within {timeout:.0f} s: {log_tail(paths.syncd_log)}"
    )


def stop_syncd(paths: StatePaths) -> bool:
    """Stop the background sync daemon if it runs."""
    return stop_process(paths.syncd_pid)


def bring_down(paths: StatePaths, config: MeshConfig) -> None:
    """Stop the sync daemon and remove the interface (and its wireguard-go); the saved state stays."""
    stop_syncd(paths)
    backend_for(paths, config).destroy(config.interface)
