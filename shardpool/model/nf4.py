"""NF4 quantization of one Linear layer, done exactly as transformers' bitsandbytes loader does it.

The base an adapter is trained on must be bit-for-bit the base a peft user loads with
``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)``.
So this builds the same ``bnb.nn.Linear4bit`` (same blocksize, storage type and statistics) from
the same full-precision weight, and lets bitsandbytes quantize it when it moves to the device.

Two backends compute with those bytes (``shardpool.nf4_backend``):

- ``bitsandbytes``: bitsandbytes' kernels for the device (CUDA, ROCm, XPU, its CPU code);
- ``torch``: for a device bitsandbytes has no 4-bit kernels for (a Maxwell card such as the M40,
  a new architecture before its wheels ship). The weight is quantized by bitsandbytes on the CPU,
  and the stage keeps exactly those packed codes and that quantization state on its device.
  :class:`TorchNF4Linear` dequantizes one weight at a time in plain PyTorch, in its forward and
  again in its backward, and keeps nothing dequantized between them: the arithmetic of
  bitsandbytes' own pure-PyTorch kernels (its ``default`` backend), with which it is tested equal.
  Those kernels are not called directly: they are private, and bitsandbytes dispatches by device,
  so on a CUDA device it would pick the CUDA library that is missing. torchao's NF4 tensor packs
  and scales differently, so it could not hold the bytes a peft user loads.
"""

from __future__ import annotations

from typing import Any, Literal

import bitsandbytes as bnb
import torch
from transformers import BitsAndBytesConfig

__all__ = [
    "DTYPES",
    "DEQUANTIZE_CHUNK_WEIGHTS",
    "NF4_BACKENDS",
    "NF4Backend",
    "TorchNF4Linear",
    "bnb_config",
    "dequantize_nf4",
    "keep_exact_cpu_matmul",
    "nf4_backend_of",
    "quantize_linear",
]

NF4Backend = Literal["bitsandbytes", "torch"]
#: The ways a stage can compute with NF4 weights (see the module's docstring).
NF4_BACKENDS: tuple[NF4Backend, ...] = ("bitsandbytes", "torch")

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
    backend: NF4Backend = "bitsandbytes",
) -> bnb.nn.Linear4bit:
    """Build a 4-bit Linear on ``device`` from a full-precision ``[out, in]`` weight.

    ``weight`` is quantized in the dtype it arrives in (the checkpoint's, as transformers'
    ``dtype="auto"`` loads it); only the compute happens in ``compute_dtype``. With ``backend``
    ``torch`` bitsandbytes quantizes on the CPU and the packed weight moves to ``device`` as it is.
    """
    out_features, in_features = weight.shape
    layer_class = TorchNF4Linear if backend == "torch" else bnb.nn.Linear4bit
    with torch.device("meta"):
        layer = layer_class(
            in_features,
            out_features,
            bias is not None,
            compute_dtype,
            compress_statistics=double_quant,
            quant_type=quant_type,
            quant_storage=torch.uint8,
        )
    template = layer.weight
    quantized_on = "cpu" if backend == "torch" else device
    packed = bnb.nn.Params4bit(weight, requires_grad=False, **template.__dict__).to(quantized_on)
    layer.weight = packed.to(device)  # already quantized: the codes and their state move as they are
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


#: Weights dequantized at a time (:func:`dequantize_nf4`): the fp32 temporaries of one chunk
#: (6 bytes a weight) are all the PyTorch path holds beyond the dequantized weight itself.
DEQUANTIZE_CHUNK_WEIGHTS = 2**20


