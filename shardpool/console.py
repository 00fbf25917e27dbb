"""What ``shardpool finetune`` shows: the placement, the training progress, the result.

Progress is a live bar on a terminal, and one plain log line per logged step where stdout is a
file or a pipe (nohup, Slurm, CI), which cannot redraw a bar. Display only: everything here
reads plain values it is given and writes nothing but the console.

With ``finetune --json``, :class:`RunEvents` writes the run's events as JSON lines on stdout (plan,
step, eval, checkpoint, done, error) and everything meant for people goes to stderr.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TextIO

from rich.console import Console
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from shardpool.config import Config
from shardpool.contract.job import StagePlacement
from shardpool.launch.run import RunRecord, is_logged_step

__all__ = [
    "RunEvents",
    "RunProgress",
    "StepLog",
    "TrainingProgress",
    "format_sample_lines",
    "format_step_line",
    "print_placement",
    "print_result",
    "print_table",
    "training_progress",
    "wants_progress_bar",
]

_LEFT_COLUMNS = {"stage", "replica", "device", "host", "layers"}
#: Wider than any table: the room a table is measured in when the output has no width of its own.
_UNBOUNDED_WIDTH = 100_000


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` whole: within the terminal's width on a terminal, at its natural width elsewhere.

    A file or a pipe (``shardpool plan > plan.txt``, ``| less``) has no width of its own, and rich
    would fit the table into 80 columns, cutting ``rtx3090`` to ``rtx30…``.
    """
    if console.is_terminal:
        console.print(table)
        return
    natural = Measurement.get(console, console.options.update_width(_UNBOUNDED_WIDTH), table).maximum
    if natural > console.width:
        table = copy.copy(table)
        table.width = natural
    console.print(table, crop=False)


def print_placement(
    console: Console,
    config: Config,
    *,
    model_name: str,
    num_layers: int,
    placements: list[StagePlacement],
    footprints: list[tuple[int, float]],
    predicted_ms: list[float | None],
    total_steps: int,
    rows: tuple[int, int],
    shares: list[int] | None = None,
) -> None:
    """The placement table (each stage's device, layers, size and predicted time) and the step shape.

    ``footprints`` holds each stage's (parameters, NF4 MiB); ``rows`` the train and eval row counts.
    With ``shares`` the placements are a data-parallel run's replicas, each holding the whole model
    and training its share of the step's micro-batches.
    """
    table = Table(title=f"placement of {model_name} ({num_layers} layers)")
    first = "replica" if shares else "stage"
    for column in (first, "device", "host", "layers", "parameters", "NF4 MiB", "predicted ms/mb"):
        table.add_column(column, justify="left" if column in _LEFT_COLUMNS else "right")
    last = len(placements) - 1
    whole = bool(shares)  # a replica holds both ends
    for index, (placement, (params, mib), predicted) in enumerate(
        zip(placements, footprints, predicted_ms, strict=True)
    ):
        extras = (["embed"] if whole or index == 0 else []) + (
            ["norm+lm_head"] if whole or index == last else []
        )
        layers = f"[{placement.start}, {placement.stop})" + (f" +{'+'.join(extras)}" if extras else "")
        if shares:
            layers += f" × {shares[index]} mb"
        shown = "-" if predicted is None else f"{predicted:.1f}"
        table.add_row(
            str(index), placement.device, placement.host, layers, f"{params:,}", f"{mib:.2f}", shown
        )
    print_table(console, table)
    replicas = config.shardpool.replicas
    shape = (
        f"data parallel: {len(shares)} replicas on shares {' / '.join(map(str, shares))}"
        if shares
        else f"{replicas} replica{'s' if replicas > 1 else ''}, schedule {config.shardpool.schedule}"
    )
    console.print(
        f"{total_steps} steps × {config.gradient_accumulation_steps} micro-batches of "
        f"{config.micro_batch_size} × {shape}, "
        + (f"{rows[0] // 2} preference pairs" if config.rl else f"{rows[0]} train rows, {rows[1]} eval rows")
    )


