"""Pipeline schedules as plain lists of actions, one list per stage.

The stages run these orders (``shardpool.train.pipeline``) and the planner simulates them
(``shardpool.plan.pipeline_sim``), so both read them from here, torch-free.

An action is ``("F", i)`` (forward micro-batch i) or ``("B", i)`` (backward micro-batch i). A
send never blocks the stage that issues it, but on a native library (NCCL) it completes only when
the neighbour's receive runs, in the order each communicator's operations were issued. Each
direction of a boundary therefore has its own communicator (``shardpool.train.transport``): one
side only sends on it, the other only receives, both in micro-batch order, so any order in which
every stage meets its receives in the order its neighbour sends them is deadlock-free; both
schedules here have that property (``tests/train/test_wire_order.py`` simulates them). Backward
passes run in micro-batch order on every stage, so gradients accumulate in the same order as in a
single-device loop.
"""

from __future__ import annotations

from typing import Literal

from shardpool.config.schema import MAX_WARMUP_LEAD

__all__ = [
    "LINK_SLACK_FORWARDS",
    "MAX_LEAD",
    "Action",
    "gpipe",
    "gradient_sends_proven",
    "gradients_delivered_by_forwards",
    "held_gradient_sends",
    "one_f_one_b",
    "peak_in_flight",
    "schedule_for",
    "warmup_forwards",
]

Action = tuple[Literal["F", "B"], int]


#: Forwards a stage with a next stage runs ahead of the textbook 1F1B warm-up (S - 1 - i).
LINK_SLACK_FORWARDS = 1
#: The deepest warm-up lead the planner considers (:func:`warmup_forwards`), as the config allows it.
MAX_LEAD = MAX_WARMUP_LEAD


def warmup_forwards(*, stage: int, num_stages: int, num_microbatches: int, lead: int = 1) -> int:
    """The warm-up forwards of stage ``stage`` under 1F1B with warm-up ``lead``: those it runs before
    alternating (one more forward, then its first backward).

    Lead 1 is the textbook S-1-i plus :data:`LINK_SLACK_FORWARDS`: S-i on every stage but the
    last. Lead L multiplies the distance to the last stage: L(S-i) - (L-1), so stage 0 of two warms
    up with L + 1 forwards. A deeper lead lets a stage keep computing while a slow link or a bursty
    neighbour (a CPU quota's periods) holds its gradients back, at L-1 more micro-batches of
    activations per stage of distance; the planner chooses it per plan (``plan.planner``), since
    on a fast link a deeper lead can also delay the gradients a stage sends back. The last stage
    never warms up: its backward needs nothing from a neighbour.
    """
    _check(stage, num_stages, num_microbatches)
    if not 1 <= lead <= MAX_LEAD:
        raise ValueError(f"warm-up lead {lead} is outside 1..{MAX_LEAD}")
    if stage == num_stages - 1:
        return 0
    distance = num_stages - stage
    return min(lead * distance - (lead - 1), num_microbatches)


def one_f_one_b(*, stage: int, num_stages: int, num_microbatches: int, lead: int = 1) -> list[Action]:
    """1F1B: warm up (:func:`warmup_forwards`: S-1-stage forwards, one more on every stage but the
    last, and more with a deeper ``lead``), then alternate forward and backward, then drain.

    With the textbook warm-up of S-1-i forwards, a stage whose neighbour is exactly as fast waits
    a round trip of its link (activation out, gradient back) before every backward in the steady
    state: 2 x latency per micro-batch, about 0.7 s a step for two stages at M = 16 over the
    mesh bench's WireGuard links. One more warm-up forward (:data:`LINK_SLACK_FORWARDS`) gives the
    gradient a whole forward-plus-backward to arrive. The backward order, and so the arithmetic,
    is unchanged. Stage i holds at most S-i+1 micro-batches' activations at once (the last stage
    1), instead of all M under GPipe.
    """
    warmup = warmup_forwards(stage=stage, num_stages=num_stages, num_microbatches=num_microbatches, lead=lead)
    actions: list[Action] = [("F", index) for index in range(warmup)]
    next_forward, next_backward = warmup, 0
    while next_forward < num_microbatches:
        actions.append(("F", next_forward))
        next_forward += 1
        actions.append(("B", next_backward))
        next_backward += 1
    actions.extend(("B", index) for index in range(next_backward, num_microbatches))
    return actions


