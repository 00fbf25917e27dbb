"""Parsing and printing of durations, byte counts and ages for the mesh commands."""

from __future__ import annotations

import re

from mesh.errors import MeshError

__all__ = ["format_age", "format_bytes", "parse_duration"]

_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_MAX_SECONDS = 3650 * 86400


def parse_duration(text: str) -> int:
    """Parse ``90s``, ``15m``, ``24h``, ``7d`` or ``2w`` (a bare number is seconds) into seconds."""
    match = _DURATION.fullmatch(text)
    if not match:
        raise MeshError(
            f"duration {text[:40]!r} is not understood: use a number with s, m, h, d or w, like 24h"
        )
    value = float(match.group(1)) * _SECONDS[match.group(2)]
    if not value <= _MAX_SECONDS:  # also refuses the infinity that a few hundred digits become
        raise MeshError(f"duration {text[:40]!r} is too long: the limit is 3650d (ten years)")
    seconds = int(value)
    if seconds <= 0:
        raise MeshError(f"duration {text[:40]!r} must be longer than zero seconds")
    return seconds


def format_bytes(count: int) -> str:
    """Print a byte count with a binary unit, e.g. ``1.5 KiB``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_age(seconds: float | None) -> str:
    """Print how long ago something happened, or ``never``."""
    if seconds is None:
        return "never"
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"
