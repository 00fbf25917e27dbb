"""``shardpool agent``: run the agent for this mesh member until SIGTERM/SIGINT.

Reads the member's address, interface, name and key from the mesh state, checks the run-as
account, the launch group and the work directory once at start (a one-line error for each), and
puts the :class:`~shardpool.agent.service.Agent` on the mesh address and the local Unix socket.
"""

from __future__ import annotations

import grp
import json
import logging
import os
import signal
import threading
from pathlib import Path

from mesh.constants import AGENT_PORT
from mesh.files import atomic_write
from shardpool import __version__
from shardpool.agent.accounts import DEFAULT_LAUNCH_GROUP, make_directory, make_tree, resolve_run_as
from shardpool.agent.local_client import agent_socket_path
from shardpool.agent.members import roster_peers
from shardpool.agent.service import Agent
from shardpool.errors import ShardpoolError

__all__ = ["run_agent"]

log = logging.getLogger(__name__)


def run_agent(
    state_dir: str | None,
    port: int = AGENT_PORT,
    *,
    work_dir: str | None = None,
    ready_file: str | None = None,
    run_as: str = "shardpool",
    group: str = DEFAULT_LAUNCH_GROUP,
    socket_path: str | None = None,
) -> int:
    """Run ``shardpool agent`` until SIGTERM/SIGINT: the mesh listener and the local Unix socket.

    Refuses to start (one-line error) when the run-as account does not exist, is root, or cannot
    run this Python; when the launch group does not exist; or when the work directory is out of
    the run-as account's reach. The local socket is ``socket_path``, else the one
    :func:`~shardpool.agent.local_client.agent_socket_path` gives for this state directory.
    ``ready_file`` (used by ``mesh init/join/up``) is written with the pid, URL and local socket
    once listening (``finetune --state-dir`` and ``jobs --state-dir`` find the socket there).
    """
    from mesh.control.directory import CachedRosterDirectory
    from mesh.control.verifier import RequestVerifier
    from mesh.node.config import load_config
    from mesh.state import StatePaths, resolve_state_dir
    from mesh.wireguard.keys import read_private_key

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    paths = StatePaths(resolve_state_dir(state_dir))
    config = load_config(paths)
    account = resolve_run_as(run_as)
    try:
        grp.getgrnam(group)
    except KeyError:
        raise ShardpoolError(
            f"launch group {group!r} does not exist; create it with `groupadd --system {group}` or pass --group"
        ) from None
    verifier = RequestVerifier(
        read_private_key(paths.private_key),
        config.mesh_id,
        CachedRosterDirectory(paths.roster, config.mesh_id),
    )
    socket = Path(agent_socket_path(socket_path, state_dir=paths.root))
    make_tree(socket.parent.parent)
    make_directory(socket.parent, mode=0o755)
    agent = Agent(
        config.address,
        port,
        verifier=verifier,
        peers=roster_peers(paths.root),
        work_dir=Path(work_dir) if work_dir else paths.root.with_name(paths.root.name + "-work"),
        interface=config.interface,
        member_name=config.name,
        run_as=account,
        group=group,
        socket_path=socket,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    agent.start()
    log.info(
        "shardpool agent %s for member %r listening on %s and %s; stages run as %s",
        __version__, config.name, agent.url, socket, account.user,
    )  # fmt: skip
    if ready_file:
        ready = {"pid": os.getpid(), "url": agent.url, "socket": str(socket)}
        atomic_write(Path(ready_file), json.dumps(ready).encode("utf-8"))
    try:
        while not stop.wait(1.0):
            pass
    finally:
        log.info("stopping: terminating jobs, then the server")
        agent.stop()
        if ready_file:
            Path(ready_file).unlink(missing_ok=True)
    return 0
