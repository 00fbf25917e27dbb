"""The environment the agent builds for a stage: gloo and NCCL on the mesh interface, no InfiniBand."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardpool.agent.processes import stage_environment


def test_mesh_stages_pin_gloo_and_nccl_to_the_mesh_interface_and_disable_infiniband(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")  # the agent's own setting never reaches a stage
    monkeypatch.setenv("NCCL_IB_DISABLE", "0")
    env = stage_environment(tmp_path, interface="shardpool0", local_ranks=2, cache_dir=tmp_path / "cache")
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "shardpool0"
    assert env["NCCL_IB_DISABLE"] == "1"


def test_without_a_mesh_interface_no_interface_is_pinned_and_infiniband_stays_off(tmp_path: Path) -> None:
    env = stage_environment(tmp_path, interface=None, local_ranks=1, cache_dir=tmp_path)
    assert "GLOO_SOCKET_IFNAME" not in env and "NCCL_SOCKET_IFNAME" not in env
    assert env["NCCL_IB_DISABLE"] == "1"
