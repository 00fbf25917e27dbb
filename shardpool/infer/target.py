"""What ``shardpool generate`` and ``serve`` run: a finetune output directory (its base model and
adapter), a config (its base model, and its output_dir's adapter once trained), or a base model
directory alone."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardpool.data.hub import local_model_dir
from shardpool.errors import ShardpoolError
from shardpool.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

__all__ = ["Target", "resolve_target"]

#: peft LoRA options a stage cannot apply as written; an adapter that sets one is refused.
_UNSUPPORTED_LORA = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False}


@dataclass(frozen=True)
class Target:
    """The base model directory, the adapter (None: the base alone), and where the tokenizer is."""

    model_dir: Path
    adapter_dir: Path | None
    tokenizer_dir: Path
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The model's name as ``/v1/models`` lists it: the adapter's directory, else the base's."""
        return (self.adapter_dir or self.model_dir).name


def resolve_target(target: str | Path) -> Target:
    """Read ``target`` (an output directory, a YAML config, or a model directory) into a :class:`Target`."""
    path = Path(target).expanduser()
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        return _from_config(path)
    if path.is_dir() and (path / ADAPTER_CONFIG).is_file():
        return _from_adapter(path)
    if path.is_dir() and (path / "config.json").is_file():
        return Target(model_dir=path, adapter_dir=None, tokenizer_dir=path)
    raise ShardpoolError(
        f"{target} is neither a finetune output directory (no {ADAPTER_CONFIG}), a YAML config, "
        "nor a model directory (no config.json); point at one of those"
    )


def _from_config(path: Path) -> Target:
    from shardpool.config import load_config

    config = load_config(path)
    output = Path(config.output_dir)
    if (output / ADAPTER_CONFIG).is_file() and (output / ADAPTER_WEIGHTS).is_file():
        return _from_adapter(output)
    model_dir = local_model_dir(config.base_model)
    return Target(model_dir=model_dir, adapter_dir=None, tokenizer_dir=model_dir)


def _from_adapter(adapter_dir: Path) -> Target:
    if not (adapter_dir / ADAPTER_WEIGHTS).is_file():
        raise ShardpoolError(f"{adapter_dir} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}; the run did not finish")
    settings = _adapter_config(adapter_dir)
    base = settings.get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise ShardpoolError(f"{adapter_dir / ADAPTER_CONFIG} does not name its base model; re-save the adapter")
    if settings.get("peft_type", "LORA") != "LORA":
        raise ShardpoolError(f"{adapter_dir} holds a {settings.get('peft_type')} adapter; only LoRA adapters run here")
    for key, default in _UNSUPPORTED_LORA.items():
        if settings.get(key, default) not in (default, None):
            raise ShardpoolError(f"{adapter_dir}: `{key}` is set; shardpool runs plain LoRA adapters only")
    targets = settings.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise ShardpoolError(f"{adapter_dir / ADAPTER_CONFIG}: target_modules must be a list of module names")
    model_dir = local_model_dir(base)
    tokenizer_dir = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else model_dir
    return Target(
        model_dir=model_dir,
        adapter_dir=adapter_dir,
        tokenizer_dir=tokenizer_dir,
        lora_r=int(settings.get("r", 8)),
        lora_alpha=float(settings.get("lora_alpha", 8)),
        lora_targets=tuple(str(name) for name in targets),
    )


def _adapter_config(adapter_dir: Path) -> dict[str, Any]:
    try:
        loaded = json.loads((adapter_dir / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ShardpoolError(f"cannot read {adapter_dir / ADAPTER_CONFIG}: {error}") from None
    if not isinstance(loaded, dict):
        raise ShardpoolError(f"{adapter_dir / ADAPTER_CONFIG} is not a JSON object; re-save the adapter")
    return loaded
