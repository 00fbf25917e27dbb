"""``shardpool mesh ...`` sub-commands (placeholder until the mesh issue lands)."""

from __future__ import annotations

import argparse


def add_mesh_commands(commands: argparse._SubParsersAction) -> None:
    """Register ``shardpool mesh`` and its sub-commands on the top-level parser."""
    commands.add_parser("mesh", help="create and join a WireGuard mesh")
