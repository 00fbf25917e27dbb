"""The single schema of a shardpool run: an axolotl-style YAML with a ``shardpool:`` block.

Keys shared with axolotl mean what they mean in axolotl. Validation is strict: an unknown key,
a wrong type or an impossible combination raises :class:`ShardpoolError` with one line that names
the key and the fix. Nothing runs before a config passes.
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shardpool.errors import ShardpoolError

__all__ = [
    "Config",
    "DatasetSpec",
    "BnbConfig",
    "ShardpoolSection",
    "load_config",
    "parse_config",
    "UNSUPPORTED_AXOLOTL_KEYS",
]

# axolotl keys that shardpool knows but does not implement yet: refused by name, never ignored.
UNSUPPORTED_AXOLOTL_KEYS: dict[str, str] = {
    "load_in_8bit": "8-bit bases are not supported; use `adapter: qlora` with `load_in_4bit: true`",
    "deepspeed": "shardpool shards the model itself; remove `deepspeed`",
    "fsdp": "shardpool shards the model itself; remove `fsdp`",
    "fsdp_config": "shardpool shards the model itself; remove `fsdp_config`",
    "flash_attention": "attention uses transformers' sdpa path; remove `flash_attention`",
    "xformers_attention": "attention uses transformers' sdpa path; remove `xformers_attention`",
    "sdp_attention": "sdpa is already the default; remove `sdp_attention`",
    "train_on_inputs": "prompt tokens are always masked for alpaca rows; remove `train_on_inputs`",
    "group_by_length": "not supported yet; remove `group_by_length`",
    "chat_template": "chat datasets are not supported yet; use `type: alpaca` or `type: completion`",
    "special_tokens": "adding tokens is not supported yet; remove `special_tokens`",
    "tokens": "adding tokens is not supported yet; remove `tokens`",
    "lora_modules_to_save": "only LoRA matrices are trained; remove `lora_modules_to_save`",
    "lora_fan_in_fan_out": "not supported; remove `lora_fan_in_fan_out`",
    "peft_use_dora": "DoRA is not supported yet; remove `peft_use_dora`",
    "peft_use_rslora": "rsLoRA is not supported yet; remove `peft_use_rslora`",
    "eval_steps": "eval runs before and after training; remove `eval_steps`",
    "evals_per_epoch": "eval runs before and after training; remove `evals_per_epoch`",
    "saves_per_epoch": "use `save_steps` instead of `saves_per_epoch`",
    "resume_from_checkpoint": "use `shardpool finetune CONFIG --resume` instead",
    "wandb_project": "logging goes to output_dir/metrics.jsonl; remove the wandb_* keys",
    "wandb_entity": "logging goes to output_dir/metrics.jsonl; remove the wandb_* keys",
    "wandb_name": "logging goes to output_dir/metrics.jsonl; remove the wandb_* keys",
    "wandb_log_model": "logging goes to output_dir/metrics.jsonl; remove the wandb_* keys",
    "wandb_watch": "logging goes to output_dir/metrics.jsonl; remove the wandb_* keys",
    "hub_model_id": "pushing to a hub is not supported; remove `hub_model_id`",
    "push_dataset_to_hub": "pushing to a hub is not supported; remove `push_dataset_to_hub`",
    "dataset_prepared_path": "datasets are tokenized per run; remove `dataset_prepared_path`",
    "tf32": "not supported; remove `tf32`",
    "model_type": "the architecture is read from base_model/config.json; remove `model_type`",
    "tokenizer_type": "the tokenizer is read from base_model; remove `tokenizer_type`",
    "tokenizer_config": "the tokenizer is read from base_model; remove `tokenizer_config`",
    "pad_to_sequence_len": "rows are always padded to sequence_len; remove `pad_to_sequence_len`",
    "early_stopping_patience": "not supported yet; remove `early_stopping_patience`",
    "rl": "only supervised fine-tuning is supported; remove `rl`",
    "gptq": "GPTQ bases are not supported; use `adapter: qlora`",
    "local_rank": "shardpool launches its own processes; remove `local_rank`",
    "strict": "validation is always strict; remove `strict`",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class DatasetSpec(_Strict):
    """One JSONL (or JSON array) dataset. ``type`` absent means pre-tokenized rows with ``input_ids``."""

    path: str = Field(description="a .jsonl file (one JSON object per line) or a .json array of objects")
    type: Literal["alpaca", "completion"] | None = Field(
        default=None,
        description="alpaca: instruction/input/output; completion: one text field; absent: pre-tokenized",
    )
    field: str | None = Field(
        default=None, description="the text field of a completion dataset (default: text)"
    )

    @model_validator(mode="after")
    def _field_only_for_completion(self) -> DatasetSpec:
        if self.field is not None and self.type != "completion":
            raise ValueError(
                "`field` only applies to `type: completion`; remove it or set `type: completion`"
            )
        return self


class BnbConfig(_Strict):
    """bitsandbytes 4-bit settings, as axolotl's ``bnb_config_kwargs``."""

    bnb_4bit_quant_type: Literal["nf4", "fp4"] = Field(default="nf4", description="4-bit data type")
    bnb_4bit_use_double_quant: bool = Field(default=True, description="quantize the absmax statistics too")


