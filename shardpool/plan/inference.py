"""Placing inference: a generating stage's memory and per-token time, and the split that balances them.

A generating stage (``shardpool generate``, ``shardpool serve``) holds its NF4 layers with the
LoRA adapter unmerged, and a KV cache per sequence in flight: ``max_slots`` sequences of up to
``max_context`` tokens each. Nothing is trained, so there are no gradients, optimizer states or
saved activations. Like a training stage, its memory and its per-token time are affine in its
layer count, and the split that minimizes the slowest stage's per-token time under every
device's memory is :func:`~shardpool.plan.splits.min_max_split`'s. Numbers and assumptions are
described in ``docs/planner.md`` ("Placing inference").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardpool.errors import ShardpoolError
from shardpool.model.shape import DECODER_LINEAR_NAMES, ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.fleet import DEFAULT_LOOPBACK, Device, LinkSpec
from shardpool.plan.memory_model import (
    FRAGMENTATION,
    activation_bytes_per_layer,
    lora_params_per_layer,
    nf4_bytes,
    reserve_base_bytes,
    reserve_bytes,
)
from shardpool.plan.splits import min_max_split, ranges_from_counts
from shardpool.plan.time_model import layer_forward_flops

__all__ = [
    "INFERENCE_LORA_BYTES_PER_PARAM",
    "WIRE_BYTES",
    "InferenceDevice",
    "InferenceLoad",
    "InferenceSplit",
    "StageModel",
    "decode_seconds",
    "fitting_split",
    "inference_device",
    "inference_split",
    "inference_stage",
    "kv_cache_bytes",
]

#: Bytes per LoRA parameter at inference: the fp32 weight alone (peft keeps adapters in fp32).
INFERENCE_LORA_BYTES_PER_PARAM = 4
#: Bytes per element of the hidden states that cross the ring (``infer.stage_process.WIRE_DTYPE``,
#: fp32, which holds every compute dtype exactly; this module stays torch-free).
WIRE_BYTES = 4
#: Bytes of the sampled token id the last stage sends back to the first.
_TOKEN_BYTES = 8
_GIB = 2**30


@dataclass(frozen=True)
class InferenceLoad:
    """What the stages must hold at once: ``max_slots`` sequences of up to ``max_context`` tokens,
    and the adapter's rank and targets (LoRA weights only)."""

    max_context: int
    max_slots: int = 1
    lora_r: int = 16
    lora_targets: tuple[str, ...] = DECODER_LINEAR_NAMES

    def __post_init__(self) -> None:
        if self.max_context < 1 or self.max_slots < 1:
            raise ShardpoolError(
                f"max_context {self.max_context} and max_slots {self.max_slots} must both be at least 1"
            )

    def prefill(self, compute_bytes: int) -> Workload:
        """One forward of a ``max_context``-token prompt, as the training cost model prices a micro-batch."""
        return Workload(
            micro_batch_size=1,
            sequence_len=self.max_context,
            lora_r=self.lora_r,
            lora_targets=self.lora_targets,
            compute_bytes=compute_bytes,
            wire_bytes=WIRE_BYTES,
        )


@dataclass(frozen=True)
class InferenceDevice:
    """One device a generating stage may run on, in pipeline order.

    ``free_bytes`` is what the stage may use there (its share, when stages share the device);
    ``compute_bytes`` its dtype's bytes (4 fp32, 2 bf16/fp16). ``token_seconds_per_layer`` is the
    decode of one token through one layer, ``head_token_seconds`` through the final norm and
    ``lm_head`` (:func:`decode_seconds`); unmeasured devices count 1 and 0, so the split is the most
    even one that fits. ``link`` carries this stage's output to the next stage (the last stage's
    token back to the first).
    """

    name: str
    free_bytes: float
    kind: str = "cpu"
    compute_bytes: int = 4
    token_seconds_per_layer: float = 1.0
    head_token_seconds: float = 0.0
    link: LinkSpec = DEFAULT_LOOPBACK


@dataclass(frozen=True)
class StageModel:
    """One generating stage at a known position: bytes and per-token seconds, ``fixed + n * per_layer``."""

    fixed_bytes: float
    per_layer_bytes: float
    fixed_s: float
    per_layer_s: float
    kind: str

    def memory(self, layers: int) -> float:
        """Predicted peak bytes with ``layers`` layers, the framework reserve included."""
        tensors = self.fixed_bytes + layers * self.per_layer_bytes
        return tensors + reserve_bytes(self.kind, tensors)

    def seconds(self, layers: int) -> float:
        """Per-token decode seconds with ``layers`` layers, its send to the next stage included."""
        return self.fixed_s + layers * self.per_layer_s

    def max_layers(self, free_bytes: float) -> int:
        """Most layers that fit in ``free_bytes`` (negative when not even the fixed part fits)."""
        room = (free_bytes - reserve_base_bytes(self.kind)) / (1 + FRAGMENTATION) - self.fixed_bytes
        layers = math.floor(room / self.per_layer_bytes)
        while layers >= 0 and self.memory(layers) > free_bytes:
            layers -= 1
        return layers


