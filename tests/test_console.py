"""What ``shardpool finetune`` prints while training: a live bar on a terminal, plain log lines elsewhere."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from shardpool.console import (
    StepLog,
    TrainingProgress,
    format_step_line,
    training_progress,
    wants_progress_bar,
)
from shardpool.launch.run import is_logged_step


@pytest.mark.parametrize(
    ("is_terminal", "is_dumb_terminal", "bar"),
    [(True, False, True), (False, False, False), (True, True, False), (False, True, False)],
)
def test_a_bar_only_on_a_terminal_that_can_redraw_it(
    is_terminal: bool, is_dumb_terminal: bool, bar: bool
) -> None:
    assert wants_progress_bar(is_terminal=is_terminal, is_dumb_terminal=is_dumb_terminal) is bar


def test_step_line_format() -> None:
    line = format_step_line(2, 3, loss=2.34567, learning_rate=0.01, tokens_per_s=512.4, eta_seconds=3.6)
    assert line == "step 2/3  loss 2.3457  lr 1.00e-02  512 tok/s  eta 0:00:04"
    line = format_step_line(
        40, 1500, loss=float("nan"), learning_rate=1.6667e-05, tokens_per_s=12345.6, eta_seconds=3725.2
    )
    assert line == "step 40/1500  loss nan  lr 1.67e-05  12346 tok/s  eta 1:02:05"
    assert format_step_line(3, 3, loss=1, learning_rate=0, tokens_per_s=0, eta_seconds=-0.1).endswith(
        "eta 0:00:00"
    )


def test_logged_steps_are_every_nth_and_the_last() -> None:
    assert [step for step in range(1, 8) if is_logged_step(step, 3, 7)] == [3, 6, 7]
    assert [step for step in range(1, 4) if is_logged_step(step, 1, 3)] == [1, 2, 3]


def _step(step: int, *, seconds: float = 1.0) -> dict[str, Any]:
    return {
        "event": "step",
        "step": step,
        "loss": 2.0 / step,
        "learning_rate": 1e-3,
        "tokens_per_s": 100.0,
        "step_seconds": seconds,
    }


def test_not_a_terminal_gets_one_plain_line_per_logged_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    out = io.StringIO()
    console = Console(file=out, width=40)
    with training_progress(console, total_steps=5, first_step=0, logging_steps=2) as progress:
        assert isinstance(progress, StepLog)
        for step in range(1, 6):
            progress.step(_step(step, seconds=5.0 if step == 1 else 1.0))
            if step == 2:
                progress.say("checkpoint saved: out/[step-2]")
    assert out.getvalue().splitlines() == [
        "step 2/5  loss 1.0000  lr 1.00e-03  100 tok/s  eta 0:00:09",
        "checkpoint saved: out/[step-2]",
        "step 4/5  loss 0.5000  lr 1.00e-03  100 tok/s  eta 0:00:02",
        "step 5/5  loss 0.4000  lr 1.00e-03  100 tok/s  eta 0:00:00",
    ]


def test_a_terminal_keeps_the_progress_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERM", "xterm-256color")
    console = Console(file=io.StringIO(), force_terminal=True)
    assert isinstance(
        training_progress(console, total_steps=3, first_step=0, logging_steps=1), TrainingProgress
    )
    monkeypatch.setenv("TERM", "dumb")
    console = Console(file=io.StringIO(), force_terminal=True)
    assert isinstance(training_progress(console, total_steps=3, first_step=0, logging_steps=1), StepLog)


def test_a_preference_step_line_shows_the_mean_reward_margin_and_accuracy() -> None:
    line = format_step_line(
        4, 6, loss=0.68123, learning_rate=1e-3, tokens_per_s=90, eta_seconds=2,
        preference={"rewards/margins": 0.12345, "rewards/accuracies": 0.75, "rewards/chosen": 0.1},
    )  # fmt: skip
    assert line == "step 4/6  loss 0.6812  margin +0.1235  acc 0.75  lr 1.00e-03  90 tok/s  eta 0:00:02"
