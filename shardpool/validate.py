"""``shardpool validate CONFIG``: everything a run checks before it starts, in seconds, without torch.

It reads the config (every problem at once), the base model's ``config.json`` (the architecture,
the stage count), and every dataset: each row is read, checked and tokenized exactly as training
does (:mod:`shardpool.data.prepare`), with the model's ``tokenizer.json`` read by ``tokenizers``
(:mod:`shardpool.data.tokenizer_file`), so neither torch nor the model's weights are loaded. It
reports the rows, the tokens per row and how many rows ``sequence_len`` truncates. A problem is
the same one line ``shardpool finetune`` would stop at.

``--show N`` prints the first N rows of each dataset as the model sees them
(:mod:`shardpool.data.show`): the text with its trained spans in green on a terminal and between
``⟦`` and ``⟧`` anywhere else (a pipe, a file, ``NO_COLOR``), or with ``--json`` one JSON object
a line. Nothing is trained and nothing is written.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from shardpool.config import Config, load_config
from shardpool.data.hub import with_local_sources
from shardpool.data.prepare import configure_tokenizer, samples_per_dataset, split_samples
from shardpool.data.show import CLOSING, OPENING, ShownRow, marked_text, shown_rows
from shardpool.data.tokenizer_file import load_tokenizer_file
from shardpool.errors import ShardpoolError
from shardpool.model.shape import check_sequence_len, check_stage_count, read_model_info

__all__ = [
    "Validation",
    "print_shown_rows",
    "run_validate",
    "show_count",
    "shown_row_header",
    "validate_config",
    "validation_lines",
]


@dataclass(frozen=True)
class Validation:
    """What a valid config amounts to: the model, the rows, and the tokens per row (before truncation)."""

    config_path: Path
    config: Config
    model_type: str
    num_layers: int
    max_position_embeddings: int
    rows_per_dataset: list[int]
    train_rows: int
    eval_rows: int
    tokens_per_row: list[int]
    truncated_rows: int
    dropped_rows: int
    shown: tuple[ShownRow, ...] = ()


def validate_config(config_path: str | Path, *, show: int = 0) -> Validation:
    """Check the config, its model directory and its datasets as ``finetune`` would; raise ShardpoolError else.

    ``show`` rows of each dataset are kept as the model sees them (:attr:`Validation.shown`).
    """
    as_written = load_config(config_path)
    config = with_local_sources(as_written)  # hub ids: from the Hugging Face cache (or the hub)
    model = read_model_info(config.base_model)
    check_stage_count(config, model)
    check_sequence_len(config, model)
    tokenizer = load_tokenizer_file(config.base_model)
    configure_tokenizer(config, tokenizer)
    per_dataset = samples_per_dataset(config, tokenizer)
    samples = [sample for dataset in per_dataset for sample in dataset]
    split = split_samples(config, samples)
    return Validation(
        config_path=Path(config_path),
        config=as_written,
        model_type=model.shape.model_type,
        num_layers=model.num_layers,
        max_position_embeddings=model.shape.max_position_embeddings,
        rows_per_dataset=[len(dataset) for dataset in per_dataset],
        train_rows=len(split.train),
        eval_rows=len(split.eval),
        tokens_per_row=[len(sample.input_ids) for sample in samples],
        truncated_rows=split.truncated_rows,
        dropped_rows=split.dropped_rows,
        shown=tuple(shown_rows(config, tokenizer, per_dataset, show)) if show else (),
    )


def validation_lines(result: Validation) -> list[str]:
    """What ``shardpool validate`` prints for a valid config, one fact a line."""
    config = result.config
    lengths = result.tokens_per_row
    rows = len(lengths)
    lines = [
        f"{result.config_path}: valid",
        f"model {config.base_model}: {result.model_type}, {result.num_layers} layers, "
        f"max_position_embeddings {result.max_position_embeddings}",
    ]
    for index, (spec, count) in enumerate(zip(config.datasets, result.rows_per_dataset, strict=True)):
        lines.append(f"datasets[{index}] {spec.path}: {count} rows ({spec.type or 'pre-tokenized'})")
    lines += [
        f"rows: {rows} ({result.train_rows} train, {result.eval_rows} eval)",
        f"tokens per row: min {min(lengths)}, median {statistics.median(lengths):g}, max {max(lengths)}",
        f"truncated at sequence_len {config.sequence_len}: {result.truncated_rows} of {rows} rows",
    ]
    if result.dropped_rows:
        lines.append(
            f"dropped (no trainable token within sequence_len): {result.dropped_rows} of {rows} rows"
        )
    return lines


def show_count(value: str) -> int:
    """The N of ``--show N``: a whole number of rows, 1 or more; one line otherwise."""
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ShardpoolError(
            f"--show takes how many rows of each dataset to print (1 or more), got {value!r}; "
            "e.g. `shardpool validate CONFIG --show 3`"
        )
    return count


def shown_row_header(row: ShownRow, sequence_len: int) -> str:
    """The line above a shown row: which row it is and how many of its tokens the model sees and trains."""
    cut = f", cut to {sequence_len} by sequence_len" if row.tokens > sequence_len else ""
    return (
        f"datasets[{row.dataset}] {row.where} ({row.kind}): {row.tokens} tokens{cut}, "
        f"{row.trained_tokens} trained"
    )


def print_shown_rows(rows: tuple[ShownRow, ...], sequence_len: int) -> None:
    """Every shown row under its header: trained text in green on a colour terminal, else between ⟦ ⟧."""
    from rich.console import Console
    from rich.text import Text

    console = Console(highlight=False, soft_wrap=True)
    colour = console.is_terminal and console.color_system is not None and not console.no_color
    how = "in green" if colour else f"between {OPENING} and {CLOSING}"
    print(f"rows as the model sees them (trained text {how}):")
    for row in rows:
        print()
        print(shown_row_header(row, sequence_len))
        if not colour:
            print(marked_text(row).removesuffix("\n"))
        else:
            text = Text(row.text[: row.seen].removesuffix("\n"))
            for start, end in row.trained:
                text.stylize("green", start, end)
            console.print(text)
        if row.tokens > sequence_len:
            print(f"[{row.tokens - sequence_len} tokens past sequence_len {sequence_len} not shown]")


def run_validate(config_path: str, *, show: str | None, as_json: bool) -> None:
    """``shardpool validate CONFIG [--show N] [--json]``: the report, then the rows asked for.

    With ``--json`` the rows are JSON lines on stdout and the report goes to stderr.
    """
    count = show_count(show) if show is not None else 0
    if as_json and not count:
        raise ShardpoolError("--json prints the rows that --show picks; add --show N")
    result = validate_config(config_path, show=count)
    report = "\n".join(validation_lines(result))
    if as_json:
        print(report, file=sys.stderr)
        for row in result.shown:
            print(json.dumps(row.to_json(), ensure_ascii=False))
        return
    print(report)
    if count:
        print()
        print_shown_rows(result.shown, result.config.sequence_len)
