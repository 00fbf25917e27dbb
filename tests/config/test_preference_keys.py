"""The config keys of preference tuning (``rl``): what is accepted, and the one line for the rest."""

from __future__ import annotations

from typing import Any

import pytest

from shardpool.config import parse_config
from shardpool.errors import ShardpoolError

PAIRS = [{"path": "pairs.jsonl", "type": "chatml.intel"}]


def _config(**overrides: Any) -> dict[str, Any]:
    return {"base_model": "m", "lora_target_linear": True, "datasets": PAIRS, "rl": "dpo", **overrides}


def test_dpo_defaults_to_trls_sigmoid_loss_and_beta() -> None:
    config = parse_config(_config())
    assert (config.preference_loss, config.preference_beta) == ("sigmoid", 0.1)
    assert parse_config(_config(rl="ipo")).preference_loss == "ipo"
    assert parse_config(_config(dpo_loss_type=["ipo"])).preference_loss == "ipo"
    assert parse_config(_config(dpo_beta=0.3)).preference_beta == 0.3  # axolotl's older spelling
    assert parse_config(_config(rl_beta=0.2, dpo_beta=0.2)).preference_beta == 0.2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rl": "grpo"}, r"`rl: grpo` is not built into shardpool"),
        ({"rl": "kto"}, r"`rl: kto` is not built into shardpool"),
        ({"datasets": [{"path": "d.jsonl", "type": "alpaca"}]}, r"give every dataset a preference type"),
        ({"sample_packing": True}, r"preference pairs are not packed"),
        ({"rl_beta": 0.1, "dpo_beta": 0.2}, r"disagree"),
        ({"rl": "ipo", "dpo_loss_type": "sigmoid"}, r"`rl: ipo` is the ipo loss"),
        ({"dpo_loss_type": ["sigmoid", "ipo"]}, r"takes one loss"),
        (
            {"rl": "simpo", "precompute_ref_log_probs": True},
            r"`rl: simpo` has no reference model to precompute",
        ),
        (
            {"rl": "ipo", "dpo_label_smoothing": 0.1},
            r"`dpo_label_smoothing` smooths `rl: dpo`'s sigmoid loss, not `ipo`",
        ),
        ({"rl": "simpo", "dpo_label_smoothing": 0.1}, r"smooths `rl: dpo`'s sigmoid loss, not `simpo`"),
        ({"rl": "simpo", "dpo_loss_type": "ipo"}, r"`rl: simpo` has its own, remove it"),
        (
            {"orpo_alpha": 0.2},
            r"`orpo_alpha` weighs `rl: orpo`'s odds-ratio term; `rl: dpo` does not read it",
        ),
        ({"dpo_label_smoothing": 0.5}, r"dpo_label_smoothing"),
        ({"rl": None}, r"preference datasets .* need `rl: dpo`, `ipo`"),
        (
            {"datasets": [{"path": "d.jsonl", "type": "chatml.intell"}]},
            r"dataset type `chatml.intell` is not built",
        ),
        (
            {"datasets": [{"path": "d.jsonl", "type": {"field_promt": "q"}}]},
            r"unknown keys \['field_promt'\]",
        ),
    ],
)
def test_what_is_not_built_is_refused_in_one_line(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ShardpoolError, match=message) as refused:
        parse_config(_config(**overrides))
    assert "\n" not in str(refused.value)


def test_axolotls_user_defined_mapping_is_a_preference_type() -> None:
    mapping = {
        "field_prompt": "q",
        "field_chosen": "good",
        "field_rejected": "bad",
        "prompt_format": "{prompt}",
    }
    config = parse_config(_config(datasets=[{"path": "d.jsonl", "type": mapping}]))
    assert config.datasets[0].type == mapping


@pytest.mark.parametrize(
    ("overrides", "loss", "beta"),
    [
        ({}, "sigmoid", 0.1),
        ({"rl_beta": 0.3}, "sigmoid", 0.3),
        ({"dpo_beta": 0.2}, "sigmoid", 0.2),
        ({"rl": "ipo"}, "ipo", 0.1),
        ({"rl": "simpo", "rl_beta": 2.0}, "simpo", 2.0),
        # axolotl hands orpo_alpha to TRL's ORPO trainer as its beta (the paper's lambda)
        ({"rl": "orpo", "orpo_alpha": 0.25, "rl_beta": 0.5}, "orpo", 0.25),
        ({"rl": "orpo", "rl_beta": 0.5}, "orpo", 0.5),
    ],
)
def test_each_rl_takes_trls_loss_and_beta(overrides: dict[str, Any], loss: str, beta: float) -> None:
    datasets = (
        [{"path": "d.jsonl", "type": "chat_template.argilla"}] if overrides.get("rl") == "orpo" else PAIRS
    )
    config = parse_config(_config(datasets=datasets, **overrides))
    assert (config.preference_loss, config.preference_beta) == (loss, beta)


def test_simpo_and_label_smoothing_defaults_are_trls() -> None:
    config = parse_config(_config(rl="simpo"))
    assert (config.simpo_gamma, config.cpo_alpha, config.dpo_label_smoothing) == (0.5, 1.0, 0.0)
