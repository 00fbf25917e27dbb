"""Join tokens on the command line: issuing and printing one, and reading one from exactly one source.

A token is read from the TOKEN argument, '-' (standard input), ``--token-file`` or
``$SHARDPOOL_JOIN_TOKEN``; the last three keep it out of ``ps``. The printed token is alone on
the last line, so scripts can take it with ``tail -n 1``.
"""

from __future__ import annotations

import getpass
import os
import stat
import sys
from collections.abc import Callable

from mesh.constants import TOKEN_ENV
from mesh.control.roster import RosterStore
from mesh.control.token import JoinToken, find_token_text, new_token, parse_token, secret_hash
from mesh.errors import MeshError
from mesh.node.config import MeshConfig
from mesh.state import StatePaths
from mesh.units import parse_duration

__all__ = ["issue_token", "print_token", "read_join_token"]

_MAX_TOKEN_TEXT = 64 * 1024  # a token is about 150 characters; all of `mesh init`'s output is under 1 KiB
_TOKEN_SOURCES = f"the TOKEN argument, '-' for standard input, --token-file PATH, or {TOKEN_ENV}"


def issue_token(
    paths: StatePaths, config: MeshConfig, ttl: str, uses: int, member_name: str | None = None
) -> JoinToken:
    """Make a join token for this coordinator and store it (its secret only as a hash)."""
    seconds = parse_duration(ttl)
    if uses < 1:
        raise MeshError("--uses must be at least 1")
    token = new_token(config.public_key, config.coordinator_endpoint, seconds)
    RosterStore(paths.database).add_token(
        token.token_id, secret_hash(token.secret), token.expires_at, uses, member_name=member_name
    )
    return token


def print_token(token: JoinToken, ttl: str, uses: int, member_name: str | None = None) -> None:
    """Print what the token is for, how to use it, and the token alone on the last line."""
    plural = "s" if uses != 1 else ""
    made_for = f" for {member_name!r}" if member_name else ""
    name_option = f" --name {member_name}" if member_name else ""
    print(f"Join token {token.token_id.hex()}{made_for} (valid {ttl}, {uses} use{plural}).")
    print("On another machine run this and paste the token (or pipe it in), so it stays out of `ps`:")
    print(f"  shardpool mesh join -{name_option} --endpoint THAT_MACHINE:PORT")
    print(token.encode())


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
