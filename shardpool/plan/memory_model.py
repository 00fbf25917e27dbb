"""The memory side of the cost model: bytes of NF4 weights, LoRA state, activations and reserve.

Each function prices one piece for one decoder layer or one stage boundary; ``plan.stage_costs``
adds them up per stage. Numbers and assumptions are described in ``docs/planner.md``.
"""

from __future__ import annotations

import math

from shardpool.contract.schedule import held_gradient_sends, peak_in_flight, schedule_for
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload

__all__ = [
    "FRAGMENTATION",
    "LORA_BYTES_PER_PARAM",
    "NF4_BLOCKSIZE",
    "TORCH_DEQUANT_CHUNK_WEIGHTS",
    "torch_dequantize_bytes",
    "activation_bytes_per_layer",
    "boundary_bytes",
    "held_boundary_bytes",
    "in_flight_microbatches",
    "lora_params_per_layer",
    "nf4_bytes",
    "reserve_base_bytes",
    "reserve_bytes",
]

NF4_BLOCKSIZE = 64
#: Absmax values per second-level (double-quant) block.
DOUBLE_QUANT_BLOCKSIZE = 256
#: Bytes per trainable LoRA parameter: fp32 weight + fp32 grad + two fp32 AdamW states.
LORA_BYTES_PER_PARAM = 16
#: Per-stage framework reserve by device kind: CUDA context and cuBLAS workspace, MPS/XPU runtime.
#: A CPU stage's memory is its whole process: Python with torch, transformers, peft and
#: bitsandbytes loaded is 440-480 MiB resident on Linux x86-64 before any tensor (measured with
#: VmRSS on torch 2.13 / transformers 5.23). Plus a fraction of tensor memory for fragmentation.
_RESERVE_BASE = {
    "cuda": 0.75 * 2**30,
    "rocm": 0.75 * 2**30,
    "xpu": 0.75 * 2**30,
    "mps": 0.5 * 2**30,
    "cpu": 0.45 * 2**30,
}
#: Fraction of a stage's tensor bytes added to its reserve for allocator fragmentation.
FRAGMENTATION = 0.05
#: Weights the PyTorch NF4 path (``shardpool.model.nf4``, the ``torch`` backend) dequantizes at a
#: time: ``shardpool.model.nf4.DEQUANTIZE_CHUNK_WEIGHTS`` (this module stays torch-free).
TORCH_DEQUANT_CHUNK_WEIGHTS = 2**20


def torch_dequantize_bytes(weights: int) -> int:
    """What dequantizing one Linear of ``weights`` on the PyTorch NF4 path holds beyond the
    dequantized weight itself: the blocks' fp32 absmax (4 bytes per 64 weights) and one chunk's
    int32 index and fp32 values (6 bytes a weight of the chunk); measured on CPU
    (``tests/plan/test_memory_parts.py``)."""
    return int(weights * 4 / 64 + 6 * min(weights, TORCH_DEQUANT_CHUNK_WEIGHTS))


def nf4_bytes(params: int) -> float:
    """Bytes of ``params`` weights in NF4 with double quantization (blocksize 64).

    4 bits per weight, one uint8 absmax per 64 weights (double-quantized), one fp32 scale per
    256 absmax values, plus the fp32 256-entry code table and offset of the second level.
    """
    blocks = math.ceil(params / NF4_BLOCKSIZE)
    return params / 2 + blocks + 4 * math.ceil(blocks / DOUBLE_QUANT_BLOCKSIZE) + 4 * 256 + 4


def lora_params_per_layer(shape: ModelShape, workload: Workload) -> int:
    """Trainable LoRA parameters of one decoder layer: ``r * (in + out)`` per targeted Linear."""
    dims = shape.linear_dims()
    return sum(workload.lora_r * (dims[name][0] + dims[name][1]) for name in _targets_in(shape, workload))


