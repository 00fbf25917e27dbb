"""ModelShape: parameter counts against public numbers and against transformers' own modules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardpool.errors import ShardpoolError
from shardpool.model.shape import DECODER_LINEAR_NAMES, ModelShape

ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
}


def test_public_parameter_counts() -> None:
    seventy = ModelShape.from_config_dir(ROOT / "configs/models/llama-2-70b.json")
    eight = ModelShape.from_config_dir(ROOT / "configs/models/llama-3-8b.json")
    assert seventy.total_params() == 68_976_648_192
    assert eight.total_params() == 8_030_261_248
    assert seventy.num_layers == 80 and eight.kv_dim == 1024


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_counts_match_transformers_modules(model_type: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(TINY, model_type=model_type, head_dim=24 if model_type == "qwen3" else None)
    raw = {k: v for k, v in raw.items() if v is not None}
    shape = ModelShape.from_config_json(raw)
    fields = shape.to_hf_config()
    fields.pop("model_type")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))
    layer = model.model.layers[0]
    modules = dict(layer.named_modules())
    for name, params in shape.linear_params().items():
        path = ("self_attn." if name in DECODER_LINEAR_NAMES[:4] else "mlp.") + name
        assert modules[path].weight.numel() == params
    linear_weights = {f"{p}.weight" for p in modules if p.endswith(DECODER_LINEAR_NAMES)}
    dense = sum(t.numel() for n, t in layer.named_parameters() if n not in linear_weights)
    assert dense == shape.layer_dense_params()
    assert sum(p.numel() for p in model.parameters()) == shape.total_params()


def test_reads_directory_and_refuses_other_architectures(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY, model_type="llama")))
    assert ModelShape.from_config_dir(tmp_path).hidden_size == 64
    with pytest.raises(ShardpoolError, match="gpt2"):
        ModelShape.from_config_json(dict(TINY, model_type="gpt2"))
    with pytest.raises(ShardpoolError, match="does not exist"):
        ModelShape.from_config_dir(tmp_path / "missing")
    with pytest.raises(ShardpoolError, match="hidden_size"):
        ModelShape.from_config_json({"model_type": "llama"})


def test_key_ignores_name_but_not_shape() -> None:
    a = ModelShape.from_config_json(dict(TINY, model_type="llama"), name="a")
    b = ModelShape.from_config_json(dict(TINY, model_type="llama"), name="b")
    c = ModelShape.from_config_json(dict(TINY, model_type="llama", hidden_size=128))
    assert a.key() == b.key() != c.key()
