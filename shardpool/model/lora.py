"""LoRA settings, deterministic initialisation, and the PEFT adapter files shardpool reads and writes.

Adapter tensors are always keyed with *global* layer indices, exactly as peft names them for the
whole model (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``), so an adapter
trained on any split loads into the full model, and into any other split.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import load_file

from mesh.files import atomic_write
from shardpool.config import Config
from shardpool.errors import ShardpoolError
from shardpool.model.shape import decoder_linear_names, local_model_type
from shardpool.model.weights import save_tensors

__all__ = [
    "LoraSettings",
    "lora_settings",
    "peft_config",
    "init_lora_weights",
    "write_adapter",
    "read_adapter_tensors",
    "base_model_reference",
    "ADAPTER_WEIGHTS",
    "ADAPTER_CONFIG",
]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA hyper-parameters every stage applies in the same way."""

    r: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]
    init_from: str | None
    #: ``lora_target_linear``: every decoder Linear of the model's family, whatever ``target_modules``
    #: says (a stage that could not read the family from config.json resolves it when it builds).
    all_linear: bool = False

    @property
    def scaling(self) -> float:
        """The factor LoRA's update is multiplied by (alpha / r)."""
        return self.alpha / self.r


def lora_settings(config: Config, *, check_init_adapter: bool = True) -> LoraSettings:
    """Resolve the LoRA targets of a config, and check them against ``lora_model_dir`` if given.

    The targets are the decoder Linear names of the base model's family (Phi-3's fused
    ``qkv_proj`` and ``gate_up_proj``), read from its config.json. Where that file is not at hand
    (a stage on another machine), requested names are checked against every family's, and
    ``lora_target_linear`` is resolved by :func:`~shardpool.model.stage.build_stage` from the
    model it builds (the launcher, which writes the adapter files, has the file).

    Stage processes on other machines pass ``check_init_adapter=False``: the launcher checked the
    adapter, and its files reach them through the job's inputs, not at ``lora_model_dir``.
    """
    model_type = local_model_type(config.base_model)
    linears = decoder_linear_names(model_type)
    if config.lora_target_linear:
        targets = decoder_linear_names(model_type or "llama")
    else:
        requested = tuple(config.lora_target_modules or ())
        unknown = [name for name in requested if name not in linears]
        if unknown:
            family = f"{model_type}'s" if model_type else "the"
            raise ShardpoolError(
                f"lora_target_modules {unknown} match no Linear of {family} decoder layers; "
                f"use names from {list(linears)} or `lora_target_linear: true`"
            )
        targets = tuple(name for name in linears if name in requested)
    settings = LoraSettings(
        r=config.lora_r,
        alpha=float(config.lora_alpha),
        dropout=config.lora_dropout,
        target_modules=tuple(targets),
        init_from=config.lora_model_dir,
        all_linear=bool(config.lora_target_linear),
    )
    if config.lora_model_dir is not None and check_init_adapter:
        _check_matches_existing_adapter(settings, Path(config.lora_model_dir))
    return settings


def _check_matches_existing_adapter(settings: LoraSettings, adapter_dir: Path) -> None:
    config_file = adapter_dir / ADAPTER_CONFIG
    if not config_file.is_file() or not (adapter_dir / ADAPTER_WEIGHTS).is_file():
        raise ShardpoolError(
            f"lora_model_dir {str(adapter_dir)!r} has no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}; point it at a PEFT adapter"
        )
    existing = json.loads(config_file.read_text(encoding="utf-8"))
    checks = {
        "lora_r": (settings.r, existing.get("r")),
        "lora_alpha": (settings.alpha, float(existing.get("lora_alpha", -1))),
        "lora_target_modules": (
            sorted(settings.target_modules),
            sorted(existing.get("target_modules") or []),
        ),
    }
    for key, (ours, theirs) in checks.items():
        if ours != theirs:
            raise ShardpoolError(
                f"`{key}` is {ours} but lora_model_dir's adapter has {theirs}; make them equal"
            )


def peft_config(settings: LoraSettings) -> LoraConfig:
    """The peft LoraConfig a stage wraps its layers with, and the adapter_config.json written."""
    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def init_lora_weights(named_lora_a: dict[str, torch.nn.Parameter], *, seed: int) -> None:
    """Initialise every lora_A from a generator seeded by (seed, global module name).

    peft draws lora_A from one global RNG stream, so the values would depend on which layers a
    process owns. Seeding per module makes the starting adapter the same for every split. The
    distribution is peft's default (Kaiming-uniform with a = sqrt(5)); lora_B stays zero.
    """
    for name, weight in named_lora_a.items():
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        generator = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little"))
        values = torch.empty(weight.shape, dtype=torch.float32)
        torch.nn.init.kaiming_uniform_(values, a=math.sqrt(5), generator=generator)
        with torch.no_grad():
            weight.copy_(values.to(device=weight.device, dtype=weight.dtype))


def write_adapter(
    output_dir: str | Path, tensors: dict[str, torch.Tensor], settings: LoraSettings, *, base_model: str
) -> None:
    """Write a PEFT adapter directory (config + safetensors), each file atomically.

    ``base_model_name_or_path`` is :func:`base_model_reference`, so the adapter loads by itself
    (``AutoPeftModelForCausalLM``) from any directory.
    """
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    config = peft_config(settings)
    config.base_model_name_or_path = base_model_reference(base_model)
    config.inference_mode = True
    payload = json.dumps(config.to_dict(), indent=2, sort_keys=True, default=_json_default)
    atomic_write(directory / ADAPTER_CONFIG, payload.encode("utf-8"))
    save_tensors(directory / ADAPTER_WEIGHTS, dict(sorted(tensors.items())), metadata={"format": "pt"})


def base_model_reference(base_model: str | Path) -> str:
    """How an adapter names its base model: the absolute path of a local directory, else as given (a hub id).

    A path relative to where training ran would not resolve from anywhere else.
    """
    path = Path(base_model).expanduser()
    return str(path.resolve()) if path.is_dir() else str(base_model)


def read_adapter_tensors(adapter_dir: str | Path) -> dict[str, torch.Tensor]:
    """Read the tensors of a PEFT adapter directory, keyed as peft saved them."""
    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise ShardpoolError(f"{path} does not exist; point at a PEFT adapter directory")
    return load_file(str(path))


def _json_default(value: object) -> object:
    if isinstance(value, set | frozenset):
        return sorted(value)
    if hasattr(value, "value"):
        return value.value  # enums such as peft's TaskType
    raise TypeError(f"cannot write {type(value).__name__} to adapter_config.json")
