"""``shardpool mesh ...``: create, join, inspect and leave the WireGuard mesh.

Every command takes ``--state-dir`` (default ``$SHARDPOOL_HOME``, then ``/var/lib/shardpool``
for root or ``~/.local/share/shardpool``). Commands that print a join token print it alone on
the last line of their output, so scripts can take it with ``tail -n 1``.
"""

from __future__ import annotations

import argparse
import getpass
import importlib.util
import json
import os
import secrets
import shutil
import socket
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mesh.addresses import (
    DEFAULT_CIDR,
    first_address,
    parse_cidr,
    parse_endpoint,
    parse_interface_name,
)
from mesh.constants import TOKEN_ENV, WIREGUARD_PORT
from mesh.control.client import request_join, send_leave
from mesh.control.model import RosterEntry, check_name
from mesh.control.roster import Invite, RosterStore
from mesh.control.token import TOKEN_PREFIX, JoinToken, find_token_text, new_token, parse_token, secret_hash
from mesh.daemon import log_tail, read_pid, spawn_detached, stop_process
from mesh.errors import MeshError
from mesh.node.api import current_roster, device_status
from mesh.node.config import (
    DEFAULT_INTERFACE,
    DEFAULT_KEEPALIVE,
    DEFAULT_MTU,
    MeshConfig,
    load_config,
    save_config,
)
from mesh.node.member import bring_down, bring_up, save_cached_roster, start_syncd, syncd_running
from mesh.node.probe import probe_all
from mesh.state import StatePaths, read_json, resolve_state_dir
from mesh.units import format_age, format_bytes, parse_duration
from mesh.wireguard.choice import BACKENDS, choose_backend
from mesh.wireguard.keys import generate_private_key, public_key, read_private_key, write_private_key
from mesh.wireguard.wgquick import WgQuickConfig, WgQuickPeer, render_wgquick, write_wgquick

__all__ = ["TOKEN_ENV", "add_mesh_commands", "build_parser", "main", "read_join_token"]

_MAX_TOKEN_TEXT = 64 * 1024  # a token is about 150 characters; all of `mesh init`'s output is under 1 KiB
_TOKEN_SOURCES = f"the TOKEN argument, '-' for standard input, --token-file PATH, or {TOKEN_ENV}"


# The shardpool agent (``shardpool agent``, :data:`AGENT_PORT` on the mesh address) lets launchers on other
# members start training stages here. It is started as a separate program, only when the shardpool
# package is installed, because this package never imports shardpool or torch.
def _shardpool_agent_files(paths: StatePaths) -> tuple[Path, Path, Path, Path]:
    """Pid file, log, ready file and the ``--no-agent`` marker of the shardpool agent."""
    return (
        paths.run / "shardpool-agent.pid",
        paths.logs / "shardpool-agent.log",
        paths.run / "shardpool-agent.json",
        paths.root / "shardpool-agent.disabled",
    )


