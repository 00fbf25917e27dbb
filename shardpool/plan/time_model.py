"""The time side of the cost model: FLOPs of a decoder layer and ``lm_head``, and pipeline step time.

A device's layer time comes from these FLOPs and its TFLOPS (or is measured by the profiler);
``plan.stage_costs`` turns it into a stage's time per micro-batch.
"""

from __future__ import annotations

from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.memory_model import lora_params_per_layer

__all__ = ["DEFAULT_EFFICIENCY", "bubble_fraction", "layer_flops", "lm_head_flops", "step_seconds"]

#: Fraction of a datasheet TFLOPS figure an NF4+LoRA layer reaches (dequantization, small GEMMs,
#: kernel launches). Used only for devices described by ``tflops``; measured devices need none.
DEFAULT_EFFICIENCY = 0.4


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


def lm_head_flops(shape: ModelShape, workload: Workload) -> float:
    """FLOPs of the last stage's ``lm_head`` (forward and input-gradient backward), loss ignored."""
    return 2 * 2 * shape.lm_head_params() * workload.tokens


def step_seconds(bottleneck_s: float, *, microbatches: int, num_stages: int) -> float:
    """Predicted optimizer-step time of a 1F1B or GPipe pipeline: ``(M + S - 1) * t_max``.

    Both schedules fill and drain the pipeline once per step; in steady state the slowest
    stage (forward + backward per micro-batch) paces everything.
    """
    return (microbatches + num_stages - 1) * bottleneck_s


def bubble_fraction(*, microbatches: int, num_stages: int) -> float:
    """Fraction of a step a stage sits idle in the fill and drain: ``(S - 1) / (M + S - 1)``."""
    return (num_stages - 1) / (microbatches + num_stages - 1)