class ShardpoolSection(_Strict):
    """shardpool's own keys: where the stages run and how they talk."""

    placement: Literal["local", "mesh"] = Field(
        default="local", description="local: stage processes on this machine; mesh: on mesh members"
    )
    stages: int | None = Field(
        default=None, ge=1, description="number of pipeline stages (default: len(devices) or 2)"
    )
    replicas: int = Field(
        default=1, ge=1, description="data-parallel pipelines; LoRA gradients are all-reduced"
    )
    schedule: Literal["1f1b", "gpipe"] = Field(default="1f1b", description="pipeline schedule")
    wire_dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        default="auto", description="dtype of activations between stages (auto: the compute dtype)"
    )
    devices: list[str] | None = Field(
        default=None, description="one device per stage, e.g. [cpu, cuda:0, mps]"
    )
    layers: list[int] | None = Field(
        default=None, description="manual split: decoder layers per stage, e.g. [1, 3, 2]"
    )
    threads_per_stage: int | None = Field(
        default=None, ge=1, description="torch intra-op threads per CPU stage (default: cores / processes)"
    )
    master_port: int | None = Field(
        default=None, ge=1, le=65535, description="rendezvous TCP port on loopback (default: a free one)"
    )

    @model_validator(mode="after")
    def _consistent_stage_count(self) -> ShardpoolSection:
        counts = {
            "shardpool.stages": self.stages,
            "shardpool.devices": None if self.devices is None else len(self.devices),
            "shardpool.layers": None if self.layers is None else len(self.layers),
        }
        given = {key: count for key, count in counts.items() if count is not None}
        if len(set(given.values())) > 1:
            described = ", ".join(f"{key} gives {count}" for key, count in given.items())
            raise ValueError(f"stage counts disagree ({described}); make them name the same number of stages")
        if self.layers is not None and any(count < 1 for count in self.layers):
            raise ValueError("`shardpool.layers` needs at least 1 layer per stage; remove empty stages")
        if self.devices is not None:
            for device in self.devices:
                _check_device_name(device)
        if self.placement == "mesh" and self.devices is not None:
            raise ValueError(
                "`shardpool.devices` is for `placement: local`; on the mesh the planner picks devices"
            )
        if self.placement == "mesh" and self.layers is not None:
            raise ValueError(
                "`shardpool.layers` is for `placement: local`; on the mesh the planner splits the layers"
            )
        return self

    @property
    def num_stages(self) -> int:
        """The number of pipeline stages this section asks for (2 when nothing says)."""
        for count in (self.stages, self.devices and len(self.devices), self.layers and len(self.layers)):
            if count:
                return int(count)
        return 2

    def stage_devices(self) -> list[str]:
        """The torch device of each stage (all ``cpu`` unless ``devices`` says otherwise)."""
        return list(self.devices) if self.devices else ["cpu"] * self.num_stages


def _check_device_name(device: str) -> None:
    kind, _, index = device.partition(":")
    if kind not in {"cpu", "cuda", "mps", "xpu"} or (index and not index.isdigit()):
        raise ValueError(f"unknown device `{device}` in shardpool.devices; use cpu, cuda:N, mps or xpu:N")


