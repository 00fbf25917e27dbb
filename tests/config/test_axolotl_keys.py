"""axolotl keys outside shardpool's schema: accepted when they change nothing, else refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from shardpool.config import AXOLOTL_KEYS, Config, parse_config
from shardpool.errors import ShardpoolError

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BASE: dict[str, Any] = {
    "base_model": "m",
    "datasets": [{"path": "d.jsonl", "type": "alpaca"}],
    "lora_target_linear": True,
}


def _error(**changes: Any) -> str:
    with pytest.raises(ShardpoolError) as caught:
        parse_config({**BASE, **changes})
    return str(caught.value)


@pytest.mark.parametrize(
    "changes",
    [
        {"load_in_8bit": False},
        {"strict": False},
        {"strict": True},
        {"wandb_project": None, "wandb_watch": None, "wandb_log_model": None, "use_mlflow": False},
        {"deepspeed": None},
        {"fsdp": [], "fsdp_config": {}},
        {"special_tokens": None},
        {"flash_attention": False, "xformers_attention": None, "sdp_attention": True},
        {"attn_implementation": "sdpa"},
        {"tf32": False},
        {"pad_to_sequence_len": True},
        {"pad_to_sequence_len": None},
        {"excess_length_strategy": "truncate"},
        {"model_type": "LlamaForCausalLM", "tokenizer_type": "LlamaTokenizer"},
        {"dataset_prepared_path": "last_run_prepared", "local_rank": 0},
        {"eval_table_size": 5, "eval_max_new_tokens": 128},
        {"gradient_checkpointing_kwargs": {"use_reentrant": False}},
        {"resume_from_checkpoint": None, "hub_model_id": None, "lora_modules_to_save": []},
        {"tensor_parallel_size": 1, "save_safetensors": True, "tokenizer_use_fast": True},
        {"loss_watchdog_threshold": 5.0, "loss_watchdog_patience": 3},
        {"datasets": [{"path": "d.jsonl", "type": "alpaca", "shards": None, "input_transform": None}]},
    ],
)
def test_keys_that_change_nothing_are_accepted_and_dropped(changes: dict[str, Any]) -> None:
    assert parse_config({**BASE, **changes}) == parse_config(BASE)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"load_in_8bit": True}, "`load_in_8bit` is not supported by shardpool: 8-bit bases"),
        ({"deepspeed": "zero3.json"}, "`deepspeed` is not supported by shardpool: shardpool splits"),
        ({"fsdp": ["full_shard"]}, "`fsdp` is not supported"),
        ({"s2_attention": True}, "`s2_attention` is not supported by shardpool: attention uses"),
        ({"save_safetensors": False}, "always written as safetensors"),
        ({"trust_remote_code": True}, "no code from the model directory is run"),
        ({"tensor_parallel_size": 2}, "`tensor_parallel_size` is not supported"),
        ({"use_mlflow": True}, "only metrics.jsonl, TensorBoard (`use_tensorboard`) and W&B"),
        ({"tokens": ["<|new|>"]}, "`tokens` is not supported by shardpool: adding tokens to the vocabulary"),
        ({"excess_length_strategy": "drop"}, "set `excess_length_strategy: truncate`"),
        ({"pad_to_sequence_len": "yes"}, "`pad_to_sequence_len` is not supported"),
        ({"datasets": [{"path": "d", "type": "alpaca", "shards": 4}]}, "`datasets[0].shards` is not"),
        ({"datasets": [{"path": "d", "ds_type": "xml"}]}, "`datasets[0].ds_type`"),
        ({"relora": True}, "`relora` is not supported by shardpool: not built in shardpool"),
    ],
)
def test_keys_that_would_change_the_run_are_refused_in_one_line(
    changes: dict[str, Any], expected: str
) -> None:
    message = _error(**changes)
    assert expected in message and "\n" not in message


@pytest.mark.parametrize("key", ["eval_table_size", "model_type", "dataset_prepared_path", "local_rank"])
def test_hints_never_get_a_did_you_mean(key: str) -> None:
    parse_config({**BASE, key: 123})


def test_unknown_keys_still_get_a_did_you_mean() -> None:
    assert "did you mean `adam_epsilon`?" in _error(adam_eps=1e-8)


@pytest.mark.parametrize("spelling", ["all-linear", ["all-linear"]])
def test_all_linear_targets_every_linear_like_lora_target_linear(spelling: Any) -> None:
    config = parse_config({**BASE, "lora_target_linear": None, "lora_target_modules": spelling})
    assert config.lora_target_linear and config.lora_target_modules is None
    config = parse_config({"base_model": "m", "datasets": BASE["datasets"], "lora_target_modules": spelling})
    assert config.lora_target_linear


def test_all_linear_against_lora_target_linear_false_is_refused() -> None:
    assert "disagree" in _error(lora_target_linear=False, lora_target_modules="all-linear")


def test_a_regex_string_of_targets_is_refused() -> None:
    assert "a list of module names or `all-linear`" in _error(lora_target_modules="q_proj")


def test_train_on_inputs_is_a_schema_key() -> None:
    assert parse_config(BASE).train_on_inputs is False
    assert parse_config({**BASE, "train_on_inputs": True}).train_on_inputs is True


def test_the_tables_do_not_shadow_schema_keys() -> None:
    assert not set(AXOLOTL_KEYS) & set(Config.model_fields)


@pytest.mark.parametrize(
    ("fixture", "remaining"),
    [
        ("axolotl-llama-2-qlora.yml", []),
        ("axolotl-llama-3-qlora-1b.yml", []),
        ("axolotl-qwen-qlora.yml", ["trust_remote_code"]),
    ],
)
def test_axolotl_examples_leave_only_what_is_not_built(fixture: str, remaining: list[str]) -> None:
    """A stock axolotl QLoRA example fails only on keys that would change the run, all in one error."""
    raw = yaml.safe_load((FIXTURES / fixture).read_text(encoding="utf-8"))
    if remaining:
        with pytest.raises(ShardpoolError) as caught:
            parse_config(raw, source=fixture)
        lines = str(caught.value).splitlines()
        lines = lines[1:] if len(lines) > 1 else lines  # one problem is one line, without the header
        assert [line.split("`")[1] for line in lines] == remaining
    for key in remaining:
        raw.pop(key)
    config = parse_config(raw, source=fixture)
    assert config.adapter == "qlora" and config.bf16 == "auto"
    assert (config.evals_per_epoch, config.saves_per_epoch) == (4, 1)