class TrainingProgress:
    """The progress bar of a run (steps done, last loss, tokens per second, time left), as a context."""

    def __init__(self, console: Console, *, total_steps: int, first_step: int) -> None:
        columns = (
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeRemainingColumn(),
        )
        self._progress = Progress(*columns, console=console, transient=False)
        self._total_steps, self._first_step = total_steps, first_step
        self._task: Any = None

    def __enter__(self) -> TrainingProgress:
        self._progress.__enter__()
        self._task = self._progress.add_task(
            "train", total=self._total_steps, completed=self._first_step, loss="-", tps="-"
        )
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._progress.__exit__(kind, error, traceback)

    def step(self, event: dict[str, Any]) -> None:
        """Advance to a ``step`` event's step and show its loss and throughput."""
        margin = (event.get("preference") or {}).get("rewards/margins")
        self._progress.update(
            self._task,
            completed=event["step"],
            loss=f"{event['loss']:.4f}" + ("" if margin is None else f" margin {margin:+.4f}"),
            tps=f"{event['tokens_per_s']:.0f}",
        )

    def say(self, line: str) -> None:
        """Print a line above the bar."""
        self._progress.console.print(line)


class StepLog:
    """Training progress as plain lines, one per logged step, for output that is not a terminal."""

    def __init__(self, console: Console, *, total_steps: int, logging_steps: int) -> None:
        self._console = console
        self._total_steps, self._logging_steps = total_steps, logging_steps
        self._seconds, self._steps_timed = 0.0, 0

    def __enter__(self) -> StepLog:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None

    def step(self, event: dict[str, Any]) -> None:
        """Time a ``step`` event, and print its line when it is a logged step (as in metrics.jsonl)."""
        self._seconds += event["step_seconds"]
        self._steps_timed += 1
        step = event["step"]
        if not is_logged_step(step, self._logging_steps, self._total_steps):
            return
        eta = (self._total_steps - step) * self._seconds / self._steps_timed
        line = format_step_line(
            step,
            self._total_steps,
            loss=event["loss"],
            learning_rate=event["learning_rate"],
            tokens_per_s=event["tokens_per_s"],
            eta_seconds=eta,
            preference=event.get("preference"),
        )
        self.say(line)

    def say(self, line: str) -> None:
        """Print a line as it is (no markup, no wrapping)."""
        self._console.print(line, markup=False, highlight=False, soft_wrap=True)


def format_step_line(
    step: int,
    total_steps: int,
    *,
    loss: float,
    learning_rate: float,
    tokens_per_s: float,
    eta_seconds: float,
    preference: dict[str, float] | None = None,
) -> str:
    """One step's log line: ``step 2/3  loss 2.3457  lr 1.00e-02  512 tok/s  eta 0:00:04``; a
    preference step adds TRL's mean reward margin and accuracy after the loss
    (``loss 0.6812  margin +0.1234  acc 0.75``)."""
    eta = int(round(max(eta_seconds, 0.0)))
    hours, rest = divmod(eta, 3600)
    rewards = ""
    if preference and "rewards/margins" in preference:
        rewards = f"  margin {preference['rewards/margins']:+.4f}  acc {preference['rewards/accuracies']:.2f}"
    return (
        f"step {step}/{total_steps}  loss {loss:.4f}{rewards}  lr {learning_rate:.2e}  "
        f"{tokens_per_s:.0f} tok/s  eta {hours}:{rest // 60:02d}:{rest % 60:02d}"
    )


#: The most characters of a prompt, and of a completion, that a sample's console line shows.
_SAMPLE_CHARS = 60


def format_sample_lines(line: dict[str, Any]) -> list[str]:
    """A ``samples`` metrics line as one console line per sample:
    ``sample 1/2 @ step 3: 'Once upon a' → ' time there was'``, each text cut to 60 characters
    (its ``repr``, so line breaks show as ``\\n``); a sample without text shows its token ids."""
    samples = line["samples"]
    shown = []
    for number, sample in enumerate(samples, start=1):
        prompt = _cut(sample["prompt"]) if sample["prompt"] is not None else "?"
        completion = (
            _cut(sample["completion"]) if sample["completion"] is not None else f"ids {sample['token_ids']}"
        )
        shown.append(f"sample {number}/{len(samples)} @ step {line['step']}: {prompt} → {completion}")
    return shown


