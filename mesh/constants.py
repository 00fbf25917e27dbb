"""Ports, paths and environment variables of shardpool and its mesh, each set in this one place.

It lives in ``mesh`` because ``mesh`` may not import ``shardpool``; both packages read it. Torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "AGENT_PORT",
    "AGENT_SOCKET_ENV",
    "CACHE_ENV",
    "DEFAULT_AGENT_SOCKET",
    "ROOT_STATE_DIR",
    "STATE_DIR_ENV",
    "TOKEN_ENV",
    "WIREGUARD_PORT",
    "cache_root",
]

WIREGUARD_PORT = 51820
"""The UDP port WireGuard listens on when neither ``--listen-port`` nor the endpoint names one."""

AGENT_PORT = 7710
"""The TCP port every member's agent listens on, on its mesh address."""

AGENT_SOCKET_ENV = "SHARDPOOL_AGENT_SOCKET"
DEFAULT_AGENT_SOCKET = "/run/shardpool/agent.sock"
"""The agent's local Unix socket, through which people on a member launch and manage jobs."""

STATE_DIR_ENV = "SHARDPOOL_HOME"
ROOT_STATE_DIR = Path("/var/lib/shardpool")
"""Mesh state (keys, roster, settings) for root; other users default to ``~/.local/share/shardpool``."""

CACHE_ENV = "SHARDPOOL_CACHE"
"""Layer profiles and fetched model blobs; default ``~/.cache/shardpool``."""

TOKEN_ENV = "SHARDPOOL_JOIN_TOKEN"
"""Where ``mesh join`` reads a token from when no argument names one (keeps it out of ``ps``)."""


def cache_root() -> Path:
    """``$SHARDPOOL_CACHE``, else ``~/.cache/shardpool``: one cache for profiles and fetched files."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "shardpool")
