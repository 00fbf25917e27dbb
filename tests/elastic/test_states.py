"""The elastic run's state machine as a pure function: every move it allows, and every other refused."""

from __future__ import annotations

import itertools

import pytest

from shardpool.elastic.states import IllegalTransition, RunEvent, RunMachine, RunState, next_state

S, E = RunState, RunEvent

_RUNNING = [S.STARTING, S.TRAINING, S.CHECKING, S.RESHARDING, S.GROWING, S.JOINING, S.GROWN]

#: The table of docs/architecture.md, written out: (state, event, next state).
LEGAL = [
    (S.STARTING, E.STAGES_STARTED, S.TRAINING),
    (S.RESTARTING_FROM_COPY, E.STAGES_STARTED, S.TRAINING),
    (S.TRAINING, E.CHECK_STEP_DONE, S.CHECKING),
    (S.CHECKING, E.PLAN_KEPT, S.TRAINING),
    (S.CHECKING, E.PLAN_MOVED, S.RESHARDING),
    (S.RESHARDING, E.RESHARDED, S.TRAINING),
    (S.TRAINING, E.GROWTH_ORDERED, S.GROWING),
    (S.GROWING, E.JOINERS_STARTED, S.JOINING),
    (S.JOINING, E.STAGES_MOVED, S.GROWN),
    (S.GROWN, E.GROWN_FOLLOWED, S.TRAINING),
    (S.GROWING, E.GROWTH_FAILED, S.TRAINING),
    (S.JOINING, E.GROWTH_FAILED, S.TRAINING),
    (S.TRAINING, E.JOIN_RESTART, S.RESTARTING_FROM_COPY),
    (S.RESHARDING, E.JOIN_RESTART, S.RESTARTING_FROM_COPY),
    (S.RESTARTING_FROM_COPY, E.RUN_REFUSED, S.STOPPING),
    *[(state, E.MEMBER_LOST, S.RESTARTING_FROM_COPY) for state in _RUNNING],
    *[(state, E.RUN_FINISHED, S.STOPPING) for state in _RUNNING],
]


@pytest.mark.parametrize(("state", "event", "after"), LEGAL, ids=lambda item: getattr(item, "value", item))
def test_each_legal_move_goes_where_the_table_says(state: RunState, event: RunEvent, after: RunState) -> None:
    assert next_state(state, event) is after


_ILLEGAL = sorted(
    set(itertools.product(RunState, RunEvent)) - {(state, event) for state, event, _ in LEGAL},
    key=lambda pair: (pair[0].value, pair[1].value),
)


def test_every_move_outside_the_table_is_refused() -> None:
    assert len(_ILLEGAL) == len(RunState) * len(RunEvent) - len(LEGAL) == 126 - 29
    for state, event in _ILLEGAL:
        with pytest.raises(IllegalTransition, match=f"{event.value} cannot happen while {state.value}"):
            next_state(state, event)


@pytest.mark.parametrize(
    ("state", "event"),
    [
        (S.TRAINING, E.STAGES_MOVED),  # stages cannot move without a growth under way
        (S.RESHARDING, E.GROWTH_ORDERED),  # no growth before the re-shard is done
        (S.CHECKING, E.GROWTH_ORDERED),
        (S.GROWING, E.GROWN_FOLLOWED),  # the loop follows only a job the stages moved to
        (S.STOPPING, E.STAGES_STARTED),  # a stopped run does not start again
        (S.STOPPING, E.MEMBER_LOST),
        (S.RESTARTING_FROM_COPY, E.CHECK_STEP_DONE),
    ],
)
def test_the_moves_that_would_hide_a_bug_are_refused(state: RunState, event: RunEvent) -> None:
    with pytest.raises(IllegalTransition):
        next_state(state, event)


def test_a_machine_walks_a_run_that_re_shards_grows_loses_a_member_and_finishes() -> None:
    machine = RunMachine()
    walk = [
        (E.STAGES_STARTED, S.TRAINING),
        (E.CHECK_STEP_DONE, S.CHECKING),
        (E.PLAN_MOVED, S.RESHARDING),
        (E.RESHARDED, S.TRAINING),
        (E.GROWTH_ORDERED, S.GROWING),
        (E.JOINERS_STARTED, S.JOINING),
        (E.STAGES_MOVED, S.GROWN),
        (E.GROWN_FOLLOWED, S.TRAINING),
        (E.MEMBER_LOST, S.RESTARTING_FROM_COPY),
        (E.STAGES_STARTED, S.TRAINING),
        (E.RUN_FINISHED, S.STOPPING),
    ]
    assert [machine.move(event) for event, _ in walk] == [state for _, state in walk]
    with pytest.raises(IllegalTransition):
        machine.move(E.STAGES_STARTED)
    assert machine.state is S.STOPPING, "a refused move leaves the state as it was"
