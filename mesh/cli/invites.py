"""The coordinator's commands: ``mesh invite`` (issue, list or revoke join tokens) and
``mesh remove`` (revoke a member and the invites tied to it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from mesh.cli.common import print_table, require_coordinator, state_paths
from mesh.cli.tokens import issue_token, print_token
from mesh.control.invites import Invite
from mesh.control.model import check_name
from mesh.control.roster import RosterStore
from mesh.control.token import TOKEN_PREFIX, parse_token
from mesh.errors import MeshError
from mesh.node.config import load_config

__all__ = ["cmd_invite", "cmd_remove"]


def cmd_invite(args: argparse.Namespace) -> int:
    """Print another join token, or list or revoke the invites (coordinator only)."""
    paths = state_paths(args)
    config = load_config(paths)
    require_coordinator(config, "invite")
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
        print_token(issue_token(paths, config, ttl, uses, member_name), ttl, uses, member_name)
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
    print_table(table)


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


def cmd_remove(args: argparse.Namespace) -> int:
    """Revoke a member on the coordinator; every machine drops it at its next sync."""
    paths = state_paths(args)
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
