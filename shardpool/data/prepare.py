"""From a config's datasets to the train and eval rows of a run, in the order they are consumed.

Every row becomes ``sequence_len`` tokens: truncated, then right-padded with the pad token (padding
never counts in the loss). With ``sample_packing`` several rows share one sequence. ``val_set_size``
holds out a seeded sample as the eval split. The training rows come out in the order they are
consumed: shuffled with ``seed``, or in file order when ``shuffle_merged_datasets`` is false.
"""

from __future__ import annotations

import logging
import math
import random
from typing import TYPE_CHECKING

from shardpool.config import Config
from shardpool.data.packing import to_rows
from shardpool.data.rows import IGNORE_INDEX, PreparedData, Sample
from shardpool.data.tokenizing import dataset_samples
from shardpool.errors import ShardpoolError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["prepare_data"]

log = logging.getLogger(__name__)


def prepare_data(config: Config, tokenizer: PreTrainedTokenizerBase) -> PreparedData:
    """Tokenize every dataset of ``config`` and cut the train and eval rows the runtime consumes.

    Order of operations: read and tokenize each file (datasets merged in config order), truncate
    to ``sequence_len`` and drop rows with nothing left to train, hold out the eval split, shuffle
    the training rows with ``seed`` (unless ``shuffle_merged_datasets: false``), then pack (if
    ``sample_packing``) and pad.
    """
    samples: list[Sample] = []
    for index, spec in enumerate(config.datasets):
        samples += dataset_samples(
            spec,
            index,
            tokenizer,
            train_on_inputs=config.train_on_inputs,
            chat_template=config.chat_template,
            chat_template_jinja=config.chat_template_jinja,
        )
    samples, dropped, truncated = _truncate(samples, config.sequence_len)
    train, evals = _split(samples, config.val_set_size, config.seed)
    if config.shuffle_merged_datasets:
        random.Random(config.seed).shuffle(train)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    packed = config.sample_packing
    return PreparedData(
        train=to_rows(train, config.sequence_len, pad_id, packed=packed),
        eval=to_rows(evals, config.sequence_len, pad_id, packed=packed),
        packed=packed,
        dropped_rows=dropped,
        truncated_rows=truncated,
    )


def _has_target(labels: list[int]) -> bool:
    """True if the loss sees a label: position 0 is never predicted (nothing comes before it)."""
    return any(label != IGNORE_INDEX for label in labels[1:])


def _truncate(samples: list[Sample], sequence_len: int) -> tuple[list[Sample], int, int]:
    """Cut samples to ``sequence_len``; drop those with no trainable label left. Returns kept, dropped, truncated."""
    kept: list[Sample] = []
    truncated = 0
    first_dropped = ""
    for sample in samples:
        if len(sample.input_ids) > sequence_len:
            truncated += 1
            sample = Sample(
                sample.input_ids[:sequence_len],
                sample.labels[:sequence_len],
                sample.attention_mask[:sequence_len],
                sample.where,
            )
        if _has_target(sample.labels):
            kept.append(sample)
        elif not first_dropped:
            first_dropped = sample.where
    dropped = len(samples) - len(kept)
    if not kept:
        raise ShardpoolError(
            f"no row has a trainable token within sequence_len {sequence_len} (first: {first_dropped}); raise `sequence_len` or shorten the prompts"
        )
    if dropped:
        log.warning(
            "dropped %d of %d rows with no trainable token within sequence_len %d (first: %s)",
            dropped,
            len(samples),
            sequence_len,
            first_dropped,
        )
    return kept, dropped, truncated


def _val_count(num_rows: int, val_set_size: float) -> int:
    """Rows to hold out: a fraction rounded half up (at least 1 when positive), or a count."""
    if val_set_size <= 0:
        return 0
    if val_set_size < 1:
        return max(1, math.floor(num_rows * val_set_size + 0.5))
    return int(val_set_size)


def _split(samples: list[Sample], val_set_size: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    """A seeded sample of rows becomes eval; both splits keep file order."""
    count = _val_count(len(samples), val_set_size)
    if count >= len(samples):
        raise ShardpoolError(
            f"val_set_size {val_set_size:g} holds out {count} of {len(samples)} rows and leaves none to train on; lower `val_set_size`"
        )
    held = set(random.Random(f"shardpool-val:{seed}").sample(range(len(samples)), count))
    train = [sample for index, sample in enumerate(samples) if index not in held]
    evals = [sample for index, sample in enumerate(samples) if index in held]
    return train, evals
