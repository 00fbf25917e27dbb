"""The contract's error, and the checks every side runs before a name from a job becomes a path.

A name from a job, a manifest or an upload (``model/a.safetensors``) must stay a relative path
inside its directory, and a digest that names a cache file must be exactly 64 hex digits:
:func:`safe_relative_name`, :func:`resolve_inside` and :func:`check_digest`.
"""

from __future__ import annotations

import re
from pathlib import Path

from shardpool.errors import ShardpoolError

__all__ = ["MAX_NAME_CHARS", "ContractError", "safe_relative_name", "resolve_inside", "check_digest"]

MAX_NAME_CHARS = 512

_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_DIGEST = re.compile(r"[0-9a-f]{64}")


class ContractError(ShardpoolError, ValueError):
    """A job, request, manifest or event breaks the contract; the message says which field and why.

    It is a ValueError too, so pydantic validators can raise it and report it as a field error.
    """


def safe_relative_name(text: object, what: str = "name") -> str:
    """Return ``text`` if it is a safe relative path (``model/a.safetensors``), else raise ContractError.

    Segments are letters, digits and ``._-`` and never start with a dot, so ``..``, hidden files,
    absolute paths, backslashes, NUL and empty segments are all refused; at most 512 characters.
    """
    if (
        not isinstance(text, str)
        or not text
        or len(text) > MAX_NAME_CHARS
        or not all(_SEGMENT.fullmatch(part) for part in text.split("/"))
    ):
        shown = repr(text)[:80]
        raise ContractError(
            f"{what} {shown} is not a safe relative path; use segments of letters, digits, '._-' "
            f"joined by '/' (at most {MAX_NAME_CHARS} characters)"
        )
    return text


def resolve_inside(root: str | Path, name: str, what: str = "name") -> Path:
    """The resolved path of ``root/name``, refused unless it stays inside ``root`` (symlinks followed).

    Checks :func:`safe_relative_name` first, so the only way out left is a symlink; resolving
    catches that one too.
    """
    safe_relative_name(name, what)
    base = Path(root).resolve()
    target = (base / name).resolve()
    if target == base or not target.is_relative_to(base):
        raise ContractError(f"{what} {name!r} escapes {base} through a symlink; remove the link")
    return target


def check_digest(value: object, what: str = "SHA-256 digest") -> str:
    """Return ``value`` if it is exactly 64 lowercase hex digits, else raise ContractError.

    Digests name cache files, so anything else (``../../etc/x``) must never reach a path.
    """
    if not isinstance(value, str) or not _DIGEST.fullmatch(value):
        shown = repr(value)[:80]
        raise ContractError(f"{what} {shown} is not 64 lowercase hex digits; the sender is broken or hostile")
    return value