def activation_bytes_per_layer(shape: ModelShape, workload: Workload) -> float:
    """Bytes autograd saves for backward in one decoder layer, for one micro-batch, without checkpointing.

    Per token, in compute dtype: the layer input and its normalized copy, the post-attention
    residual and its normalized copy (4h); q (after RoPE), attention output and o_proj input
    (3 q_dim); k and v (2 kv_dim); gate, SiLU(gate), up and their product (4 intermediate);
    each LoRA ``A`` output (r per target), and the attention log-sum-exp (fp32 per head).
    In 16-bit compute, peft's fp32 adapters keep an fp32 copy of each targeted module's input.
    Assumes SDPA attention (no s x s probabilities kept). Checked against a measured layer in tests.
    """
    h, q, kv, inter = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size
    targets = _targets_in(shape, workload)
    per_token = workload.compute_bytes * (4 * h + 3 * q + 2 * kv + 4 * inter + workload.lora_r * len(targets))
    per_token += 4 * shape.num_attention_heads
    if workload.compute_bytes < 4 and workload.lora_r > 0:
        # peft keeps adapters in fp32 and casts each targeted module's input up: one fp32 copy each.
        dims = shape.linear_dims()
        per_token += 4 * sum(dims[name][0] for name in targets)
    return per_token * workload.tokens


def _targets_in(shape: ModelShape, workload: Workload) -> set[str]:
    """The workload's LoRA targets that this model's decoder layer has (Phi-3 fuses q/k/v and gate/up)."""
    return set(workload.lora_targets) & shape.linear_dims().keys()


def boundary_bytes(shape: ModelShape, workload: Workload) -> int:
    """Bytes crossing a stage boundary per micro-batch in one direction (activation or its gradient)."""
    return workload.tokens * shape.hidden_size * workload.wire_bytes


def held_boundary_bytes(
    shape: ModelShape,
    workload: Workload,
    *,
    kind: str,
    index: int,
    num_stages: int,
    in_flight: int,
) -> dict[str, float]:
    """Bytes a stage holds at its boundaries beyond its layers' saved activations, by part.

    ``stage_outputs`` (every stage but the last): the output each micro-batch's backward starts
    from, kept from its forward to its backward, for the micro-batches in flight; its send's buffer
    goes at the same time (a native link reports the send complete, and on gloo the gradient
    coming back proves the neighbour has it), plus a wire-dtype copy of each where the wire dtype
    differs. ``sent_gradients`` (a CPU stage with a previous one): its input's gradients that gloo
    still holds, each until an activation proves the previous stage received it
    (:func:`~shardpool.contract.schedule.held_gradient_sends`: a few under 1F1B, all M under GPipe);
    a GPU stage's gloo sends are host copies, outside its device memory, and a native link lets
    them go once complete.
    """
    elements = workload.tokens * shape.hidden_size
    first, last = index == 0, index == num_stages - 1
    held: dict[str, float] = {}
    if not last:
        wire_copy = workload.wire_bytes if workload.wire_bytes != workload.compute_bytes else 0
        held["stage_outputs"] = elements * (workload.compute_bytes + wire_copy) * in_flight
    if kind == "cpu" and not first:
        held["sent_gradients"] = elements * workload.wire_bytes * held_gradient_sends(
            workload.schedule, stage=index, num_stages=num_stages,
            num_microbatches=workload.gradient_accumulation_steps, lead=workload.lead,
        )  # fmt: skip
    return held


def reserve_base_bytes(kind: str) -> float:
    """The per-kind constant part of a stage's framework reserve (unknown kinds count as CUDA)."""
    return _RESERVE_BASE.get(kind, _RESERVE_BASE["cuda"])


def reserve_bytes(kind: str, tensor_bytes: float) -> float:
    """Framework reserve of one stage: a per-kind constant plus 5% of its tensors for fragmentation."""
    return reserve_base_bytes(kind) + FRAGMENTATION * tensor_bytes


def in_flight_microbatches(workload: Workload, *, index: int, num_stages: int) -> int:
    """Micro-batches whose activations stage ``index`` holds at once, read off the schedule the
    stages run (:func:`~shardpool.contract.schedule.schedule_for`).

    1F1B: stage i holds up to ``S - i + 1`` at lead 1 (the last stage 1, never more than M), and
    L - 1 more per stage of distance to the last at lead L. GPipe runs all M forwards first, so
    every stage holds M.
    """
    actions = schedule_for(
        workload.schedule, stage=index, num_stages=num_stages,
        num_microbatches=workload.gradient_accumulation_steps, lead=workload.lead,
    )  # fmt: skip
    return max(1, peak_in_flight(actions))
