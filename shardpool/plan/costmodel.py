"""The cost model's input: :class:`Workload`, what is being trained as far as memory and time go.

A :class:`Workload` is built from a loaded :class:`~shardpool.config.Config` in exactly one place,
:meth:`Workload.from_config`; the rest of the plan package takes the typed value. The formulas
that price a workload live beside it: ``plan.memory_model`` (bytes), ``plan.time_model`` (FLOPs
and pipeline step time) and ``plan.stage_costs`` (one stage, affine in its layer count).
Numbers and assumptions are described in ``docs/planner.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from shardpool.config import Config
from shardpool.contract.schedule import MAX_LEAD
from shardpool.errors import ShardpoolError
from shardpool.model.shape import (
    ALL_DECODER_LINEAR_NAMES,
    DECODER_LINEAR_NAMES,
    decoder_linear_names,
    local_model_type,
)
from shardpool.plan.precision import NF4_SETTINGS, Cap, NF4Setting, config_cap

__all__ = ["Schedule", "Workload"]

Schedule = Literal["1f1b", "gpipe"]

#: Bytes per element of each dtype name a Config reports (``Config.compute_dtype_name`` and
#: ``Config.wire_dtype_name``).
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Workload:
    """What is being trained, as far as cost goes.

    ``gradient_accumulation_steps`` is the number of micro-batches per optimizer step (the
    pipeline's M). ``stages`` forces an exact stage count; ``max_stages`` caps it. ``replicas``
    data-parallel copies of the pipeline all-reduce their LoRA gradients every step.
    Byte sizes: ``compute_bytes`` for activations and unquantized weights (4 fp32, 2 bf16/fp16),
    ``wire_bytes`` for tensors sent between stages. ``precision`` is the config's cap
    (:mod:`shardpool.plan.precision`): when set, each stage's dtype, and so its ``compute_bytes``,
    is chosen from its device; None keeps ``compute_bytes`` for every stage. ``quantize`` says
    the base is NF4 (qlora); without it the base weights are priced in the stage's dtype.
    ``nf4_backend`` is ``shardpool.nf4_backend``: how stages compute with NF4 weights (one setting,
    or one per stage in pipeline order; :func:`~shardpool.plan.precision.choose_nf4_backend`). ``layers``
    fixes the split (decoder layers per stage, ``shardpool.layers``): the planner then chooses only
    which devices hold the stages, in which order.
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
    replicas: int = 1
    precision: Cap | None = None
    quantize: bool = True
    layers: tuple[int, ...] | None = None
    #: Whole-model replicas on several devices, each on a share of the step (``plan.data_parallel``):
    #: ``auto`` where they predict a shorter step than any pipeline, ``on`` wherever two devices
    #: hold the model, ``off`` never (``shardpool.data_parallel``; off unless a config says).
    data_parallel: Literal["auto", "on", "off"] = "off"
    #: A fixed split of the step's micro-batches over that many replicas (``shardpool.shares``).
    shares: tuple[int, ...] | None = None
    #: The 1F1B warm-up depth (:func:`~shardpool.contract.schedule.warmup_forwards`); None: the
    #: planner chooses it per plan (``shardpool.warmup_lead: auto``).
    warmup_lead: int | None = 1
    nf4_backend: NF4Setting | tuple[NF4Setting, ...] = "auto"

    def __post_init__(self) -> None:
        for name in (
            "micro_batch_size",
            "sequence_len",
            "gradient_accumulation_steps",
            "compute_bytes",
            "wire_bytes",
            "replicas",
        ):
            if getattr(self, name) <= 0:
                raise ShardpoolError(f"{name} is {getattr(self, name)}; it must be positive")
        if self.lora_r < 0:
            raise ShardpoolError(f"lora_r is {self.lora_r}; it must be zero or positive")
        unknown = sorted(set(self.lora_targets) - set(ALL_DECODER_LINEAR_NAMES))
        if unknown:
            raise ShardpoolError(
                f"lora target modules {unknown} are not Linear modules of a decoder layer; "
                f"choose from {', '.join(ALL_DECODER_LINEAR_NAMES)}"
            )
        if self.schedule not in ("1f1b", "gpipe"):
            raise ShardpoolError(f"schedule {self.schedule!r} is unknown; use '1f1b' or 'gpipe'")
        if self.warmup_lead is not None and not 1 <= self.warmup_lead <= MAX_LEAD:
            raise ShardpoolError(
                f"shardpool.warmup_lead is {self.warmup_lead}; give 1 to {MAX_LEAD}, or auto to let the planner choose"
            )
        for name in ("max_stages", "stages"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ShardpoolError(f"shardpool.{name} is {value}; it must be positive")
        if self.layers is not None and (not self.layers or min(self.layers) < 1):
            raise ShardpoolError(f"shardpool.layers is {list(self.layers)}; give at least 1 layer per stage")
        settings = self.nf4_backend if isinstance(self.nf4_backend, tuple) else (self.nf4_backend,)
        if not settings or any(setting not in NF4_SETTINGS for setting in settings):
            raise ShardpoolError(
                f"shardpool.nf4_backend is {self.nf4_backend!r}; use {', '.join(NF4_SETTINGS)} or a list of them"
            )
        if self.shares is not None and (
            len(self.shares) < 2 or min(self.shares) < 1 or sum(self.shares) != self.step_microbatches
        ):
            raise ShardpoolError(
                f"shardpool.shares is {list(self.shares)}; give at least 2 replicas, each at least 1 "
                f"micro-batch, adding up to the step's {self.step_microbatches}"
            )

    @property
    def step_microbatches(self) -> int:
        """Micro-batches in one optimizer step, over all replicas."""
        return self.gradient_accumulation_steps * self.replicas

    @property
    def lead(self) -> int:
        """The 1F1B warm-up lead the stages run: the chosen one, else (auto, before the planner chose) 1."""
        return self.warmup_lead or 1

    @property
    def tokens(self) -> int:
        """Tokens in one micro-batch."""
        return self.micro_batch_size * self.sequence_len

    def nf4_setting(self, stage: int) -> NF4Setting:
        """``shardpool.nf4_backend`` for pipeline stage ``stage``: the one setting, or its entry of the list."""
        if isinstance(self.nf4_backend, tuple):
            return self.nf4_backend[stage]
        return self.nf4_backend

    def profile_key(self) -> str:
        """What a per-layer profile depends on (cache key part); an unquantized base (``-fp``) times
        another layer than an NF4 one."""
        targets = ",".join(sorted(self.lora_targets))
        return (
            f"mb{self.micro_batch_size}-seq{self.sequence_len}-r{self.lora_r}-[{targets}]"
            f"-gc{int(self.gradient_checkpointing)}-dt{self.compute_bytes}{'' if self.quantize else '-fp'}"
        )

    def profile_request(self) -> dict[str, Any]:
        """The fields a layer profile depends on (those of :meth:`profile_key`), as JSON for a member's
        ``POST /v1/devices``.

        Planner-only fields (``stages``, ``replicas``, ...) stay with the launcher: an agent rejects
        workload fields it does not know, so a member whose agent predates a planner field still
        answers, and the profile does not depend on them anyway.
        """
        request: dict[str, Any] = {
            "micro_batch_size": self.micro_batch_size,
            "sequence_len": self.sequence_len,
            "lora_r": self.lora_r,
            "lora_targets": list(self.lora_targets),
            "gradient_checkpointing": self.gradient_checkpointing,
            "compute_bytes": self.compute_bytes,
        }
        if not self.quantize:  # only then: the request of a qlora run is the one older agents took
            request["quantize"] = False
        return request

    @classmethod
    def from_config(cls, config: Config) -> Workload:
        """The workload of a loaded shardpool config: its batch shape, LoRA, dtypes and schedule.

        This is the one place the plan package reads a Config's training fields. Only an
        explicit ``shardpool.stages`` binds the stage count; ``devices`` alone does not.
        """
        if config.lora_target_linear or not config.lora_target_modules:
            targets = decoder_linear_names(local_model_type(config.base_model) or "llama")
        else:
            targets = tuple(config.lora_target_modules)
        return cls(
            micro_batch_size=config.micro_batch_size,
            sequence_len=config.sequence_len,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            lora_r=config.lora_r,
            lora_targets=targets,
            gradient_checkpointing=config.gradient_checkpointing,
            schedule=config.shardpool.schedule,
            compute_bytes=_DTYPE_BYTES[config.compute_dtype_name],
            wire_bytes=_DTYPE_BYTES[config.wire_dtype_name],
            stages=config.shardpool.stages,
            replicas=config.shardpool.replicas,
            precision=config_cap(config.bf16, config.fp16),
            quantize=config.adapter == "qlora",
            layers=tuple(config.shardpool.layers) if config.shardpool.layers else None,
            data_parallel=config.shardpool.data_parallel,
            shares=tuple(config.shardpool.shares) if config.shardpool.shares else None,
            warmup_lead=None if config.shardpool.warmup_lead == "auto" else config.shardpool.warmup_lead,
            nf4_backend=tuple(backend)
            if isinstance(backend := config.shardpool.nf4_backend, list)
            else backend,
        )
