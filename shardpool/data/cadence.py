"""When a run evaluates and saves, and which epoch a step ends in: pure arithmetic on the step plan.

The cadence keys follow axolotl and Hugging Face: ``eval_steps`` is a step count, or below 1 a
fraction of all steps (every ``ceil(total_steps * f)``); ``evals_per_epoch`` and
``saves_per_epoch`` mean every ``ceil(steps_per_epoch / N)`` steps; ``save_steps`` is a count.
A step is due when it is a multiple of its interval. The stages and the launcher compute the same
answers from the same config, so they never exchange them.
"""

from __future__ import annotations

import math

from shardpool.config import Config

__all__ = [
    "cadence_interval",
    "config_steps_per_epoch",
    "due_steps",
    "epoch_at",
    "eval_step_set",
    "save_step_set",
    "steps_per_epoch",
]

_EPSILON = 1e-9  # 10 / 4 × 4 computed in floats may land a hair above a whole number


def steps_per_epoch(num_train_rows: int, rows_per_step: int) -> float:
    """Optimizer steps one pass over the training rows takes (fractional: leftovers carry over)."""
    return num_train_rows / rows_per_step


def config_steps_per_epoch(config: Config, num_train_rows: int, *, replicas: int) -> float:
    """:func:`steps_per_epoch` of a run of ``config``: each step reads micro-batches of every replica.

    A preference run (``rl``) holds each pair as two rows, and its micro-batches count pairs.
    """
    if config.rl is not None:
        num_train_rows //= 2
    rows_per_step = config.micro_batch_size * config.gradient_accumulation_steps * replicas
    return steps_per_epoch(num_train_rows, rows_per_step)


def epoch_at(step: int, per_epoch: float) -> float:
    """The fractional epoch at the end of ``step``, as Hugging Face logs it (``step / steps_per_epoch``)."""
    return round(step / per_epoch, 4)


def cadence_interval(
    every_steps: int | float | None,
    per_epoch: int | None,
    *,
    total_steps: int,
    epoch_steps: float,
) -> int | None:
    """Steps between two evals (or saves), from a step count or fraction, or a count per epoch; None: never."""
    if every_steps is not None:
        if every_steps < 1:
            return max(1, math.ceil(total_steps * every_steps - _EPSILON))
        return int(every_steps)
    if per_epoch is not None:
        return max(1, math.ceil(epoch_steps / per_epoch - _EPSILON))
    return None


def due_steps(interval: int | None, total_steps: int) -> frozenset[int]:
    """The steps (1-based) that are multiples of ``interval``, up to ``total_steps``."""
    if interval is None:
        return frozenset()
    return frozenset(range(interval, total_steps + 1, interval))


def eval_step_set(
    config: Config, *, total_steps: int, epoch_steps: float, num_eval_rows: int
) -> frozenset[int]:
    """The steps after which the eval loss is measured (none without an eval split)."""
    if num_eval_rows == 0:
        return frozenset()
    interval = cadence_interval(
        config.eval_steps, config.evals_per_epoch, total_steps=total_steps, epoch_steps=epoch_steps
    )
    return due_steps(interval, total_steps)


def save_step_set(config: Config, *, total_steps: int, epoch_steps: float) -> frozenset[int]:
    """The steps after which a checkpoint is saved; never the last, which writes the adapter itself."""
    interval = cadence_interval(
        config.save_steps, config.saves_per_epoch, total_steps=total_steps, epoch_steps=epoch_steps
    )
    return due_steps(interval, total_steps) - {total_steps}