def dequantize_nf4(packed: torch.Tensor, state: Any, dtype: torch.dtype) -> torch.Tensor:
    """The ``[out, in]`` weight that 4-bit codes ``packed`` and their bitsandbytes ``state`` stand for.

    Two codes a byte (high nibble first), each an index into ``state.code`` scaled by its block's
    absmax; with double quantization the absmax values are themselves 8-bit codes into
    ``state.state2.code`` in blocks of ``state.state2.blocksize``, plus ``state.offset``. Computed
    in fp32 and cast to ``dtype`` last, as bitsandbytes' own kernels do.

    The result is written :data:`DEQUANTIZE_CHUNK_WEIGHTS` weights at a time: each byte of a chunk
    is looked up once in a table of the 256 code pairs and scaled in place, so beyond the result
    this holds the blocks' fp32 absmax (4 bytes per 64 weights) and one chunk's int32 index and
    fp32 values (6 bytes a weight of the chunk), whatever the size of the weight.
    """
    absmax = state.absmax
    if state.nested:
        nested = state.state2
        absmax = _scaled_blocks(nested.code[absmax.int()], nested.absmax, nested.blocksize) + state.offset
    absmax = absmax.float()
    count = torch.Size(state.shape).numel()
    code = state.code.to(torch.float32)
    byte = torch.arange(256, device=code.device)
    pairs = torch.stack((code[byte >> 4], code[byte & 0xF]), dim=1)  # byte -> (high code, low code)
    codes = packed.reshape(-1).view(torch.uint8)
    result = torch.empty(count, dtype=dtype, device=codes.device)
    step = max(state.blocksize, DEQUANTIZE_CHUNK_WEIGHTS // state.blocksize * state.blocksize)
    for first in range(0, count, step):  # a multiple of the blocksize: chunks start on a block
        last = min(first + step, count)
        values = pairs[codes[first // 2 : (last + 1) // 2].int()].reshape(-1)[: last - first]
        scales = absmax[first // state.blocksize : (last + state.blocksize - 1) // state.blocksize]
        result[first:last] = _scaled_blocks(values, scales, state.blocksize)
        del values  # before the next chunk's are made
    return result.reshape(state.shape)


def _scaled_blocks(values: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> torch.Tensor:
    """``values`` (flat fp32, scaled in place) times the absmax of their block of ``blocksize``
    (the last block may be short)."""
    count = values.numel()
    full = count - count % blocksize
    values[:full].view(-1, blocksize).mul_(absmax[: full // blocksize].view(-1, 1))
    if full < count:
        values[full:].mul_(absmax[full // blocksize])
    return values


class _NF4Matmul(torch.autograd.Function):
    """``x @ W.T + bias`` with ``W`` dequantized for the forward and again for the backward, so no
    full-precision weight outlives the call (the base is frozen: no gradient for it or its bias)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, inputs: torch.Tensor, packed: torch.Tensor, state: Any, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.packed, ctx.state = packed, state
        return torch.nn.functional.linear(inputs, dequantize_nf4(packed, state, inputs.dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:  # type: ignore[override]
        grad_inputs = None
        if ctx.needs_input_grad[0]:
            weight = dequantize_nf4(ctx.packed, ctx.state, grad_output.dtype)
            grad_inputs = torch.matmul(grad_output, weight)
        return grad_inputs, None, None, None


class TorchNF4Linear(bnb.nn.Linear4bit):
    """A ``bnb.nn.Linear4bit`` (same packed weight and state, so peft wraps it with its QLoRA layer
    and saves the same adapter) whose forward and backward run in plain PyTorch on any device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output in ``x``'s dtype, computed in the layer's compute dtype."""
        input_dtype = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return _NF4Matmul.apply(x, self.weight.data, self.weight.quant_state, bias).to(input_dtype)


def nf4_backend_of(model: torch.nn.Module) -> NF4Backend | None:
    """How ``model``'s NF4 layers compute (``torch`` if any runs the PyTorch path), or None without any:
    what a stage reports it ran, whatever its job asked for."""
    layers = [module for module in model.modules() if isinstance(module, bnb.nn.Linear4bit)]
    if not layers:
        return None
    return "torch" if any(isinstance(layer, TorchNF4Linear) for layer in layers) else "bitsandbytes"
