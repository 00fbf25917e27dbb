"""``torchrun --nproc-per-node N -m shardpool finetune``: reading torchrun's world, fitting the config
to it, and (slow) a real torchrun launch on CPU stages against local placement; ``generate`` and
``serve`` under torchrun (rank 0 drives, the other ranks are the stages) against peft's ``generate``."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import openai
import psutil
import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer

from shardpool.config import parse_config
from shardpool.errors import ShardpoolError
from shardpool.infer.target import resolve_target
from shardpool.torchrun import (
    TorchrunWorld,
    torchrun_config,
    torchrun_devices,
    torchrun_inference_stages,
    torchrun_world,
)
from tests.helpers.generation import PROMPTS, peft_greedy, random_adapter, varied_tiny_model
from tests.helpers.mesh_training import Drained, wait_for
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


# ----------------------------------------------------------------------------- generate and serve
def test_generate_and_serve_under_torchrun_run_one_driver_and_the_other_ranks_as_stages() -> None:
    assert torchrun_inference_stages(3, None) == 2
    assert torchrun_inference_stages(2, 1) == 1
    with pytest.raises(ShardpoolError, match="use --nproc-per-node 2 or more"):
        torchrun_inference_stages(1, None)
    with pytest.raises(ShardpoolError, match="use --nproc-per-node 4 or remove --stages"):
        torchrun_inference_stages(3, 3)


@pytest.fixture(scope="module")
def generation_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("torchrun-generation")
    return random_adapter(varied_tiny_model(root / "model"), root / "adapter")


def _torchrun_command(processes: int, *arguments: str) -> list[str]:
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(processes),
    ]
    return [*launcher, "-m", "shardpool", *arguments]


def _torchrun_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO_ROOT), **extra)


@pytest.mark.slow
def test_generate_under_torchrun_equals_peft_generate(generation_adapter: Path) -> None:
    """Three processes: rank 0 drives, ranks 1 and 2 are two stages; the greedy tokens are peft's."""
    target = resolve_target(generation_adapter)
    reference = peft_greedy(target.model_dir, generation_adapter, (PROMPTS[5],), 32)[0]
    launched = subprocess.run(
        _torchrun_command(3, "generate", str(generation_adapter), "--prompt", PROMPTS[5],
                          "--max-new-tokens", "32", "--json"),
        capture_output=True, text=True, timeout=600, cwd=str(REPO_ROOT),
        env=_torchrun_env(SHARDPOOL_CONTROL_SECRET=secrets.token_hex(32)),
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr[-3000:]
    answer = json.loads(launched.stdout.strip().splitlines()[-1])
    assert answer["token_ids"] == reference
    assert len(set(reference)) > 8, "equal outputs must mean equal logits"
    assert "is not set" not in launched.stderr  # the secret was given: no warning


@pytest.mark.slow
def test_a_bad_target_under_torchrun_is_one_line_from_rank_0(tmp_path: Path) -> None:
    """Rank 0 says what is wrong; the stage ranks, never given a ring, exit without a word."""
    launched = subprocess.run(
        _torchrun_command(3, "generate", str(tmp_path / "missing"), "--prompt", "x"),
        capture_output=True, text=True, timeout=300, cwd=str(REPO_ROOT), env=_torchrun_env(),
    )  # fmt: skip
    assert launched.returncode != 0
    lines = [line for line in (launched.stdout + launched.stderr).splitlines() if "shardpool: error:" in line]
    assert len(lines) == 1 and "missing" in lines[0], launched.stderr[-3000:]
    assert "exitcode  : 2" in launched.stderr and "rank      : 0 (local_rank: 0)" in launched.stderr


@pytest.mark.slow
def test_serve_under_torchrun_answers_the_openai_client_and_stops_on_sigterm(
    generation_adapter: Path,
) -> None:
    target = resolve_target(generation_adapter)
    reference = peft_greedy(target.model_dir, generation_adapter, (PROMPTS[2],), 16)[0]
    tokenizer = AutoTokenizer.from_pretrained(target.tokenizer_dir)
    server = Drained(
        subprocess.Popen(
            _torchrun_command(2, "serve", str(generation_adapter), "--port", "0"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO_ROOT),
            env=_torchrun_env(SHARDPOOL_CONTROL_SECRET=secrets.token_hex(32)),
        )
    )  # fmt: skip
    try:
        wait_for(lambda: "serving " in server.said() or server.poll() is not None, 300)
        assert server.poll() is None, server.said()
        line = next(line for line in server.said().splitlines() if line.startswith("serving "))
        assert line.endswith("/v1 (1 stage)"), line
        client = openai.OpenAI(base_url=line.split(" on ", 1)[1].split(" ", 1)[0], api_key="-", max_retries=0)
        answer = client.completions.create(
            model=generation_adapter.name, prompt=PROMPTS[2], max_tokens=16, temperature=0
        )
        assert answer.usage.completion_tokens == len(reference)
        assert answer.choices[0].text == tokenizer.decode(reference, skip_special_tokens=True)
        processes = [
            psutil.Process(server.process.pid),
            *psutil.Process(server.process.pid).children(recursive=True),
        ]
        assert len(processes) >= 3  # torchrun, the driver and the stage
        server.process.send_signal(signal.SIGTERM)
        server.finish(timeout=60)
        assert not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        server.kill()
