"""One pipeline stage's costs: memory and times per micro-batch, affine in its layer count.

Every decoder layer of a Llama-family model is identical, so a stage's memory and each of its
times (forward, backward, the after-step work) are ``fixed + n * per_layer`` for ``n`` layers.
The planner exploits this; :func:`stage_costs` gives those coefficients, from the pieces in
``plan.memory_model`` and ``plan.time_model``, the transfers to its neighbours, and the breakdowns
shown to users. :meth:`StageCosts.times` hands them to the simulation (``plan.pipeline_sim``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.memory_model import (
    FRAGMENTATION,
    LORA_BYTES_PER_PARAM,
    activation_bytes_per_layer,
    held_boundary_bytes,
    in_flight_microbatches,
    lora_params_per_layer,
    nf4_bytes,
    reserve_base_bytes,
    reserve_bytes,
    torch_dequantize_bytes,
)
from shardpool.plan.pipeline_sim import NO_TRANSFER, StageTimes, Transfer
from shardpool.plan.time_model import GRADIENT_BYTES, DeviceTimes, ring_allreduce_seconds

__all__ = ["StageCosts", "stage_costs"]


@dataclass(frozen=True)
class StageCosts:
    """Affine costs of one stage at a known position: ``fixed + n * per_layer`` for ``n`` layers.

    Times per micro-batch: ``forward_*`` and ``backward_*`` (compute on the device); ``after_*`` is
    once per step (all-reduce across replicas, optimizer). ``to_next``/``to_previous`` are the
    transfers of its output activation and its input gradient (no transfer at the ends).
    ``*_breakdown`` dicts split the fixed and per-layer bytes by cause, so plans can show where
    memory goes.
    """

    forward_fixed_s: float
    forward_per_layer_s: float
    backward_fixed_s: float
    backward_per_layer_s: float
    fixed_bytes: float
    per_layer_bytes: float
    capacity_bytes: float
    kind: str
    in_flight: int
    to_next: Transfer = NO_TRANSFER
    to_previous: Transfer = NO_TRANSFER
    after_fixed_s: float = 0.0
    after_per_layer_s: float = 0.0
    fixed_breakdown: Mapping[str, float] = field(default_factory=dict)
    per_layer_breakdown: Mapping[str, float] = field(default_factory=dict)

    @property
    def fixed_s(self) -> float:
        """Compute seconds per micro-batch that do not depend on the layer count (embedding, lm_head)."""
        return self.forward_fixed_s + self.backward_fixed_s

    @property
    def per_layer_s(self) -> float:
        """Forward + backward seconds per micro-batch of one layer."""
        return self.forward_per_layer_s + self.backward_per_layer_s

    @property
    def comm_s(self) -> float:
        """Seconds per micro-batch of its two sends on idle links (they overlap compute)."""
        return self.to_next.seconds + self.to_previous.seconds

    def seconds(self, layers: int) -> float:
        """Compute seconds per micro-batch (forward + backward) with ``layers`` layers."""
        return self.fixed_s + layers * self.per_layer_s

    def forward(self, layers: int) -> float:
        """Forward seconds per micro-batch with ``layers`` layers."""
        return self.forward_fixed_s + layers * self.forward_per_layer_s

    def backward(self, layers: int) -> float:
        """Backward seconds per micro-batch with ``layers`` layers."""
        return self.backward_fixed_s + layers * self.backward_per_layer_s

    def after(self, layers: int) -> float:
        """Seconds once per step after the schedule: gradient all-reduce and optimizer."""
        return self.after_fixed_s + layers * self.after_per_layer_s

    def times(self, layers: int) -> StageTimes:
        """This stage with ``layers`` layers, as the simulation takes it."""
        return StageTimes(
            forward_s=self.forward(layers),
            backward_s=self.backward(layers),
            to_next=self.to_next,
            to_previous=self.to_previous,
            after_s=self.after(layers),
        )

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

    def memory(self, layers: int) -> float:
        """Predicted peak bytes with ``layers`` layers, framework reserve included."""
        tensors = self.fixed_bytes + layers * self.per_layer_bytes
        return tensors + reserve_bytes(self.kind, tensors)

    def growth(self, held: int, layers: int) -> float:
        """How many bytes the predicted peak grows from ``held`` layers to ``layers`` (negative when it shrinks)."""
        return self.memory(layers) - self.memory(held)

    def scaled(self, speed: float) -> StageCosts:
        """These costs on a device ``speed`` times slower at compute (forward and backward, ends
        included); memory, transfers and the after-step work are unchanged."""
        return replace(
            self,
            forward_fixed_s=self.forward_fixed_s * speed,
            forward_per_layer_s=self.forward_per_layer_s * speed,
            backward_fixed_s=self.backward_fixed_s * speed,
            backward_per_layer_s=self.backward_per_layer_s * speed,
        )

    def to_json(self) -> dict[str, Any]:
        """The affine coefficients as a ``plan.json`` stage's ``costs`` (seconds and bytes, unrounded),
        so a running plan can be re-split (``plan.calibrate``) without the fleet it was planned from."""
        data: dict[str, Any] = {name: getattr(self, name) for name in _FLOAT_FIELDS}
        data["kind"] = self.kind
        data["in_flight"] = self.in_flight
        data["to_next"] = [self.to_next.busy_s, self.to_next.latency_s]
        data["to_previous"] = [self.to_previous.busy_s, self.to_previous.latency_s]
        data["fixed_breakdown"] = dict(self.fixed_breakdown)
        data["per_layer_breakdown"] = dict(self.per_layer_breakdown)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StageCosts:
        """Read :meth:`to_json`'s output back; a clear error when a field is missing or not a number."""
        try:
            return cls(
                **{name: float(data[name]) for name in _FLOAT_FIELDS},
                kind=str(data["kind"]),
                in_flight=int(data["in_flight"]),
                to_next=Transfer(*(float(x) for x in data["to_next"])),
                to_previous=Transfer(*(float(x) for x in data["to_previous"])),
                fixed_breakdown={str(k): float(v) for k, v in dict(data["fixed_breakdown"]).items()},
                per_layer_breakdown={str(k): float(v) for k, v in dict(data["per_layer_breakdown"]).items()},
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ShardpoolError(
                f"plan.json stage costs are incomplete or malformed ({error!r}); re-plan to rewrite them"
            ) from None

    def breakdown(self, layers: int) -> dict[str, int]:
        """Bytes by cause for ``layers`` layers (sums to :meth:`memory`)."""
        parts = {key: value for key, value in self.fixed_breakdown.items()}
        for key, value in self.per_layer_breakdown.items():
            parts[key] = parts.get(key, 0.0) + layers * value
        tensors = self.fixed_bytes + layers * self.per_layer_bytes
        parts["reserve"] = reserve_bytes(self.kind, tensors)
        return {key: int(round(value)) for key, value in parts.items()}


#: The float fields of :class:`StageCosts`, as ``plan.json`` stores them.
_FLOAT_FIELDS = (
    "forward_fixed_s",
    "forward_per_layer_s",
    "backward_fixed_s",
    "backward_per_layer_s",
    "after_fixed_s",
    "after_per_layer_s",
    "fixed_bytes",
    "per_layer_bytes",
    "capacity_bytes",
)


def stage_costs(
    shape: ModelShape,
    workload: Workload,
    *,
    times: DeviceTimes,
    capacity_bytes: float,
    kind: str,
    index: int,
    num_stages: int,
    to_next: Transfer = NO_TRANSFER,
    to_previous: Transfer = NO_TRANSFER,
    replica_link: tuple[float, float] | None = None,
    measured_activation_bytes: float | None = None,
    nf4_backend: str | None = None,
) -> StageCosts:
    """Costs of a stage at pipeline position ``index`` of ``num_stages`` on one device.

    ``times`` are the device's compute times (measured or modeled). ``to_next``/``to_previous``
    are the sends of this stage's output activation and input gradient (ignored at the ends).
    ``replica_link`` is ``(bandwidth, latency)`` between the replicas of this stage, for the ring
    all-reduce of its LoRA gradients when ``workload.replicas > 1``. ``measured_activation_bytes``
    overrides the analytic per-layer activation estimate when the profiler measured it.

    The base weights are NF4 (``weights_nf4``) when ``workload.quantize``, else in the stage's dtype
    (``weights``, as ``adapter: lora`` loads them). An NF4 stage dequantizes one Linear at a time
    (in ``workspace``); on the ``torch`` backend (``nf4_backend``) that dequantization holds more
    while it runs (``torch_dequantize``, :func:`~shardpool.plan.memory_model.torch_dequantize_bytes`).
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
    lora_params = lora_params_per_layer(shape, workload)

    linear_params = shape.linear_params().values()
    if workload.quantize:
        weights = {"weights_nf4": sum(nf4_bytes(p) for p in linear_params) + shape.layer_dense_params() * cb}
    else:
        weights = {"weights": (sum(linear_params) + shape.layer_dense_params()) * cb}
    per_layer = weights | {
        "lora_and_optimizer": lora_params * LORA_BYTES_PER_PARAM,
        "activations": kept_act * in_flight,
    }
    largest_linear = max(linear_params)
    # Backward of one layer at a time: its full activations (recomputed if checkpointing) and
    # gradients, and (NF4) one dequantized weight matrix.
    fixed = {"workspace": full_act + (largest_linear * cb if workload.quantize else 0)}
    if workload.quantize and nf4_backend == "torch":
        fixed["torch_dequantize"] = torch_dequantize_bytes(largest_linear)
    fixed |= {
        "boundary_buffers": 2 * tokens * shape.hidden_size * max(cb, workload.wire_bytes),
    } | held_boundary_bytes(
        shape, workload, kind=kind, index=index, num_stages=num_stages, in_flight=in_flight
    )
    forward_fixed = backward_fixed = 0.0
    if first:
        fixed["embeddings"] = shape.embedding_params() * cb
        forward_fixed += times.embed_s
    if last:
        fixed["lm_head"] = (shape.lm_head_params() + shape.final_norm_params()) * cb
        vocab_elems = tokens * shape.vocab_size
        # fp32 log-softmax kept per micro-batch in flight; logits, fp32 copy and their grad transient.
        fixed["logits"] = vocab_elems * (4 * in_flight + cb + 8)
        forward_fixed += times.head_forward_s
        backward_fixed += times.head_backward_s
    after_fixed, after_per_layer = 0.0, times.optimizer_per_layer_s
    if replica_link is not None and workload.replicas > 1:
        bandwidth, latency = replica_link
        after_fixed = ring_allreduce_seconds(
            0.0, replicas=workload.replicas, bandwidth=bandwidth, latency=latency
        )
        after_per_layer += ring_allreduce_seconds(
            lora_params * GRADIENT_BYTES, replicas=workload.replicas, bandwidth=bandwidth, latency=0.0
        )
    return StageCosts(
        forward_fixed_s=forward_fixed,
        forward_per_layer_s=times.layer_forward_s,
        backward_fixed_s=backward_fixed,
        backward_per_layer_s=times.layer_backward_s,
        fixed_bytes=sum(fixed.values()),
        per_layer_bytes=sum(per_layer.values()),
        capacity_bytes=capacity_bytes,
        kind=kind,
        in_flight=in_flight,
        to_next=NO_TRANSFER if last else to_next,
        to_previous=NO_TRANSFER if first else to_previous,
        after_fixed_s=after_fixed,
        after_per_layer_s=after_per_layer,
        fixed_breakdown=fixed,
        per_layer_breakdown=per_layer,
    )
