"""The keys axolotl's example configs leave empty (``fp16:``, ``debug:``, ``deepspeed:``) are unset.

A value shardpool cannot honour still gets its one-line refusal; the config with all of them
empty trains.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from rich.console import Console

from shardpool.config import load_config, parse_config
from shardpool.config.json_schema import config_json_schema
from shardpool.errors import ShardpoolError
from tests.helpers.training import base_config, completion_rows, write_jsonl

#: The keys axolotl's published examples write with no value, each as they spell it.
EMPTY_IN_AXOLOTL_EXAMPLES = (
    "wandb_project wandb_entity wandb_watch wandb_name wandb_log_model wandb_run_id "
    "resume_from_checkpoint lora_model_dir special_tokens dataset_prepared_path fp16 evals_per_epoch "
    "torchdistx_path gptq_groupsize gptq_model_v1 push_dataset_to_hub max_packed_sequence_len "
    "trackio_project_name trackio_run_name trackio_space_id deepspeed fsdp fsdp_config "
    "lora_modules_to_save early_stopping_patience debug local_rank xformers_attention eval_table_size "
    "lora_fan_in_fan_out s2_attention"
).split()

BASE: dict[str, Any] = {
    "base_model": "m",
    "datasets": [{"path": "d.jsonl", "type": "alpaca"}],
    "lora_target_linear": True,
}


def _yaml_with_empty_keys(config: dict[str, Any]) -> str:
    """``config`` as YAML, then each key of the examples on a line of its own with no value."""
    return yaml.safe_dump(config, sort_keys=False) + "".join(f"{key}:\n" for key in EMPTY_IN_AXOLOTL_EXAMPLES)


def test_every_key_the_examples_leave_empty_is_unset(tmp_path: Path) -> None:
    config_file = tmp_path / "config.yml"
    config_file.write_text(_yaml_with_empty_keys(BASE), encoding="utf-8")
    assert load_config(config_file) == parse_config(BASE)


@pytest.mark.parametrize("key", EMPTY_IN_AXOLOTL_EXAMPLES)
def test_each_empty_key_alone_is_unset(key: str) -> None:
    assert parse_config({**BASE, key: None}) == parse_config(BASE)


def test_the_json_schema_accepts_them_empty() -> None:
    config = {**BASE, **dict.fromkeys(EMPTY_IN_AXOLOTL_EXAMPLES)}
    assert list(jsonschema.Draft202012Validator(config_json_schema()).iter_errors(config)) == []


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("fp16", "maybe", "`fp16` in config: input should be a valid boolean"),
        ("deepspeed", "zero3.json", "`deepspeed` is not supported by shardpool"),
        ("fsdp", ["full_shard"], "`fsdp` is not supported by shardpool"),
        ("fsdp_config", {"fsdp_offload_params": True}, "`fsdp_config` is not supported by shardpool"),
        ("wandb_watch", "gradients", "`wandb_watch` is not supported by shardpool"),
        ("trackio_project_name", "p", "`trackio_project_name` is not supported by shardpool"),
        ("torchdistx_path", "/opt/torchdistx", "`torchdistx_path` is not supported by shardpool"),
        ("max_packed_sequence_len", 2048, "`max_packed_sequence_len` is not supported by shardpool"),
        ("lora_modules_to_save", ["embed_tokens"], "`lora_modules_to_save` is not supported by shardpool"),
        ("lora_fan_in_fan_out", True, "`lora_fan_in_fan_out` is not supported by shardpool"),
        ("early_stopping_patience", 3, "`early_stopping_patience` is not supported by shardpool"),
        ("s2_attention", True, "`s2_attention` is not supported by shardpool"),
        ("evals_per_epoch", "often", "`evals_per_epoch` in config: input should be a valid integer"),
    ],
)
def test_a_value_shardpool_cannot_honour_is_still_refused_in_one_line(
    key: str, value: Any, expected: str
) -> None:
    with pytest.raises(ShardpoolError) as caught:
        parse_config({**BASE, **dict.fromkeys(EMPTY_IN_AXOLOTL_EXAMPLES), key: value})
    assert expected in str(caught.value) and "\n" not in str(caught.value)


def test_unknown_keys_are_still_refused() -> None:
    with pytest.raises(ShardpoolError, match=r"unknown key `debugging`"):
        parse_config({**BASE, "debugging": None})


@pytest.mark.slow
def test_a_config_with_every_key_empty_trains(tiny_model: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", completion_rows(24))
    config = base_config(tiny_model, data, tmp_path / "out", max_steps=1, val_set_size=0)
    config_file = tmp_path / "config.yml"
    config_file.write_text(_yaml_with_empty_keys(config), encoding="utf-8")
    from shardpool.finetune import finetune

    output = finetune(load_config(config_file), console=Console(quiet=True))
    assert (output / "adapter_model.safetensors").is_file()


def test_a_plugin_config_is_refused_once_for_its_plugins() -> None:
    """axolotl's Liger example: the plugin's own keys are not unknown, the plugin is refused."""
    liger = {
        "plugins": ["axolotl.integrations.liger.LigerPlugin"],
        "liger_rope": True,
        "liger_rms_norm": True,
        "liger_glu_activation": True,
        "liger_fused_linear_cross_entropy": True,
        "cut_cross_entropy": True,
    }
    with pytest.raises(ShardpoolError) as caught:
        parse_config({**BASE, **liger})
    assert str(caught.value).startswith("`plugins` is not supported by shardpool")
    assert "\n" not in str(caught.value)
