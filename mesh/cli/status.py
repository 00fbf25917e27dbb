"""``mesh status`` (every member's address, path, endpoint, round trip, handshake, traffic and
reachability) and ``mesh export-config`` (this machine's wg-quick file, for hand-managed machines).

PATH is ``lan``, ``direct`` or ``relay`` as the coordinator's path planning last told this
machine (``-`` while a pair has no path yet); peers it gives no instruction for (the coordinator,
members with an ``--endpoint``) count as ``direct`` while their handshake is fresh. ENDPOINT is
what the device uses now; RTT is one echo over the mesh address, so it measures that path.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from mesh.cli.common import print_table, state_paths
from mesh.node.api import current_roster, device_status
from mesh.node.config import MeshConfig, load_config
from mesh.node.member import syncd_running
from mesh.node.probe import probe_rtts
from mesh.state import StatePaths, read_json
from mesh.units import format_age, format_bytes
from mesh.wireguard.keys import read_private_key
from mesh.wireguard.wgquick import WgQuickConfig, WgQuickPeer, render_wgquick, write_wgquick

__all__ = ["cmd_export_config", "cmd_status", "export_config", "path_of"]

FRESH_HANDSHAKE_S = 180.0
"""A peer without a path instruction counts as ``direct`` while its last handshake is this recent."""


def path_of(instructed: str | None, handshake_age: float | None) -> str | None:
    """The path to show for a peer: the coordinator's word, else ``direct`` on a fresh handshake."""
    if instructed is not None:
        return instructed if instructed in ("lan", "direct", "relay") else None
    if handshake_age is not None and handshake_age <= FRESH_HANDSHAKE_S:
        return "direct"
    return None


def _status_report(paths: StatePaths, config: MeshConfig) -> dict[str, Any]:
    roster = current_roster(paths, config)
    device = device_status(paths, config)
    others = [m.address for m in roster.members if m.public_key != config.public_key]
    rtts = probe_rtts(others, timeout=1.0) if device is not None else {}
    sync = read_json(paths.syncd_status) if paths.syncd_status.exists() else {}
    instructed = sync.get("paths") if isinstance(sync.get("paths"), dict) else {}
    now = time.time()
    rows = []
    for entry in roster.members:
        own = entry.public_key == config.public_key
        peer = device.peer(entry.public_key) if device is not None else None
        age = (now - peer.last_handshake) if peer and peer.last_handshake else None
        rtt = rtts.get(entry.address)
        rows.append(
            {
                "name": entry.name,
                "address": entry.address,
                "public_key": entry.public_key,
                "endpoint": (peer.endpoint if peer and peer.endpoint else entry.endpoint),
                "coordinator": entry.coordinator,
                "self": own,
                "last_handshake": peer.last_handshake if peer else None,
                "handshake_age": age,
                "path": None if own else path_of(instructed.get(entry.public_key), age),
                "rtt_ms": None if own or rtt is None else round(rtt * 1000, 2),
                "rx_bytes": peer.rx_bytes if peer else 0,
                "tx_bytes": peer.tx_bytes if peer else 0,
                "reachable": (device is not None) if own else rtt is not None,
            }
        )
    return {
        "mesh_id": config.mesh_id,
        "name": config.name,
        "role": config.role,
        "interface": config.interface,
        "backend": config.backend,
        "address": config.address,
        "cidr": config.cidr,
        "interface_up": device is not None,
        "syncd_running": syncd_running(paths) is not None,
        "revision": roster.revision,
        "last_sync": sync.get("last_sync"),
        "sync_error": sync.get("last_error"),
        "removed": bool(sync.get("revoked")),
        "members": rows,
    }


def _print_status(report: dict[str, Any]) -> None:
    state = "up" if report["interface_up"] else "DOWN"
    syncd = "running" if report["syncd_running"] else "stopped"
    print(f"mesh {report['mesh_id']} {report['cidr']}: this machine is {report['name']!r} ({report['role']})")
    print(
        f"interface {report['interface']} ({report['backend']}): {state}; sync daemon: {syncd}; roster revision {report['revision']}"
    )
    if report["removed"]:
        print(
            "this machine was REMOVED from the mesh by the coordinator: run `shardpool mesh leave`, then join again"
        )
    elif report["sync_error"]:
        print(f"sync: {report['sync_error']}")
    table = [("NAME", "ADDRESS", "PATH", "ENDPOINT", "RTT", "HANDSHAKE", "RX", "TX", "REACHABLE")]
    for row in report["members"]:
        name = row["name"] + (" (self)" if row["self"] else "") + (" *" if row["coordinator"] else "")
        table.append(
            (
                name,
                row["address"],
                row["path"] or "-",
                row["endpoint"] or "-",
                "-" if row["rtt_ms"] is None else f"{row['rtt_ms']:.1f} ms",
                "-" if row["self"] else format_age(row["handshake_age"]),
                "-" if row["self"] else format_bytes(row["rx_bytes"]),
                "-" if row["self"] else format_bytes(row["tx_bytes"]),
                "yes" if row["reachable"] else "NO",
            )
        )
    print_table(table)
    print("(* = coordinator)")


def cmd_status(args: argparse.Namespace) -> int:
    """Show every member: address, endpoint, last handshake, traffic and reachability."""
    paths = state_paths(args)
    report = _status_report(paths, load_config(paths))
    if args.json:
        json.dump(report, sys.stdout, indent=2, sort_keys=True)
        print()
    else:
        _print_status(report)
    return 0


def export_config(paths: StatePaths, config: MeshConfig) -> WgQuickConfig:
    """Build this machine's wg-quick configuration from its state and roster."""
    roster = current_roster(paths, config)
    peers = tuple(
        WgQuickPeer(
            public_key=m.public_key,
            allowed_ips=(f"{m.address}/32",),
            endpoint=m.endpoint,
            persistent_keepalive=config.keepalive or None,
            comment=f"{m.name}{' (coordinator)' if m.coordinator else ''}",
        )
        for m in roster.members
        if m.public_key != config.public_key
    )
    return WgQuickConfig(
        private_key=read_private_key(paths.private_key),
        addresses=(f"{config.address}/{config.prefixlen}",),
        listen_port=config.listen_port,
        mtu=config.mtu,
        peers=peers,
    )


def cmd_export_config(args: argparse.Namespace) -> int:
    """Write a wg-quick file (mode 0600, it holds the private key) for a hand-managed machine."""
    paths = state_paths(args)
    config = load_config(paths)
    wgquick = export_config(paths, config)
    if args.output == "-":
        sys.stdout.write(render_wgquick(wgquick))
        return 0
    target = Path(args.output or f"{config.interface}.conf")
    write_wgquick(target, wgquick)
    print(
        f"Wrote {target} (mode 0600) with {len(wgquick.peers)} peer(s); load it with `wg-quick up {target.resolve()}`."
    )
    return 0
