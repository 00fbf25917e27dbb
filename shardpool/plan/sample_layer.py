"""The layer a profile times: one decoder layer of a model as a training stage holds it, random weights.

The layer is built from the model shape alone: the transformers decoder layer class of its family
(:data:`LAYER_CLASSES`), its Linear modules quantized to NF4 (blocksize 64, double quantization)
on the NF4 backend a stage on the device would use, or plain frozen Linear modules in the stage's
dtype for an unquantized base (``adapter: lora``), wrapped with LoRA by peft as a stage does.
:mod:`shardpool.plan.profiler` times it (:func:`layer_run`), and :mod:`shardpool.plan.co_run` runs
it alone and side by side.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import time
from dataclasses import dataclass
from typing import Any

from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload

__all__ = ["LAYER_CLASSES", "LayerRun", "build_layer", "layer_run"]

#: The transformers module and class prefix of each supported family's decoder layer.
LAYER_CLASSES = {
    "llama": ("llama", "Llama"),
    "mistral": ("mistral", "Mistral"),
    "qwen2": ("qwen2", "Qwen2"),
    "qwen3": ("qwen3", "Qwen3"),
    "gemma2": ("gemma2", "Gemma2"),
    "gemma3_text": ("gemma3", "Gemma3"),
    "phi3": ("phi3", "Phi3"),
}


def build_layer(
    shape: ModelShape, workload: Workload, device: str, dtype_name: str, nf4_backend: str | None = None
) -> tuple[Any, Any, Any]:
    """One decoder layer with LoRA computing in ``dtype_name`` (``float16``), its rotary embedding
    and its torch dtype: quantized to NF4 on ``nf4_backend`` (None: bitsandbytes) unless the
    workload's base is unquantized."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig

    module_name, prefix = LAYER_CLASSES[shape.model_type]
    modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    layer_cls = getattr(modeling, f"{prefix}DecoderLayer")
    rotary_cls = getattr(modeling, f"{prefix}RotaryEmbedding")
    fields = shape.to_hf_config()
    fields.pop("model_type")
    fields["num_hidden_layers"] = 1
    config = AutoConfig.for_model(shape.model_type, **fields)
    # Gemma 2 soft-caps attention scores, which SDPA cannot: its stages run eager attention.
    sdpa = getattr(modeling, f"{prefix}ForCausalLM")._supports_sdpa
    config._attn_implementation = "sdpa" if sdpa else "eager"
    dtype = getattr(torch, dtype_name)

    with torch.device("meta"):
        layer = layer_cls(config, layer_idx=0)
    generator = torch.Generator().manual_seed(0)
    for parent in list(layer.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(
                    parent,
                    child_name,
                    _nf4_linear(child, dtype, device, generator, nf4_backend or "bitsandbytes")
                    if workload.quantize
                    else _dense_linear(child, dtype, device, generator),
                )
    for module in layer.modules():
        for param_name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                fill = torch.zeros if param_name == "bias" else torch.ones
                module.register_parameter(
                    param_name,
                    torch.nn.Parameter(fill(param.shape, dtype=dtype, device=device), requires_grad=False),
                )

    class _Holder(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.layer = inner

        def forward(self, hidden: torch.Tensor, position_embeddings: Any) -> torch.Tensor:
            out = self.layer(hidden, position_embeddings=position_embeddings)
            return out[0] if isinstance(out, tuple) else out

    holder = _Holder(layer)
    if workload.lora_r > 0:
        lora = LoraConfig(
            r=workload.lora_r,
            lora_alpha=2 * workload.lora_r,
            lora_dropout=0.0,
            target_modules=sorted(set(workload.lora_targets)),
        )
        holder = get_peft_model(holder, lora)
        holder.to(device)
    rotary = rotary_cls(config=config).to(device)
    if "layer_type" in inspect.signature(rotary.forward).parameters:  # Gemma 3: one base per layer type
        rotary = functools.partial(rotary, layer_type=config.layer_types[0])
    return holder, rotary, dtype


@dataclass(frozen=True)
class LayerRun:
    """A built sample layer with one micro-batch of input: what one training step of a layer computes."""

    model: Any
    hidden: Any
    position_embeddings: Any
    dtype: Any
    device: str
    gradient_checkpointing: bool

    def step(self) -> float:
        """One forward + backward of the micro-batch, as a stage runs it; returns the forward's seconds."""
        import torch.utils.checkpoint

        from shardpool.plan.devices import synchronize

        x = self.hidden.detach().requires_grad_(True)
        start = time.perf_counter()
        if self.gradient_checkpointing:
            out = torch.utils.checkpoint.checkpoint(
                self.model, x, self.position_embeddings, use_reentrant=False
            )
        else:
            out = self.model(x, self.position_embeddings)
        synchronize(self.device)
        forward = time.perf_counter() - start
        out.float().sum().backward()
        return forward


def layer_run(
    shape: ModelShape, workload: Workload, device: str, dtype_name: str, nf4_backend: str | None = None
) -> LayerRun:
    """The layer of :func:`build_layer` on ``device`` with a random micro-batch of the workload's
    size and its rotary position embeddings, ready to :meth:`LayerRun.step`."""
    import torch

    model, rotary, dtype = build_layer(shape, workload, device, dtype_name, nf4_backend)
    hidden = torch.randn(
        workload.micro_batch_size, workload.sequence_len, shape.hidden_size, dtype=dtype, device=device
    )
    positions = torch.arange(workload.sequence_len, device=device).unsqueeze(0)
    position_embeddings = rotary(hidden, positions.expand(workload.micro_batch_size, -1))
    return LayerRun(
        model=model,
        hidden=hidden,
        position_embeddings=position_embeddings,
        dtype=dtype,
        device=device,
        gradient_checkpointing=workload.gradient_checkpointing,
    )


def _nf4_linear(linear: Any, dtype: Any, device: str, generator: Any, backend: str) -> Any:
    """``linear``'s shape with random weights, quantized to NF4 as a stage does it, on ``backend``."""
    import torch

    from shardpool.model.nf4 import quantize_linear

    weight = torch.randn(linear.out_features, linear.in_features, generator=generator, dtype=dtype) * 0.02
    bias = torch.zeros(linear.out_features, dtype=dtype) if linear.bias is not None else None
    return quantize_linear(weight, bias, device=device, compute_dtype=dtype, backend=backend)  # type: ignore[arg-type]


def _dense_linear(linear: Any, dtype: Any, device: str, generator: Any) -> Any:
    """``linear``'s shape with random frozen weights in ``dtype``, as an unquantized base holds it."""
    import torch

    dense = torch.nn.Linear(
        linear.in_features, linear.out_features, bias=linear.bias is not None, device=device, dtype=dtype
    )
    with torch.no_grad():
        weight = torch.randn(linear.out_features, linear.in_features, generator=generator, dtype=dtype)
        dense.weight.copy_(weight * 0.02)
        if dense.bias is not None:
            dense.bias.zero_()
    return dense.requires_grad_(False)
