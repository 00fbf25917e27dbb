"""Which attention kernel a stage runs: axolotl's attention keys mapped to transformers' names.

axolotl spells the choice as booleans (``flash_attention: true``, ``sdp_attention: true``, ...);
transformers as ``attn_implementation``. Every spelling becomes one requested name at parse time;
each stage then resolves it on its own device with :func:`choose_attention`, because a pool mixes
devices that can and cannot run a kernel. The fallback is always ``sdpa``: it computes the same
attention (to float rounding), so a stage that falls back changes speed and memory, not results.
Nothing here imports torch: the facts about the device are passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ATTENTION_FLAGS", "AttentionChoice", "AttentionName", "choose_attention"]

AttentionName = Literal["sdpa", "eager", "flash_attention_2", "flex_attention", "xformers"]

#: axolotl's boolean attention keys and the implementation each one asks for when true.
ATTENTION_FLAGS: dict[str, AttentionName] = {
    "flash_attention": "flash_attention_2",
    "sdp_attention": "sdpa",
    "eager_attention": "eager",
    "flex_attention": "flex_attention",
    "xformers_attention": "xformers",
}

_FLASH_MIN_CAPABILITY = (8, 0)
_HALF_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class AttentionChoice:
    """The implementation one stage uses, and the one line that says why when it is not the requested one."""

    implementation: str
    fallback: str | None = None


def _flash_missing(
    device_type: str, compute_dtype: str, flash_attn_installed: bool, capability: tuple[int, int] | None
) -> str | None:
    if device_type != "cuda":
        return f"it needs a CUDA GPU and this stage is on {device_type}"
    if not flash_attn_installed:
        return "the flash-attn package is not installed (pip install flash-attn)"
    if capability is None or capability < _FLASH_MIN_CAPABILITY:
        shown = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
        return f"it needs compute capability 8.0 or newer (Ampere) and this GPU has {shown}"
    if compute_dtype not in _HALF_DTYPES:
        return f"it computes in bf16 or fp16 and this run computes in {compute_dtype} (set bf16: true)"
    return None


def choose_attention(
    requested: str,
    *,
    device_type: str,
    compute_dtype: str,
    flash_attn_installed: bool,
    cuda_capability: tuple[int, int] | None = None,
) -> AttentionChoice:
    """Resolve ``requested`` on one stage's device; fall back to sdpa, with the reason, where it cannot run."""
    if requested in ("sdpa", "eager"):
        return AttentionChoice(requested)
    if requested == "flash_attention_2":
        missing = _flash_missing(device_type, compute_dtype, flash_attn_installed, cuda_capability)
        if missing is None:
            return AttentionChoice(requested)
        return AttentionChoice("sdpa", f"flash_attention_2 is not used: {missing}; this stage uses sdpa")
    return AttentionChoice(
        "sdpa",
        f"{requested} is not built into shardpool; this stage uses sdpa, which computes the same attention",
    )
