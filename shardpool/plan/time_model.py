"""The time side of the cost model: FLOPs of a decoder layer and ``lm_head``, a device's compute
times, the optimizer step and the replicas' gradient all-reduce.

A device's layer time comes from these FLOPs and its TFLOPS (or is measured by the profiler);
:class:`DeviceTimes` splits it into forward and backward and adds the embedding, ``lm_head`` with
the loss, and the optimizer; ``plan.stage_costs`` turns them into a stage's times per micro-batch
and ``plan.pipeline_sim`` into the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.memory_model import lora_params_per_layer

__all__ = [
    "DEFAULT_EFFICIENCY",
    "GRADIENT_BYTES",
    "OPTIMIZER_SECONDS_PER_PARAM",
    "TORCH_DEQUANT_BYTES_PER_FLOP",
    "DeviceTimes",
    "bubble_fraction",
    "layer_flops",
    "layer_forward_flops",
    "lm_head_flops",
    "modeled_times",
    "ring_allreduce_seconds",
    "step_seconds",
    "torch_dequant_extra_bytes",
    "torch_dequant_seconds",
]

#: Fraction of a datasheet TFLOPS figure an NF4+LoRA layer reaches (dequantization, small GEMMs,
#: kernel launches). Used only for devices described by ``tflops``; measured devices need none.
DEFAULT_EFFICIENCY = 0.4
#: Seconds per trainable parameter of one AdamW step with gradient clipping (torch's foreach
#: kernels, fp32 state), for devices whose profile did not time it. CPU: 2-5 ns measured on one
#: x86-64 thread (torch 2.x); accelerators are memory-bound at a few hundred GB/s.
OPTIMIZER_SECONDS_PER_PARAM = {"cpu": 5e-9, "mps": 1e-9}
_OPTIMIZER_ACCELERATOR = 2e-10
#: Bytes per LoRA gradient element all-reduced across replicas (fp32 adapters).
GRADIENT_BYTES = 4
#: Memory bandwidth (bytes/s) assumed per datasheet FLOP/s for dequantizing in plain PyTorch on a
#: device a fleet file describes by ``tflops`` alone: the ratio of the Maxwell cards the PyTorch
#: path is for (M40: 288 GB/s over 6.8 TFLOPS, 0.042). Cards with tensor cores have less bandwidth
#: per FLOP (a 4090: 0.012), so on them this underestimates the dequantization; give such a card
#: ``seconds_per_layer`` measured on the PyTorch path.
TORCH_DEQUANT_BYTES_PER_FLOP = 0.04


def torch_dequant_extra_bytes(compute_bytes: int) -> float:
    """Bytes of memory traffic per weight that dequantizing in plain PyTorch
    (``shardpool.model.nf4.dequantize_nf4``) moves beyond bitsandbytes' fused kernel, whose own
    dequantization the ``efficiency`` of a fleet device already covers.

    Per weight: an int32 index for each byte of codes (0.5 read, 2 written), the fp32 code-pair
    lookup (2 read, 4 written) and the absmax scaling in place (4 + 4): 16.5 bytes, against
    bitsandbytes' 0.5 read and 4 written, so 12 in fp32. A 16-bit stage also casts the result
    (4 + 2), against bitsandbytes' 2 written: 20.
    """
    return 16.5 - 4.5 if compute_bytes >= 4 else 16.5 + 6 - 2.5


def torch_dequant_seconds(shape: ModelShape, workload: Workload, *, tflops: float) -> tuple[float, float]:
    """Forward and backward seconds per micro-batch that computing one layer's NF4 weights in plain
    PyTorch adds on a device described by its datasheet ``tflops``.

    Every Linear is dequantized once in the forward, once in the backward, and once more for the
    recompute under gradient checkpointing (counted as backward), each time moving
    :func:`torch_dequant_extra_bytes` per weight at :data:`TORCH_DEQUANT_BYTES_PER_FLOP` × ``tflops``.
    """
    bandwidth = TORCH_DEQUANT_BYTES_PER_FLOP * tflops * 1e12
    once = shape.layer_linear_params() * torch_dequant_extra_bytes(workload.compute_bytes) / bandwidth
    return once, once * (1 + int(workload.gradient_checkpointing))


@dataclass(frozen=True)
class DeviceTimes:
    """Seconds per micro-batch on one device: a decoder layer's forward and backward (LoRA weight
    gradients included), the embedding lookup (stage 0), final norm + ``lm_head`` + loss forward and
    backward (last stage), and one optimizer step per layer's LoRA parameters (once per step)."""

    layer_forward_s: float
    layer_backward_s: float
    embed_s: float = 0.0
    head_forward_s: float = 0.0
    head_backward_s: float = 0.0
    optimizer_per_layer_s: float = 0.0

    @property
    def layer_s(self) -> float:
        """Forward + backward of one layer."""
        return self.layer_forward_s + self.layer_backward_s


