"""Models and datasets by Hugging Face id: from the local cache (offline too), else one clear line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardpool.data.hub import is_hub_id
from tests.helpers.training import REPO_ROOT, base_config, completion_rows, write_config

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


def _cache_repo(cache: Path, kind: str, repo_id: str) -> Path:
    """An entry of the Hugging Face hub cache laid out as huggingface_hub writes it."""
    root = cache / "hub" / f"{kind}s--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(SNAPSHOT)
    snapshot = root / "snapshots" / SNAPSHOT
    snapshot.mkdir(parents=True)
    return snapshot


def _offline_env(cache: Path) -> dict[str, str]:
    return dict(os.environ, HF_HOME=str(cache), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", COLUMNS="200")


@pytest.mark.parametrize(
    ("name", "hub"),
    [
        ("mhenrichsen/alpaca_2k_test", True),
        ("NousResearch/Llama-3.2-1B", True),
        ("gpt2", True),
        ("data/train.jsonl", False),
        ("train.parquet", False),
        ("./model", False),
        ("/abs/model", False),
        ("~/model", False),
        ("owner/name/extra", False),
        ("", False),
    ],
)
def test_what_counts_as_a_hub_id(name: str, hub: bool) -> None:
    assert is_hub_id(name) is hub


@pytest.mark.slow
def test_a_hub_model_and_a_hub_parquet_dataset_train_offline_from_the_cache(
    tiny_model: Path, tmp_path: Path
) -> None:
    """What an axolotl user has after one online run: both ids in the cache, then HF_HUB_OFFLINE=1."""
    cache = tmp_path / "hf"
    model_snapshot = _cache_repo(cache, "model", "acme/tiny-llama")
    for item in tiny_model.iterdir():
        shutil.copy(item, model_snapshot / item.name)
    data_snapshot = _cache_repo(cache, "dataset", "acme/tiny-text")
    (data_snapshot / "data").mkdir()
    rows = completion_rows(40)
    pq.write_table(pa.Table.from_pylist(rows[:32]), data_snapshot / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(rows[32:]), data_snapshot / "data" / "test-00000-of-00001.parquet")
    config = base_config(
        tiny_model, tmp_path / "unused.jsonl", tmp_path / "out", max_steps=None, num_epochs=1, val_set_size=0,
        micro_batch_size=8, gradient_accumulation_steps=1,
    )  # fmt: skip
    config.update(base_model="acme/tiny-llama", datasets=[{"path": "acme/tiny-text", "type": "completion"}])
    config_file = write_config(tmp_path / "hub.yaml", config)
    env = _offline_env(cache)
    run = subprocess.run(
        [sys.executable, "-m", "shardpool", "finetune", str(config_file)],
        capture_output=True, text=True, timeout=300, cwd=str(REPO_ROOT), env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    adapter = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "acme/tiny-llama", "the adapter names the hub id, as HF does"
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["steps"] == 4, "one epoch of the 32 train rows (not the 8 test rows) in steps of 8"
    load = (
        "from peft import AutoPeftModelForCausalLM; import sys; "
        f"m = AutoPeftModelForCausalLM.from_pretrained({str(tmp_path / 'out')!r}); print(type(m).__name__)"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", load], capture_output=True, text=True, timeout=120, env=env
    )
    assert loaded.returncode == 0 and "PeftModelForCausalLM" in loaded.stdout, loaded.stderr[-2000:]


@pytest.mark.slow
def test_an_id_in_neither_cache_nor_hub_is_one_line_naming_it(tmp_path: Path) -> None:
    config = base_config(Path("acme/not-cached"), tmp_path / "d.jsonl", tmp_path / "out")
    config["base_model"] = "acme/not-cached"
    config_file = write_config(tmp_path / "missing.yaml", config)
    run = subprocess.run(
        [sys.executable, "-m", "shardpool", "plan", str(config_file), "--json"],
        capture_output=True, text=True, timeout=120, cwd=str(REPO_ROOT), env=_offline_env(tmp_path / "hf"),
    )  # fmt: skip
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr
    assert "base_model 'acme/not-cached' is not a local path, not in the Hugging Face cache" in lines[0]
    assert "HF_HUB_OFFLINE is set" in lines[0] and "hf download acme/not-cached" in lines[0]
