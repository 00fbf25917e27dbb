"""Local device discovery and the `shardpool devices` command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardpool.errors import ShardpoolError
from shardpool.plan.device_facts import normalize_device
from shardpool.plan.devices import device_info, list_devices

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_is_listed_last_with_its_ram() -> None:
    devices = list_devices()
    cpu = devices[-1]
    assert cpu.name == "cpu" and cpu.kind == "cpu"
    assert 0 < cpu.free_bytes <= cpu.total_bytes and cpu.threads >= 1


def test_normalize_and_unknown() -> None:
    assert normalize_device("cuda") == "cuda:0"
    assert normalize_device("CPU") == "cpu"
    with pytest.raises(ShardpoolError, match="unknown"):
        device_info("tpu:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message when CUDA is absent")
def test_missing_cuda_is_a_clear_error() -> None:
    with pytest.raises(ShardpoolError, match="not available"):
        device_info("cuda:0")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_cuda_device_memory() -> None:
    info = device_info("cuda:0")
    assert info.kind in ("cuda", "rocm") and 0 < info.free_bytes <= info.total_bytes


@pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs an Apple MPS device")
def test_mps_device_memory() -> None:
    info = device_info("mps")
    assert info.kind == "mps" and info.total_bytes > 0


def test_devices_command_json(tmp_path: Path) -> None:
    env = {"SHARDPOOL_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    import os

    env = {**os.environ, **env}
    result = subprocess.run(
        [sys.executable, "-m", "shardpool", "devices", "configs/quickstart.yaml", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert rows[-1]["device"] == "cpu" and rows[-1]["ms_per_layer"] > 0
    assert (tmp_path / "profiles.json").is_file()
