"""Two meshes on one machine each have their own agent, and launchers reach the right one.

Before issue 39, ``mesh init/join --state-dir`` started ``shardpool agent`` without ``--socket``,
so every agent wanted ``/run/shardpool/agent.sock``: the second mesh's agent could not start, and
that mesh could neither host stages nor launch. Now an agent's socket is derived from its state
directory when that is not ``/var/lib/shardpool`` (:func:`state_dir_socket`). The real test
starts both agents the way ``mesh init/join/up`` do, on two loopback addresses, from two mesh
states that need no WireGuard interface.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mesh.cli.agent_process import start_shardpool_agent, stop_shardpool_agent
from mesh.constants import AGENT_SOCKET_ENV, DEFAULT_AGENT_SOCKET, ROOT_STATE_DIR
from mesh.control.model import Roster, RosterEntry
from mesh.node.config import MeshConfig, save_config
from mesh.node.member import save_cached_roster
from mesh.state import StatePaths
from mesh.wireguard.keys import generate_private_key, public_key, write_private_key
from shardpool.agent.local_client import (
    LocalAgentClient,
    agent_socket_of_state_dir,
    agent_socket_path,
    state_dir_socket,
)
from tests.helpers.agents import shared_dir

REPO = Path(__file__).resolve().parents[2]


def test_each_state_directory_has_its_own_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AGENT_SOCKET_ENV, raising=False)
    first, second = state_dir_socket("/srv/mesh-a"), state_dir_socket("/srv/mesh-b")
    assert first != second and first != DEFAULT_AGENT_SOCKET
    assert Path(first).parent == Path(DEFAULT_AGENT_SOCKET).parent and len(first) < 108  # sun_path
    assert state_dir_socket(ROOT_STATE_DIR) == DEFAULT_AGENT_SOCKET
    assert agent_socket_path(state_dir="/srv/mesh-a") == first == state_dir_socket("/srv/../srv/mesh-a/")
    monkeypatch.setenv(AGENT_SOCKET_ENV, "/tmp/lab/agent.sock")
    assert agent_socket_path(state_dir="/srv/mesh-a") == "/tmp/lab/agent.sock"
    assert agent_socket_path("/explicit.sock", state_dir="/srv/mesh-a") == "/explicit.sock"


def _mesh_state(root: Path, name: str, address: str) -> StatePaths:
    """A member's mesh state (key, settings, cached roster) whose mesh address is ``address``."""
    paths = StatePaths(root)
    paths.ensure()
    private = generate_private_key()
    write_private_key(paths.private_key, private)
    coordinator = public_key(generate_private_key())
    save_config(
        paths,
        MeshConfig(
            role="member", mesh_id=f"mesh-{name}", name=name, interface=f"sp{name}0", backend="userspace",
            cidr="127.0.0.0/8", address=address, public_key=public_key(private), endpoint=None,
            listen_port=51820, mtu=1420, keepalive=25, coordinator_key=coordinator,
            coordinator_endpoint="192.0.2.1:51820", coordinator_address="127.0.0.9", api_port=51820,
        ),
    )  # fmt: skip
    save_cached_roster(
        paths,
        Roster(
            f"mesh-{name}",
            "127.0.0.0/8",
            2,
            (
                RosterEntry("coord", "127.0.0.9", coordinator, "192.0.2.1:51820", True),
                RosterEntry(name, address, public_key(private)),
            ),
        ),
    )
    return paths


@pytest.fixture
def two_meshes(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[StatePaths, StatePaths]]:
    monkeypatch.delenv(AGENT_SOCKET_ENV, raising=False)
    with shared_dir() as shared:
        first = _mesh_state(shared / "mesh-a", "alpha", "127.0.0.2")
        second = _mesh_state(shared / "mesh-b", "beta", "127.0.0.3")
        try:
            yield first, second
        finally:
            stop_shardpool_agent(first)
            stop_shardpool_agent(second)


@pytest.mark.slow
def test_two_meshes_on_one_machine_each_launch_through_their_own_agent(
    two_meshes: tuple[StatePaths, StatePaths],
) -> None:
    for paths in two_meshes:
        line = start_shardpool_agent(paths)
        assert line.startswith("shardpool agent: listening on"), line
    sockets = [agent_socket_of_state_dir(paths.root) for paths in two_meshes]
    assert sockets == [state_dir_socket(paths.root) for paths in two_meshes]
    assert sockets[0] != sockets[1]
    for socket_path, name in zip(sockets, ("alpha", "beta"), strict=True):
        assert [m.name for m in LocalAgentClient(socket_path).members() if m.is_self] == [name]
    for paths in two_meshes:
        listed = subprocess.run(
            [sys.executable, "-m", "shardpool", "jobs", "--state-dir", str(paths.root)],
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
        assert listed.returncode == 0 and "no jobs" in listed.stdout.lower(), (listed.stdout, listed.stderr)
