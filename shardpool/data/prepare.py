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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from shardpool.config import Config, DatasetSpec
from shardpool.data.chat import resolve_chat_template, use_config_chat_template
from shardpool.data.preference import (
    PreferenceTexts,
    chat_template_renderer,
    dpo_pairs,
    dpo_samples,
    fits_sequence_len,
    orpo_samples,
    preference_format,
    preference_texts,
)
from shardpool.data.reading import read_rows
from shardpool.data.rows import IGNORE_INDEX, PreparedData, Sample, TokenRows
from shardpool.data.special_tokens import apply_special_tokens
from shardpool.data.tokenizing import dataset_samples
from shardpool.errors import ShardpoolError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "SplitSamples",
    "configure_tokenizer",
    "preference_pairs",
    "preference_rows",
    "prepare_data",
    "samples_per_dataset",
    "split_samples",
]

log = logging.getLogger(__name__)

#: A row of a split: one sample, or a preference pair of two.
_Row = TypeVar("_Row")


def configure_tokenizer(config: Config, tokenizer: Any) -> None:
    """Apply the config's ``special_tokens`` and top-level chat template to the base model's tokenizer.

    Training and ``shardpool validate`` both call it, so they tokenize alike; the tokenizer saved
    beside the adapter carries the settings.
    """
    if config.special_tokens is not None:
        apply_special_tokens(tokenizer, config.special_tokens.as_settings(), source=config.base_model)
    use_config_chat_template(config, tokenizer)


def prepare_data(config: Config, tokenizer: PreTrainedTokenizerBase) -> PreparedData:
    """Tokenize every dataset of ``config`` and cut the train and eval rows the runtime consumes.

    Order of operations: read and tokenize each file (datasets merged in config order), truncate
    to ``sequence_len`` and drop rows with nothing left to train, hold out the eval split, shuffle
    the training rows with ``seed`` (unless ``shuffle_merged_datasets: false``), then pack (if
    ``sample_packing``) and pad.
    """
    from shardpool.data.packing import to_rows  # torch: only here, so samples are made without it

    if config.rl is not None:
        return _prepare_pairs(config, tokenizer)
    merged = [sample for samples in samples_per_dataset(config, tokenizer) for sample in samples]
    split = split_samples(config, merged)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    packed = config.sample_packing
    return PreparedData(
        train=to_rows(split.train, config.sequence_len, pad_id, packed=packed),
        eval=to_rows(split.eval, config.sequence_len, pad_id, packed=packed),
        packed=packed,
        dropped_rows=split.dropped_rows,
        truncated_rows=split.truncated_rows,
    )


def _prepare_pairs(config: Config, tokenizer: Any) -> PreparedData:
    """A preference run's rows, train and eval (``val_set_size`` holds out pairs): every pair's
    chosen sequence, then every rejected one in the same order (:func:`shardpool.data.steps.pair_rows`
    puts a pair's two rows in one micro-batch)."""
    from shardpool.data.packing import to_rows

    pairs: list[tuple[Sample, Sample]] = []
    dropped = 0
    for index, spec in enumerate(config.datasets):
        kept, left_out = preference_pairs(config, spec, index, tokenizer)
        pairs += kept
        dropped += left_out
    if not pairs:
        raise ShardpoolError(
            f"no preference row fits sequence_len {config.sequence_len}; raise sequence_len or shorten the rows"
        )
    pairs, held_out = _split(pairs, config.val_set_size, config.seed)
    if config.shuffle_merged_datasets:
        random.Random(config.seed).shuffle(pairs)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def rows(split: list[tuple[Sample, Sample]]) -> TokenRows:
        return to_rows(
            [c for c, _ in split] + [r for _, r in split], config.sequence_len, pad_id, packed=False
        )

    return PreparedData(train=rows(pairs), eval=rows(held_out), packed=False, dropped_rows=dropped)


