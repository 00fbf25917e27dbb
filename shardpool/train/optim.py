"""A stage's optimizer and learning-rate schedule, built from the config.

The optimizer is AdamW over the stage's LoRA parameters, in the form
:func:`shardpool.config.optimizers.choose_optimizer` picks for the stage's device: torch's (fused
or not) or bitsandbytes' 8-bit / paged. A stage that cannot run the one asked for writes one
warning line to its log (stderr) and uses 32-bit torch AdamW. The schedule is transformers' with
axolotl's meanings: ``constant`` warms up like ``constant_with_warmup``, and
``cosine_min_lr_ratio`` decays cosine to that fraction of the peak (transformers'
``cosine_with_min_lr``, the same curve as axolotl's).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from typing import Any

import torch
from transformers import get_scheduler

from shardpool.config import Config
from shardpool.config.optimizers import OptimizerChoice, choose_optimizer

__all__ = ["build_optimizer", "build_scheduler", "scheduler_name", "warmup_steps", "bitsandbytes_usable"]


def bitsandbytes_usable() -> bool:
    """Whether bitsandbytes imports here (its optimizers are only tried when it does)."""
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install raises more than ImportError
        return False
    return True


def build_optimizer(
    config: Config, params: Iterable[torch.nn.Parameter], device: torch.device
) -> torch.optim.Optimizer:
    """The config's AdamW over ``params`` (all on ``device``), in the form this device can run."""
    choice = choose_optimizer(
        config.optimizer,
        device.type,
        bitsandbytes_usable=device.type != "cuda" or bitsandbytes_usable(),
    )
    if choice.fallback:
        print(f"shardpool: warning: {choice.fallback}", file=sys.stderr, flush=True)
    return _construct(choice, list(params), config)


def _construct(
    choice: OptimizerChoice, params: list[torch.nn.Parameter], config: Config
) -> torch.optim.Optimizer:
    settings: dict[str, Any] = {
        "lr": config.learning_rate,
        "betas": (config.adam_beta1, config.adam_beta2),
        "eps": config.adam_epsilon,
        "weight_decay": config.weight_decay,
    }
    if choice.builder == "torch_adamw":
        return torch.optim.AdamW(params, **settings)
    if choice.builder == "torch_adamw_fused":
        return torch.optim.AdamW(params, fused=True, **settings)
    import bitsandbytes as bnb

    classes = {
        "bnb_adamw_8bit": bnb.optim.AdamW8bit,
        "bnb_paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
        "bnb_paged_adamw_32bit": bnb.optim.PagedAdamW32bit,
    }
    return classes[choice.builder](params, **settings)


def scheduler_name(config: Config) -> str:
    """The transformers scheduler for an axolotl ``lr_scheduler`` (and ``cosine_min_lr_ratio``)."""
    if config.lr_scheduler == "cosine" and config.cosine_min_lr_ratio is not None:
        return "cosine_with_min_lr"
    names = {
        "cosine": "cosine",
        "linear": "linear",
        "constant": "constant_with_warmup",
        "constant_with_warmup": "constant_with_warmup",
    }
    return names[config.lr_scheduler]


def warmup_steps(config: Config, total_steps: int) -> int:
    """Warm-up steps from ``warmup_steps`` or ``warmup_ratio`` (rounded up, as transformers does)."""
    if config.warmup_steps is not None:
        return config.warmup_steps
    return math.ceil(total_steps * (config.warmup_ratio or 0.0))


def build_scheduler(config: Config, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    """The learning-rate schedule over ``total_steps`` optimizer steps, warm-up included."""
    name = scheduler_name(config)
    extra = {"min_lr_rate": config.cosine_min_lr_ratio} if name == "cosine_with_min_lr" else None
    return get_scheduler(
        name,
        optimizer,
        num_warmup_steps=warmup_steps(config, total_steps),
        num_training_steps=total_steps,
        scheduler_specific_kwargs=extra,
    )
