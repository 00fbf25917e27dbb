"""`sequence_len` above the model's `max_position_embeddings` is refused while the config is read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardpool.config import parse_config
from shardpool.errors import ShardpoolError
from tests.helpers.training import run_cli, write_config


def _model_dir(tmp_path: Path, **model_config: Any) -> Path:
    """A directory with only a config.json: all the check reads."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", **model_config}))
    return model


def _raw(model: Path, **changes: Any) -> dict[str, Any]:
    return {
        "base_model": str(model),
        "datasets": [{"path": "data.jsonl", "type": "alpaca"}],
        "lora_target_linear": True,
        **changes,
    }


def test_sequence_len_above_max_position_embeddings_is_one_line_naming_both(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, max_position_embeddings=1024)
    with pytest.raises(ShardpoolError) as caught:
        parse_config(_raw(model, sequence_len=4096), source="run.yaml")
    assert str(caught.value) == (
        f"run.yaml: `sequence_len` 4096 is above the model's max_position_embeddings 1024 "
        f"({model}/config.json); lower `sequence_len` to 1024 or less"
    )


def test_the_default_sequence_len_is_checked_too(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, max_position_embeddings=256)
    with pytest.raises(ShardpoolError, match=r"`sequence_len` 512 \(the default\) is above .* 256"):
        parse_config(_raw(model), source="run.yaml")


def test_it_is_listed_with_every_other_problem(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, max_position_embeddings=1024)
    with pytest.raises(ShardpoolError) as caught:
        parse_config(_raw(model, sequence_len=2048, micro_batch_size="eight"), source="run.yaml")
    lines = str(caught.value).splitlines()
    assert lines[0] == "run.yaml has 2 problems; fix them all, then run again:"
    assert any("max_position_embeddings 1024" in line for line in lines[1:])
    assert any("`micro_batch_size`" in line for line in lines[1:])


@pytest.mark.parametrize(
    "model_config",
    [{"max_position_embeddings": 1024}, {}, {"max_position_embeddings": "many"}],
)
def test_a_sequence_len_within_the_limit_or_without_one_passes(
    tmp_path: Path, model_config: dict[str, Any]
) -> None:
    model = _model_dir(tmp_path, **model_config)
    assert parse_config(_raw(model, sequence_len=1024)).sequence_len == 1024


def test_a_missing_model_directory_is_left_to_the_model_check(tmp_path: Path) -> None:
    assert parse_config(_raw(tmp_path / "absent", sequence_len=999999)).sequence_len == 999999


def test_finetune_refuses_it_at_once_and_writes_nothing(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, max_position_embeddings=128)
    config = write_config(
        tmp_path / "run.yaml", _raw(model, sequence_len=129, output_dir=str(tmp_path / "out"))
    )
    result = run_cli("finetune", str(config), timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"shardpool: error: {config}: `sequence_len` 129 is above the model's max_position_embeddings "
        f"128 ({model}/config.json); lower `sequence_len` to 128 or less"
    ]
    assert not (tmp_path / "out").exists()


def test_plan_with_another_model_checks_that_model(tmp_path: Path) -> None:
    """`shardpool plan CONFIG --model X --set sequence_len=N` plans X, so N is held to X's limit."""
    from shardpool.plan.config_plan import load_config_with_overrides

    small = _model_dir(tmp_path, max_position_embeddings=1024)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 8192}))
    config = write_config(tmp_path / "run.yaml", _raw(small, sequence_len=512))
    planned = load_config_with_overrides(str(config), ["sequence_len=4096"], model_path=str(big))
    assert planned.sequence_len == 4096
    with pytest.raises(ShardpoolError, match=rf"`sequence_len` 9000 is above .* 8192 \({big}\)"):
        load_config_with_overrides(str(config), ["sequence_len=9000"], model_path=str(big))
    with pytest.raises(ShardpoolError, match=r"`sequence_len` 4096 is above .* 1024"):
        load_config_with_overrides(str(config), ["sequence_len=4096"])


def test_a_model_resolved_later_is_checked_when_it_is_read(tmp_path: Path) -> None:
    """A hub id has no config.json at parse time; check_sequence_len refuses once it is local."""
    from shardpool.model.shape import ModelInfo, ModelShape, check_sequence_len

    model = _model_dir(tmp_path, max_position_embeddings=64)
    config = parse_config(_raw(tmp_path / "elsewhere", sequence_len=128))
    info = ModelInfo(path=model, shape=ModelShape.from_config_json(_tiny_shape(64)))
    with pytest.raises(ShardpoolError) as caught:
        check_sequence_len(config, info)
    assert str(caught.value) == (
        f"`sequence_len` 128 is above the model's max_position_embeddings 64 ({model}/config.json); "
        "lower `sequence_len` to 64 or less"
    )
    check_sequence_len(parse_config(_raw(tmp_path / "elsewhere", sequence_len=64)), info)


def _tiny_shape(positions: int) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "vocab_size": 32,
        "max_position_embeddings": positions,
    }
