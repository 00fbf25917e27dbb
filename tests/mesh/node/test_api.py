"""Tests of mesh/node/api.py: members() from a member's cached roster, with no interface up."""

from __future__ import annotations

import pytest

from mesh.control.model import Roster, RosterEntry
from mesh.errors import MeshError
from mesh.node.api import Member, member, members
from mesh.node.config import MeshConfig, save_config
from mesh.node.member import save_cached_roster
from mesh.state import StatePaths
from mesh.wireguard.keys import generate_private_key, public_key, write_private_key

PRIVATE = generate_private_key()
SELF = public_key(PRIVATE)
COORD = public_key(generate_private_key())


def _member_state(home) -> StatePaths:
    paths = StatePaths(home)
    paths.ensure()
    write_private_key(paths.private_key, PRIVATE)
    config = MeshConfig(
        role="member", mesh_id="m", name="b", interface="spapitest0", backend="userspace", cidr="198.51.100.0/28",
        address="198.51.100.2", public_key=SELF, endpoint=None, listen_port=51820, mtu=1420, keepalive=25,
        coordinator_key=COORD, coordinator_endpoint="192.0.2.1:51820", coordinator_address="198.51.100.1", api_port=51820,
    )  # fmt: skip
    save_config(paths, config)
    save_cached_roster(
        paths,
        Roster(
            "m",
            "198.51.100.0/28",
            2,
            (
                RosterEntry("a", "198.51.100.1", COORD, "192.0.2.1:51820", True),
                RosterEntry("b", "198.51.100.2", SELF),
            ),
        ),
    )
    return paths


def test_members_from_cached_roster_with_interface_down(tmp_path) -> None:
    _member_state(tmp_path)
    found = members(tmp_path, probe=False)
    assert found == [
        Member("a", "198.51.100.1", COORD, "192.0.2.1:51820", False, False, True, None, 0, 0),
        Member("b", "198.51.100.2", SELF, None, False, True, False, None, 0, 0),
    ]
    # probing is skipped while the interface is down: nothing can be reachable through it
    assert [m.online for m in members(tmp_path, probe=True)] == [False, False]


def test_member_by_name(tmp_path) -> None:
    _member_state(tmp_path)
    assert member("a", tmp_path, probe=False).address == "198.51.100.1"
    with pytest.raises(MeshError, match="no member called 'zz'; the mesh has: a, b"):
        member("zz", tmp_path, probe=False)


def test_state_dir_from_environment(tmp_path, monkeypatch) -> None:
    _member_state(tmp_path)
    monkeypatch.setenv("SHARDPOOL_HOME", str(tmp_path))
    assert [m.name for m in members(probe=False)] == ["a", "b"]


def test_not_in_a_mesh(tmp_path) -> None:
    with pytest.raises(MeshError, match="no mesh state"):
        members(tmp_path)
