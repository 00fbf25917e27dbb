"""Which model families shardpool can split, and the facts about their layout it relies on.

The Llama family (Llama, Mistral, Qwen2, Qwen3) shares one layout in transformers 5.x:
``model.embed_tokens`` → ``model.layers.{i}`` → ``model.norm`` → ``lm_head``, with rotary position
embeddings computed once per forward and passed to every decoder layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardpool.config import Config
from shardpool.errors import ShardpoolError

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "DECODER_LINEAR_NAMES",
    "ModelInfo",
    "read_model_info",
    "check_stage_count",
    "layer_prefix",
    "mask_kind",
]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# The Linear modules inside one decoder layer: what `lora_target_linear` targets, and what is NF4.
DECODER_LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

EMBED_NAME = "model.embed_tokens.weight"
NORM_NAME = "model.norm.weight"
LM_HEAD_NAME = "lm_head.weight"


@dataclass(frozen=True)
class ModelInfo:
    """What shardpool reads from a base model directory before loading any weight."""

    path: Path
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    raw_config: dict[str, Any]

    @property
    def base_name(self) -> str:
        """The model directory's name, for messages."""
        return self.path.name


def read_model_info(model_dir: str | Path) -> ModelInfo:
    """Read ``config.json`` of a local model directory and check shardpool can split it."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ShardpoolError(
            f"base_model directory {str(path)!r} does not exist; point base_model at a local model directory"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ShardpoolError(f"{path} has no config.json; base_model must be a Hugging Face model directory")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ShardpoolError(
            f"{config_file} is not valid JSON ({error.msg} at line {error.lineno}); fix or re-save it"
        ) from None
    model_type = str(raw.get("model_type", ""))
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(SUPPORTED_MODEL_TYPES)
        raise ShardpoolError(
            f"unsupported architecture {model_type or 'unknown'!r} in {config_file}; shardpool supports {supported}"
        )
    if not any(path.glob("*.safetensors")):
        raise ShardpoolError(
            f"{path} has no .safetensors files; re-save the model with save_pretrained(safe_serialization=True)"
        )
    return ModelInfo(
        path=path,
        model_type=model_type,
        num_layers=int(raw["num_hidden_layers"]),
        hidden_size=int(raw["hidden_size"]),
        vocab_size=int(raw["vocab_size"]),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        raw_config=raw,
    )


def check_stage_count(config: Config, model: ModelInfo) -> None:
    """Refuse more stages than layers, and a manual split that does not cover the model exactly."""
    stages = config.shardpool.num_stages
    if stages > model.num_layers:
        raise ShardpoolError(
            f"{stages} stages but {model.base_name} has only {model.num_layers} decoder layers; "
            f"use at most {model.num_layers} stages"
        )
    layers = config.shardpool.layers
    if layers is not None and sum(layers) != model.num_layers:
        raise ShardpoolError(
            f"shardpool.layers {layers} sums to {sum(layers)} but the model has {model.num_layers} layers; "
            f"make the counts add up to {model.num_layers}"
        )


def layer_prefix(layer_index: int) -> str:
    """The state-dict prefix of one decoder layer, e.g. ``model.layers.3.``."""
    return f"model.layers.{layer_index}."


def mask_kind(config: Any, layer_index: int) -> str:
    """Whether a decoder layer uses ``full_attention`` or ``sliding_attention``, as its model does."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return str(layer_types[layer_index])
    if getattr(config, "model_type", "") == "mistral" and getattr(config, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"