class Config(_Strict):
    """A whole run. Field names and meanings follow axolotl where axolotl has them."""

    base_model: str = Field(description="local Hugging Face model directory (config.json + safetensors)")
    adapter: Literal["qlora", "lora"] = Field(
        default="qlora", description="qlora: NF4 base; lora: full-precision base"
    )
    load_in_4bit: bool = Field(default=True, description="quantize the base to 4 bits (required by qlora)")
    bnb_config_kwargs: BnbConfig = Field(default_factory=BnbConfig, description="bitsandbytes 4-bit settings")
    lora_r: int = Field(default=8, ge=1, description="LoRA rank")
    lora_alpha: float = Field(default=16, gt=0, description="LoRA scaling numerator (scale = alpha / r)")
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="dropout on the LoRA input")
    lora_target_modules: list[str] | None = Field(default=None, description="module names that get LoRA")
    lora_target_linear: bool = Field(default=False, description="put LoRA on every Linear except lm_head")
    lora_model_dir: str | None = Field(default=None, description="start from this existing PEFT adapter")
    datasets: list[DatasetSpec] = Field(min_length=1, description="JSONL datasets, merged in order")
    val_set_size: float = Field(default=0.0, ge=0.0, description="eval split: a fraction (<1) or a row count")
    sequence_len: int = Field(
        default=512, gt=0, description="rows are truncated or padded to this many tokens"
    )
    sample_packing: bool = Field(default=False, description="pack several short rows into one sequence")
    shuffle_merged_datasets: bool = Field(default=True, description="shuffle rows (seeded) before batching")
    curriculum_sampling: bool = Field(
        default=False, description="consume rows in file order (needs no shuffle)"
    )
    micro_batch_size: int = Field(default=1, ge=1, description="rows per micro-batch")
    gradient_accumulation_steps: int = Field(default=1, ge=1, description="micro-batches per optimizer step")
    num_epochs: float = Field(default=1.0, gt=0, description="passes over the training rows")
    max_steps: int | None = Field(default=None, ge=1, description="stop after this many optimizer steps")
    learning_rate: float = Field(default=2e-4, gt=0, description="peak learning rate")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field(
        default="cosine", description="decay after warm-up"
    )
    warmup_steps: int | None = Field(default=None, ge=0, description="linear warm-up steps")
    warmup_ratio: float | None = Field(
        default=None, ge=0.0, lt=1.0, description="warm-up as a fraction of steps"
    )
    optimizer: Literal["adamw_torch"] = Field(default="adamw_torch", description="optimizer (AdamW)")
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW decoupled weight decay")
    adam_beta1: float = Field(default=0.9, gt=0.0, lt=1.0, description="AdamW beta1")
    adam_beta2: float = Field(default=0.999, gt=0.0, lt=1.0, description="AdamW beta2")
    adam_epsilon: float = Field(default=1e-8, gt=0.0, description="AdamW epsilon")
    max_grad_norm: float = Field(default=1.0, ge=0.0, description="clip the global grad norm (0 disables)")
    seed: int = Field(default=42, description="seed for LoRA init, shuffling and dropout")
    gradient_checkpointing: bool = Field(default=False, description="recompute layer activations in backward")
    output_dir: str = Field(default="./outputs/shardpool", description="where the adapter and logs go")
    save_steps: int | None = Field(default=None, ge=1, description="checkpoint every this many steps")
    logging_steps: int = Field(default=1, ge=1, description="write metrics every this many steps")
    bf16: bool | Literal["auto"] = Field(default=False, description="compute in bfloat16")
    fp16: bool = Field(default=False, description="compute in float16")
    shardpool: ShardpoolSection = Field(default_factory=ShardpoolSection, description="shardpool's own keys")

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        if self.adapter == "qlora" and not self.load_in_4bit:
            raise ValueError("`adapter: qlora` needs `load_in_4bit: true`; set it, or use `adapter: lora`")
        if self.adapter == "lora" and self.load_in_4bit:
            raise ValueError(
                "`adapter: lora` trains on a full-precision base; set `load_in_4bit: false` or use qlora"
            )
        if not self.lora_target_linear and not self.lora_target_modules:
            raise ValueError(
                "no LoRA targets: set `lora_target_modules` (e.g. [q_proj, v_proj]) or `lora_target_linear: true`"
            )
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            raise ValueError("`warmup_steps` and `warmup_ratio` both set; keep one")
        if self.bf16 is True and self.fp16:
            raise ValueError("`bf16` and `fp16` both set; keep one")
        if self.curriculum_sampling and self.shuffle_merged_datasets:
            raise ValueError(
                "`curriculum_sampling: true` needs `shuffle_merged_datasets: false` to keep file order"
            )
        if self.val_set_size >= 1 and not float(self.val_set_size).is_integer():
            raise ValueError("`val_set_size` is a fraction below 1 or a whole row count; fix its value")
        if self.max_steps is None and not math.isfinite(self.num_epochs):
            raise ValueError("`num_epochs` must be finite; set a number or `max_steps`")
        return self

    @property
    def compute_dtype_name(self) -> str:
        """The dtype layers compute in: float32, bfloat16 or float16."""
        if self.bf16 is True:
            return "bfloat16"
        if self.fp16:
            return "float16"
        return "float32"

    @property
    def wire_dtype_name(self) -> str:
        """The dtype of activations and their gradients between stages."""
        names = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
        return names.get(self.shardpool.wire_dtype, self.compute_dtype_name)


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file, raising ShardpoolError with one line on any problem."""
    config_path = Path(path)
    if not config_path.is_file():
        raise ShardpoolError(f"config file {str(config_path)!r} does not exist; check the path")
    try:
        raw = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ShardpoolError(f"{config_path} is not valid YAML{where}; fix the syntax") from None
    return parse_config(raw, source=str(config_path))


def parse_config(raw: Any, *, source: str = "config") -> Config:
    """Validate an already-parsed config mapping (the YAML's top level)."""
    if not isinstance(raw, dict):
        raise ShardpoolError(f"{source} must be a mapping of keys to values at the top level")
    for key in raw:
        if key in UNSUPPORTED_AXOLOTL_KEYS:
            raise ShardpoolError(
                f"`{key}` is not supported by shardpool yet: {UNSUPPORTED_AXOLOTL_KEYS[key]}"
            )
    try:
        return Config.model_validate(_coerce_numbers(raw))
    except ValidationError as error:
        raise ShardpoolError(_describe_validation_error(error, source)) from None


def _coerce_numbers(raw: dict[str, Any]) -> dict[str, Any]:
    """Accept YAML ints where floats are expected (``learning_rate: 1``) and strings like ``2e-4``.

    PyYAML reads ``2e-4`` (no dot) as a string; axolotl users write it that way all the time.
    """
    float_keys = {
        "lora_alpha", "lora_dropout", "val_set_size", "num_epochs", "learning_rate", "warmup_ratio",
        "weight_decay", "max_grad_norm", "adam_beta1", "adam_beta2", "adam_epsilon",
    }  # fmt: skip
    coerced = dict(raw)
    for key in float_keys & coerced.keys():
        value = coerced[key]
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            coerced[key] = float(value)
        elif isinstance(value, str):
            try:
                coerced[key] = float(value)
            except ValueError:
                pass
    return coerced


def _known_keys(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        annotation = model.model_fields.get(str(part))
        if annotation is None:
            break
        candidate = _model_in(annotation.annotation)
        if candidate is None:
            break
        model = candidate
    return list(model.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _dotted(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for part in loc:
        if isinstance(part, int):
            parts[-1] = f"{parts[-1]}[{part}]" if parts else f"[{part}]"
        else:
            parts.append(str(part))
    return ".".join(parts)


def _is_union_tag(part: Any) -> bool:
    """pydantic puts the member type of a union (``bool``, ``literal['auto']``) into the error path."""
    return isinstance(part, str) and ("[" in part or part in {"bool", "int", "float", "str", "list", "dict"})


def _describe_validation_error(error: ValidationError, source: str) -> str:
    first = error.errors()[0]
    loc = tuple(part for part in first["loc"] if not _is_union_tag(part))
    kind = first["type"]
    key = _dotted(loc)
    if kind == "extra_forbidden":
        unknown = str(loc[-1])
        close = difflib.get_close_matches(unknown, _known_keys(loc), n=1, cutoff=0.6)
        hint = f"did you mean `{close[0]}`?" if close else "remove it (see docs/config.md for the keys)"
        return f"unknown key `{key}` in {source}; {hint}"
    if kind == "missing":
        return f"missing required key `{key}` in {source}; add it"
    message = str(first["msg"])
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
        return f"{source}: {message}" if not key else f"{source}: `{key}`: {message}"
    got = first.get("input")
    shown = repr(got) if not isinstance(got, dict) else "a mapping"
    return f"`{key}` in {source}: {message.lower()} (got {shown}); fix its value"
