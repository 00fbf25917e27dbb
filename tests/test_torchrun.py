"""``torchrun --nproc-per-node N -m shardpool finetune``: reading torchrun's world, fitting the config
to it, and (slow) a real torchrun launch on CPU stages against local placement."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from shardpool.config import parse_config
from shardpool.errors import ShardpoolError
from shardpool.torchrun import TorchrunWorld, torchrun_config, torchrun_devices, torchrun_world
from tests.helpers.shared_runs import FP32_TWO_STAGES, trained_once
from tests.helpers.training import REPO_ROOT, base_config, write_config

TORCHRUN_ENV = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


def _world(size: int = 2, local: int | None = None) -> TorchrunWorld:
    return TorchrunWorld(0, size, 0, size if local is None else local, "127.0.0.1", 29500)


def test_no_torchrun_variables_is_no_torchrun() -> None:
    assert torchrun_world({"PATH": "/bin"}) is None


def test_torchrun_variables_become_the_world() -> None:
    assert torchrun_world(TORCHRUN_ENV) == TorchrunWorld(1, 2, 1, 2, "127.0.0.1", 29500)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"MASTER_PORT": ""}, "MASTER_PORT are not"),
        ({"RANK": "x"}, "RANK is 'x'"),
        ({"RANK": "2"}, "RANK 2 is outside WORLD_SIZE 2"),
    ],
)
def test_a_partial_or_malformed_torchrun_world_is_one_line(change: dict[str, str], message: str) -> None:
    with pytest.raises(ShardpoolError, match=message):
        torchrun_world(TORCHRUN_ENV | change)


def test_devices_are_one_gpu_per_process_else_the_cpu() -> None:
    assert torchrun_devices(2, 0) == ["cpu", "cpu"]
    assert torchrun_devices(2, 4) == ["cuda:0", "cuda:1"]
    with pytest.raises(ShardpoolError, match="--nproc-per-node 1"):
        torchrun_devices(2, 1)


def _config(tmp_path: Path, **shardpool: object) -> object:
    raw = base_config(tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "out", shardpool=shardpool)
    return parse_config(raw, source="test")


def test_config_gets_one_stage_per_process_on_torchruns_devices(tmp_path: Path) -> None:
    fitted = torchrun_config(_config(tmp_path, layers=[3, 3]), _world(), ["cpu", "cpu"])  # type: ignore[arg-type]
    assert (fitted.shardpool.stages, fitted.shardpool.devices, fitted.shardpool.layers) == (
        2,
        ["cpu", "cpu"],
        [3, 3],
    )


@pytest.mark.parametrize(
    ("section", "world", "message"),
    [
        ({"stages": 3}, _world(), "shardpool.stages gives 3 stages"),
        ({"layers": [2, 2, 2]}, _world(), "shardpool.layers gives 3 stages"),
        ({"placement": "mesh"}, _world(), "remove `placement: mesh`"),
        ({"replicas": 2, "stages": 2}, _world(), "shardpool.replicas: 1"),
        ({"devices": ["cpu", "cuda:0"]}, _world(), "remove shardpool.devices"),
        ({"data_parallel": "on"}, _world(), "remove shardpool.shares and data_parallel: on"),
        ({}, _world(4, local=2), "one machine only"),
    ],
)
def test_what_torchrun_cannot_honour_is_refused_in_one_line(
    tmp_path: Path, section: dict[str, object], world: TorchrunWorld, message: str
) -> None:
    with pytest.raises(ShardpoolError, match=message) as caught:
        torchrun_config(_config(tmp_path, **section), world, ["cpu"] * world.world_size)  # type: ignore[arg-type]
    assert "\n" not in str(caught.value)


def _torchrun(config: Path, *, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200", PYTHONPATH=str(REPO_ROOT))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return subprocess.run(
        [*command, "-m", "shardpool", "finetune", str(config)],
        capture_output=True, text=True, timeout=timeout, cwd=str(REPO_ROOT), env=env,
    )  # fmt: skip


@pytest.mark.slow
def test_torchrun_on_cpu_stages_equals_local_placement(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, completion_data: Path
) -> None:
    """The same split, seeds and data: the adapters agree within 1e-6 (fp32), as do the eval losses."""
    torchrun_out = tmp_path / "torchrun"
    # The local run goes in-process (the same local launcher and stage processes as the CLI's):
    # a second fresh interpreter would only add its imports. Its settings are the fp32 run of
    # tests/train/test_precision.py, so the session trains it once for both.
    local_out = trained_once(tmp_path_factory, tiny_model, completion_data, **FP32_TWO_STAGES)
    launched = _torchrun(write_config(tmp_path / "tr.yaml", base_config(
        tiny_model, completion_data, torchrun_out, **FP32_TWO_STAGES)))  # fmt: skip
    assert launched.returncode == 0, launched.stderr[-3000:]
    a = load_file(str(local_out / "adapter_model.safetensors"))
    b = load_file(str(torchrun_out / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and a
    assert max(float((a[key] - b[key]).abs().max()) for key in a) < 1e-6
    for name in ("README.md", "metrics.jsonl", "plan.json", "run_summary.json", "tokenizer.json"):
        assert (torchrun_out / name).is_file(), name
    assert "eval loss" in launched.stdout


@pytest.mark.slow
def test_a_bad_config_under_torchrun_is_one_line_from_rank_0(tmp_path: Path, tiny_model: Path) -> None:
    """Rank 0 alone checks the config and prints the one line; the other ranks exit without a word."""
    raw = base_config(
        tiny_model, tmp_path / "missing.jsonl", tmp_path / "out", lora_r=0, shardpool={"stages": 2}
    )
    launched = _torchrun(write_config(tmp_path / "bad.yaml", raw), timeout=300)
    assert launched.returncode != 0
    lines = [line for line in (launched.stdout + launched.stderr).splitlines() if "shardpool: error:" in line]
    assert lines == [lines[0]] and "`lora_r`" in lines[0], launched.stderr[-3000:]
    assert "exitcode  : 2" in launched.stderr and "rank      : 0 (local_rank: 0)" in launched.stderr
    assert not (tmp_path / "out").exists()
