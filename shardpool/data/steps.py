"""The step plan: which training rows every micro-batch of every optimizer step reads.

The launcher and every stage process compute the same plan from the same config, so all of them
agree on the number of steps and on each micro-batch without exchanging it.
"""

from __future__ import annotations

import math
import random

from shardpool.config import Config
from shardpool.errors import ShardpoolError

__all__ = ["config_step_batches", "consecutive_pairs", "pair_rows", "step_batches"]


def config_step_batches(config: Config, num_rows: int, *, replicas: int) -> list[list[list[int]]]:
    """:func:`step_batches` for a run of ``config`` over ``num_rows`` training rows on ``replicas`` replicas.

    Each step takes ``gradient_accumulation_steps`` micro-batches per replica. A preference run
    (``rl``) holds its pairs as ``num_rows`` rows, every chosen row first and then every rejected
    one: the steps take ``micro_batch_size`` pairs per micro-batch, each micro-batch listing its
    chosen rows and then their rejected rows in the same order (:func:`pair_rows`).
    """
    if config.rl is not None:
        pairs = num_rows // 2
        return [
            [pair_rows(microbatch, pairs) for microbatch in step]
            for step in _config_steps(config, pairs, replicas=replicas)
        ]
    return _config_steps(config, num_rows, replicas=replicas)


def consecutive_pairs(num_pairs: int, per_batch: int) -> list[list[int]]:
    """The pair indices ``0 .. num_pairs - 1`` in order, ``per_batch`` to a micro-batch (the last may hold fewer)."""
    return [list(range(start, min(start + per_batch, num_pairs))) for start in range(0, num_pairs, per_batch)]


def pair_rows(pair_indices: list[int], num_pairs: int) -> list[int]:
    """The rows of the pairs ``pair_indices`` among ``num_pairs``: their chosen rows, then their rejected rows."""
    return [*pair_indices, *(num_pairs + index for index in pair_indices)]


def _config_steps(config: Config, num_rows: int, *, replicas: int) -> list[list[list[int]]]:
    return step_batches(
        num_rows,
        micro_batch_size=config.micro_batch_size,
        micro_batches_per_step=config.gradient_accumulation_steps * replicas,
        num_epochs=config.num_epochs,
        max_steps=config.max_steps,
        shuffle_each_epoch=config.shuffle_merged_datasets,
        seed=config.seed,
    )


def step_batches(
    num_rows: int,
    *,
    micro_batch_size: int,
    micro_batches_per_step: int,
    num_epochs: float,
    max_steps: int | None,
    shuffle_each_epoch: bool,
    seed: int,
) -> list[list[list[int]]]:
    """Plan every optimizer step: steps -> micro-batches -> row indices.

    The epochs form one stream of row indices: epoch 0 in row order (the rows are already in
    consumption order), each later epoch ``e`` reshuffled with ``random.Random(seed + e)`` when
    ``shuffle_each_epoch``, else in row order again. Rows left over at an epoch's end are carried
    into the next epoch's first step; only the rows after the last whole step are dropped. A
    fractional ``num_epochs`` takes ``floor(num_rows * num_epochs)`` rows of that stream, and
    ``max_steps`` caps the step count (with ``num_epochs`` infinite it alone sets it).
    """
    if micro_batch_size < 1 or micro_batches_per_step < 1:
        raise ValueError("micro_batch_size and micro_batches_per_step must be at least 1")
    per_step = micro_batch_size * micro_batches_per_step
    if num_rows < per_step:
        raise ShardpoolError(
            f"dataset has {num_rows} training rows but one step needs {per_step} "
            f"({micro_batch_size} × {micro_batches_per_step} micro-batches); lower micro_batch_size or gradient_accumulation_steps"
        )
    steps = _step_count(num_rows, per_step, num_epochs, max_steps)
    stream = _index_stream(num_rows, steps * per_step, shuffle_each_epoch, seed)
    return [
        [
            stream[start + micro * micro_batch_size : start + (micro + 1) * micro_batch_size]
            for micro in range(micro_batches_per_step)
        ]
        for start in range(0, steps * per_step, per_step)
    ]


def _step_count(num_rows: int, per_step: int, num_epochs: float, max_steps: int | None) -> int:
    if not math.isfinite(num_epochs):
        if max_steps is None:
            raise ShardpoolError("`num_epochs` is not finite and `max_steps` is unset; set one of them")
        return max_steps
    if num_epochs <= 0:
        raise ShardpoolError(f"`num_epochs` must be positive, got {num_epochs:g}; raise it")
    covered = math.floor(num_rows * num_epochs + 1e-9)  # 100 × 0.29 is 28.999…, meant as 29
    steps = covered // per_step
    if steps == 0:
        raise ShardpoolError(
            f"num_epochs {num_epochs:g} covers {covered} rows but one step needs {per_step}; raise `num_epochs`"
        )
    return steps if max_steps is None else min(steps, max_steps)


def _index_stream(num_rows: int, length: int, shuffle_each_epoch: bool, seed: int) -> list[int]:
    stream: list[int] = []
    epoch = 0
    while len(stream) < length:
        order = list(range(num_rows))
        if epoch > 0 and shuffle_each_epoch:
            random.Random(seed + epoch).shuffle(order)
        stream += order
        epoch += 1
    return stream[:length]
