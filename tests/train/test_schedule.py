"""shardpool.contract.schedule: every action list runs to completion with blocking receives, backward passes
run in micro-batch order, and 1F1B bounds the activations a stage holds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpool.contract.schedule import (
    MAX_LEAD,
    gpipe,
    gradients_delivered_by_forwards,
    held_gradient_sends,
    one_f_one_b,
    peak_in_flight,
    schedule_for,
    warmup_forwards,
)


def _simulate(schedules: list[list[tuple[str, int]]]) -> int:
    """Run the stages' action lists against each other: sends never block, receives do.

    Returns the number of rounds taken; fails on a deadlock (no stage can make progress).
    """
    stages = len(schedules)
    position = [0] * stages
    forward_mail = [set() for _ in range(stages)]  # micro-batches whose activations reached stage i
    backward_mail = [set() for _ in range(stages)]  # micro-batches whose gradients reached stage i
    rounds = 0
    while any(position[i] < len(schedules[i]) for i in range(stages)):
        progressed = False
        for i in range(stages):
            if position[i] == len(schedules[i]):
                continue
            kind, index = schedules[i][position[i]]
            if kind == "F" and (i == 0 or index in forward_mail[i]):
                if i + 1 < stages:
                    forward_mail[i + 1].add(index)
            elif kind == "B" and (i == stages - 1 or index in backward_mail[i]):
                if i > 0:
                    backward_mail[i - 1].add(index)
            else:
                continue
            position[i] += 1
            progressed = True
        assert progressed, f"deadlock at positions {position}"
        rounds += 1
    return rounds


@settings(max_examples=300, deadline=None)
@given(
    stages=st.integers(1, 8),
    microbatches=st.integers(1, 16),
    name=st.sampled_from(["1f1b", "gpipe"]),
    lead=st.integers(1, MAX_LEAD),
)
def test_schedules_complete_and_keep_backward_order(
    stages: int, microbatches: int, name: str, lead: int
) -> None:
    schedules = [
        schedule_for(name, stage=i, num_stages=stages, num_microbatches=microbatches, lead=lead)
        for i in range(stages)
    ]
    _simulate(schedules)
    for actions in schedules:
        assert sorted(actions) == sorted(
            [("F", m) for m in range(microbatches)] + [("B", m) for m in range(microbatches)]
        )
        assert [m for kind, m in actions if kind == "B"] == list(range(microbatches))
        for m in range(microbatches):
            assert actions.index(("F", m)) < actions.index(("B", m))


@pytest.mark.parametrize(("stages", "microbatches"), [(4, 8), (3, 2), (2, 6)])
def test_1f1b_holds_at_most_s_minus_i_plus_one_microbatches_and_the_last_stage_one(
    stages: int, microbatches: int
) -> None:
    for stage in range(stages):
        peak = peak_in_flight(one_f_one_b(stage=stage, num_stages=stages, num_microbatches=microbatches))
        assert peak == (1 if stage == stages - 1 else min(stages - stage + 1, microbatches))
        assert (
            peak_in_flight(gpipe(stage=stage, num_stages=stages, num_microbatches=microbatches))
            == microbatches
        )


def test_1f1b_on_four_stages_is_the_textbook_order_with_one_more_warm_up_forward() -> None:
    assert one_f_one_b(stage=0, num_stages=4, num_microbatches=6) == [
        ("F", 0), ("F", 1), ("F", 2), ("F", 3), ("F", 4), ("B", 0), ("F", 5), ("B", 1), ("B", 2),
        ("B", 3), ("B", 4), ("B", 5),
    ]  # fmt: skip
    assert one_f_one_b(stage=2, num_stages=4, num_microbatches=6) == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("F", 4), ("B", 2), ("F", 5),
        ("B", 3), ("B", 4), ("B", 5),
    ]  # fmt: skip
    assert one_f_one_b(stage=3, num_stages=4, num_microbatches=3) == [
        ("F", 0),
        ("B", 0),
        ("F", 1),
        ("B", 1),
        ("F", 2),
        ("B", 2),
    ]


@pytest.mark.parametrize("lead", range(1, MAX_LEAD + 1))
def test_a_deeper_lead_warms_each_stage_up_by_its_distance_to_the_last_and_holds_that_many_more(
    lead: int,
) -> None:
    stages, microbatches = 4, 40
    for stage in range(stages):
        distance = stages - stage
        expected = 0 if stage == stages - 1 else lead * distance - (lead - 1)
        assert (
            warmup_forwards(stage=stage, num_stages=stages, num_microbatches=microbatches, lead=lead)
            == expected
        )
        actions = one_f_one_b(stage=stage, num_stages=stages, num_microbatches=microbatches, lead=lead)
        assert actions[: expected + 1] == [("F", index) for index in range(expected + 1)]
        assert actions[expected + 1] == ("B", 0)
        assert peak_in_flight(actions) == expected + 1
    # Lead 1 is the schedule as it always ran; a short step caps the warm-up at its micro-batches.
    assert one_f_one_b(stage=0, num_stages=2, num_microbatches=6, lead=1) == one_f_one_b(
        stage=0, num_stages=2, num_microbatches=6
    )
    assert warmup_forwards(stage=0, num_stages=2, num_microbatches=3, lead=MAX_LEAD) == 3


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="lead"):
        one_f_one_b(stage=0, num_stages=2, num_microbatches=4, lead=MAX_LEAD + 1)
    with pytest.raises(ValueError, match="lead"):
        one_f_one_b(stage=0, num_stages=2, num_microbatches=4, lead=0)
    with pytest.raises(ValueError):
        one_f_one_b(stage=4, num_stages=4, num_microbatches=2)
    with pytest.raises(ValueError):
        gpipe(stage=0, num_stages=1, num_microbatches=0)


def test_each_activation_proves_which_gradients_the_stage_before_has_received() -> None:
    # Stage 1 of 2 under 1F1B, M = 6: stage 0 warms up with F0 F1 F2, then runs B0 before F3, B1
    # before F4, B2 before F5. Activations 0-2 prove nothing.
    own = one_f_one_b(stage=1, num_stages=2, num_microbatches=6)
    previous = one_f_one_b(stage=0, num_stages=2, num_microbatches=6)
    assert gradients_delivered_by_forwards(own, previous) == {3: 0, 4: 1, 5: 2}
    middle = one_f_one_b(stage=1, num_stages=3, num_microbatches=6)
    first = one_f_one_b(stage=0, num_stages=3, num_microbatches=6)
    assert gradients_delivered_by_forwards(middle, first) == {4: 0, 5: 1}
    # GPipe sends every activation before any backward: nothing is proven before the step's end.
    assert gradients_delivered_by_forwards(gpipe(stage=1, num_stages=2, num_microbatches=4),
                                           gpipe(stage=0, num_stages=2, num_microbatches=4)) == {}  # fmt: skip


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 5), st.integers(1, 40), st.integers(1, MAX_LEAD), st.data())
def test_under_1f1b_a_stage_holds_a_bounded_number_of_gradient_sends_whatever_m(
    num_stages: int, microbatches: int, lead: int, data: st.DataObject
) -> None:
    stage = data.draw(st.integers(1, num_stages - 1))
    own = one_f_one_b(stage=stage, num_stages=num_stages, num_microbatches=microbatches, lead=lead)
    previous = one_f_one_b(stage=stage - 1, num_stages=num_stages, num_microbatches=microbatches, lead=lead)
    proven = gradients_delivered_by_forwards(own, previous)
    for forward, through in proven.items():  # sound: each proven gradient was taken before that forward
        before = previous[: previous.index(("F", forward))]
        assert all(("B", index) in before for index in range(through + 1))
    # Without the proofs a stage holds all M until the step's end; with them, what the stage
    # before it holds in flight, whatever M.
    held = held_gradient_sends(
        "1f1b", stage=stage, num_stages=num_stages, num_microbatches=microbatches, lead=lead
    )
    assert 1 <= held <= peak_in_flight(previous)
    assert (
        held_gradient_sends("gpipe", stage=stage, num_stages=num_stages, num_microbatches=microbatches)
        == microbatches
    )
