"""NF4 quantization of one Linear layer, done exactly as transformers' bitsandbytes loader does it.

The base an adapter is trained on must be bit-for-bit the base a peft user loads with
``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)``.
So this builds the same ``bnb.nn.Linear4bit`` (same blocksize, storage type and statistics) from
the same full-precision weight, and lets bitsandbytes quantize it when it moves to the device.
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch
from transformers import BitsAndBytesConfig

__all__ = ["quantize_linear", "bnb_config", "keep_exact_cpu_matmul", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bnb_config(
    *, quant_type: str = "nf4", double_quant: bool = True, compute_dtype: str = "float32"
) -> BitsAndBytesConfig:
    """The transformers quantization config that reproduces a stage's base on a user's machine."""
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=DTYPES[compute_dtype],
    )


def quantize_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    device: torch.device | str,
    compute_dtype: torch.dtype,
    quant_type: str = "nf4",
    double_quant: bool = True,
) -> bnb.nn.Linear4bit:
    """Build a 4-bit Linear on ``device`` from a full-precision ``[out, in]`` weight.

    ``weight`` is quantized in the dtype it arrives in (the checkpoint's, as transformers'
    ``dtype="auto"`` loads it); only the compute happens in ``compute_dtype``.
    """
    out_features, in_features = weight.shape
    with torch.device("meta"):
        layer = bnb.nn.Linear4bit(
            in_features,
            out_features,
            bias is not None,
            compute_dtype,
            compress_statistics=double_quant,
            quant_type=quant_type,
            quant_storage=torch.uint8,
        )
    template = layer.weight
    layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, **template.__dict__).to(device)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias.to(device=device), requires_grad=False)
    keep_exact_cpu_matmul(layer)
    return layer


def keep_exact_cpu_matmul(model: torch.nn.Module) -> torch.nn.Module:
    """Stop bitsandbytes from repacking 4-bit weights to bf16 on CPU in eval mode.

    On CPUs with AVX512-BF16, ``Linear4bit.forward`` in eval mode without grad rewrites its weight
    into a packed bf16 format and computes in bf16 from then on. That is an inference shortcut, not
    the NF4 base: it moves logits by ~1e-3. Training and eval in shardpool, and any comparison with
    them, must see the exact base, so this turns the shortcut off on every 4-bit layer.
    """
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return model