def preference_rows(
    config: Config, spec: DatasetSpec, index: int, tokenizer: Any
) -> list[tuple[str, PreferenceTexts]]:
    """Every row of preference dataset ``datasets[index]`` (its ``file:line``) as the prompt, chosen and
    rejected text axolotl's strategy for its type makes; ``validate --show`` shows these texts."""
    assert config.rl is not None
    fmt = preference_format(spec.model_dump(exclude_none=True), config.rl)
    render = None
    if fmt.renders:
        template = resolve_chat_template(
            spec.chat_template or config.chat_template,
            spec.chat_template_jinja or config.chat_template_jinja,
            tokenizer,
        )
        render = chat_template_renderer(tokenizer, template)
    return [(where, preference_texts(row, where, fmt, render)) for where, row in read_rows(spec, index)]


def preference_pairs(
    config: Config, spec: DatasetSpec, index: int, tokenizer: Any
) -> tuple[list[tuple[Sample, Sample]], int]:
    """The (chosen, rejected) sequences of dataset ``datasets[index]``, as axolotl makes the texts
    and TRL's DPOTrainer the tokens, and how many rows were left out because they do not fit
    ``sequence_len`` (axolotl drops them)."""
    texts = preference_rows(config, spec, index, tokenizer)
    fitting = [
        (where, text) for where, text in texts if fits_sequence_len(text, tokenizer, config.sequence_len)
    ]
    if config.rl in ("orpo", "simpo"):  # TRL's ORPO and CPO trainers tokenize each row alike
        samples = [
            orpo_samples(text, tokenizer, where, max_length=config.sequence_len) for where, text in fitting
        ]
        return samples, len(texts) - len(samples)
    pairs = dpo_pairs(fitting, tokenizer, max_length=config.sequence_len) if fitting else []
    return [dpo_samples(pair, max_length=config.sequence_len) for pair in pairs], len(texts) - len(pairs)


def samples_per_dataset(config: Config, tokenizer: Any) -> list[list[Sample]]:
    """The rows of each dataset of ``config``, in config order, tokenized and masked (not truncated)."""
    return [
        dataset_samples(
            spec,
            index,
            tokenizer,
            train_on_inputs=config.train_on_inputs,
            chat_template=config.chat_template,
            chat_template_jinja=config.chat_template_jinja,
            eot_tokens=config.eot_tokens,
        )
        for index, spec in enumerate(config.datasets)
    ]


@dataclass(frozen=True)
class SplitSamples:
    """Samples truncated to ``sequence_len`` and split: ``train`` in consumption order, ``eval``.

    ``dropped_rows`` had no trainable token left; ``truncated_rows`` were cut to ``sequence_len``.
    """

    train: list[Sample]
    eval: list[Sample]
    dropped_rows: int
    truncated_rows: int


def split_samples(config: Config, samples: list[Sample]) -> SplitSamples:
    """Truncate ``samples``, drop those with nothing to train, hold out the eval split, shuffle the rest.

    Raises one line when no row is left to train on.
    """
    samples, dropped, truncated = _truncate(samples, config.sequence_len)
    train, evals = _split(samples, config.val_set_size, config.seed)
    if config.shuffle_merged_datasets:
        random.Random(config.seed).shuffle(train)
    return SplitSamples(train, evals, dropped, truncated)


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


def _split(samples: list[_Row], val_set_size: float, seed: int) -> tuple[list[_Row], list[_Row]]:
    """A seeded sample of rows (or pairs) becomes eval; both splits keep file order."""
    count = _val_count(len(samples), val_set_size)
    if count >= len(samples):
        raise ShardpoolError(
            f"val_set_size {val_set_size:g} holds out {count} of {len(samples)} rows and leaves none to train on; lower `val_set_size`"
        )
    held = set(random.Random(f"shardpool-val:{seed}").sample(range(len(samples)), count))
    train = [sample for index, sample in enumerate(samples) if index not in held]
    evals = [sample for index, sample in enumerate(samples) if index in held]
    return train, evals
