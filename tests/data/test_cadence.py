"""shardpool.data.cadence: which steps evaluate and save, and the epoch of a step, as axolotl and HF count them."""

from __future__ import annotations

import pytest

from shardpool.config import parse_config
from shardpool.data.cadence import (
    cadence_interval,
    config_steps_per_epoch,
    due_steps,
    epoch_at,
    eval_step_set,
    save_step_set,
)

BASE = {"base_model": "m", "datasets": [{"path": "d.jsonl"}], "lora_target_linear": True}


@pytest.mark.parametrize(
    ("every_steps", "per_epoch", "total_steps", "epoch_steps", "expected"),
    [
        (None, None, 10, 10.0, None),  # neither key: never
        (3, None, 10, 10.0, 3),  # a step count
        (3.0, None, 10, 10.0, 3),  # written as a float
        (0.25, None, 10, 10.0, 3),  # HF: ceil(10 x 0.25)
        (0.2, None, 10, 10.0, 2),  # 10 x 0.2 is exactly 2, not 3
        (0.01, None, 10, 10.0, 1),  # never below one step
        (None, 4, 10, 10.0, 3),  # axolotl: ceil(10 / 4)
        (None, 2, 10, 10.0, 5),
        (None, 4, 40, 10.0, 3),  # per epoch, whatever the number of epochs
        (None, 1, 7, 3.5, 4),  # leftover rows make a fractional epoch
        (None, 20, 10, 10.0, 1),  # more evals than steps: every step
    ],
)
def test_interval_table(
    every_steps: float | None,
    per_epoch: int | None,
    total_steps: int,
    epoch_steps: float,
    expected: int | None,
) -> None:
    assert (
        cadence_interval(every_steps, per_epoch, total_steps=total_steps, epoch_steps=epoch_steps) == expected
    )


def test_due_steps_are_the_multiples_up_to_the_last() -> None:
    assert due_steps(3, 10) == {3, 6, 9}
    assert due_steps(5, 10) == {5, 10}
    assert due_steps(None, 10) == frozenset()
    assert due_steps(11, 10) == frozenset()


def test_eval_steps_include_the_last_and_need_an_eval_split() -> None:
    config = parse_config({**BASE, "evals_per_epoch": 2})
    assert eval_step_set(config, total_steps=8, epoch_steps=4.0, num_eval_rows=5) == {2, 4, 6, 8}
    assert eval_step_set(config, total_steps=8, epoch_steps=4.0, num_eval_rows=0) == frozenset()
    assert eval_step_set(parse_config(BASE), total_steps=8, epoch_steps=4.0, num_eval_rows=5) == frozenset()


def test_save_steps_never_include_the_last() -> None:
    assert save_step_set(parse_config({**BASE, "saves_per_epoch": 1}), total_steps=8, epoch_steps=4.0) == {4}
    assert save_step_set(parse_config({**BASE, "save_steps": 3}), total_steps=9, epoch_steps=9.0) == {3, 6}
    assert save_step_set(parse_config(BASE), total_steps=9, epoch_steps=9.0) == frozenset()


def test_epoch_is_steps_over_steps_per_epoch() -> None:
    config = parse_config({**BASE, "micro_batch_size": 2, "gradient_accumulation_steps": 3})
    per_epoch = config_steps_per_epoch(config, 30, replicas=1)
    assert per_epoch == 5.0
    assert [epoch_at(step, per_epoch) for step in (1, 5, 7)] == [0.2, 1.0, 1.4]
    assert config_steps_per_epoch(config, 30, replicas=2) == 2.5
    assert epoch_at(1, 3.0) == 0.3333