def _cut(text: str) -> str:
    return repr(text if len(text) <= _SAMPLE_CHARS else text[: _SAMPLE_CHARS - 1] + "…")


def wants_progress_bar(*, is_terminal: bool, is_dumb_terminal: bool) -> bool:
    """Whether to show a live bar: only on a terminal that can redraw it (not a file, pipe or TERM=dumb)."""
    return is_terminal and not is_dumb_terminal


class RunProgress(Protocol):
    """How a run's progress is shown, as a context: step events in, lines said above or between them."""

    def __enter__(self) -> RunProgress: ...
    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...
    def step(self, event: dict[str, Any]) -> None: ...
    def say(self, line: str) -> None: ...


def training_progress(
    console: Console, *, total_steps: int, first_step: int, logging_steps: int
) -> RunProgress:
    """The progress bar on a terminal, else a plain line per logged step (see :func:`wants_progress_bar`)."""
    if wants_progress_bar(is_terminal=console.is_terminal, is_dumb_terminal=console.is_dumb_terminal):
        return TrainingProgress(console, total_steps=total_steps, first_step=first_step)
    return StepLog(console, total_steps=total_steps, logging_steps=logging_steps)


def print_result(console: Console, config: Config, record: RunRecord) -> None:
    """The eval loss before and after (or the last train loss), and how to load the adapter."""
    if record.eval_before is not None and record.eval_after is not None:
        console.print(f"eval loss: {record.eval_before:.4f} before → {record.eval_after:.4f} after")
    elif record.last_loss is not None:
        console.print(f"final train loss: {record.last_loss:.4f} (no eval split: set val_set_size)")
    console.print(f"adapter written to {Path(config.output_dir)}; load it with:")
    console.print(
        "\n".join(f"    {line}" for line in _loading_snippet(config)),
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


def _loading_snippet(config: Config) -> list[str]:
    """Python that loads the base model as shardpool trained on it, with the adapter on top."""
    dtype = config.compute_dtype_name
    quant = config.adapter == "qlora"
    snippet = [
        "import torch",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM" + (", BitsAndBytesConfig" if quant else ""),
    ]
    if quant:
        kwargs = config.bnb_config_kwargs
        snippet.append(
            f'bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="{kwargs.bnb_4bit_quant_type}", '
            f"bnb_4bit_use_double_quant={kwargs.bnb_4bit_use_double_quant}, bnb_4bit_compute_dtype=torch.{dtype})"
        )
    load_args = f'"{config.base_model}", dtype=torch.{dtype}' + (", quantization_config=bnb" if quant else "")
    snippet.append(f"base = AutoModelForCausalLM.from_pretrained({load_args})")
    snippet.append(f'model = PeftModel.from_pretrained(base, "{Path(config.output_dir)}")')
    return snippet


class RunEvents:
    """A run's events as JSON lines on ``stream``: one object a line, flushed at once; None writes nothing.

    Every object has ``event`` (``plan``, ``step``, ``eval``, ``samples``, ``checkpoint``, ``rebalance``,
    ``rebalance_held``, ``member_lost``, ``member_joined``, ``replan``, ``done`` or ``error``)
    and plain JSON values: a loss that is NaN or infinite (a diverging run) is written as null.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream

    @property
    def enabled(self) -> bool:
        """Whether events are written anywhere."""
        return self._stream is not None

    def emit(self, event: str, **fields: Any) -> None:
        """Write one event with ``fields``."""
        if self._stream is None:
            return
        self._stream.write(json.dumps({"event": event, **_plain(fields)}, allow_nan=False) + "\n")
        self._stream.flush()


def _plain(value: Any) -> Any:
    """``value`` with every non-finite float as None, so any JSON reader accepts it."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    return value
