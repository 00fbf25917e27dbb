"""Local device discovery and the `shardpool devices` command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.device_facts import (
    DeviceInfo,
    format_compute_capability,
    layer_devices,
    nf4_probe_refusal,
    normalize_device,
    rocm_architecture,
)
from shardpool.plan.devices import device_info, list_devices, probe_nf4
from shardpool.plan.local_fleet import local_fleet

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


def test_the_cpu_computes_in_bf16_has_no_compute_capability_and_runs_nf4() -> None:
    cpu = device_info("cpu")
    assert (cpu.compute_capability, cpu.bf16, cpu.nf4_error) == (None, True, None)
    assert probe_nf4("cpu") is None  # a real bitsandbytes Linear4bit forward on the CPU


def test_a_device_without_4bit_kernels_gives_the_reason() -> None:
    reason = probe_nf4("meta")  # tensors without data: bitsandbytes cannot quantize there
    assert reason is not None and "\n" not in reason


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device; not run here")
def test_cuda_device_capability_and_bf16() -> None:
    info = device_info("cuda:0")
    if info.kind == "cuda":
        major, minor = torch.cuda.get_device_capability(0)
        assert info.compute_capability == f"{major}.{minor}"
        assert info.bf16 == (major >= 8)
    else:
        assert info.compute_capability is not None and info.compute_capability.startswith("gfx")


def test_compute_capability_and_rocm_names() -> None:
    assert format_compute_capability(8, 6) == "8.6"
    assert format_compute_capability(5, 2) == "5.2"
    assert rocm_architecture("gfx90a:sramecc+:xnack-") == "gfx90a"
    assert rocm_architecture("gfx1100") == "gfx1100"


M40 = DeviceInfo("cuda:1", "cuda", "Tesla M40", 24 << 30, 23 << 30, compute_capability="5.2", bf16=False,
                 nf4_error="Error named symbol not found at line 90")  # fmt: skip
RTX_3090 = DeviceInfo(
    "cuda:0", "cuda", "NVIDIA GeForce RTX 3090", 24 << 30, 23 << 30, compute_capability="8.6", bf16=True
)


def test_a_device_that_cannot_run_nf4_gets_no_layers_and_one_line() -> None:
    kept, refused = layer_devices([RTX_3090, M40], needs_nf4=True)
    assert kept == [RTX_3090]
    assert refused == [
        "cuda:1 (Tesla M40, 5.2) cannot run bitsandbytes 4-bit: Error named symbol not found at line 90; "
        "it gets no layers"
    ]
    assert layer_devices([RTX_3090, M40], needs_nf4=False) == ([RTX_3090, M40], [])
    assert nf4_probe_refusal(
        "mps", "Apple arm64 GPU", None, "NotImplementedError: no 4-bit\nmore"
    ).startswith("mps (Apple arm64 GPU) cannot run bitsandbytes 4-bit: NotImplementedError: no 4-bit; ")


def test_a_refused_device_named_in_the_config_is_refused_in_one_line() -> None:
    class Probe:
        def device_info(self, name: str) -> DeviceInfo:
            return M40

    shape = ModelShape.from_config_json(
        {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}, name="tiny")  # fmt: skip
    with pytest.raises(
        ShardpoolError, match=r"cuda:1 \(Tesla M40, 5.2\) cannot run .*remove it from shardpool.devices"
    ):
        local_fleet(["cuda:1"], shape=shape, workload=Workload(sequence_len=16), probe=Probe())  # type: ignore[arg-type]


def test_a_refused_device_is_reported_but_not_profiled(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardpool.plan import report

    cpu = device_info("cpu", nf4=False)
    monkeypatch.setattr(report, "list_devices", lambda: [M40, cpu])
    profiled: list[str] = []

    def fake_profile(shape: object, workload: object, *, device: str, threads: int | None) -> object:
        profiled.append(device)
        raise RuntimeError("stop after the first profile")

    monkeypatch.setattr(report, "profile_layer", fake_profile)
    with pytest.raises(RuntimeError, match="stop after"):
        report.device_rows(None, None)  # type: ignore[arg-type]
    assert profiled == ["cpu"]
