"""The mesh commands' argument parser: ``shardpool mesh ...`` (:func:`add_mesh_commands`) and the
stand-alone ``python -m mesh ...`` (:func:`main`), with the same commands, options and help.
"""

from __future__ import annotations

import argparse
import sys

from mesh.addresses import DEFAULT_CIDR
from mesh.cli.invites import cmd_invite, cmd_remove
from mesh.cli.membership import cmd_init, cmd_join, cmd_leave
from mesh.cli.running import cmd_down, cmd_up
from mesh.cli.status import cmd_export_config, cmd_status
from mesh.constants import TOKEN_ENV, WIREGUARD_PORT
from mesh.errors import MeshError
from mesh.node.config import DEFAULT_INTERFACE, DEFAULT_MTU
from mesh.wireguard.choice import BACKENDS

__all__ = ["DESCRIPTION", "add_mesh_commands", "build_parser", "main"]

DESCRIPTION = """`shardpool mesh ...`: create, join, inspect and leave the WireGuard mesh.

Every command takes --state-dir (default $SHARDPOOL_HOME, then /var/lib/shardpool
for root or ~/.local/share/shardpool). Commands that print a join token print it alone on
the last line of their output, so scripts can take it with `tail -n 1`.
"""
"""The description of ``shardpool mesh`` and ``python -m mesh`` in their help: plain text, as
argparse prints it (commands in single backticks, like the other help texts)."""


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir", help="mesh state directory (default: $SHARDPOOL_HOME, /var/lib/shardpool as root)"
    )


def add_mesh_commands(commands: argparse._SubParsersAction) -> None:
    """Register ``shardpool mesh`` and its sub-commands on the top-level parser."""
    mesh = commands.add_parser("mesh", help="create and join a WireGuard mesh", description=DESCRIPTION)
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
    init.add_argument(
        "--no-relay",
        action="store_true",
        help="do not relay WireGuard traffic for members that cannot reach each other directly",
    )
    init.add_argument(
        "--relay-ports",
        metavar="FIRST-LAST",
        help="UDP ports the relay may open, two per relayed pair (default: the 256 ports above --listen-port)",
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
    join.add_argument(
        "--relay",
        action="store_true",
        help="also relay WireGuard traffic for members that cannot reach each other directly "
        "(needs --endpoint: the relay must be reachable)",
    )
    join.add_argument(
        "--relay-ports",
        metavar="FIRST-LAST",
        help="with --relay: UDP ports the relay may open (default: the 256 ports above --listen-port)",
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
    parser = argparse.ArgumentParser(prog="python -m mesh", description=DESCRIPTION)
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
