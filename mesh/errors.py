"""The one exception type of the mesh package, shown to users as a single line."""

from __future__ import annotations

__all__ = ["MeshError"]


class MeshError(Exception):
    """A mesh problem the user can fix: its message names the problem and the fix, in one line."""
