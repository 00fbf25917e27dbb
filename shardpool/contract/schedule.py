"""Pipeline schedules as plain lists of actions, one list per stage.

The stages run these orders (``shardpool.train.pipeline``) and the planner simulates them
(``shardpool.plan.pipeline_sim``), so both read them from here, torch-free.

An action is ``("F", i)`` (forward micro-batch i) or ``("B", i)`` (backward micro-batch i). Sends
never block in the runtime, so any order in which every stage meets its receives in the order
its neighbour sends them is deadlock-free; both schedules here have that property. Backward
passes run in micro-batch order on every stage, so gradients accumulate in the same order as in a
single-device loop.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["Action", "one_f_one_b", "gpipe", "schedule_for", "peak_in_flight"]

Action = tuple[Literal["F", "B"], int]


def one_f_one_b(*, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """1F1B: warm up with S-1-stage forwards, then alternate forward and backward, then drain.

    Stage i holds at most S-i micro-batches' activations at once, instead of all M under GPipe.
    """
    _check(stage, num_stages, num_microbatches)
    warmup = min(num_stages - 1 - stage, num_microbatches)
    actions: list[Action] = [("F", index) for index in range(warmup)]
    next_forward, next_backward = warmup, 0
    while next_forward < num_microbatches:
        actions.append(("F", next_forward))
        next_forward += 1
        actions.append(("B", next_backward))
        next_backward += 1
    actions.extend(("B", index) for index in range(next_backward, num_microbatches))
    return actions


def gpipe(*, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """GPipe: every forward, then every backward."""
    _check(stage, num_stages, num_microbatches)
    return [("F", index) for index in range(num_microbatches)] + [
        ("B", index) for index in range(num_microbatches)
    ]


def schedule_for(name: str, *, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """The action list of one stage under the named schedule (``1f1b`` or ``gpipe``)."""
    builders = {"1f1b": one_f_one_b, "gpipe": gpipe}
    return builders[name](stage=stage, num_stages=num_stages, num_microbatches=num_microbatches)


def peak_in_flight(actions: list[Action]) -> int:
    """The most micro-batches whose activations a stage holds at once under ``actions``."""
    held = peak = 0
    for kind, _ in actions:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def _check(stage: int, num_stages: int, num_microbatches: int) -> None:
    if not 0 <= stage < num_stages or num_microbatches < 1:
        raise ValueError(
            f"no schedule for stage {stage} of {num_stages} with {num_microbatches} micro-batches"
        )