@dataclass(frozen=True)
class InferenceSplit:
    """The chosen split: ``[start, stop)`` layers per stage, and each stage's predicted per-token
    seconds and peak bytes."""

    layers: list[tuple[int, int]]
    token_seconds: list[float]
    memory_bytes: list[float]


def kv_cache_bytes(shape: ModelShape, *, layers: int, tokens: int, dtype_bytes: int) -> int:
    """Bytes of the keys and values ``layers`` decoder layers hold for ``tokens`` positions:
    ``num_key_value_heads × head_dim × 2 × tokens × dtype_bytes`` per layer.

    :class:`~shardpool.model.shape.ModelShape` does not record sliding windows or per-layer
    attention types, so every layer is counted as holding the full ``tokens``: for a model whose
    layers attend through a window (Mistral, Gemma 2/3, Phi-3 with ``sliding_window``) this is an
    upper bound.
    """
    return layers * shape.num_key_value_heads * shape.head_dim * 2 * tokens * dtype_bytes


def inference_stage(
    shape: ModelShape, load: InferenceLoad, device: InferenceDevice, *, index: int, num_stages: int
) -> StageModel:
    """The memory and per-token time of a generating stage at position ``index`` of ``num_stages``.

    Per layer: its NF4 weights (norms and biases in the compute dtype), its LoRA weights in fp32
    and the KV cache of ``max_context × max_slots`` positions. Fixed: one prefill forward of
    ``max_context`` tokens through one layer (bounded by what a training forward of that length
    saves, since no-grad frees each tensor after use) with one dequantized Linear, the hidden states
    in and out, the embeddings (first stage), and the final norm, ``lm_head`` and one position's
    logits (last stage), priced as the training model prices them. The per-token time is the
    device's per-layer and ``lm_head`` decode times plus its link's time for one hidden state in
    :data:`WIRE_BYTES` (the last stage: one token id).
    """
    cb = device.compute_bytes
    first, last = index == 0, index == num_stages - 1
    linear_params = shape.linear_params().values()
    per_layer = (
        sum(nf4_bytes(p) for p in linear_params)
        + shape.layer_dense_params() * cb
        + lora_params_per_layer(shape, load.prefill(cb)) * INFERENCE_LORA_BYTES_PER_PARAM
        + kv_cache_bytes(shape, layers=1, tokens=load.max_context * load.max_slots, dtype_bytes=cb)
    )
    prefill_tokens = load.max_context
    fixed = (
        activation_bytes_per_layer(shape, load.prefill(cb))
        + max(linear_params) * cb
        + 2 * prefill_tokens * shape.hidden_size * max(cb, WIRE_BYTES)
    )
    fixed_s = device.link.seconds(_TOKEN_BYTES if last else shape.hidden_size * WIRE_BYTES)
    if first:
        fixed += shape.embedding_params() * cb
    if last:
        fixed += (shape.lm_head_params() + shape.final_norm_params()) * cb
        fixed += shape.vocab_size * (cb + 4)  # one position's logits and their fp32 copy for sampling
        fixed_s += device.head_token_seconds
    return StageModel(
        fixed_bytes=fixed,
        per_layer_bytes=per_layer,
        fixed_s=fixed_s,
        per_layer_s=device.token_seconds_per_layer,
        kind=device.kind,
    )


def decode_seconds(
    device: Device, shape: ModelShape, workload: Workload, load: InferenceLoad
) -> tuple[float, float]:
    """Seconds to decode one token through one layer, and through final norm + ``lm_head``, on a
    device the planner has times for (measured or from ``tflops``) for ``workload``'s micro-batch.

    The layer's forward time (:meth:`~shardpool.plan.fleet.Device.times`: measured, or the FLOPs
    model's forward share of a fleet device's forward + backward) is scaled by FLOPs from the
    micro-batch's forward to one token attending to ``max_context`` positions:
    ``2·(P_linear + LoRA) + 4·max_context·q_dim``. ``lm_head``'s forward is linear in the tokens.
    This is compute-bound pricing; on a GPU, decoding one token reads every weight once and is
    bound by memory bandwidth, so it is a lower bound there.
    """
    times = device.times(shape, workload, nf4_backend=device.nf4_backend)
    lora = lora_params_per_layer(shape, workload)
    token_flops = 2 * (shape.layer_linear_params() + lora) + 4 * load.max_context * shape.q_dim
    per_layer = times.layer_forward_s * token_flops / layer_forward_flops(shape, workload)
    return per_layer, times.head_forward_s / workload.tokens