def _start_shardpool_agent(paths: StatePaths, timeout: float = 15.0) -> str:
    """Start ``shardpool agent`` detached and wait until it listens; return one line saying what happened.

    Never raises: the mesh works without the agent, so a failure is reported, not fatal.
    """
    pid_file, log_file, ready_file, disabled = _shardpool_agent_files(paths)
    if disabled.exists():
        return f"shardpool agent: not started (disabled with --no-agent; delete {disabled} to enable it)"
    running = read_pid(pid_file)
    if running is not None:
        return f"shardpool agent: already running (pid {running})"
    spec = importlib.util.find_spec("shardpool")
    if spec is None or spec.origin is None:
        return "shardpool agent: not started (the shardpool package is not installed here)"
    package_parent = str(Path(spec.origin).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, PYTHONPATH=package_parent + (os.pathsep + path if path else ""))
    ready_file.unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        "shardpool",
        "agent",
        "--state-dir",
        str(paths.root),
        "--ready-file",
        str(ready_file),
    ]
    pid = spawn_detached(argv, pid_file, log_file, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if read_pid(pid_file) != pid:
            return f"shardpool agent: could not start: {log_tail(log_file, 2)} (log: {log_file})"
        if ready_file.exists():
            try:
                ready = read_json(ready_file)
            except MeshError:
                ready = {}
            if ready.get("pid") == pid:
                return f"shardpool agent: listening on {ready.get('url')} (pid {pid}; log {log_file})"
        time.sleep(0.05)
    stop_process(pid_file)
    return f"shardpool agent: not ready within {timeout:.0f} s, stopped it: {log_tail(log_file, 2)}"


def _stop_shardpool_agent(paths: StatePaths) -> None:
    """Stop the shardpool agent (and so its jobs) if it runs."""
    pid_file, _, ready_file, _ = _shardpool_agent_files(paths)
    stop_process(pid_file, timeout=10.0)
    ready_file.unlink(missing_ok=True)


def _agent_choice(paths: StatePaths, no_agent: bool) -> str:
    """Remember ``--no-agent`` (until ``leave``) or start the agent; return the line to print."""
    if no_agent:
        _shardpool_agent_files(paths)[3].touch()
        return "shardpool agent: not started (--no-agent); this machine cannot host remote training stages"
    return _start_shardpool_agent(paths)


def _paths(args: argparse.Namespace) -> StatePaths:
    return StatePaths(resolve_state_dir(args.state_dir))


def _require_root(action: str) -> None:
    if os.geteuid() != 0:
        raise MeshError(
            f"`shardpool mesh {action}` changes network interfaces and needs root: run it with sudo"
        )


def _require_no_mesh(paths: StatePaths) -> None:
    if paths.config.exists() or paths.database.exists():
        raise MeshError(
            f"{paths.root} already holds a mesh: run `shardpool mesh leave` first, or use another --state-dir"
        )


def _default_name() -> str:
    cleaned = "".join(c if c.isalnum() else "-" for c in socket.gethostname().lower()).strip("-")
    return (cleaned or "machine")[:63]


def _mtu(value: int | None) -> int | None:
    if value is not None and not 1280 <= value <= 9000:
        raise MeshError(f"--mtu {value} is out of range: use 1280-9000 (1420 suits most links)")
    return value


def _discard_state(paths: StatePaths) -> None:
    """Remove what a failed ``init``/``join`` created, keeping logs for diagnosis."""
    for path in (paths.config, paths.private_key, paths.roster, paths.syncd_status):
        path.unlink(missing_ok=True)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{paths.database}{suffix}").unlink(missing_ok=True)


def _issue_token(
    paths: StatePaths, config: MeshConfig, ttl: str, uses: int, member_name: str | None = None
) -> JoinToken:
    seconds = parse_duration(ttl)
    if uses < 1:
        raise MeshError("--uses must be at least 1")
    token = new_token(config.public_key, config.coordinator_endpoint, seconds)
    RosterStore(paths.database).add_token(
        token.token_id, secret_hash(token.secret), token.expires_at, uses, member_name=member_name
    )
    return token


def _print_token(token: JoinToken, ttl: str, uses: int, member_name: str | None = None) -> None:
    plural = "s" if uses != 1 else ""
    made_for = f" for {member_name!r}" if member_name else ""
    name_option = f" --name {member_name}" if member_name else ""
    print(f"Join token {token.token_id.hex()}{made_for} (valid {ttl}, {uses} use{plural}).")
    print("On another machine run this and paste the token (or pipe it in), so it stays out of `ps`:")
    print(f"  shardpool mesh join -{name_option} --endpoint THAT_MACHINE:PORT")
    print(token.encode())


def cmd_init(args: argparse.Namespace) -> int:
    """Create a mesh: keys, database, interface on the first address, coordinator, first token."""
    paths = _paths(args)
    _require_no_mesh(paths)
    network = parse_cidr(args.cidr)
    interface = parse_interface_name(args.interface)
    _, endpoint_port = parse_endpoint(args.endpoint)
    name = check_name(args.name or _default_name())
    mtu = _mtu(args.mtu) or DEFAULT_MTU
    parse_duration(args.ttl)
    _require_root("init")
    backend = choose_backend(args.backend)
    paths.ensure()
    private_key = generate_private_key()
    own_key = public_key(private_key)
    listen_port = args.listen_port or endpoint_port
    address = first_address(network)
    config = MeshConfig(
        role="coordinator",
        mesh_id=secrets.token_hex(8),
        name=name,
        interface=interface,
        backend=backend,
        cidr=str(network),
        address=address,
        public_key=own_key,
        endpoint=args.endpoint,
        listen_port=listen_port,
        mtu=mtu,
        keepalive=DEFAULT_KEEPALIVE,
        coordinator_key=own_key,
        coordinator_endpoint=args.endpoint,
        coordinator_address=address,
        api_port=listen_port,
    )
    try:
        write_private_key(paths.private_key, private_key)
        store = RosterStore.create(
            paths.database,
            config.mesh_id,
            config.cidr,
            RosterEntry(name, address, own_key, args.endpoint, True),
        )
        save_config(paths, config)
        token = _issue_token(paths, config, args.ttl, args.uses)
        bring_up(paths, config, private_key, store.roster())
        try:
            start_syncd(paths)
        except BaseException:
            bring_down(paths, config)
            raise
    except BaseException:
        _discard_state(paths)
        raise
    agent_line = _agent_choice(paths, args.no_agent)
    print(f"Created mesh {config.mesh_id} ({config.cidr}) with {backend} WireGuard on {interface}.")
    print(f"This machine is {name!r} at {address}; the coordinator listens on {args.endpoint} (UDP and TCP).")
    print(agent_line)
    _print_token(token, args.ttl, args.uses)
    return 0


def _require_coordinator(config: MeshConfig, action: str) -> None:
    if not config.is_coordinator:
        raise MeshError(
            f"this machine is a member, not the coordinator: run `shardpool mesh {action}` on "
            f"{config.coordinator_endpoint}"
        )


def cmd_invite(args: argparse.Namespace) -> int:
    """Print another join token, or list or revoke the invites (coordinator only)."""
    paths = _paths(args)
    config = load_config(paths)
    _require_coordinator(config, "invite")
    issue_options = [
        o for o, v in (("--ttl", args.ttl), ("--uses", args.uses), ("--name", args.name)) if v is not None
    ]
    mode = "--list" if args.list else "--revoke" if args.revoke is not None else None
    if mode and issue_options:
        raise MeshError(f"{mode} does not take {', '.join(issue_options)}: those options are for a new token")
    if args.json and not args.list:
        raise MeshError("--json only goes with --list")
    store = RosterStore(paths.database)
    if args.list:
        _list_invites(store.invites(), args.json)
    elif args.revoke is not None:
        _revoke_invite(store, args.revoke)
    else:
        ttl = args.ttl or "24h"
        uses = 1 if args.uses is None else args.uses
        member_name = check_name(args.name) if args.name else None
        _print_token(_issue_token(paths, config, ttl, uses, member_name), ttl, uses, member_name)
    return 0


def _utc(stamp: float | None) -> str:
    return "-" if stamp is None else time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(stamp))


