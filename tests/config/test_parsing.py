"""shardpool.config.parsing: every problem of a config reported at once, before torch is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shardpool.config import parse_config
from shardpool.errors import ShardpoolError

REPO = Path(__file__).resolve().parents[2]
BASE: dict[str, Any] = {
    "base_model": "m",
    "datasets": [{"path": "d.jsonl", "type": "alpaca"}],
    "lora_target_linear": True,
}


def _lines(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(ShardpoolError) as caught:
        parse_config(raw, source="my.yaml")
    return str(caught.value).splitlines()


def test_every_problem_is_reported_in_one_error() -> None:
    lines = _lines(
        {
            **BASE,
            "lerning_rate": 1e-4,
            "deepspeed": "zero3.json",
            "micro_batch_size": "two",
            "warmup_steps": 2,
            "warmup_ratio": 0.1,
            "shardpool": {"stages": 3, "layers": [1, 2]},
            "datasets": [{"path": "x", "typ": "alpaca"}, {"path": "y", "shards": 4}],
        }
    )
    assert lines[0] == "my.yaml has 7 problems; fix them all, then run again:"
    body = "\n".join(lines[1:])
    for expected in (
        "unknown key `lerning_rate`; did you mean `learning_rate`?",
        "`deepspeed` is not supported by shardpool",
        "`micro_batch_size`: input should be a valid integer",
        "`warmup_steps` and `warmup_ratio` both set; keep one",
        "`shardpool`: stage counts disagree",
        "unknown key `datasets[0].typ`; did you mean `type`?",
        "`datasets[1].shards` is not supported by shardpool",
    ):
        assert expected in body
    assert all(line.startswith("  - ") for line in lines[1:]) and len(lines) == 8


def test_a_single_problem_is_one_line_naming_the_file() -> None:
    assert _lines({**BASE, "lerning_rate": 1e-4}) == [
        "unknown key `lerning_rate` in my.yaml; did you mean `learning_rate`?"
    ]


def test_rules_reading_a_broken_key_are_not_reported_twice() -> None:
    """``load_in_4bit: "yes"`` is a type error; the qlora rule that reads it must not add a second line."""
    lines = _lines({**BASE, "load_in_4bit": "yes", "bf16": True, "fp16": True})
    assert lines[0].startswith("my.yaml has 2 problems")
    assert "`load_in_4bit`: input should be a valid boolean" in lines[1]
    assert "`bf16` and `fp16` both set" in lines[2]


def test_one_key_with_a_union_type_is_one_problem() -> None:
    assert len(_lines({**BASE, "bf16": "yes"})) == 1


def test_missing_required_keys_do_not_hide_the_others() -> None:
    lines = _lines({"lora_target_linear": True, "fp16": True, "bf16": True})
    body = "\n".join(lines)
    assert "missing required key `base_model`" in body and "missing required key `datasets`" in body
    assert "`bf16` and `fp16` both set" in body


def test_parsing_does_not_import_torch_and_takes_under_a_second(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    text = (REPO / "tests/config/fixtures/axolotl-llama-2-qlora.yml").read_text(encoding="utf-8")
    config.write_text(
        text.replace("attn_implementation: flash_attention_2", "neftune_noise_alpha: 5"), encoding="utf-8"
    )
    script = (
        "import json, sys, time\n"
        "start = time.process_time()\n"
        "from shardpool.config import load_config\n"
        "from shardpool.errors import ShardpoolError\n"
        "try:\n"
        f"    load_config({str(config)!r})\n"
        "except ShardpoolError as error:\n"
        "    message = str(error)\n"
        "print(json.dumps({'seconds': time.process_time() - start, 'message': message,\n"
        "                  'heavy': sorted(m for m in ('torch', 'transformers', 'peft', 'bitsandbytes')\n"
        "                                  if m in sys.modules)}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60, check=True
    )
    result = json.loads(done.stdout)
    assert result["heavy"] == []
    assert "neftune_noise_alpha" in result["message"]  # it did validate the whole config
    # CPU seconds, not wall-clock: on the shared test machine other processes' load stretches the
    # wall-clock time of the same work (1.1 s at a load of 10 on 2 cores) without it doing more.
    assert result["seconds"] < 1.0


def test_config_dump_parses_again() -> None:
    """Jobs carry ``config.model_dump()``; with accepted axolotl keys dropped it must parse again."""
    config = parse_config({**BASE, "strict": False, "lora_target_modules": "all-linear", "wandb_project": ""})
    assert parse_config(config.model_dump(mode="json")) == config
