"""The single description of a model architecture shardpool can split, read from ``config.json``.

Every supported family (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text, Phi-3) shares one
layout in transformers 5.x: ``model.embed_tokens`` -> ``model.layers.{i}`` -> ``model.norm`` ->
``lm_head``, with rotary position embeddings computed once per forward and passed to every decoder
layer. All decoder layers have the same size, which the planner relies on. What differs is kept
in the families' own transformers modules (Gemma's scaled embedding, its attention and logit
soft-capping) or described here: the Linear names of a layer (Phi-3 fuses ``qkv_proj`` and
``gate_up_proj``), its norms, and which layers attend through a sliding window.

This module holds the supported families, the state-dict names of that layout, the sizes the
planner needs (:class:`ModelShape`, no weights read), and the checked base-model directory a run
trains on (:class:`ModelInfo`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from shardpool.config import Config
from shardpool.config.parsing import sequence_len_refusal
from shardpool.errors import ShardpoolError

__all__ = [
    "check_sequence_len",
    "check_stage_count",
    "decoder_linear_names",
    "ALL_DECODER_LINEAR_NAMES",
    "DECODER_LINEAR_NAMES",
    "FUSED_LINEAR_NAMES",
    "EMBED_NAME",
    "LM_HEAD_NAME",
    "NORM_NAME",
    "SUPPORTED_MODEL_TYPES",
    "ModelInfo",
    "ModelShape",
    "layer_prefix",
    "local_model_type",
    "mask_kind",
    "read_model_info",
]

SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "phi3",
)

#: The Linear modules inside one decoder layer of the Llama layout (Gemma's too), in execution
#: order: what NF4 quantizes and what ``lora_target_linear`` targets.
DECODER_LINEAR_NAMES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)

#: Phi-3's decoder Linear modules: q, k, v in one ``qkv_proj`` and gate, up in one ``gate_up_proj``.
FUSED_LINEAR_NAMES: tuple[str, ...] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

#: Every name a decoder Linear has in some supported family, for checks that do not know the family.
ALL_DECODER_LINEAR_NAMES: tuple[str, ...] = DECODER_LINEAR_NAMES + ("qkv_proj", "gate_up_proj")

_FUSED_FAMILIES = ("phi3",)
_GEMMA_FAMILIES = ("gemma2", "gemma3_text")
#: Families whose every layer attends through ``sliding_window`` when the config sets one (the
#: others give each layer its own type in ``layer_types``).
_WHOLE_MODEL_WINDOW = ("mistral", "phi3")

EMBED_NAME = "model.embed_tokens.weight"
NORM_NAME = "model.norm.weight"
LM_HEAD_NAME = "lm_head.weight"

_REQUIRED_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


def layer_prefix(layer_index: int) -> str:
    """The state-dict prefix of one decoder layer, e.g. ``model.layers.3.``."""
    return f"model.layers.{layer_index}."


def decoder_linear_names(model_type: str | None) -> tuple[str, ...]:
    """The Linear modules of one decoder layer of ``model_type``, in execution order (all families' names if None)."""
    if model_type is None:
        return ALL_DECODER_LINEAR_NAMES
    return FUSED_LINEAR_NAMES if model_type in _FUSED_FAMILIES else DECODER_LINEAR_NAMES


def local_model_type(base_model: str | Path) -> str | None:
    """``model_type`` from the config.json of a local base model directory; None if there is none."""
    config_file = Path(base_model).expanduser() / "config.json"
    try:
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return model_type if isinstance(model_type, str) else None


def mask_kind(hf_config: Any, layer_index: int) -> str:
    """Whether decoder layer ``layer_index`` (its index in the whole model) uses ``full_attention``
    or ``sliding_attention``, as its model does.

    ``hf_config`` is the transformers config object of the model (not a shardpool Config).
    """
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        return str(layer_types[layer_index])
    if (
        getattr(hf_config, "model_type", "") in _WHOLE_MODEL_WINDOW
        and getattr(hf_config, "sliding_window", None) is not None
    ):
        return "sliding_attention"
    return "full_attention"


@dataclass(frozen=True)
class ModelShape:
    """Architecture numbers of a decoder-only model of a supported family.

    ``head_dim`` is explicit (qwen3 and some mistral models decouple it from
    ``hidden_size / num_attention_heads``). ``attention_bias`` adds biases to q/k/v/o
    (qwen2 always has q/k/v biases, which ``qkv_bias`` records).
    """

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    name: str = ""

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config_json(cls, config: Mapping[str, Any], *, name: str = "") -> ModelShape:
        """Build a shape from a parsed HF ``config.json``; refuse architectures shardpool can't place."""
        model_type = str(config.get("model_type", ""))
        if model_type == "gemma3":
            raise ShardpoolError(
                f"{name or 'config.json'} is the multimodal Gemma 3 (model_type 'gemma3'); shardpool trains "
                "text-only models: use a Gemma 3 text checkpoint (model_type 'gemma3_text', e.g. gemma-3-1b)"
            )
        if config.get("use_bidirectional_attention"):
            raise ShardpoolError(
                f"{name or 'config.json'} sets use_bidirectional_attention (an encoder, not a causal LM); "
                "shardpool trains causal LMs"
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ShardpoolError(
                f"unsupported architecture {model_type or 'unknown'!r} in {name or 'config.json'}; "
                f"shardpool supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        missing = [key for key in _REQUIRED_KEYS if config.get(key) is None]
        if missing:
            raise ShardpoolError(
                f"config.json lacks {', '.join(missing)}; pass the model's complete HF config.json"
            )
        heads = _positive_int(config, "num_attention_heads")
        hidden = _positive_int(config, "hidden_size")
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        if kv_heads <= 0 or head_dim <= 0 or heads % kv_heads:
            raise ShardpoolError(
                f"config.json has num_attention_heads={heads}, num_key_value_heads={kv_heads}: "
                "the heads must be a positive multiple of the key/value heads; fix config.json"
            )
        attention_bias = bool(config.get("attention_bias", False))
        rope_theta = config.get("rope_theta")
        if rope_theta is None and isinstance(config.get("rope_parameters"), Mapping):
            rope_theta = config["rope_parameters"].get("rope_theta")
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=_positive_int(config, "intermediate_size"),
            num_layers=_positive_int(config, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=_positive_int(config, "vocab_size"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
            name=name or str(config.get("_name_or_path", "") or ""),
        )

    @classmethod
    def from_config_dir(cls, path: str | Path) -> ModelShape:
        """Read ``config.json`` from a model directory (or the JSON file itself)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ShardpoolError(
                f"{file} does not exist; point base_model at a directory holding config.json"
            )
        data = _read_json_object(file)
        return cls.from_config_json(data, name=data.get("_name_or_path") or path.stem)

    # ------------------------------------------------------------------ sizes

    @property
    def q_dim(self) -> int:
        """Width of the query projection output."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key (and value) projection output."""
        return self.num_key_value_heads * self.head_dim

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of each Linear module of one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        if self.model_type in _FUSED_FAMILIES:
            return {
                "qkv_proj": (h, self.q_dim + 2 * self.kv_dim),
                "o_proj": (self.q_dim, h),
                "gate_up_proj": (h, 2 * i),
                "down_proj": (i, h),
            }
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def linear_params(self) -> dict[str, int]:
        """Weight parameters of each Linear module of one decoder layer (biases excluded)."""
        return {name: fan_in * fan_out for name, (fan_in, fan_out) in self.linear_dims().items()}

    def layer_linear_params(self) -> int:
        """Weight parameters of all Linear modules of one decoder layer: what NF4 quantizes."""
        return sum(self.linear_params().values())

    def layer_dense_params(self) -> int:
        """Parameters of one decoder layer that stay in compute dtype: norms and biases."""
        h = self.hidden_size
        # Gemma norms both sides of attention and of the MLP; the others only before each.
        dense = 4 * h if self.model_type in _GEMMA_FAMILIES else 2 * h
        if self.model_type in ("qwen3", "gemma3_text"):
            dense += 2 * self.head_dim  # q_norm and k_norm
        if self.qkv_bias:
            dense += self.q_dim + 2 * self.kv_dim
        if self.o_bias:
            dense += h
        if self.mlp_bias:
            dense += 2 * self.intermediate_size + h
        return dense

    def embedding_params(self) -> int:
        """Parameters of ``embed_tokens`` (owned by stage 0)."""
        return self.vocab_size * self.hidden_size

    def lm_head_params(self) -> int:
        """Parameters of ``lm_head`` (owned by the last stage, as its own copy even if tied)."""
        return self.vocab_size * self.hidden_size

    def final_norm_params(self) -> int:
        """Parameters of the final RMSNorm (owned by the last stage)."""
        return self.hidden_size

    def total_params(self) -> int:
        """All parameters of the model, counting a tied ``lm_head`` once."""
        layers = self.num_layers * (self.layer_linear_params() + self.layer_dense_params())
        head = 0 if self.tie_word_embeddings else self.lm_head_params()
        return layers + self.embedding_params() + head + self.final_norm_params()

    # ------------------------------------------------------------------ conversions

    def to_hf_config(self) -> dict[str, Any]:
        """A minimal HF config dict that rebuilds this architecture (used by the profiler)."""
        config: dict[str, Any] = {
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
        }
        if self.model_type in ("llama", "qwen3"):
            config["attention_bias"] = self.o_bias
        if self.model_type == "llama":
            config["mlp_bias"] = self.mlp_bias
        if self.model_type in _FUSED_FAMILIES:
            del config["head_dim"]  # Phi-3 derives it from hidden_size and the heads
            # Its default token ids would not fit a small vocabulary; a profiled layer needs none.
            config.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
        return config

    def key(self) -> str:
        """A short stable digest of the architecture, for cache keys (the name is excluded)."""
        fields = asdict(self)
        fields.pop("name")
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _positive_int(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ShardpoolError(f"config.json has {key}={value!r}; it must be a positive integer")
    return value


@dataclass(frozen=True)
class ModelInfo:
    """A base model directory checked before any weight is loaded: its path and its shape."""

    path: Path
    shape: ModelShape

    @property
    def base_name(self) -> str:
        """The model directory's name, for messages."""
        return self.path.name

    @property
    def num_layers(self) -> int:
        """Decoder layers of the model."""
        return self.shape.num_layers

    @property
    def tie_word_embeddings(self) -> bool:
        """Whether ``lm_head`` shares the embedding matrix."""
        return self.shape.tie_word_embeddings


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
    shape = ModelShape.from_config_json(_read_json_object(config_file), name=str(config_file))
    if not any(path.glob("*.safetensors")):
        raise ShardpoolError(
            f"{path} has no .safetensors files; re-save the model with save_pretrained(safe_serialization=True)"
        )
    return ModelInfo(path=path, shape=replace(shape, name=path.name))


def _read_json_object(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ShardpoolError(
            f"{file} is not valid JSON ({error.msg} at line {error.lineno}); fix or re-save it"
        ) from None
    except OSError as error:
        raise ShardpoolError(f"cannot read {file} ({error}); pass a valid HF config.json") from None
    if not isinstance(data, dict):
        raise ShardpoolError(f"{file} is not a JSON object; pass a valid HF config.json")
    return data


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


def check_sequence_len(config: Config, model: ModelInfo) -> None:
    """Refuse a ``sequence_len`` above the model's ``max_position_embeddings`` (from its config.json).

    A local base_model was checked already when the config was read; this covers a hub id,
    whose config.json is only at hand once it is resolved to the local cache.
    """
    message = sequence_len_refusal(config.sequence_len, model.path / "config.json")
    if message is not None:
        raise ShardpoolError(message)
