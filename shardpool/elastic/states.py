"""The run-time states of an elastic run and the one function that moves between them.

A run trains; after its re-balance check step it is *checking* (deciding) and, when the decision
moves layers or shares, *resharding* until the next step proves the ranks moved; a member worth
taking that the job can grow into makes it *growing* (the event loop starts the joining ranks),
*joining* (they build their stage and wait) and *grown* (the stages moved; the event loop follows
the grown job next); a lost member, or a joined one the job cannot grow into, ends the attempt:
*restarting_from_copy* (the newest complete step-boundary copy becomes a checkpoint and a new plan
starts from it); a run that finished, or that the re-plan policy stops, is *stopping*.

:func:`next_state` is the whole table (docs/architecture.md prints it): a pure function that
raises :class:`IllegalTransition` for any move it does not list. :class:`RunMachine` holds the
current state of one run; the supervisor, the re-balance check and a growth order move it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from shardpool.errors import ShardpoolError

__all__ = ["TRANSITIONS", "IllegalTransition", "RunEvent", "RunMachine", "RunState", "next_state"]


class RunState(Enum):
    """Where a run is."""

    STARTING = "starting"
    TRAINING = "training"
    CHECKING = "checking"
    RESHARDING = "resharding"
    GROWING = "growing"
    JOINING = "joining"
    GROWN = "grown"
    RESTARTING_FROM_COPY = "restarting_from_copy"
    STOPPING = "stopping"


class RunEvent(Enum):
    """What happened."""

    STAGES_STARTED = "stages_started"
    CHECK_STEP_DONE = "check_step_done"
    PLAN_KEPT = "plan_kept"
    PLAN_MOVED = "plan_moved"
    RESHARDED = "resharded"
    GROWTH_ORDERED = "growth_ordered"
    JOINERS_STARTED = "joiners_started"
    STAGES_MOVED = "stages_moved"
    GROWN_FOLLOWED = "grown_followed"
    GROWTH_FAILED = "growth_failed"
    MEMBER_LOST = "member_lost"
    JOIN_RESTART = "join_restart"
    RUN_REFUSED = "run_refused"
    RUN_FINISHED = "run_finished"


S, E = RunState, RunEvent

#: States in which stages run: an attempt can end in any of them.
_RUNNING = (S.STARTING, S.TRAINING, S.CHECKING, S.RESHARDING, S.GROWING, S.JOINING, S.GROWN)

#: Every legal move: (state, event) -> the next state.
TRANSITIONS: dict[tuple[RunState, RunEvent], RunState] = {
    (S.STARTING, E.STAGES_STARTED): S.TRAINING,
    (S.RESTARTING_FROM_COPY, E.STAGES_STARTED): S.TRAINING,
    (S.TRAINING, E.CHECK_STEP_DONE): S.CHECKING,
    (S.CHECKING, E.PLAN_KEPT): S.TRAINING,
    (S.CHECKING, E.PLAN_MOVED): S.RESHARDING,
    (S.RESHARDING, E.RESHARDED): S.TRAINING,
    (S.TRAINING, E.GROWTH_ORDERED): S.GROWING,
    (S.GROWING, E.JOINERS_STARTED): S.JOINING,
    (S.JOINING, E.STAGES_MOVED): S.GROWN,
    (S.GROWN, E.GROWN_FOLLOWED): S.TRAINING,
    (S.GROWING, E.GROWTH_FAILED): S.TRAINING,
    (S.JOINING, E.GROWTH_FAILED): S.TRAINING,
    (S.TRAINING, E.JOIN_RESTART): S.RESTARTING_FROM_COPY,
    (S.RESHARDING, E.JOIN_RESTART): S.RESTARTING_FROM_COPY,
    (S.RESTARTING_FROM_COPY, E.RUN_REFUSED): S.STOPPING,
    **{(state, E.MEMBER_LOST): S.RESTARTING_FROM_COPY for state in _RUNNING},
    **{(state, E.RUN_FINISHED): S.STOPPING for state in _RUNNING},
}


class IllegalTransition(ShardpoolError):
    """A move the table does not list: a bug in whoever asked for it."""


def next_state(state: RunState, event: RunEvent) -> RunState:
    """The state ``event`` moves a run in ``state`` to; :class:`IllegalTransition` when it may not."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(
            f"elastic run: {event.value} cannot happen while {state.value}; "
            "this is a bug in shardpool, please report it with the run's log"
        ) from None


@dataclass
class RunMachine:
    """The state of one run, moved only through :func:`next_state`."""

    state: RunState = RunState.STARTING

    def move(self, event: RunEvent) -> RunState:
        """Apply ``event``; return the new state (raises :class:`IllegalTransition`)."""
        self.state = next_state(self.state, event)
        return self.state

    def is_in(self, *states: RunState) -> bool:
        """Whether the run is in one of ``states``."""
        return self.state in states
