"""Cost model of one pipeline stage: its memory and its time per micro-batch.

Every decoder layer of a Llama-family model is identical, so a stage's memory and time are
affine in its layer count ``n``: ``fixed + n * per_layer``. The planner exploits this;
:func:`stage_costs` gives those coefficients and the breakdowns shown to users. Numbers and
assumptions are described in ``docs/planner.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from shardpool.errors import ShardpoolError
from shardpool.model.shape import DECODER_LINEAR_NAMES, ModelShape

__all__ = [
    "DEFAULT_EFFICIENCY",
    "NF4_BLOCKSIZE",
    "StageCosts",
    "Workload",
    "activation_bytes_per_layer",
    "boundary_bytes",
    "bubble_fraction",
    "in_flight_microbatches",
    "layer_flops",
    "lm_head_flops",
    "lora_params_per_layer",
    "nf4_bytes",
    "reserve_bytes",
    "stage_costs",
    "step_seconds",
]

NF4_BLOCKSIZE = 64
#: Absmax values per second-level (double-quant) block.
DOUBLE_QUANT_BLOCKSIZE = 256
#: Fraction of a datasheet TFLOPS figure an NF4+LoRA layer reaches (dequantization, small GEMMs,
#: kernel launches). Used only for devices described by ``tflops``; measured devices need none.
DEFAULT_EFFICIENCY = 0.4
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
_FRAGMENTATION = 0.05

Schedule = Literal["1f1b", "gpipe"]


@dataclass(frozen=True)
class Workload:
    """What is being trained, as far as cost goes.

    ``gradient_accumulation_steps`` is the number of micro-batches per optimizer step (the
    pipeline's M). ``stages`` forces an exact stage count; ``max_stages`` caps it.
    Byte sizes: ``compute_bytes`` for activations and unquantized weights (4 fp32, 2 bf16/fp16),
    ``wire_bytes`` for tensors sent between stages.
    """

    micro_batch_size: int = 1
    sequence_len: int = 2048
    gradient_accumulation_steps: int = 8
    lora_r: int = 16
    lora_targets: tuple[str, ...] = DECODER_LINEAR_NAMES
    gradient_checkpointing: bool = False
    schedule: Schedule = "1f1b"
    compute_bytes: int = 4
    wire_bytes: int = 4
    max_stages: int | None = None
    stages: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "micro_batch_size",
            "sequence_len",
            "gradient_accumulation_steps",
            "compute_bytes",
            "wire_bytes",
        ):
            if getattr(self, name) <= 0:
                raise ShardpoolError(f"{name} is {getattr(self, name)}; it must be positive")
        if self.lora_r < 0:
            raise ShardpoolError(f"lora_r is {self.lora_r}; it must be zero or positive")
        unknown = sorted(set(self.lora_targets) - set(DECODER_LINEAR_NAMES))
        if unknown:
            raise ShardpoolError(
                f"lora target modules {unknown} are not Linear modules of a decoder layer; "
                f"choose from {', '.join(DECODER_LINEAR_NAMES)}"
            )
        if self.schedule not in ("1f1b", "gpipe"):
            raise ShardpoolError(f"schedule {self.schedule!r} is unknown; use '1f1b' or 'gpipe'")
        for name in ("max_stages", "stages"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ShardpoolError(f"shardpool.{name} is {value}; it must be positive")

    @property
    def tokens(self) -> int:
        """Tokens in one micro-batch."""
        return self.micro_batch_size * self.sequence_len

    def profile_key(self) -> str:
        """What a per-layer profile depends on (cache key part)."""
        targets = ",".join(sorted(self.lora_targets))
        return (
            f"mb{self.micro_batch_size}-seq{self.sequence_len}-r{self.lora_r}-[{targets}]"
            f"-gc{int(self.gradient_checkpointing)}-dt{self.compute_bytes}"
        )

    @classmethod
    def from_config(cls, config: Any) -> Workload:
        """Build a workload from a loaded shardpool config (pydantic model or plain mapping).

        Reads the axolotl-style fields and ``shardpool.{schedule, wire_dtype, stages}``;
        absent fields take the defaults of this class.
        """
        get = _getter(config)
        section = get("shardpool")
        sp = _getter(section if section is not None else {})
        if get("compute_dtype_name") is not None:
            compute_bytes = _dtype_bytes(get("compute_dtype_name"))
        else:
            compute_bytes = 2 if (get("bf16") is True or _truthy(get("fp16"))) else 4
        wire = get("wire_dtype_name") or sp("wire_dtype")
        wire_bytes = _dtype_bytes(wire) if wire not in (None, "auto") else compute_bytes
        targets = get("lora_target_modules")
        if _truthy(get("lora_target_linear")) or not targets:
            targets = DECODER_LINEAR_NAMES
        defaults = cls()
        gc = get("gradient_checkpointing")
        stages = sp("stages")  # only an explicit count binds the planner; devices alone do not
        return cls(
            micro_batch_size=int(get("micro_batch_size") or defaults.micro_batch_size),
            sequence_len=int(get("sequence_len") or defaults.sequence_len),
            gradient_accumulation_steps=int(
                get("gradient_accumulation_steps") or defaults.gradient_accumulation_steps
            ),
            lora_r=int(get("lora_r") if get("lora_r") is not None else defaults.lora_r),
            lora_targets=tuple(str(t) for t in targets),
            gradient_checkpointing=_truthy(gc),
            schedule=str(sp("schedule") or "1f1b").lower(),  # type: ignore[arg-type]
            compute_bytes=compute_bytes,
            wire_bytes=wire_bytes,
            stages=int(stages) if isinstance(stages, int) and not isinstance(stages, bool) else None,
        )


# ---------------------------------------------------------------------------- memory pieces


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
    return sum(workload.lora_r * (dims[name][0] + dims[name][1]) for name in set(workload.lora_targets))


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
    targets = set(workload.lora_targets)
    per_token = workload.compute_bytes * (4 * h + 3 * q + 2 * kv + 4 * inter + workload.lora_r * len(targets))
    per_token += 4 * shape.num_attention_heads
    if workload.compute_bytes < 4 and workload.lora_r > 0:
        # peft keeps adapters in fp32 and casts each targeted module's input up: one fp32 copy each.
        dims = shape.linear_dims()
        per_token += 4 * sum(dims[name][0] for name in targets)
    return per_token * workload.tokens


def boundary_bytes(shape: ModelShape, workload: Workload) -> int:
    """Bytes crossing a stage boundary per micro-batch in one direction (activation or its gradient)."""
    return workload.tokens * shape.hidden_size * workload.wire_bytes


def reserve_bytes(kind: str, tensor_bytes: float) -> float:
    """Framework reserve of one stage: a per-kind constant plus 5% of its tensors for fragmentation."""
    return _RESERVE_BASE.get(kind, _RESERVE_BASE["cuda"]) + _FRAGMENTATION * tensor_bytes


def in_flight_microbatches(workload: Workload, *, index: int, num_stages: int) -> int:
    """Micro-batches whose activations stage ``index`` holds at once.

    1F1B: stage i runs S - i warm-up forwards before its first backward, so it holds up to
    ``S - i`` (never more than M). GPipe runs all M forwards first, so every stage holds M.
    """
    m = workload.gradient_accumulation_steps
    if workload.schedule == "gpipe":
        return m
    return max(1, min(num_stages - index, m))


# ---------------------------------------------------------------------------- time pieces


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


# ---------------------------------------------------------------------------- one stage


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
        base = _RESERVE_BASE.get(self.kind, _RESERVE_BASE["cuda"])
        room = (self.capacity_bytes - base) / (1 + _FRAGMENTATION) - self.fixed_bytes
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


# ---------------------------------------------------------------------------- config helpers


def _getter(obj: Any):
    if isinstance(obj, Mapping):
        return obj.get
    return lambda key: getattr(obj, key, None)


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.lower() in ("true", "1", "yes", "auto")
    return bool(value)


def _dtype_bytes(name: Any) -> int:
    sizes = {
        "fp32": 4,
        "float32": 4,
        "float": 4,
        "bf16": 2,
        "bfloat16": 2,
        "fp16": 2,
        "float16": 2,
        "half": 2,
    }
    key = str(name).lower().removeprefix("torch.")
    if key not in sizes:
        raise ShardpoolError(f"wire_dtype {name!r} is unknown; use fp32, bf16 or fp16")
    return sizes[key]
