"""The events a stage process reports to its launcher: their names, their fields, their wire form.

A stage prints each event as one stdout line, :data:`EVENT_PREFIX` then a JSON object whose
``event`` key is a :class:`StageEvent`; every other line is plain log output. The agent relays
those lines and the launcher validates each one with :func:`parse_stage_event` into its closed
model, so a stage cannot smuggle an unknown event or field past either of them.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
)

from shardpool.config.schema import MAX_SAMPLE_NEW_TOKENS, MAX_SAMPLE_PROMPTS
from shardpool.contract.fields import MAX_STAGES, MAX_STEPS, MAX_WORLD_SIZE, Steps, describe_validation_error
from shardpool.contract.names import ContractError, safe_relative_name

__all__ = [
    "EVENT_PREFIX",
    "PREFERENCE_METRICS",
    "STAGE_COPY_FIGURES",
    "StageEvent",
    "ReadyEvent",
    "StepEvent",
    "EvalEvent",
    "CheckpointWrittenEvent",
    "FinalWrittenEvent",
    "StageDoneEvent",
    "SamplesEvent",
    "DoneEvent",
    "ErrorEvent",
    "StageEventModel",
    "TokenId",
    "parse_stage_event",
]

#: Stdout lines of a stage process that start with this carry one JSON event.
EVENT_PREFIX = "@shardpool "
MAX_MESSAGE_CHARS = 2000
#: A keep_state step event's per-rank figures of the step-boundary copies (:class:`StepEvent`),
#: in the order the stages gather them.
STAGE_COPY_FIGURES = ("stage_copy_s", "stage_copy_blocked_s", "stage_copy_cpu_s")


class StageEvent(str, enum.Enum):
    """The name of every event a stage process reports (the ``event`` key of its JSON lines)."""

    READY = "ready"
    STEP = "step"
    EVAL = "eval"
    CHECKPOINT_WRITTEN = "checkpoint_written"
    FINAL_WRITTEN = "final_written"
    STAGE_DONE = "stage_done"
    SAMPLES = "samples"
    DONE = "done"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _first_line(text: Any) -> Any:
    if isinstance(text, str):
        line = text.splitlines()[0] if text.strip() else text
        return line[:MAX_MESSAGE_CHARS]
    return text


#: A metric a preference step reports, named as TRL logs it: the first six for every ``rl``,
#: ``nll_loss`` for ORPO and SimPO, the log odds for ORPO.
PreferenceMetric = Literal[
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "nll_loss",
    "log_odds_ratio",
    "log_odds_chosen",
]
#: Every preference metric, in the order the last stage sums them.
PREFERENCE_METRICS: tuple[str, ...] = get_args(PreferenceMetric)

OptionalLoss = float | None
Timings = Annotated[list[float], Field(max_length=MAX_WORLD_SIZE)]
Counts = Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_WORLD_SIZE)]
#: A token id of the model's vocabulary (the stage checks it against the vocabulary's size).
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
RelativeOutput = Annotated[str, AfterValidator(lambda text: safe_relative_name(text, "output directory"))]


class ReadyEvent(_Event):
    """Rank 0 built its stage and is about to train."""

    event: Literal[StageEvent.READY]
    total_steps: Steps
    first_step: Steps


class StepEvent(_Event):
    """One optimizer step finished (rank 0); losses may be NaN or infinite when training diverges."""

    event: Literal[StageEvent.STEP]
    step: int = Field(ge=1, le=MAX_STEPS)
    epoch: float = Field(ge=0)
    loss: float
    learning_rate: float
    grad_norm: float
    tokens_per_s: float
    step_seconds: float
    stage_compute_s: Timings
    stage_wait_s: Timings
    bytes_sent: Timings
    #: Each rank's seconds in the step-end collectives (the replicas' gradient all-reduce, the global
    #: norm): where a replica that finished its share waits for the others, or a pipeline stage that
    #: finished first waits for the last backward. Not part of ``stage_wait_s`` (receives only).
    stage_sync_s: Timings | None = None
    #: Each rank's most micro-batches held in flight at once this step (activations saved for a
    #: backward): the 1F1B warm-up depth it ran, set by the plan's ``warmup_lead``.
    stage_in_flight: Counts | None = None
    #: With ``keep_state``: each rank's most recent step-boundary copy, seconds from the clones
    #: until its files were written (a member lost inside that window loses the step being copied).
    stage_copy_s: Timings | None = None
    #: With ``keep_state``: each rank's time handing its last copy over between steps (clones,
    #: waiting for the copy before), outside ``step_seconds``, and its copy thread's CPU seconds.
    stage_copy_blocked_s: Timings | None = None
    stage_copy_cpu_s: Timings | None = None
    #: At the re-balance check step only: each rank's room, the bytes it can still take on (what
    #: is free on its device less what its step peaks already take), which caps what a re-shard gives it.
    stage_room_bytes: Timings | None = None
    loss_scale: float | None = None
    skipped_step: bool = False
    #: A preference run's metrics (TRL's names, means over the step's pairs); None for SFT.
    preference: dict[PreferenceMetric, float] | None = None


class EvalEvent(_Event):
    """The eval loss after ``step`` (rank 0), at the cadence of ``eval_steps`` / ``evals_per_epoch``."""

    event: Literal[StageEvent.EVAL]
    step: int = Field(ge=1, le=MAX_STEPS)
    epoch: float = Field(ge=0)
    eval_loss: float


class CheckpointWrittenEvent(_Event):
    """Every stage's part of a checkpoint reached the launcher under ``partial`` (relative to output_dir)."""

    event: Literal[StageEvent.CHECKPOINT_WRITTEN]
    step: int = Field(ge=1, le=MAX_STEPS)
    partial: RelativeOutput
    eval_before: OptionalLoss = None


