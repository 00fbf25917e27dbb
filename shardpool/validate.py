"""``shardpool validate CONFIG``: everything a run checks before it starts, in seconds, without torch.

It reads the config (every problem at once), the base model's ``config.json`` (the architecture,
the stage count), and every dataset: each row is read, checked and tokenized exactly as training
does (:mod:`shardpool.data.prepare`), with the model's ``tokenizer.json`` read by ``tokenizers``
(:mod:`shardpool.data.tokenizer_file`), so neither torch nor the model's weights are loaded. It
reports the rows, the tokens per row and how many rows ``sequence_len`` truncates. A problem is
the same one line ``shardpool finetune`` would stop at.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from shardpool.config import Config, load_config
from shardpool.data.hub import with_local_sources
from shardpool.data.prepare import configure_tokenizer, samples_per_dataset, split_samples
from shardpool.data.tokenizer_file import load_tokenizer_file
from shardpool.model.shape import check_sequence_len, check_stage_count, read_model_info

__all__ = ["Validation", "validate_config", "validation_lines"]


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


def validate_config(config_path: str | Path) -> Validation:
    """Check the config, its model directory and its datasets as ``finetune`` would; raise ShardpoolError else."""
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
