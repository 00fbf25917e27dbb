"""shardpool.config: strict validation with one-line errors that name the key and the fix."""

from __future__ import annotations

from typing import Any

import pytest

from shardpool.config import Config, parse_config
from shardpool.errors import ShardpoolError

BASE: dict[str, Any] = {
    "base_model": "m",
    "datasets": [{"path": "d.jsonl", "type": "alpaca"}],
    "lora_target_linear": True,
}


def _error(**changes: Any) -> str:
    with pytest.raises(ShardpoolError) as caught:
        parse_config({**BASE, **changes})
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_defaults_follow_axolotl() -> None:
    config = parse_config(BASE)
    assert (config.adapter, config.load_in_4bit, config.lr_scheduler, config.optimizer) == (
        "qlora",
        True,
        "cosine",
        "adamw_torch",
    )
    assert config.shardpool.num_stages == 2 and config.shardpool.schedule == "1f1b"
    assert config.compute_dtype_name == config.wire_dtype_name == "float32"


def test_numbers_written_the_axolotl_way_are_accepted() -> None:
    config = parse_config(
        {**BASE, "learning_rate": "2e-4", "lora_alpha": 16, "bf16": True, "shardpool": {"wire_dtype": "fp32"}}
    )
    assert config.learning_rate == 2e-4 and config.lora_alpha == 16.0
    assert config.compute_dtype_name == "bfloat16" and config.wire_dtype_name == "float32"


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"lerning_rate": 1e-4}, "did you mean `learning_rate`?"),
        ({"shardpool": {"stagez": 2}}, "unknown key `shardpool.stagez`"),
        ({"datasets": [{"path": "x", "typ": "alpaca"}]}, "did you mean `type`?"),
        ({"micro_batch_size": "two"}, "`micro_batch_size`"),
        ({"adapter": "qlora", "load_in_4bit": False}, "needs `load_in_4bit: true`"),
        ({"warmup_steps": 2, "warmup_ratio": 0.1}, "keep one"),
        ({"bf16": True, "fp16": True}, "keep one"),
        ({"curriculum_sampling": True}, "shuffle_merged_datasets: false"),
        ({"shardpool": {"stages": 3, "layers": [1, 2]}}, "stage counts disagree"),
        ({"shardpool": {"devices": ["tpu"]}}, "unknown device `tpu`"),
        ({"deepspeed": "z3.json"}, "`deepspeed` is not supported"),
        ({"lora_target_linear": False}, "no LoRA targets"),
        ({"save_steps": 2, "saves_per_epoch": 2}, "`save_steps` and `saves_per_epoch` both set"),
        ({"eval_steps": 2, "evals_per_epoch": 2}, "`eval_steps` and `evals_per_epoch` both set"),
        ({"eval_steps": 2.5}, "a whole step count or a fraction below 1"),
        ({"eval_steps": 0}, "`eval_steps`"),
        ({"save_total_limit": 0}, "`save_total_limit`"),
        (
            {"gradient_accumulation_steps": 3, "shardpool": {"shares": [2, 1], "layers": [1, 2]}},
            "trains whole-model replicas; remove shardpool.layers",
        ),
        (
            {"gradient_accumulation_steps": 3, "shardpool": {"shares": [2, 1], "replicas": 2}},
            "remove shardpool.replicas",
        ),
        (
            {"gradient_accumulation_steps": 3, "shardpool": {"shares": [3]}},
            "at least 2 replicas of at least 1 micro-batch",
        ),
        (
            {"gradient_accumulation_steps": 3, "shardpool": {"shares": [2, 1], "data_parallel": "off"}},
            "`data_parallel` is off; keep one",
        ),
        (
            {"gradient_accumulation_steps": 3, "shardpool": {"shares": [2, 1], "devices": ["cpu"] * 3}},
            "give one device per replica",
        ),
        ({"gradient_accumulation_steps": 4, "shardpool": {"shares": [2, 1]}}, "add up to 3 but a step has 4"),
        ({"shardpool": {"data_parallel": "always"}}, "`shardpool.data_parallel`"),
        (
            {"shardpool": {"data_parallel": "on", "stages": 2}},
            "`data_parallel: on` trains whole-model replicas; remove shardpool.stages or use auto",
        ),
    ],
)
def test_bad_configs_name_the_key_and_the_fix(changes: dict[str, Any], expected: str) -> None:
    assert expected in _error(**changes)


def test_cadence_keys_take_axolotl_values() -> None:
    config = parse_config({**BASE, "eval_steps": 0.25, "saves_per_epoch": 2, "save_total_limit": 3})
    assert (config.eval_steps, config.saves_per_epoch, config.save_total_limit) == (0.25, 2, 3)
    assert parse_config({**BASE, "eval_steps": 5, "evals_per_epoch": None}).eval_steps == 5


def test_every_field_is_documented() -> None:
    for name, field in Config.model_fields.items():
        assert field.description, f"{name} needs a description"
