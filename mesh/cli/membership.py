"""``mesh init``, ``mesh join`` and ``mesh leave``: create a mesh, enter one with a token, leave it.

Each either completes or removes what it created (keys, database, interface), keeping logs.
"""

from __future__ import annotations

import argparse
import secrets
import shutil

from mesh.addresses import first_address, parse_cidr, parse_endpoint, parse_interface_name
from mesh.cli.agent_process import agent_choice, shardpool_agent_files, stop_shardpool_agent
from mesh.cli.common import (
    checked_mtu,
    default_name,
    discard_state,
    require_no_mesh,
    require_root,
    state_paths,
)
from mesh.cli.tokens import issue_token, print_token, read_join_token
from mesh.constants import WIREGUARD_PORT
from mesh.control.client import request_join, send_leave
from mesh.control.model import RosterEntry, check_name
from mesh.control.roster import RosterStore
from mesh.errors import MeshError
from mesh.node.config import (
    DEFAULT_KEEPALIVE,
    DEFAULT_MTU,
    MeshConfig,
    default_relay_ports,
    load_config,
    parse_relay_ports,
    save_config,
)
from mesh.node.member import bring_down, bring_up, save_cached_roster, start_syncd
from mesh.state import StatePaths
from mesh.units import parse_duration
from mesh.wireguard.choice import choose_backend
from mesh.wireguard.keys import generate_private_key, public_key, read_private_key, write_private_key

__all__ = ["cmd_init", "cmd_join", "cmd_leave"]


def cmd_init(args: argparse.Namespace) -> int:
    """Create a mesh: keys, database, interface on the first address, coordinator, first token."""
    paths = state_paths(args)
    require_no_mesh(paths)
    network = parse_cidr(args.cidr)
    interface = parse_interface_name(args.interface)
    _, endpoint_port = parse_endpoint(args.endpoint)
    name = check_name(args.name or default_name())
    mtu = checked_mtu(args.mtu) or DEFAULT_MTU
    parse_duration(args.ttl)
    listen_port = args.listen_port or endpoint_port
    relay = not getattr(args, "no_relay", False)
    relay_ports = _relay_ports(args, relay, listen_port, "--no-relay")
    require_root("init")
    backend = choose_backend(args.backend)
    paths.ensure()
    private_key = generate_private_key()
    own_key = public_key(private_key)
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
        relay=relay,
        relay_ports=relay_ports,
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
        token = issue_token(paths, config, args.ttl, args.uses)
        bring_up(paths, config, private_key, store.roster())
        try:
            start_syncd(paths)
        except BaseException:
            bring_down(paths, config)
            raise
    except BaseException:
        discard_state(paths)
        raise
    agent_line = agent_choice(paths, args.no_agent)
    print(f"Created mesh {config.mesh_id} ({config.cidr}) with {backend} WireGuard on {interface}.")
    print(f"This machine is {name!r} at {address}; the coordinator listens on {args.endpoint} (UDP and TCP).")
    print(agent_line)
    print(_relay_line(config))
    print_token(token, args.ttl, args.uses)
    return 0


def cmd_join(args: argparse.Namespace) -> int:
    """Join a mesh with a token: local keys, authenticated exchange, interface, background sync."""
    relay = bool(getattr(args, "relay", False))
    if relay and not args.endpoint:
        raise MeshError("--relay needs --endpoint: members can only use a relay they can reach")
    endpoint_port = parse_endpoint(args.endpoint)[1] if args.endpoint else None
    listen_port = args.listen_port or endpoint_port or WIREGUARD_PORT
    relay_ports = _relay_ports(args, relay, listen_port, "no --relay")
    token = read_join_token(args.token, args.token_file)
    token.check_not_expired()
    paths = state_paths(args)
    require_no_mesh(paths)
    interface = parse_interface_name(args.interface)
    name = check_name(args.name or default_name())
    mtu = checked_mtu(args.mtu)
    require_root("join")
    backend = choose_backend(args.backend)
    paths.ensure()
    private_key = generate_private_key()
    own_key = public_key(private_key)
    try:
        write_private_key(paths.private_key, private_key)
        result = request_join(token, name, own_key, args.endpoint)
    except BaseException:
        discard_state(paths)
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
        listen_port=listen_port,
        mtu=mtu or result.mtu,
        keepalive=result.keepalive,
        coordinator_key=token.coordinator_key,
        coordinator_endpoint=token.endpoint,
        coordinator_address=result.coordinator_address,
        api_port=result.api_port,
        relay=relay,
        relay_ports=relay_ports,
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
    print(agent_choice(paths, args.no_agent))
    if config.relay:
        print(_relay_line(config))
    return 0


def _relay_ports(args: argparse.Namespace, relay: bool, listen_port: int, off: str) -> tuple[int, int]:
    """The relay's port range from ``--relay-ports``, else the default; refused when no relay runs."""
    text = getattr(args, "relay_ports", None)
    if text is None:
        return default_relay_ports(listen_port)
    if not relay:
        raise MeshError(f"--relay-ports has no effect with {off}: drop one of them")
    return parse_relay_ports(text, listen_port)


def _relay_line(config: MeshConfig) -> str:
    """One line saying whether this machine relays, and which UDP ports to open for it."""
    if not config.relay:
        return "No relay here (--no-relay): pairs that cannot connect directly need a `mesh join --relay` member."
    first, last = config.relay_ports
    return f"This machine relays for members that cannot connect directly: open UDP ports {first}-{last}."


def _delete_state(paths: StatePaths) -> None:
    discard_state(paths)
    for directory in (paths.run, paths.logs):
        shutil.rmtree(directory, ignore_errors=True)


def cmd_leave(args: argparse.Namespace) -> int:
    """Leave the mesh: tell the coordinator, remove the interface, delete keys and state."""
    paths = state_paths(args)
    config = load_config(paths)
    require_root("leave")
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
    stop_shardpool_agent(paths)
    bring_down(paths, config)
    _delete_state(paths)
    shardpool_agent_files(paths)[3].unlink(missing_ok=True)
    print(
        f"Left mesh {config.mesh_id}: interface {config.interface} removed and state in {paths.root} deleted."
    )
    return 0
