"""shardpool.model.lora: LoRA targets, the starting adapter check, and the adapter files peft reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftConfig

from shardpool.config import parse_config
from shardpool.errors import ShardpoolError
from shardpool.model.lora import (
    LoraSettings,
    base_model_reference,
    init_lora_weights,
    lora_settings,
    read_adapter_tensors,
    write_adapter,
)

BASE = {"base_model": "m", "datasets": [{"path": "d.jsonl"}]}


def test_targets_resolve_in_layer_order() -> None:
    settings = lora_settings(parse_config({**BASE, "lora_target_modules": ["v_proj", "q_proj"]}))
    assert settings.target_modules == ("q_proj", "v_proj")
    assert len(lora_settings(parse_config({**BASE, "lora_target_linear": True})).target_modules) == 7
    with pytest.raises(ShardpoolError, match="lm_head"):
        lora_settings(parse_config({**BASE, "lora_target_modules": ["lm_head"]}))


def test_adapter_files_round_trip_and_peft_reads_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = LoraSettings(r=4, alpha=8.0, dropout=0.05, target_modules=("q_proj", "v_proj"), init_from=None)
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 16)}
    (tmp_path / "models" / "quickstart").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    write_adapter(tmp_path, tensors, settings, base_model="models/quickstart")
    loaded = PeftConfig.from_pretrained(str(tmp_path))
    assert (loaded.r, loaded.lora_alpha, sorted(loaded.target_modules)) == (4, 8.0, ["q_proj", "v_proj"])
    assert loaded.base_model_name_or_path == str((tmp_path / "models/quickstart").resolve()), "absolute"
    assert torch.equal(read_adapter_tensors(tmp_path)[next(iter(tensors))], next(iter(tensors.values())))
    assert not list(tmp_path.glob("*.tmp")), "no temporary files are left behind"


def test_a_base_model_that_is_no_local_directory_is_kept_as_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert base_model_reference("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    (tmp_path / "Qwen" / "Qwen2.5-0.5B").mkdir(parents=True)
    assert base_model_reference("Qwen/Qwen2.5-0.5B") == str((tmp_path / "Qwen/Qwen2.5-0.5B").resolve())


def test_a_starting_adapter_with_other_hyperparameters_is_refused(tmp_path: Path) -> None:
    settings = LoraSettings(r=8, alpha=16.0, dropout=0.0, target_modules=("q_proj",), init_from=None)
    write_adapter(tmp_path, {}, settings, base_model="m")
    config = {**BASE, "lora_target_modules": ["q_proj"], "lora_model_dir": str(tmp_path)}
    assert lora_settings(parse_config({**config, "lora_r": 8})).r == 8
    with pytest.raises(ShardpoolError, match="`lora_r` is 4 but lora_model_dir's adapter has 8"):
        lora_settings(parse_config({**config, "lora_r": 4}))
    assert json.loads((tmp_path / "adapter_config.json").read_text())["r"] == 8


def test_init_depends_only_on_seed_and_module_name() -> None:
    first = {
        "x.lora_A.weight": torch.nn.Parameter(torch.zeros(4, 8)),
        "y.lora_A.weight": torch.nn.Parameter(torch.zeros(4, 8)),
    }
    again = {"x.lora_A.weight": torch.nn.Parameter(torch.zeros(4, 8))}
    init_lora_weights(first, seed=1)
    init_lora_weights(again, seed=1)
    assert torch.equal(first["x.lora_A.weight"], again["x.lora_A.weight"])
    assert not torch.equal(first["x.lora_A.weight"], first["y.lora_A.weight"])
    bound = 1 / 8**0.5  # kaiming-uniform with a = sqrt(5) on fan_in 8
    assert float(first["x.lora_A.weight"].abs().max()) <= bound
