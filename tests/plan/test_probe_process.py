"""Accelerators measured in a child process that ends with the planning: which devices go there,
that it is another process and measures what this one would, that it never outlives planning (an
error, a crash or Ctrl-C included), and that finetune and torchrun's rank 0 plan through it."""

from __future__ import annotations

import io
import json
import multiprocessing
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from shardpool.config import parse_config
from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.probe_process import ProcessProbe, measured_in_child
from shardpool.plan.profile_cache import cache_path
from shardpool.plan.profiler import TorchProbe
from tests.helpers.training import base_config, write_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ModelShape.from_config_dir(ROOT / "configs/models/tiny-llama.json")
WORKLOAD = Workload(micro_batch_size=1, sequence_len=64, lora_r=4)
#: Device names no machine has: measuring them fails in whichever process measures.
ABSENT_GPUS = ["cuda:98", "cuda:99"]
ABSENT_LINE = "device cuda:98 is not available here"


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SHARDPOOL_CACHE", str(tmp_path / "cache"))  # a child started later inherits it
    return tmp_path / "cache"


@pytest.fixture
def no_measuring_here(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Discovery in this process fails with its own line; a child process measures as usual."""

    def refuse(self: TorchProbe, name: str) -> None:
        raise ShardpoolError(f"{name} was measured in the training process")

    monkeypatch.setattr(TorchProbe, "device_info", refuse)
    yield
    assert multiprocessing.active_children() == [], "the measuring child outlived the planning"


def test_accelerators_are_measured_in_a_child_and_the_cpu_here() -> None:
    for name in ("cuda", "cuda:0", "cuda:7", "CUDA:1", "xpu", "xpu:1", "mps", "mps:0"):
        assert measured_in_child(name), name
    for name in ("cpu", "CPU", "cpu:0"):
        assert not measured_in_child(name), name


def test_a_cpu_only_plan_starts_no_child() -> None:
    with ProcessProbe() as probe:
        assert probe.device_info("cpu").kind == "cpu"
        assert probe.loopback().bandwidth > 0
        assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_the_child_measures_the_cpu_as_this_process_does_and_shares_the_cache(private_cache: Path) -> None:
    """Forced through the child, the CPU's facts are this process's, and the profile the child
    measured and cached is the one this process then reads (same key, same numbers)."""
    with ProcessProbe(in_child=lambda name: True) as probe:
        info = probe.device_info("cpu")
        profiled = probe.profile_layer(TINY, WORKLOAD, device="cpu", threads=1)
        assert len(multiprocessing.active_children()) == 1
    here = TorchProbe().device_info("cpu")
    assert replace(info, free_bytes=0) == replace(here, free_bytes=0)
    assert 0 < info.free_bytes <= info.total_bytes  # free memory moves with the machine's load
    assert len(json.loads(cache_path().read_text())) == 1, "the child wrote the shared profile cache"
    assert cache_path().parent == private_cache
    assert profiled.seconds_per_layer > 0 and profiled.activation_bytes > 0
    assert TorchProbe().profile_layer(TINY, WORKLOAD, device="cpu", threads=1) == profiled
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_an_error_in_the_child_is_raised_here_as_its_one_line() -> None:
    with ProcessProbe() as probe, pytest.raises(ShardpoolError, match=ABSENT_LINE):
        probe.device_info(ABSENT_GPUS[0])
    assert multiprocessing.active_children() == []


#: Run in a fresh interpreter: an earlier CUDA test in this pytest process may already hold a
#: context, which would hide one made by the probe.
_MEASURE_A_GPU = """
import json, torch
from pathlib import Path
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.probe_process import ProcessProbe
tiny = ModelShape.from_config_dir(Path("configs/models/tiny-llama.json"))
with ProcessProbe() as probe:
    before = probe.device_info("cuda:0").free_bytes
    probe.profile_layer(tiny, Workload(micro_batch_size=1, sequence_len=64, lora_r=4), device="cuda:0", threads=None)
    after = probe.device_info("cuda:0").free_bytes
print(json.dumps({"initialized": torch.cuda.is_initialized(), "before": before, "after": after}))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measuring_a_gpu_leaves_this_process_without_a_context_and_the_memory_free() -> None:
    finished = subprocess.run(
        [sys.executable, "-c", _MEASURE_A_GPU],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert finished.returncode == 0, finished.stderr[-2000:]
    measured = json.loads(finished.stdout.strip().splitlines()[-1])
    assert not measured["initialized"], "the planning process created no CUDA context"
    assert measured["after"] >= measured["before"] - 64 * 2**20, (
        "the profiled layer's memory went back to the device"
    )


# ---------------------------------------------------------------------------- who plans through it


@pytest.mark.slow
@pytest.mark.usefixtures("no_measuring_here")
def test_finetune_measures_a_local_plans_gpus_in_a_child(
    tmp_path: Path, tiny_model: Path, completion_data: Path
) -> None:
    from shardpool.finetune import finetune

    raw = base_config(
        tiny_model, completion_data, tmp_path / "out", shardpool={"stages": 2, "devices": ABSENT_GPUS}
    )
    with pytest.raises(ShardpoolError, match=ABSENT_LINE):
        finetune(parse_config(raw, source="test"), console=Console(file=io.StringIO()))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_finetune_ends_the_measuring_child_before_any_stage_starts(
    tmp_path: Path, tiny_model: Path, completion_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every device measured in the child (here the CPU), the child is there while the launcher
    plans and gone when it starts the stages."""
    from shardpool import finetune as finetune_module
    from shardpool.launch.local_launcher import LocalLauncher

    seen: dict[str, Any] = {}

    class Started(Exception):
        """The stages would start now."""

    class Watched(LocalLauncher):
        def plan(self, config: Any) -> Any:
            planned = super().plan(config)
            seen["planning"] = len(multiprocessing.active_children())
            return planned

        def start(self, job: Any, job_file: Path, on_event: Any) -> None:
            seen["starting stages"] = len(multiprocessing.active_children())
            raise Started

    monkeypatch.setattr(finetune_module, "ProcessProbe", lambda: ProcessProbe(in_child=lambda name: True))
    monkeypatch.setattr(finetune_module, "launcher_for", lambda config, *, probe, **_: Watched(probe=probe))
    raw = base_config(tiny_model, completion_data, tmp_path / "out")
    with pytest.raises(Started):
        finetune_module.finetune(parse_config(raw, source="test"), console=Console(file=io.StringIO()))
    assert seen == {"planning": 1, "starting stages": 0}


class _Store:
    """The part of torchrun's store rank 0 writes before any other rank starts its stage."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value


@pytest.mark.slow
@pytest.mark.usefixtures("no_measuring_here")
def test_torchruns_rank_0_measures_the_gpus_in_a_child(
    tmp_path: Path, tiny_model: Path, completion_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardpool import torchrun

    monkeypatch.setattr(torchrun, "torchrun_devices", lambda world_size, cuda_devices: ABSENT_GPUS)
    raw = base_config(tiny_model, completion_data, tmp_path / "out", shardpool={"stages": 2})
    config = write_config(tmp_path / "c.yaml", raw)
    store = _Store()
    world = torchrun.TorchrunWorld(0, 2, 0, 2, "127.0.0.1", 29500)
    with pytest.raises(ShardpoolError, match=ABSENT_LINE):
        torchrun._lead(config, world, store, resume=False, console=Console(file=io.StringIO()))
    assert ABSENT_LINE in json.loads(store.values[torchrun.JOB_KEY])["error"]
