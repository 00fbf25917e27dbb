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

__all__ = ["LINK_SLACK_FORWARDS", "Action", "gpipe", "one_f_one_b", "peak_in_flight", "schedule_for"]

Action = tuple[Literal["F", "B"], int]


#: Forwards a stage with a next stage runs ahead of the textbook 1F1B warm-up (S - 1 - i).
LINK_SLACK_FORWARDS = 1


def one_f_one_b(*, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """1F1B: warm up with S-1-stage forwards (one more on every stage but the last), then
    alternate forward and backward, then drain.

    With the textbook warm-up of S-1-i forwards, a stage whose neighbour is exactly as fast waits
    a round trip of its link (activation out, gradient back) before every backward in the steady
    state: 2 x latency per micro-batch, about 0.7 s a step for two stages at M = 16 over the
    mesh bench's WireGuard links. One more warm-up forward (:data:`LINK_SLACK_FORWARDS`) gives the
    gradient a whole forward-plus-backward to arrive. The backward order, and so the arithmetic,
    is unchanged. Stage i holds at most S-i+1 micro-batches' activations at once (the last stage
    1), instead of all M under GPipe.
    """
    _check(stage, num_stages, num_microbatches)
    slack = LINK_SLACK_FORWARDS if stage < num_stages - 1 else 0
    warmup = min(num_stages - 1 - stage + slack, num_microbatches)
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
