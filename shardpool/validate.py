"""``shardpool validate CONFIG``: everything a run checks before it starts, in seconds, without torch.

It reads the config (every problem at once), the base model's ``config.json`` (the architecture,
the stage count), and every dataset: each row is read, checked and tokenized exactly as training
does (:mod:`shardpool.data.prepare`), with the model's ``tokenizer.json`` read by ``tokenizers``
(:mod:`shardpool.data.tokenizer_file`), so neither torch nor the model's weights are loaded. It
reports the rows, the tokens per row and how many rows ``sequence_len`` truncates; for a preference
run (``rl``) the pairs (:func:`shardpool.data.prepare.preference_pairs`), the tokens per sequence and
how many rows are left out because they do not fit ``sequence_len``. A problem is the same one line
``shardpool finetune`` would stop at.

``--show N`` prints the first N rows of each dataset as the model sees them
(:mod:`shardpool.data.show`): the text with its trained spans in green on a terminal and between
``⟦`` and ``⟧`` anywhere else (a pipe, a file, ``NO_COLOR``), or with ``--json`` one JSON object
a line; a preference dataset's first N pairs, each as its chosen and its rejected sequence.
Nothing is trained and nothing is written.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardpool.config import Config, load_config
from shardpool.data.hub import with_local_sources
from shardpool.data.prepare import (
    configure_tokenizer,
    preference_pairs,
    samples_per_dataset,
    split_samples,
)
from shardpool.data.rows import Sample
from shardpool.data.show import (
    CLOSING,
    OPENING,
    ShownRow,
    dataset_kind,
    marked_text,
    shown_pairs,
    shown_rows,
)
from shardpool.data.tokenizer_file import load_tokenizer_file
from shardpool.errors import ShardpoolError
from shardpool.model.shape import check_sequence_len, check_stage_count, read_model_info

__all__ = [
    "DataCounts",
    "Validation",
    "print_shown_rows",
    "run_validate",
    "show_count",
    "shown_row_header",
    "validate_config",
    "validation_lines",
]


@dataclass(frozen=True)
class DataCounts:
    """What a config's datasets amount to: the rows per dataset, the split, the tokens per row.

    ``tokens_per_row`` counts before ``sequence_len`` cuts. For a preference run (``rl``) a row is a
    pair: ``rows_per_dataset`` counts pairs, ``tokens_per_row`` has each chosen and rejected
    sequence, ``truncated_rows`` counts sequences, and ``dropped_rows`` the rows left out because
    they do not fit ``sequence_len`` (``left_out_per_dataset`` per dataset).
    """

    rows_per_dataset: list[int]
    train_rows: int
    eval_rows: int
    tokens_per_row: list[int]
    truncated_rows: int
    dropped_rows: int
    shown: tuple[ShownRow, ...] = ()
    left_out_per_dataset: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Validation:
    """What a valid config amounts to: the model and the data."""

    config_path: Path
    config: Config
    model_type: str
    num_layers: int
    max_position_embeddings: int
    data: DataCounts


def validate_config(config_path: str | Path, *, show: int = 0) -> Validation:
    """Check the config, its model directory and its datasets as ``finetune`` would; raise ShardpoolError else.

    ``show`` rows (pairs) of each dataset are kept as the model sees them (:attr:`DataCounts.shown`).
    """
    as_written = load_config(config_path)
    config = with_local_sources(as_written)  # hub ids: from the Hugging Face cache (or the hub)
    model = read_model_info(config.base_model)
    check_stage_count(config, model)
    check_sequence_len(config, model)
    tokenizer = load_tokenizer_file(config.base_model)
    configure_tokenizer(config, tokenizer)
    counts = _pair_counts if config.rl is not None else _row_counts
    return Validation(
        config_path=Path(config_path),
        config=as_written,
        model_type=model.shape.model_type,
        num_layers=model.num_layers,
        max_position_embeddings=model.shape.max_position_embeddings,
        data=counts(config, tokenizer, show),
    )


def _row_counts(config: Config, tokenizer: Any, show: int) -> DataCounts:
    """A supervised run's data: every row tokenized, truncated and split as training does."""
    per_dataset = samples_per_dataset(config, tokenizer)
    samples = [sample for dataset in per_dataset for sample in dataset]
    split = split_samples(config, samples)
    return DataCounts(
        rows_per_dataset=[len(dataset) for dataset in per_dataset],
        train_rows=len(split.train),
        eval_rows=len(split.eval),
        tokens_per_row=[len(sample.input_ids) for sample in samples],
        truncated_rows=split.truncated_rows,
        dropped_rows=split.dropped_rows,
        shown=tuple(shown_rows(config, tokenizer, per_dataset, show)) if show else (),
    )