def gpipe(*, stage: int, num_stages: int, num_microbatches: int, lead: int = 1) -> list[Action]:
    """GPipe: every forward, then every backward (``lead`` has nothing to deepen)."""
    _check(stage, num_stages, num_microbatches)
    return [("F", index) for index in range(num_microbatches)] + [
        ("B", index) for index in range(num_microbatches)
    ]


def schedule_for(
    name: str, *, stage: int, num_stages: int, num_microbatches: int, lead: int = 1
) -> list[Action]:
    """The action list of one stage under the named schedule (``1f1b`` or ``gpipe``) and warm-up ``lead``."""
    builders = {"1f1b": one_f_one_b, "gpipe": gpipe}
    return builders[name](stage=stage, num_stages=num_stages, num_microbatches=num_microbatches, lead=lead)


def peak_in_flight(actions: list[Action]) -> int:
    """The most micro-batches whose activations a stage holds at once under ``actions``."""
    held = peak = 0
    for kind, _ in actions:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def gradients_delivered_by_forwards(own: list[Action], previous: list[Action]) -> dict[int, int]:
    """What each activation from the previous stage proves about this stage's gradient sends.

    ``own`` and ``previous`` are the action lists of a stage and of the stage before it. The
    previous stage sends the activation of micro-batch j only after its earlier actions, and
    each of its backwards first waited for this stage's gradient. So once activation j has
    arrived, the gradient sends that its backwards before ``("F", j)`` needed were received.
    Returns, for each such j, the last send position (0-based, in ``own``'s backward order)
    up to which every gradient send is proven received. Forwards that prove nothing are left out.

    Without this proof a gloo send counts as complete only when the step ends. A stage then
    keeps every micro-batch's input-gradient buffer for the whole step, where the schedule
    needs only a few in flight.
    """
    send_order = [index for kind, index in own if kind == "B"]
    received: set[int] = set()
    proven: dict[int, int] = {}
    prefix = 0  # sends 0..prefix-1 proven received; only grows, as ``received`` does
    for kind, index in previous:
        if kind == "B":
            received.add(index)
            continue
        while prefix < len(send_order) and send_order[prefix] in received:
            prefix += 1
        if prefix:
            proven[index] = prefix - 1
    return proven


def gradient_sends_proven(
    name: str, *, stage: int, num_stages: int, num_microbatches: int, lead: int = 1
) -> dict[int, int]:
    """:func:`gradients_delivered_by_forwards` for stage ``stage`` under the named schedule: its
    own actions against its previous stage's; empty on stage 0, which sends no gradient."""
    if stage == 0:
        return {}
    own = schedule_for(name, stage=stage, num_stages=num_stages, num_microbatches=num_microbatches, lead=lead)
    previous = schedule_for(
        name, stage=stage - 1, num_stages=num_stages, num_microbatches=num_microbatches, lead=lead
    )
    return gradients_delivered_by_forwards(own, previous)


def held_gradient_sends(
    name: str, *, stage: int, num_stages: int, num_microbatches: int, lead: int = 1
) -> int:
    """The most input-gradient sends stage ``stage`` holds at once under the named schedule, letting
    each go once an activation proves it received (:func:`gradients_delivered_by_forwards`); 0 on
    stage 0, which sends none. Under 1F1B at most what the stage before it holds in flight, whatever
    M; under GPipe all M, until the step's end."""
    proven = gradient_sends_proven(
        name, stage=stage, num_stages=num_stages, num_microbatches=num_microbatches, lead=lead
    )
    sent = released = peak = 0
    for kind, index in schedule_for(
        name, stage=stage, num_stages=num_stages, num_microbatches=num_microbatches, lead=lead
    ):
        if kind == "F" and index in proven:
            released = max(released, proven[index] + 1)
        elif kind == "B":
            sent += 1
            peak = max(peak, sent - released)
    return peak


def _check(stage: int, num_stages: int, num_microbatches: int) -> None:
    if not 0 <= stage < num_stages or num_microbatches < 1:
        raise ValueError(
            f"no schedule for stage {stage} of {num_stages} with {num_microbatches} micro-batches"
        )