class FinalWrittenEvent(_Event):
    """Every stage's final LoRA tensors reached the launcher under ``directory`` (relative to output_dir)."""

    event: Literal[StageEvent.FINAL_WRITTEN]
    directory: RelativeOutput


class StageDoneEvent(_Event):
    """One stage process finished, with its peak memory and how its NF4 layers computed (None: none)."""

    event: Literal[StageEvent.STAGE_DONE]
    rank: int = Field(ge=0, lt=MAX_WORLD_SIZE)
    stage: int = Field(ge=0, lt=MAX_STAGES)
    peak_rss_bytes: int = Field(ge=0)
    peak_device_bytes: int | None = Field(default=None, ge=0)
    peak_device_reserved_bytes: int | None = Field(default=None, ge=0)
    nf4_backend: Literal["bitsandbytes", "torch"] | None = None
    #: Seconds this stage spent precomputing reference log-probabilities (``precompute_ref_log_probs``).
    reference_pass_s: float | None = Field(default=None, ge=0)


class SamplesEvent(_Event):
    """The greedy completions of the job's sample prompts after ``step`` (rank 0): the new token
    ids of each prompt in order, the end-of-sequence token included where one was generated."""

    event: Literal[StageEvent.SAMPLES]
    step: int = Field(ge=1, le=MAX_STEPS)
    token_ids: list[Annotated[list[TokenId], Field(max_length=MAX_SAMPLE_NEW_TOKENS)]] = Field(
        min_length=1, max_length=MAX_SAMPLE_PROMPTS
    )


class DoneEvent(_Event):
    """The run finished (rank 0), with the eval loss before and after training."""

    event: Literal[StageEvent.DONE]
    eval_before: OptionalLoss = None
    eval_after: OptionalLoss = None


class ErrorEvent(_Event):
    """A stage failed; ``message`` is one line (cut to 2,000 characters), the traceback is in its log."""

    event: Literal[StageEvent.ERROR]
    rank: int = Field(ge=0, lt=MAX_WORLD_SIZE)
    message: Annotated[str, BeforeValidator(_first_line)]


StageEventModel = Annotated[
    Union[  # noqa: UP007 - a discriminated union needs the Union spelling for older pydantic
        ReadyEvent,
        StepEvent,
        EvalEvent,
        CheckpointWrittenEvent,
        FinalWrittenEvent,
        StageDoneEvent,
        SamplesEvent,
        DoneEvent,
        ErrorEvent,
    ],
    Field(discriminator="event"),
]
_EVENTS: TypeAdapter[Any] = TypeAdapter(StageEventModel)


def parse_stage_event(raw: Any) -> Any:
    """Validate one event a stage reported (a JSON object) into its model, or raise ContractError."""
    try:
        return _EVENTS.validate_python(raw)
    except ValidationError as error:
        first = error.errors()[0]
        if first["type"] == "union_tag_invalid":
            known = ", ".join(event.value for event in StageEvent)
            named = str(first["input"].get("event"))[:40]
            raise ContractError(f"stage event: unknown event {named!r}; known: {known}") from None
        raise ContractError(describe_validation_error(error, "stage event")) from None
