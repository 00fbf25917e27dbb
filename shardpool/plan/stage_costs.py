"""One pipeline stage's costs: memory and time per micro-batch, affine in its layer count.

Every decoder layer of a Llama-family model is identical, so a stage's memory and time are
``fixed + n * per_layer`` for ``n`` layers. The planner exploits this; :func:`stage_costs` gives
those coefficients, from the pieces in ``plan.memory_model`` and ``plan.time_model``, and the
breakdowns shown to users.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.memory_model import (
    FRAGMENTATION,
    LORA_BYTES_PER_PARAM,
    activation_bytes_per_layer,
    in_flight_microbatches,
    lora_params_per_layer,
    nf4_bytes,
    reserve_base_bytes,
    reserve_bytes,
)
from shardpool.plan.time_model import layer_flops, lm_head_flops

__all__ = ["StageCosts", "stage_costs"]


@dataclass(frozen=True)
class StageCosts:
    """Affine costs of one stage at a known position: ``fixed + n * per_layer`` for ``n`` layers.

    ``*_breakdown`` dicts split the fixed and per-layer parts by cause (bytes or seconds), so
    plans can show where memory goes.
    """

    fixed_s: float
    per_layer_s: float
    fixed_bytes: float
    per_layer_bytes: float
    capacity_bytes: float
    kind: str
    in_flight: int
    comm_s: float
    fixed_breakdown: Mapping[str, float] = field(default_factory=dict)
    per_layer_breakdown: Mapping[str, float] = field(default_factory=dict)

    def max_layers(self) -> int:
        """Most layers that fit in memory at this position (negative when not even the fixed part fits)."""
        if self.per_layer_bytes <= 0:
            return 1 << 30
        base = reserve_base_bytes(self.kind)
        room = (self.capacity_bytes - base) / (1 + FRAGMENTATION) - self.fixed_bytes
        layers = math.floor(room / self.per_layer_bytes)
        while layers >= 0 and self.memory(layers) > self.capacity_bytes:
            layers -= 1
        return layers

    def seconds(self, layers: int) -> float:
        """Predicted seconds per micro-batch (forward + backward) with ``layers`` layers."""
        return self.fixed_s + layers * self.per_layer_s

    def memory(self, layers: int) -> float:
        """Predicted peak bytes with ``layers`` layers, framework reserve included."""
        tensors = self.fixed_bytes + layers * self.per_layer_bytes
        return tensors + reserve_bytes(self.kind, tensors)

    def breakdown(self, layers: int) -> dict[str, int]:
        """Bytes by cause for ``layers`` layers (sums to :meth:`memory`)."""
        parts = {key: value for key, value in self.fixed_breakdown.items()}
        for key, value in self.per_layer_breakdown.items():
            parts[key] = parts.get(key, 0.0) + layers * value
        tensors = self.fixed_bytes + layers * self.per_layer_bytes
        parts["reserve"] = reserve_bytes(self.kind, tensors)
        return {key: int(round(value)) for key, value in parts.items()}


def stage_costs(
    shape: ModelShape,
    workload: Workload,
    *,
    seconds_per_layer: float,
    capacity_bytes: float,
    kind: str,
    index: int,
    num_stages: int,
    send_forward_s: float = 0.0,
    send_backward_s: float = 0.0,
    measured_activation_bytes: float | None = None,
) -> StageCosts:
    """Costs of a stage at pipeline position ``index`` of ``num_stages`` on one device.

    ``seconds_per_layer`` is the device's forward + backward time of one layer per micro-batch
    (measured or from TFLOPS). ``send_forward_s``/``send_backward_s`` are the times to send this
    stage's output activation to the next stage and its input gradient to the previous one
    (zero at the ends). ``measured_activation_bytes`` overrides the analytic per-layer
    activation estimate when the profiler measured it.
    """
    first, last = index == 0, index == num_stages - 1
    cb = workload.compute_bytes
    tokens = workload.tokens
    in_flight = in_flight_microbatches(workload, index=index, num_stages=num_stages)
    full_act = (
        measured_activation_bytes
        if measured_activation_bytes is not None
        else activation_bytes_per_layer(shape, workload)
    )
    kept_act = tokens * shape.hidden_size * cb if workload.gradient_checkpointing else full_act

    per_layer = {
        "weights_nf4": sum(nf4_bytes(p) for p in shape.linear_params().values())
        + shape.layer_dense_params() * cb,
        "lora_and_optimizer": lora_params_per_layer(shape, workload) * LORA_BYTES_PER_PARAM,
        "activations": kept_act * in_flight,
    }
    largest_linear = max(shape.linear_params().values())
    fixed = {
        # Backward of one layer at a time: its full activations (recomputed if checkpointing)
        # and gradients, and one dequantized weight matrix.
        "workspace": full_act + largest_linear * cb,
        "boundary_buffers": 2 * tokens * shape.hidden_size * max(cb, workload.wire_bytes),
    }
    flops_rate = layer_flops(shape, workload) / seconds_per_layer
    fixed_s = 0.0
    if first:
        fixed["embeddings"] = shape.embedding_params() * cb
    if last:
        fixed["lm_head"] = (shape.lm_head_params() + shape.final_norm_params()) * cb
        vocab_elems = tokens * shape.vocab_size
        # fp32 log-softmax kept per micro-batch in flight; logits, fp32 copy and their grad transient.
        fixed["logits"] = vocab_elems * (4 * in_flight + cb + 8)
        fixed_s += lm_head_flops(shape, workload) / flops_rate
    comm_s = send_forward_s + send_backward_s
    return StageCosts(
        fixed_s=fixed_s + comm_s,
        per_layer_s=seconds_per_layer,
        fixed_bytes=sum(fixed.values()),
        per_layer_bytes=sum(per_layer.values()),
        capacity_bytes=capacity_bytes,
        kind=kind,
        in_flight=in_flight,
        comm_s=comm_s,
        fixed_breakdown=fixed,
        per_layer_breakdown=per_layer,
    )
