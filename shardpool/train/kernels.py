"""The kernel settings one stage takes from the config on its own device: attention and TF32.

The decisions are pure (:func:`shardpool.config.attention.choose_attention`); this module only
gathers the device's facts and applies the result, printing the one-line fallback to the stage
log, as the optimizer fallback does.
"""

from __future__ import annotations

import importlib.util
import sys

import torch

from shardpool.config import Config
from shardpool.config.attention import choose_attention

__all__ = ["stage_attention", "apply_tf32"]


def stage_attention(config: Config, device: torch.device, compute_dtype: str | None = None) -> str:
    """The attention implementation this stage builds its layers with (the config's, or sdpa).

    ``compute_dtype`` is the stage's own dtype when the planner chose one (else the config's).
    """
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    choice = choose_attention(
        config.attn_implementation,
        device_type=device.type,
        compute_dtype=compute_dtype or config.compute_dtype_name,
        flash_attn_installed=importlib.util.find_spec("flash_attn") is not None,
        cuda_capability=capability,
    )
    if choice.fallback:
        print(f"shardpool: warning: {choice.fallback}", file=sys.stderr, flush=True)
    return choice.implementation


def apply_tf32(config: Config, device: torch.device) -> bool:
    """Let this process's fp32 CUDA matmuls and convolutions use TF32 when ``tf32: true``; True if set.

    TF32 exists on NVIDIA Ampere and newer only; elsewhere (CPU, MPS, older GPUs) the flag changes nothing.
    It is set through the ``allow_tf32`` flags: on torch 2.13 they also set the newer
    ``fp32_precision`` ones, so readers of either agree. Setting only the newer ones would leave
    ``torch.get_float32_matmul_precision()`` and ``allow_tf32`` raising torch's "mix of the legacy and
    new APIs" error for every later reader of those, torch.compile included.
    """
    if not config.tf32 or device.type != "cuda":
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True
