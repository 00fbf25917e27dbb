"""Which optimizer a stage's device gets for a config's ``optimizer``: a pure decision, no torch.

Every choice is AdamW with the config's betas, epsilon and weight decay; they differ in how the
state is kept. bitsandbytes' 8-bit and paged optimizers are used on CUDA. Where a device cannot
run the one asked for, it gets 32-bit torch AdamW (the same update, full-precision state) and the
run says so in one line. The plan and the stage processes both ask this table, so they agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["OptimizerChoice", "choose_optimizer", "FUSED_ADAMW_DEVICES", "BITSANDBYTES_DEVICES"]

Builder = Literal[
    "torch_adamw", "torch_adamw_fused", "bnb_adamw_8bit", "bnb_paged_adamw_8bit", "bnb_paged_adamw_32bit"
]

#: Device types with torch's fused AdamW kernel (torch >= 2.4, shardpool's minimum).
FUSED_ADAMW_DEVICES = frozenset({"cuda", "cpu", "mps", "xpu"})
#: Device types on which shardpool runs bitsandbytes' optimizers.
BITSANDBYTES_DEVICES = frozenset({"cuda"})

_BITSANDBYTES: dict[str, Builder] = {
    "adamw_bnb_8bit": "bnb_adamw_8bit",
    "adamw_8bit": "bnb_adamw_8bit",  # axolotl's other name for it
    "paged_adamw_8bit": "bnb_paged_adamw_8bit",
    "paged_adamw_32bit": "bnb_paged_adamw_32bit",
}


@dataclass(frozen=True)
class OptimizerChoice:
    """What is built for one stage: ``builder`` names it; ``fallback`` is the one line saying why
    it is not the optimizer the config asked for (None when it is)."""

    builder: Builder
    fallback: str | None = None


def choose_optimizer(name: str, device_type: str, *, bitsandbytes_usable: bool = True) -> OptimizerChoice:
    """The optimizer a stage on ``device_type`` (``cpu``, ``cuda``, ...) builds for ``optimizer: name``.

    ``bitsandbytes_usable`` is False where bitsandbytes cannot be imported; its optimizers then
    fall back like on a device without support.
    """
    if name == "adamw_torch":
        return OptimizerChoice("torch_adamw")
    if name == "adamw_torch_fused":
        if device_type in FUSED_ADAMW_DEVICES:
            return OptimizerChoice("torch_adamw_fused")
        return OptimizerChoice(
            "torch_adamw",
            f"`optimizer: {name}`: torch has no fused AdamW on {device_type}; "
            f"that stage uses unfused AdamW (the same update)",
        )
    if name in _BITSANDBYTES:
        if device_type in BITSANDBYTES_DEVICES and bitsandbytes_usable:
            return OptimizerChoice(_BITSANDBYTES[name])
        reason = (
            "bitsandbytes cannot be imported"
            if device_type in BITSANDBYTES_DEVICES
            else (f"bitsandbytes optimizers run on CUDA only, this stage is on {device_type}")
        )
        return OptimizerChoice(
            "torch_adamw",
            f"`optimizer: {name}`: {reason}; that stage uses 32-bit torch AdamW instead",
        )
    raise ValueError(f"unknown optimizer {name!r}")
