"""axolotl's attention keys: folded into one request at parse time, resolved per device with a stated fallback."""

from __future__ import annotations

from typing import Any

import pytest

from shardpool.config import parse_config
from shardpool.config.attention import choose_attention
from shardpool.errors import ShardpoolError

BASE: dict[str, Any] = {"base_model": "m", "datasets": [{"path": "d.jsonl"}], "lora_target_linear": True}
AMPERE = {
    "device_type": "cuda",
    "compute_dtype": "bfloat16",
    "flash_attn_installed": True,
    "cuda_capability": (8, 6),
}


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({}, "sdpa"),
        ({"flash_attention": True}, "flash_attention_2"),
        ({"flash_attention": False, "sdp_attention": None}, "sdpa"),
        ({"sdp_attention": True}, "sdpa"),
        ({"eager_attention": True, "attn_implementation": "eager"}, "eager"),
        ({"xformers_attention": True}, "xformers"),
        ({"attn_implementation": "flash_attention_2"}, "flash_attention_2"),
    ],
)
def test_attention_keys_fold_into_one_request(keys: dict[str, Any], expected: str) -> None:
    assert parse_config({**BASE, **keys}).attn_implementation == expected


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"flash_attention": True, "sdp_attention": True}, "ask for different attention kernels; keep one"),
        ({"flash_attention": True, "attn_implementation": "eager"}, "ask for different attention kernels"),
        ({"flash_attention": "yes"}, "`flash_attention` is true or false, got 'yes'"),
        ({"attn_implementation": "magic"}, "`attn_implementation`"),
    ],
)
def test_contradicting_or_bad_attention_keys_are_one_line_each(keys: dict[str, Any], message: str) -> None:
    with pytest.raises(ShardpoolError) as caught:
        parse_config({**BASE, **keys})
    assert message in str(caught.value)
    assert "Traceback" not in str(caught.value)


def test_flash_attention_runs_where_everything_it_needs_is_there() -> None:
    choice = choose_attention("flash_attention_2", **AMPERE)
    assert (choice.implementation, choice.fallback) == ("flash_attention_2", None)


@pytest.mark.parametrize(
    ("facts", "reason"),
    [
        ({"device_type": "cpu", "cuda_capability": None}, "needs a CUDA GPU and this stage is on cpu"),
        ({"device_type": "mps", "cuda_capability": None}, "this stage is on mps"),
        ({"flash_attn_installed": False}, "pip install flash-attn"),
        ({"cuda_capability": (7, 0)}, "this GPU has 7.0"),  # V100
        ({"cuda_capability": (5, 2)}, "this GPU has 5.2"),  # M40
        ({"compute_dtype": "float32"}, "set bf16: true"),
    ],
)
def test_flash_attention_falls_back_to_sdpa_saying_why(facts: dict[str, Any], reason: str) -> None:
    choice = choose_attention("flash_attention_2", **{**AMPERE, **facts})
    assert choice.implementation == "sdpa"
    assert choice.fallback is not None and reason in choice.fallback and "uses sdpa" in choice.fallback


@pytest.mark.parametrize("requested", ["xformers", "flex_attention"])
def test_kernels_shardpool_does_not_build_fall_back_to_sdpa(requested: str) -> None:
    choice = choose_attention(requested, **AMPERE)
    assert choice.implementation == "sdpa"
    assert choice.fallback is not None and requested in choice.fallback


@pytest.mark.parametrize("requested", ["sdpa", "eager"])
def test_sdpa_and_eager_run_everywhere(requested: str) -> None:
    choice = choose_attention(
        requested, device_type="cpu", compute_dtype="float32", flash_attn_installed=False
    )
    assert (choice.implementation, choice.fallback) == (requested, None)