def _pair_counts(config: Config, tokenizer: Any, show: int) -> DataCounts:
    """A preference run's data: every dataset's pairs as training makes them, each sequence's tokens
    counted from its text (:func:`shardpool.data.show.shown_pairs`, which also checks the ids)."""
    per_dataset: list[list[tuple[Sample, Sample]]] = []
    left_out: list[int] = []
    for index, spec in enumerate(config.datasets):
        pairs, count = preference_pairs(config, spec, index, tokenizer)
        per_dataset.append(pairs)
        left_out.append(count)
    total = sum(len(pairs) for pairs in per_dataset)
    if not total:
        raise ShardpoolError(
            f"no preference row fits sequence_len {config.sequence_len}; raise sequence_len or shorten the rows"
        )
    sequences = shown_pairs(config, tokenizer, per_dataset, max(len(pairs) for pairs in per_dataset))
    shown = [
        sequence
        for index in range(len(per_dataset))
        for sequence in [s for s in sequences if s.dataset == index][: 2 * show]
    ]
    return DataCounts(
        rows_per_dataset=[len(pairs) for pairs in per_dataset],
        train_rows=total,
        eval_rows=0,
        tokens_per_row=[sequence.tokens for sequence in sequences],
        truncated_rows=sum(sequence.tokens > config.sequence_len for sequence in sequences),
        dropped_rows=sum(left_out),
        shown=tuple(shown),
        left_out_per_dataset=left_out,
    )


def validation_lines(result: Validation) -> list[str]:
    """What ``shardpool validate`` prints for a valid config, one fact a line."""
    config = result.config
    lines = [
        f"{result.config_path}: valid",
        f"model {config.base_model}: {result.model_type}, {result.num_layers} layers, "
        f"max_position_embeddings {result.max_position_embeddings}",
    ]
    lines += (_pair_lines if config.rl is not None else _row_lines)(config, result.data)
    return lines


def _pair_lines(config: Config, data: DataCounts) -> list[str]:
    """The data lines of a preference run: pairs per dataset, rows left out, tokens per sequence."""
    lines = []
    for index, (spec, count, left_out) in enumerate(
        zip(config.datasets, data.rows_per_dataset, data.left_out_per_dataset, strict=True)
    ):
        but = f", {left_out} rows left out" if left_out else ""
        lines.append(f"datasets[{index}] {spec.path}: {count} pairs ({dataset_kind(spec)}){but}")
    lengths = data.tokens_per_row
    rows = data.train_rows + data.dropped_rows
    return [
        *lines,
        f"pairs: {data.train_rows} (rl: {config.rl}), {len(lengths)} sequences (chosen and rejected)",
        _tokens_line("sequence", lengths),
        f"truncated at sequence_len {config.sequence_len}: {data.truncated_rows} of {len(lengths)} sequences",
        f"left out (do not fit sequence_len): {data.dropped_rows} of {rows} rows",
    ]


def _row_lines(config: Config, data: DataCounts) -> list[str]:
    """The data lines of a supervised run: rows per dataset, the split, tokens per row, truncation."""
    lengths = data.tokens_per_row
    rows = len(lengths)
    lines = []
    for index, (spec, count) in enumerate(zip(config.datasets, data.rows_per_dataset, strict=True)):
        lines.append(f"datasets[{index}] {spec.path}: {count} rows ({dataset_kind(spec)})")
    lines += [
        f"rows: {rows} ({data.train_rows} train, {data.eval_rows} eval)",
        _tokens_line("row", lengths),
        f"truncated at sequence_len {config.sequence_len}: {data.truncated_rows} of {rows} rows",
    ]
    if data.dropped_rows:
        lines.append(f"dropped (no trainable token within sequence_len): {data.dropped_rows} of {rows} rows")
    return lines


def _tokens_line(what: str, lengths: list[int]) -> str:
    """``tokens per row: min 46, median 56, max 64``."""
    return f"tokens per {what}: min {min(lengths)}, median {statistics.median(lengths):g}, max {max(lengths)}"


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
    """The line above a shown row: which row it is (and which sequence of its pair) and how many of
    its tokens the model sees and trains."""
    cut = f", cut to {sequence_len} by sequence_len" if row.tokens > sequence_len else ""
    sequence = f", {row.pair}" if row.pair else ""
    return (
        f"datasets[{row.dataset}] {row.where} ({row.kind}){sequence}: {row.tokens} tokens{cut}, "
        f"{row.trained_tokens} trained"
    )


def print_shown_rows(rows: tuple[ShownRow, ...], sequence_len: int) -> None:
    """Every shown row under its header: trained text in green on a colour terminal, else between ⟦ ⟧."""
    from rich.console import Console
    from rich.text import Text

    console = Console(highlight=False, soft_wrap=True)
    colour = console.is_terminal and console.color_system is not None and not console.no_color
    how = "in green" if colour else f"between {OPENING} and {CLOSING}"
    what = (
        "pairs as the model sees them, chosen then rejected"
        if any(r.pair for r in rows)
        else "rows as the model sees them"
    )
    print(f"{what} (trained text {how}):")
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
        for row in result.data.shown:
            print(json.dumps(row.to_json(), ensure_ascii=False))
        return
    print(report)
    if count:
        print()
        print_shown_rows(result.data.shown, result.config.sequence_len)