def layer_flops(shape: ModelShape, workload: Workload) -> float:
    """FLOPs of forward + backward of one NF4+LoRA decoder layer for one micro-batch.

    The NF4 base weights are frozen: backward computes input gradients only (one GEMM per
    Linear, like the forward), so Linear work is ``2 * 2 * params * tokens`` rather than the
    ``3 * 2`` of full training; LoRA adds a few ``r``-wide GEMMs (counted). Causal attention
    adds ``2 * b * s^2 * q_dim`` forward and about 2.5x that backward. Gradient checkpointing
    repeats the forward once.
    """
    tokens = workload.tokens
    lora = lora_params_per_layer(shape, workload)
    linear_fwd = 2 * (shape.layer_linear_params() + lora) * tokens
    attention_fwd = 2 * workload.micro_batch_size * workload.sequence_len**2 * shape.q_dim
    recompute = 1 if workload.gradient_checkpointing else 0
    # LoRA weight gradients: one more r-wide GEMM pair per target.
    lora_weight_grads = 2 * lora * tokens
    return linear_fwd * (2 + recompute) + lora_weight_grads + attention_fwd * (3.5 + recompute)


def layer_forward_flops(shape: ModelShape, workload: Workload) -> float:
    """FLOPs of the first forward of one layer (a checkpointed layer's recompute counts as backward)."""
    tokens = workload.tokens
    linear_fwd = 2 * (shape.layer_linear_params() + lora_params_per_layer(shape, workload)) * tokens
    attention_fwd = 2 * workload.micro_batch_size * workload.sequence_len**2 * shape.q_dim
    return linear_fwd + attention_fwd


def lm_head_flops(shape: ModelShape, workload: Workload) -> float:
    """FLOPs of the last stage's ``lm_head`` (forward and input-gradient backward), loss ignored."""
    return 2 * 2 * shape.lm_head_params() * workload.tokens


def modeled_times(
    shape: ModelShape, workload: Workload, *, layer_s: float, kind: str, forward_s: float | None = None
) -> DeviceTimes:
    """A device's times from its forward + backward layer time alone (what a fleet file gives).

    Forward is the FLOPs model's share of ``layer_s`` (the frozen NF4 base makes backward about one
    forward of the Linear layers plus the LoRA weight gradients and 2.5x the attention) unless
    ``forward_s`` was measured; ``lm_head`` runs at the layer's FLOP rate, half forward and half
    backward; the embedding lookup is free; the optimizer takes
    :data:`OPTIMIZER_SECONDS_PER_PARAM` per LoRA parameter.
    """
    if forward_s is None:
        forward_s = layer_s * layer_forward_flops(shape, workload) / layer_flops(shape, workload)
    head_s = lm_head_flops(shape, workload) * layer_s / layer_flops(shape, workload)
    per_param = OPTIMIZER_SECONDS_PER_PARAM.get(kind, _OPTIMIZER_ACCELERATOR)
    return DeviceTimes(
        layer_forward_s=forward_s,
        layer_backward_s=max(0.0, layer_s - forward_s),
        head_forward_s=head_s / 2,
        head_backward_s=head_s / 2,
        optimizer_per_layer_s=per_param * lora_params_per_layer(shape, workload),
    )


def ring_allreduce_seconds(nbytes: float, *, replicas: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``replicas`` peers: 2(N-1) steps of ``nbytes / N`` each,
    so ``2 (N-1)/N * nbytes / bandwidth + 2 (N-1) * latency``; zero for one replica."""
    if replicas <= 1:
        return 0.0
    return 2 * (replicas - 1) / replicas * nbytes / bandwidth + 2 * (replicas - 1) * latency


def step_seconds(stage_s: float, *, microbatches: int, num_stages: int) -> float:
    """The closed form for identical stages with free links and no after-step work:
    ``(M + S - 1) * (f + b)`` under 1F1B and GPipe alike (``stage_s`` is ``f + b``).

    The planner simulates the schedule instead (``plan.pipeline_sim``); tests prove the two equal
    on identical stages.
    """
    return (microbatches + num_stages - 1) * stage_s


def bubble_fraction(*, microbatches: int, num_stages: int) -> float:
    """Fraction of a step identical stages sit idle in the fill and drain: ``(S - 1) / (M + S - 1)``.

    A plan reports its simulated bubble; this is the fallback for a hand-written ``plan.json``.
    """
    return (num_stages - 1) / (microbatches + num_stages - 1)