def _list_invites(invites: list[Invite], as_json: bool) -> None:
    now = time.time()
    if as_json:
        json.dump([invite.to_json(now) for invite in invites], sys.stdout, indent=2, sort_keys=True)
        print()
        return
    table = [("ID", "CREATED", "EXPIRES", "USES LEFT", "STATE", "FOR", "JOINED")]
    for invite in invites:
        table.append(
            (
                invite.token_id,
                _utc(invite.created_at),
                _utc(invite.expires_at),
                str(invite.uses_left),
                invite.state(now),
                invite.member_name or "-",
                ",".join(invite.joined) or "-",
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())


def _invite_id(text: str) -> bytes:
    """An invite id from ``--revoke``: the 16 hex digits that --list shows, or the whole token."""
    cleaned = text.strip()
    if cleaned.startswith(TOKEN_PREFIX):
        return parse_token(cleaned).token_id
    if len(cleaned) != 16 or any(c not in "0123456789abcdefABCDEF" for c in cleaned):
        raise MeshError(
            f"invite id {cleaned[:40]!r} is not 16 hex digits: copy it from `shardpool mesh invite --list`"
        )
    return bytes.fromhex(cleaned)


def _revoke_invite(store: RosterStore, text: str) -> None:
    invite, revoked_now = store.revoke_invite(_invite_id(text))
    made_for = f" (made for {invite.member_name!r})" if invite.member_name else ""
    if revoked_now:
        print(f"Revoked invite {invite.token_id}{made_for}: the coordinator refuses it from now on.")
    else:
        print(f"Invite {invite.token_id}{made_for} was already revoked at {_utc(invite.revoked_at)}.")


def _read_limited(read: Callable[[int], bytes | str], what: str) -> str:
    data = read(_MAX_TOKEN_TEXT + 1)
    if len(data) > _MAX_TOKEN_TEXT:
        raise MeshError(f"{what} holds more than {_MAX_TOKEN_TEXT} bytes: it is not a join token")
    if isinstance(data, bytes):
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise MeshError(f"{what} is not text: it is not a join token") from None
    return str(data)


def _read_fd(fd: int, limit: int) -> bytes:
    """Read up to ``limit`` bytes or to the end, even from a pipe that delivers them in pieces."""
    data = b""
    while len(data) < limit:
        chunk = os.read(fd, limit - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _read_token_file(path: str) -> str:
    """Read a token file, refusing one that other users can read or change (like ssh's key files)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOCTTY)
    except OSError as error:
        raise MeshError(f"cannot open --token-file {path} ({error.strerror})") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise MeshError(f"--token-file {path} is a directory: give the file that holds the token")
        loose = stat.S_IMODE(info.st_mode) & 0o066
        if loose:
            who = "readable" if loose & 0o044 else "writable"
            raise MeshError(
                f"--token-file {path} is {who} by other users (mode {stat.S_IMODE(info.st_mode):04o}): "
                f"run `chmod 600 {path}` and retry"
            )
        return _read_limited(lambda size: _read_fd(fd, size), f"--token-file {path}")
    finally:
        os.close(fd)


def _read_token_stdin() -> str:
    if sys.stdin is None or sys.stdin.closed:
        raise MeshError("the token is '-' but standard input is closed: pipe the token in")
    if sys.stdin.isatty():
        return getpass.getpass("Join token (input hidden): ")
    return _read_limited(sys.stdin.read, "standard input")


def read_join_token(argument: str | None, token_file: str | None) -> JoinToken:
    """Read the join token from exactly one source: argv, '-' (stdin), a file or the environment.

    argv is the least private (any local user sees it in ``ps``); the others keep it out of the
    process list. Zero or several sources is a one-line error, so a stale ``SHARDPOOL_JOIN_TOKEN``
    never silently wins over the token the user typed.
    """
    environment = os.environ.get(TOKEN_ENV, "").strip()
    sources = [
        name
        for name, given in (
            ("the TOKEN argument", argument not in (None, "-")),
            ("'-' (standard input)", argument == "-"),
            ("--token-file", token_file is not None),
            (TOKEN_ENV, bool(environment)),
        )
        if given
    ]
    if not sources:
        raise MeshError(f"no join token given: pass it as {_TOKEN_SOURCES}")
    if len(sources) > 1:
        raise MeshError(f"join token given {len(sources)} ways ({', '.join(sources)}): use exactly one")
    if token_file is not None:
        text, where = _read_token_file(token_file), f"--token-file {token_file}"
    elif argument == "-":
        text, where = _read_token_stdin(), "standard input"
    elif argument is not None:
        text, where = argument, "the TOKEN argument"
    else:
        text, where = environment, TOKEN_ENV
    if not text.strip():
        raise MeshError(f"{where} is empty: it should hold the token printed by `shardpool mesh invite`")
    return parse_token(find_token_text(text))


def cmd_join(args: argparse.Namespace) -> int:
    """Join a mesh with a token: local keys, authenticated exchange, interface, background sync."""
    token = read_join_token(args.token, args.token_file)
    token.check_not_expired()
    paths = _paths(args)
    _require_no_mesh(paths)
    interface = parse_interface_name(args.interface)
    endpoint_port = parse_endpoint(args.endpoint)[1] if args.endpoint else None
    name = check_name(args.name or _default_name())
    mtu = _mtu(args.mtu)
    _require_root("join")
    backend = choose_backend(args.backend)
    paths.ensure()
    private_key = generate_private_key()
    own_key = public_key(private_key)
    try:
        write_private_key(paths.private_key, private_key)
        result = request_join(token, name, own_key, args.endpoint)
    except BaseException:
        _discard_state(paths)
        raise
    config = MeshConfig(
        role="member",
        mesh_id=result.roster.mesh_id,
        name=result.member.name,
        interface=interface,
        backend=backend,
        cidr=result.roster.cidr,
        address=result.member.address,
        public_key=own_key,
        endpoint=args.endpoint,
        listen_port=args.listen_port or endpoint_port or WIREGUARD_PORT,
        mtu=mtu or result.mtu,
        keepalive=result.keepalive,
        coordinator_key=token.coordinator_key,
        coordinator_endpoint=token.endpoint,
        coordinator_address=result.coordinator_address,
        api_port=result.api_port,
    )
    save_config(paths, config)
    save_cached_roster(paths, result.roster)
    try:
        bring_up(paths, config, private_key, result.roster)
        start_syncd(paths)
    except MeshError as error:
        bring_down(paths, config)
        raise MeshError(
            f"joined as {config.name!r} ({config.address}) but could not start: {error}; fix it and run `shardpool mesh up`"
        ) from None
    peers = len(result.roster.members) - 1
    print(
        f"Joined mesh {config.mesh_id} as {config.name!r} at {config.address} on {interface} ({backend} WireGuard)."
    )
    print(f"{peers} peer{'s' if peers != 1 else ''} configured; the roster stays in sync in the background.")
    print(_agent_choice(paths, args.no_agent))
    return 0


def _status_report(paths: StatePaths, config: MeshConfig) -> dict[str, Any]:
    roster = current_roster(paths, config)
    device = device_status(paths, config)
    others = [m.address for m in roster.members if m.public_key != config.public_key]
    reachable = probe_all(others, timeout=1.0) if device is not None else {}
    sync = read_json(paths.syncd_status) if paths.syncd_status.exists() else {}
    now = time.time()
    rows = []
    for entry in roster.members:
        own = entry.public_key == config.public_key
        peer = device.peer(entry.public_key) if device is not None else None
        rows.append(
            {
                "name": entry.name,
                "address": entry.address,
                "public_key": entry.public_key,
                "endpoint": (peer.endpoint if peer and peer.endpoint else entry.endpoint),
                "coordinator": entry.coordinator,
                "self": own,
                "last_handshake": peer.last_handshake if peer else None,
                "handshake_age": (now - peer.last_handshake) if peer and peer.last_handshake else None,
                "rx_bytes": peer.rx_bytes if peer else 0,
                "tx_bytes": peer.tx_bytes if peer else 0,
                "reachable": (device is not None) if own else reachable.get(entry.address, False),
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
    header = ("NAME", "ADDRESS", "ENDPOINT", "HANDSHAKE", "RX", "TX", "REACHABLE")
    table = [header]
    for row in report["members"]:
        name = row["name"] + (" (self)" if row["self"] else "") + (" *" if row["coordinator"] else "")
        table.append(
            (
                name,
                row["address"],
                row["endpoint"] or "-",
                "-" if row["self"] else format_age(row["handshake_age"]),
                "-" if row["self"] else format_bytes(row["rx_bytes"]),
                "-" if row["self"] else format_bytes(row["tx_bytes"]),
                "yes" if row["reachable"] else "NO",
            )
        )
    widths = [max(len(str(line[i])) for line in table) for i in range(len(header))]
    for line in table:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
    print("(* = coordinator)")


def cmd_status(args: argparse.Namespace) -> int:
    """Show every member: address, endpoint, last handshake, traffic and reachability."""
    paths = _paths(args)
    report = _status_report(paths, load_config(paths))
    if args.json:
        json.dump(report, sys.stdout, indent=2, sort_keys=True)
        print()
    else:
        _print_status(report)
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    """Revoke a member on the coordinator; every machine drops it at its next sync."""
    paths = _paths(args)
    config = load_config(paths)
    if not config.is_coordinator:
        raise MeshError(
            f"only the coordinator can remove members: run this on the coordinator ({config.coordinator_endpoint})"
        )
    name = check_name(args.name)
    removal = RosterStore(paths.database).remove(name)
    if removal.member is not None:
        entry = removal.member
        print(
            f"Removed {entry.name!r} ({entry.address}); every machine drops it within {config.sync_interval * 2:.0f} s."
        )
        print("Its address is retired and will not be given to another machine.")
    else:
        print(f"No active member is called {name!r}.")
    if removal.revoked_invites:
        count = len(removal.revoked_invites)
        print(
            f"Revoked {count} invite{'s' if count != 1 else ''} made for or used by {name!r}: "
            f"{', '.join(removal.revoked_invites)}."
        )
    return 0


def _delete_state(paths: StatePaths) -> None:
    _discard_state(paths)
    for directory in (paths.run, paths.logs):
        shutil.rmtree(directory, ignore_errors=True)


def cmd_leave(args: argparse.Namespace) -> int:
    """Leave the mesh: tell the coordinator, remove the interface, delete keys and state."""
    paths = _paths(args)
    config = load_config(paths)
    _require_root("leave")
    if config.is_coordinator:
        others = [m for m in RosterStore(paths.database).roster().members if not m.coordinator]
        if others and not args.force:
            raise MeshError(
                f"this machine coordinates a mesh with {len(others)} other member(s); leaving dismantles it "
                "(members keep their current peers but nobody can join): rerun with --force"
            )
    else:
        try:
            send_leave(
                config.coordinator_address,
                config.api_port,
                read_private_key(paths.private_key),
                config.coordinator_key,
                config.mesh_id,
                timeout=3.0,
            )
        except MeshError as error:
            print(
                f"warning: could not tell the coordinator ({error}); ask it to run `shardpool mesh remove {config.name}`"
            )
    _stop_shardpool_agent(paths)
    bring_down(paths, config)
    _delete_state(paths)
    _shardpool_agent_files(paths)[3].unlink(missing_ok=True)
    print(
        f"Left mesh {config.mesh_id}: interface {config.interface} removed and state in {paths.root} deleted."
    )
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    """Stop the background processes and remove the interface, keeping the state for `up`."""
    paths = _paths(args)
    config = load_config(paths)
    _require_root("down")
    _stop_shardpool_agent(paths)
    bring_down(paths, config)
    save_config(paths, config.with_changes(down=True))
    print(
        f"Mesh interface {config.interface} is down; run `shardpool mesh up` to restore it from {paths.root}."
    )
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    """Recreate the interface and restart the agent from saved state."""
    paths = _paths(args)
    config = load_config(paths)
    _require_root("up")
    if syncd_running(paths) and device_status(paths, config) is not None:
        print(f"Mesh interface {config.interface} is already up.")
        print(_start_shardpool_agent(paths))
        return 0
    _stop_shardpool_agent(paths)
    bring_down(paths, config)
    private_key = read_private_key(paths.private_key)
    roster = current_roster(paths, config)
    bring_up(paths, config, private_key, roster)
    try:
        start_syncd(paths)
    except BaseException:
        bring_down(paths, config)
        raise
    save_config(paths, config.with_changes(down=False))
    print(
        f"Mesh interface {config.interface} is up at {config.address} with {len(roster.members) - 1} peer(s)."
    )
    print(_start_shardpool_agent(paths))
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
    paths = _paths(args)
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


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir", help="mesh state directory (default: $SHARDPOOL_HOME, /var/lib/shardpool as root)"
    )


def add_mesh_commands(commands: argparse._SubParsersAction) -> None:
    """Register ``shardpool mesh`` and its sub-commands on the top-level parser."""
    mesh = commands.add_parser("mesh", help="create and join a WireGuard mesh", description=__doc__)
    _add_subcommands(mesh)


def _add_subcommands(mesh: argparse.ArgumentParser) -> None:
    sub = mesh.add_subparsers(dest="mesh_command", required=True, metavar="MESH_COMMAND")

    init = sub.add_parser("init", help="create a mesh on this machine and start its coordinator")
    init.add_argument(
        "--endpoint", required=True, help="HOST:PORT where other machines reach this one (UDP and TCP)"
    )
    init.add_argument("--cidr", default=DEFAULT_CIDR, help=f"mesh address range (default {DEFAULT_CIDR})")
    init.add_argument("--name", help="this machine's member name (default: host name)")
    init.add_argument(
        "--interface",
        default=DEFAULT_INTERFACE,
        help=f"WireGuard interface name (default {DEFAULT_INTERFACE})",
    )
    init.add_argument("--listen-port", type=int, help="local UDP/TCP port (default: the endpoint's port)")
    init.add_argument("--mtu", type=int, help=f"interface MTU (default {DEFAULT_MTU})")
    init.add_argument(
        "--backend", choices=BACKENDS, help="force kernel or userspace WireGuard (default: probe)"
    )
    init.add_argument("--ttl", default="24h", help="lifetime of the first join token (default 24h)")
    init.add_argument(
        "--uses", type=int, default=1, help="how many machines the first token admits (default 1)"
    )
    init.add_argument(
        "--no-agent",
        action="store_true",
        help="do not start the shardpool agent (no remote training stages here)",
    )
    init.set_defaults(handler=cmd_init)

    invite = sub.add_parser(
        "invite", help="print another join token, or list and revoke invites (on the coordinator)"
    )
    invite.add_argument("--ttl", help="token lifetime, e.g. 30m, 24h, 7d (default 24h)")
    invite.add_argument("--uses", type=int, help="how many machines it admits (default 1)")
    invite.add_argument(
        "--name",
        help="the member this token is for: only a machine joining with that --name is admitted, "
        "and `mesh remove NAME` revokes the token",
    )
    invite_mode = invite.add_mutually_exclusive_group()
    invite_mode.add_argument(
        "--list", action="store_true", help="list every invite: id, dates, uses left, state, name"
    )
    invite_mode.add_argument(
        "--revoke", metavar="ID", help="revoke the invite with this id (from --list) so it admits nobody"
    )
    invite.add_argument("--json", action="store_true", help="with --list: print JSON instead of a table")
    invite.set_defaults(handler=cmd_invite)

    join = sub.add_parser(
        "join",
        help="join a mesh with a token",
        description="Join a mesh with a token. Give the token in exactly one way. On the command line "
        "it is visible to every local user in `ps`, so prefer '-' (paste it, or pipe it in), "
        f"--token-file, or the {TOKEN_ENV} environment variable.",
    )
    join.add_argument(
        "token",
        nargs="?",
        metavar="TOKEN",
        help="the token printed by `mesh init` or `mesh invite`, or '-' to read it from standard input "
        "(hidden when typed at a terminal)",
    )
    join.add_argument(
        "--token-file",
        metavar="PATH",
        help="read the token from this file; it must not be readable or writable by other users (chmod 600)",
    )
    join.add_argument(
        "--endpoint",
        help="HOST:PORT where other machines reach this one; omit behind NAT without a port forward",
    )
    join.add_argument("--name", help="this machine's member name (default: host name)")
    join.add_argument(
        "--interface",
        default=DEFAULT_INTERFACE,
        help=f"WireGuard interface name (default {DEFAULT_INTERFACE})",
    )
    join.add_argument(
        "--listen-port",
        type=int,
        help=f"local UDP port (default: the endpoint's port, else {WIREGUARD_PORT})",
    )
    join.add_argument("--mtu", type=int, help="interface MTU (default: the mesh's)")
    join.add_argument(
        "--backend", choices=BACKENDS, help="force kernel or userspace WireGuard (default: probe)"
    )
    join.add_argument(
        "--no-agent",
        action="store_true",
        help="do not start the shardpool agent (no remote training stages here)",
    )
    join.set_defaults(handler=cmd_join)

    status = sub.add_parser("status", help="show members, handshakes, traffic and reachability")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.set_defaults(handler=cmd_status)

    remove = sub.add_parser("remove", help="revoke a member (on the coordinator)")
    remove.add_argument("name", help="member name, as in `mesh status`")
    remove.set_defaults(handler=cmd_remove)

    leave = sub.add_parser("leave", help="leave the mesh and delete this machine's mesh state")
    leave.add_argument(
        "--force", action="store_true", help="on the coordinator: dismantle a mesh that has members"
    )
    leave.set_defaults(handler=cmd_leave)

    down = sub.add_parser("down", help="stop the interface and background processes, keep the state")
    down.set_defaults(handler=cmd_down)
    up = sub.add_parser("up", help="restart the interface and background processes from saved state")
    up.set_defaults(handler=cmd_up)

    export = sub.add_parser("export-config", help="write a wg-quick file for hand-managed machines")
    export.add_argument("-o", "--output", help="file to write (default IFNAME.conf; '-' for standard output)")
    export.set_defaults(handler=cmd_export_config)

    for parser in (init, invite, join, status, remove, leave, down, up, export):
        _common(parser)


def build_parser() -> argparse.ArgumentParser:
    """Build a stand-alone parser, so ``python -m mesh`` works without the shardpool package."""
    parser = argparse.ArgumentParser(prog="python -m mesh", description=__doc__)
    _add_subcommands(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one mesh command stand-alone, printing a MeshError as one line (exit 2)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except MeshError as error:
        print(f"shardpool: error: {error}", file=sys.stderr)
        return 2
