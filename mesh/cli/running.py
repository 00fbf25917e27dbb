"""``mesh up`` and ``mesh down``: recreate or remove the interface and the background processes
(sync daemon, shardpool agent) from the saved state, which both keep.
"""

from __future__ import annotations

import argparse

from mesh.cli.agent_process import start_shardpool_agent, stop_shardpool_agent
from mesh.cli.common import require_root, state_paths
from mesh.node.api import current_roster, device_status
from mesh.node.config import load_config, save_config
from mesh.node.member import bring_down, bring_up, start_syncd, syncd_running
from mesh.wireguard.keys import read_private_key

__all__ = ["cmd_down", "cmd_up"]


def cmd_down(args: argparse.Namespace) -> int:
    """Stop the background processes and remove the interface, keeping the state for `up`."""
    paths = state_paths(args)
    config = load_config(paths)
    require_root("down")
    stop_shardpool_agent(paths)
    bring_down(paths, config)
    save_config(paths, config.with_changes(down=True))
    print(
        f"Mesh interface {config.interface} is down; run `shardpool mesh up` to restore it from {paths.root}."
    )
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    """Recreate the interface and restart the agent from saved state."""
    paths = state_paths(args)
    config = load_config(paths)
    require_root("up")
    if syncd_running(paths) and device_status(paths, config) is not None:
        print(f"Mesh interface {config.interface} is already up.")
        print(start_shardpool_agent(paths))
        return 0
    stop_shardpool_agent(paths)
    bring_down(paths, config)
    private_key = read_private_key(paths.private_key)
    roster = current_roster(paths, config)
    bring_up(paths, config, private_key, roster)
    try:
        start_syncd(paths)
    except BaseException:
        bring_down(paths, config)
        raise
    save_config(paths, config.with_changes(down=False))
    print(
        f"Mesh interface {config.interface} is up at {config.address} with {len(roster.members) - 1} peer(s)."
    )
    print(start_shardpool_agent(paths))
    return 0
