"""Tests of mesh/node/config.py: saving and loading a machine's settings."""

from __future__ import annotations

import json
import os
import stat

import pytest

from mesh.errors import MeshError
from mesh.node.config import MeshConfig, load_config, save_config
from mesh.state import StatePaths


def _config() -> MeshConfig:
    return MeshConfig(
        role="member", mesh_id="m", name="b", interface="sp0", backend="userspace", cidr="198.51.100.0/28",
        address="198.51.100.2", public_key="k", endpoint=None, listen_port=51820, mtu=1420, keepalive=25,
        coordinator_key="c", coordinator_endpoint="192.0.2.1:51820", coordinator_address="198.51.100.1", api_port=51820,
    )  # fmt: skip


def test_round_trip_is_private(tmp_path) -> None:
    paths = StatePaths(tmp_path)
    save_config(paths, _config())
    assert load_config(paths) == _config()
    assert stat.S_IMODE(os.stat(paths.config).st_mode) == 0o600
    assert _config().prefixlen == 28 and not _config().is_coordinator


def test_missing_state_is_explained(tmp_path) -> None:
    with pytest.raises(MeshError, match="mesh init.*mesh join"):
        load_config(StatePaths(tmp_path))


def test_incomplete_state_is_explained(tmp_path) -> None:
    (tmp_path / "mesh.json").write_text(json.dumps({"role": "member"}))
    with pytest.raises(MeshError, match="incomplete"):
        load_config(StatePaths(tmp_path))