def inference_device(
    device: Device,
    shape: ModelShape,
    workload: Workload,
    load: InferenceLoad,
    *,
    link: LinkSpec = DEFAULT_LOOPBACK,
) -> InferenceDevice:
    """A fleet device (its free memory, kind, dtype and profile) as a generating stage's device."""
    per_layer, head = decode_seconds(device, shape, workload, load)
    return InferenceDevice(
        name=device.name,
        free_bytes=device.memory_bytes,
        kind=device.kind,
        compute_bytes=workload.compute_bytes,
        token_seconds_per_layer=per_layer,
        head_token_seconds=head,
        link=link,
    )


def inference_split(
    shape: ModelShape, load: InferenceLoad, devices: Sequence[InferenceDevice]
) -> InferenceSplit:
    """The contiguous split of the model's layers over ``devices`` (one stage each, in order) that
    minimizes the slowest stage's per-token time with every stage within its device's free memory.

    Raises a one-line :class:`ShardpoolError` naming the device that cannot fit and by how much
    when no split fits.
    """
    count = len(devices)
    if count < 1 or count > shape.num_layers:
        raise ShardpoolError(
            f"{count} stages for {shape.num_layers} layers; use between 1 and {shape.num_layers} devices"
        )
    stages = [
        inference_stage(shape, load, device, index=i, num_stages=count) for i, device in enumerate(devices)
    ]
    caps = [stage.max_layers(device.free_bytes) for stage, device in zip(stages, devices, strict=True)]
    counts = min_max_split(
        [stage.fixed_s for stage in stages], [stage.per_layer_s for stage in stages], caps, shape.num_layers
    )
    if counts is None:
        raise ShardpoolError(_explain_no_fit(shape, load, devices, stages, caps))
    return InferenceSplit(
        layers=ranges_from_counts(counts),
        token_seconds=[stage.seconds(n) for stage, n in zip(stages, counts, strict=True)],
        memory_bytes=[stage.memory(n) for stage, n in zip(stages, counts, strict=True)],
    )


def fitting_split(
    shape: ModelShape,
    load: InferenceLoad,
    devices: Sequence[InferenceDevice],
    preferred: Sequence[tuple[int, int]],
) -> list[tuple[int, int]]:
    """``preferred`` (e.g. the even split) when every stage of it fits its device's free memory,
    else :func:`inference_split`'s layers (its one-line error when no split fits)."""
    count = len(devices)
    stages = [
        inference_stage(shape, load, device, index=i, num_stages=count) for i, device in enumerate(devices)
    ]
    if all(
        stage.memory(stop - start) <= device.free_bytes
        for stage, device, (start, stop) in zip(stages, devices, preferred, strict=True)
    ):
        return list(preferred)
    return inference_split(shape, load, devices).layers


def _explain_no_fit(
    shape: ModelShape,
    load: InferenceLoad,
    devices: Sequence[InferenceDevice],
    stages: Sequence[StageModel],
    caps: Sequence[int],
) -> str:
    """One line: the device short of memory and by how much (a device that cannot hold one layer
    first; else the one that would need the least more to take the layers the others cannot)."""
    layers = shape.num_layers
    unfit = [i for i, cap in enumerate(caps) if cap < 1]
    if unfit:
        # Every stage holds at least one layer: a device that cannot is short whatever the others hold.
        options = [(stages[i].memory(1) - devices[i].free_bytes, 1, devices[i].name) for i in unfit]
        extra, needed, name = max(options)
    else:
        options = []
        for i, (stage, device) in enumerate(zip(stages, devices, strict=True)):
            needed = layers - sum(min(cap, layers) for j, cap in enumerate(caps) if j != i)
            options.append((stage.memory(needed) - device.free_bytes, needed, device.name))
        extra, needed, name = min(options)
    return (
        f"{shape.name or 'the model'} does not fit for inference: {name} needs {max(extra, 2**20) / _GIB:.2f} GiB "
        f"more to hold {needed} of the {layers} layers with a KV cache of {load.max_context} tokens × "
        f"{load.max_slots} sequences; lower --max-concurrent or --max-context, or add devices"
    )
