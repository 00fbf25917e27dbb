"""`shardpool schema`: the config's JSON Schema, from the code's key tables, agreeing with the parser."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from shardpool.config import AXOLOTL_KEYS, Config, load_config, parse_config
from shardpool.config.json_schema import DRAFT, config_json_schema
from shardpool.errors import ShardpoolError
from tests.helpers.training import REPO_ROOT, run_cli

QUICKSTART = yaml.safe_load((REPO_ROOT / "configs" / "quickstart.yaml").read_text())
FIXTURES = sorted((REPO_ROOT / "tests" / "config" / "fixtures").glob("*.yml"))


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    """The schema as `shardpool schema` prints it, checked against the draft 2020-12 meta-schema."""
    result = run_cli("schema", timeout=120)
    assert result.returncode == 0, result.stderr
    schema = json.loads(result.stdout)
    assert schema["$schema"] == DRAFT == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _errors(validator: jsonschema.Draft202012Validator, config: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, error.path))}: {error.message}" for error in validator.iter_errors(config)]


def test_the_quickstart_config_is_accepted(validator: jsonschema.Draft202012Validator) -> None:
    assert _errors(validator, QUICKSTART) == []


@pytest.mark.parametrize(
    ("changes", "where"),
    [
        ({"datasets": [{"path": "data.jsonl", "type": "alpacca"}]}, "datasets.0.type"),
        ({"micro_batch_size": "eight"}, "micro_batch_size"),
        ({"adapter": "qlorra"}, "adapter"),
        ({"shardpool": {"stages": 2, "placment": "mesh"}}, "shardpool"),
        ({"learning_rat": 0.1}, ""),
        ({"deepspeed": "zero2.json"}, "deepspeed"),
        ({"load_in_8bit": True}, "load_in_8bit"),
        ({"learning_rate": "fast"}, "learning_rate"),
    ],
)
def test_typos_and_refused_values_are_rejected_where_they_are(
    validator: jsonschema.Draft202012Validator, changes: dict[str, Any], where: str
) -> None:
    errors = _errors(validator, {**QUICKSTART, **changes})
    assert [error.split(": ")[0] for error in errors] == [where], errors


@pytest.mark.parametrize(
    "changes",
    [
        {"learning_rate": "2e-4"},
        {"lora_target_modules": "all-linear"},
        {"strict": False, "model_type": "LlamaForCausalLM", "wandb_project": None, "deepspeed": ""},
        {"flash_attention": True, "pad_to_sequence_len": True, "load_in_8bit": False},
        {"datasets": [{"path": "data.jsonl", "type": "alpaca", "ds_type": "json", "split": None}]},
    ],
)
def test_axolotl_spellings_the_parser_accepts_are_accepted(
    validator: jsonschema.Draft202012Validator, changes: dict[str, Any]
) -> None:
    config = {**QUICKSTART, **changes}
    assert _errors(validator, config) == []
    parse_config(config)


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda path: path.name)
def test_the_schema_accepts_every_axolotl_fixture_the_parser_accepts(
    validator: jsonschema.Draft202012Validator, fixture: Path
) -> None:
    try:
        load_config(fixture)
    except ShardpoolError:
        pytest.skip("refused by the parser; the schema may not see why (rules across keys, files)")
    assert _errors(validator, yaml.safe_load(fixture.read_text())) == []


def test_every_key_the_parser_knows_is_in_the_schema() -> None:
    properties = config_json_schema()["properties"]
    assert set(Config.model_fields) | set(AXOLOTL_KEYS) <= set(properties)
    assert all(properties[name].get("description") for name in Config.model_fields)
