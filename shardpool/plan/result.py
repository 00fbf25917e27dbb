"""A pipeline plan as the planner returns it and ``plan.json`` stores it, and its table for people.

:class:`Plan` lists the stages in pipeline order (:class:`PlannedStage`: a device, its contiguous
layers and the predicted time and memory); :func:`plan_table` renders it for ``shardpool plan``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardpool.contract.schedule import MAX_LEAD
from shardpool.errors import ShardpoolError
from shardpool.plan.precision import DTYPE_BYTES, DTYPE_SHORT
from shardpool.plan.stage_costs import StageCosts
from shardpool.plan.time_model import bubble_fraction

__all__ = ["Plan", "PlannedStage", "plan_table"]

GIB = 2**30


@dataclass
class PlannedStage:
    """One pipeline stage: a device and its contiguous layers ``[start, stop)``, with predictions.

    Per micro-batch: ``predicted_ms_per_microbatch`` and ``compute_ms`` are its forward + backward
    compute (``forward_ms`` + ``backward_ms``), ``comm_ms`` its two sends on idle links, which
    overlap compute in the simulated step. ``after_step_ms`` is once per step: the replicas'
    gradient all-reduce and the optimizer step. ``measured`` says how the device's profile was
    taken (:meth:`shardpool.plan.device_facts.Measurement.to_json`); empty for a device whose speed
    was given rather than measured. ``dtype`` is the stage's compute dtype (``float32``,
    ``bfloat16``, ``float16``; :mod:`shardpool.plan.precision`) and ``dtype_reason`` why; empty
    where the plan did not choose one (the config's dtype then applies). ``nf4_backend`` is how the
    stage computes with its NF4 weights (``bitsandbytes`` or ``torch``, :mod:`shardpool.model.nf4`)
    and ``nf4_reason`` why; empty for an unquantized base or an older plan (bitsandbytes then
    applies). ``costs`` are the stage's
    affine costs at its position (:class:`~shardpool.plan.stage_costs.StageCosts`), which
    calibration re-splits (``plan.calibrate``); None in a hand-written or older ``plan.json``.
    """

    device: str
    host: str
    start: int
    stop: int
    predicted_ms_per_microbatch: float
    memory_bytes: int
    free_bytes: int
    slot: str = ""
    capacity_bytes: int = 0
    compute_ms: float = 0.0
    comm_ms: float = 0.0
    in_flight_microbatches: int = 1
    memory_breakdown: dict[str, int] = field(default_factory=dict)
    bottleneck: bool = False
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    after_step_ms: float = 0.0
    measured: dict[str, Any] = field(default_factory=dict)
    dtype: str = ""
    dtype_reason: str = ""
    nf4_backend: str = ""
    nf4_reason: str = ""
    costs: StageCosts | None = None

    @property
    def num_layers(self) -> int:
        """Number of decoder layers this stage holds."""
        return self.stop - self.start

    def to_json(self) -> dict[str, Any]:
        """This stage as a ``plan.json`` entry (``measured`` only where the device was profiled)."""
        entry: dict[str, Any] = {
            "device": self.device,
            "host": self.host,
            "layers": [self.start, self.stop],
            "slot": self.slot or self.device,
            "predicted_ms_per_microbatch": round(self.predicted_ms_per_microbatch, 3),
            "compute_ms": round(self.compute_ms, 3),
            "comm_ms": round(self.comm_ms, 3),
            "memory_bytes": self.memory_bytes,
            "free_bytes": self.free_bytes,
            "capacity_bytes": self.capacity_bytes,
            "in_flight_microbatches": self.in_flight_microbatches,
            "memory_breakdown": dict(self.memory_breakdown),
            "bottleneck": self.bottleneck,
            "forward_ms": round(self.forward_ms, 3),
            "backward_ms": round(self.backward_ms, 3),
            "after_step_ms": round(self.after_step_ms, 3),
        }
        if self.measured:
            entry["measured"] = dict(self.measured)
        if self.dtype:
            entry["dtype"] = self.dtype
            entry["dtype_reason"] = self.dtype_reason
        if self.nf4_backend:
            entry["nf4_backend"] = self.nf4_backend
            entry["nf4_reason"] = self.nf4_reason
        if self.costs is not None:
            entry["costs"] = self.costs.to_json()
        return entry

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PlannedStage:
        """Read a ``plan.json`` stage entry; only ``device`` and ``layers`` are required."""
        try:
            start, stop = (int(x) for x in data["layers"])
            device = str(data["device"])
        except (KeyError, TypeError, ValueError):
            raise ShardpoolError(
                f"plan stage {dict(data)!r} lacks 'device' or a 'layers': [start, stop] pair; fix plan.json"
            ) from None
        return cls(
            device=device,
            host=str(data.get("host", "local")),
            start=start,
            stop=stop,
            predicted_ms_per_microbatch=float(data.get("predicted_ms_per_microbatch", 0.0)),
            memory_bytes=int(data.get("memory_bytes", 0)),
            free_bytes=int(data.get("free_bytes", 0)),
            slot=str(data.get("slot", device)),
            capacity_bytes=int(data.get("capacity_bytes", 0)),
            compute_ms=float(data.get("compute_ms", 0.0)),
            comm_ms=float(data.get("comm_ms", 0.0)),
            in_flight_microbatches=int(data.get("in_flight_microbatches", 1)),
            memory_breakdown={str(k): int(v) for k, v in dict(data.get("memory_breakdown", {})).items()},
            bottleneck=bool(data.get("bottleneck", False)),
            forward_ms=float(data.get("forward_ms", 0.0)),
            backward_ms=float(data.get("backward_ms", 0.0)),
            after_step_ms=float(data.get("after_step_ms", 0.0)),
            measured=dict(measured) if isinstance(measured := data.get("measured"), Mapping) else {},
            dtype=_dtype_of(data.get("dtype", "")),
            dtype_reason=str(data.get("dtype_reason", "")),
            nf4_backend=_nf4_backend_of(data.get("nf4_backend", "")),
            nf4_reason=str(data.get("nf4_reason", "")),
            costs=StageCosts.from_json(costs) if isinstance(costs := data.get("costs"), Mapping) else None,
        )


@dataclass
class Plan:
    """A pipeline plan: stages in pipeline order and the predicted step.

    ``predicted_step_s`` is the simulated step (``plan.pipeline_sim``) over ``microbatches`` (the
    configured gradient accumulation); ``bubble_fraction`` the share of it the busiest device
    does not compute. ``recommended_microbatches`` is the smallest M that keeps the fill and
    drain under about 20% (``M >= 4 S``) while fitting in memory. ``fits`` is False only for plans built by
    :func:`evaluate_split` from a split that overflows a device. ``refused`` maps each device that may
    hold no layers of this run to the one-line reason (``shardpool.nf4_backend: bitsandbytes`` on a
    card bitsandbytes has no kernels for).
    ``calibration`` is empty for a plan from profiles; a plan re-split from measured steps
    (``plan.calibrate``) records there each stage's measured speed relative to its profile and the
    steps it was measured on.
    """

    stages: list[PlannedStage]
    predicted_step_s: float
    bubble_fraction: float
    microbatches: int
    recommended_microbatches: int
    schedule: str = "1f1b"
    num_layers: int = 0
    model: str = ""
    left_out: list[str] = field(default_factory=list)
    search: str = "exact"
    fits: bool = True
    refused: dict[str, str] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    #: A data-parallel plan's replicas, in rank order, each holding the whole model
    #: (``stages`` is then the first of them), and the step's micro-batches each trains.
    data_parallel: list[PlannedStage] = field(default_factory=list)
    shares: list[int] = field(default_factory=list)
    #: The 1F1B warm-up depth the stages run (``contract.schedule.warmup_forwards``); 1 for GPipe and
    #: for plans written before it was chosen.
    warmup_lead: int = 1

    @property
    def is_data_parallel(self) -> bool:
        """Whether this plan trains whole-model replicas on shares of the step instead of a pipeline."""
        return bool(self.shares)

    @property
    def bottleneck_ms(self) -> float:
        """Predicted milliseconds per micro-batch of the slowest stage."""
        return max(stage.predicted_ms_per_microbatch for stage in self.stages)

    @property
    def bottleneck_index(self) -> int:
        """Position of the slowest stage."""
        times = [stage.predicted_ms_per_microbatch for stage in self.stages]
        return times.index(max(times))

    def layer_ranges(self) -> list[tuple[int, int]]:
        """``[start, stop)`` of every stage, in pipeline order."""
        return [(stage.start, stage.stop) for stage in self.stages]

    def to_json(self) -> dict[str, Any]:
        """The plan in ``plan.json`` format (stages in pipeline order)."""
        return (
            {
                "stages": [stage.to_json() for stage in self.stages],
                "predicted_step_s": round(self.predicted_step_s, 6),
                "bottleneck_ms": round(self.bottleneck_ms, 3),
                "bottleneck_stage": self.bottleneck_index,
                "bubble_fraction": round(self.bubble_fraction, 6),
                "microbatches": self.microbatches,
                "recommended_microbatches": self.recommended_microbatches,
                "schedule": self.schedule,
                "warmup_lead": self.warmup_lead,
                "num_layers": self.num_layers,
                "model": self.model,
                "left_out": list(self.left_out),
                "search": self.search,
                "fits": self.fits,
                "refused": dict(self.refused),
            }
            | ({"calibration": dict(self.calibration)} if self.calibration else {})
            | (
                {
                    "shares": list(self.shares),
                    "data_parallel": [stage.to_json() for stage in self.data_parallel],
                }
                if self.shares
                else {}
            )
        )

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Plan:
        """Read a plan written by :meth:`to_json` (or a hand-written one with just stages); a
        :class:`ShardpoolError` for anything that is not one."""
        try:
            return cls._from_json(data)
        except (TypeError, ValueError, AttributeError) as error:
            raise ShardpoolError(
                f"plan.json is malformed ({type(error).__name__}: {error}); re-plan to rewrite it"
            ) from None

    @classmethod
    def _from_json(cls, data: Mapping[str, Any]) -> Plan:
        raw_stages = data.get("stages") if isinstance(data, Mapping) else None
        if not raw_stages or not isinstance(raw_stages, list):
            raise ShardpoolError("plan.json has no 'stages' list; write at least one stage")
        stages = [PlannedStage.from_json(stage) for stage in raw_stages]
        expected = 0
        for stage in stages:
            if stage.start != expected or stage.stop <= stage.start:
                raise ShardpoolError(
                    f"plan.json stage on {stage.device} has layers [{stage.start}, {stage.stop}) but the "
                    f"next stage must start at layer {expected} and hold at least one; make the ranges contiguous"
                )
            expected = stage.stop
        num_stages = len(stages)
        microbatches = int(data.get("microbatches", 1))
        replicas = [PlannedStage.from_json(stage) for stage in data.get("data_parallel") or []]
        shares = [int(share) for share in data.get("shares") or []]
        lead = int(data.get("warmup_lead", 1))
        if not 1 <= lead <= MAX_LEAD:
            raise ShardpoolError(
                f"plan.json's warmup_lead is {lead}, outside 1..{MAX_LEAD}; re-plan to rewrite it"
            )
        if len(replicas) != len(shares) or (shares and (num_stages != 1 or min(shares) < 1)):
            raise ShardpoolError(
                "plan.json's data_parallel replicas and shares do not match one stage and a share of "
                "at least 1 per replica; re-plan to rewrite it"
            )
        return cls(
            stages=stages,
            predicted_step_s=float(data.get("predicted_step_s", 0.0)),
            bubble_fraction=float(
                data.get("bubble_fraction", bubble_fraction(microbatches=microbatches, num_stages=num_stages))
            ),
            microbatches=microbatches,
            recommended_microbatches=int(data.get("recommended_microbatches", microbatches)),
            schedule=str(data.get("schedule", "1f1b")),
            num_layers=int(data.get("num_layers", expected)),
            model=str(data.get("model", "")),
            left_out=[str(x) for x in data.get("left_out", [])],
            search=str(data.get("search", "given")),
            fits=bool(data.get("fits", True)),
            refused={str(k): str(v) for k, v in dict(data.get("refused", {})).items()},
            calibration=dict(calibration)
            if isinstance(calibration := data.get("calibration"), Mapping)
            else {},
            data_parallel=replicas,
            shares=shares,
            warmup_lead=lead,
        )


def _schedule_words(plan: Plan) -> str:
    """The schedule as the plan table names it: ``1f1b``, with its warm-up lead when deeper than 1."""
    return plan.schedule if plan.warmup_lead == 1 else f"{plan.schedule}, warm-up lead {plan.warmup_lead}"


def plan_table(plan: Plan) -> Any:
    """A rich Table of the plan: one row per stage, the bottleneck marked, step time and bubble below."""
    from rich.table import Table

    caption = (
        f"ms/mb: predicted forward + backward per micro-batch. Predicted step {plan.predicted_step_s:.3f} s "
        f"with {plan.microbatches} micro-batches ({_schedule_words(plan)}), "
        f"bubble {plan.bubble_fraction:.1%}; recommended micro-batches: {plan.recommended_microbatches}"
    )
    if plan.shares:
        caption = (
            f"ms/mb: predicted forward + backward per micro-batch. Data parallel: {len(plan.shares)} "
            f"replicas of the whole model split the {plan.microbatches} micro-batches "
            f"{' / '.join(map(str, plan.shares))} and all-reduce their LoRA gradients; predicted step "
            f"{plan.predicted_step_s:.3f} s, the busiest replica idle {plan.bubble_fraction:.1%} of it"
        )
    if plan.left_out:
        caption += f"; left out: {', '.join(plan.left_out)}"
    if not plan.fits:
        caption += "; DOES NOT FIT in memory"
    for reason in plan.refused.values():
        caption += f"; refused: {reason}"
    rows = plan.data_parallel or plan.stages
    # Why a stage computes NF4 in plain PyTorch (bitsandbytes' kernels are the rule, and say nothing).
    for reason in dict.fromkeys(stage.nf4_reason for stage in rows if stage.nf4_backend == "torch"):
        caption += f"; nf4: {reason}"
    title = f"plan for {plan.model or 'the model'} ({plan.num_layers} layers, {plan.search} search)"
    table = Table(title=title, caption=caption, show_edge=False)
    nf4 = any(stage.nf4_backend == "torch" for stage in rows)  # the column only where a stage differs
    columns = (
        "#",
        "host",
        "device",
        "layers",
        "dtype",
        *(("nf4",) if nf4 else ()),
        "used GiB",
        "free GiB",
        "ms/mb",
        "",
    )
    for column in columns:
        table.add_column(
            column,
            justify="right" if "GiB" in column or "ms" in column else "left",
            no_wrap=True,
            min_width=len(column),  # a narrow terminal shortens the values, never a heading
        )
    for index, stage in enumerate(rows):
        table.add_row(
            f"r{index}" if plan.shares else str(index),
            stage.host,
            stage.slot or stage.device,
            f"[{stage.start}, {stage.stop})" + (f" × {plan.shares[index]} mb" if plan.shares else ""),
            DTYPE_SHORT.get(stage.dtype, "config"),
            *((_NF4_SHORT.get(stage.nf4_backend, "-"),) if nf4 else ()),
            f"{stage.memory_bytes / GIB:.2f}",
            f"{stage.free_bytes / GIB:.2f}",
            f"{stage.predicted_ms_per_microbatch:.1f}",
            "bottleneck" if stage.bottleneck else "",
        )
    return table


#: The plan table's names of the NF4 backends.
_NF4_SHORT = {"bitsandbytes": "bnb", "torch": "torch"}


def _dtype_of(value: Any) -> str:
    """A plan stage's ``dtype``: empty, or one of the compute dtype names; a clear error otherwise."""
    text = str(value or "")
    if text and text not in DTYPE_BYTES:
        raise ShardpoolError(f"plan stage dtype {text!r} is unknown; use one of {', '.join(DTYPE_BYTES)}")
    return text


def _nf4_backend_of(value: Any) -> str:
    """A plan stage's ``nf4_backend``: empty, ``bitsandbytes`` or ``torch``; a clear error otherwise."""
    text = str(value or "")
    if text not in ("", "bitsandbytes", "torch"):
        raise ShardpoolError(f"plan stage nf4_backend {text!r} is unknown; use bitsandbytes or torch")
    return text
