"""The one exception type the CLI shows to users as a single line."""

from __future__ import annotations

__all__ = ["ShardpoolError"]


class ShardpoolError(Exception):
    """A problem the user can fix: its message names the problem and the fix, in one line.

    The CLI prints it as ``shardpool: error: <message>`` with no traceback and exits 2.
    """
