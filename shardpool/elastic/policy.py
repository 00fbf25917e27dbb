"""Whether a run survives a lost member, and the lines that tell the user what happened.

:class:`ReplanPolicy` applies ``on_member_loss``, ``min_members`` and ``max_replans_per_hour``;
:func:`supervision_line` is the ``metrics.jsonl`` (and ``finetune --json``) line of a loss,
re-plan or join; :class:`AttemptEnded` is how an attempt that lost or gained a member ends.
Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from shardpool.contract.job import StagePlacement
from shardpool.launch.run import placement_of
from shardpool.plan.result import Plan

__all__ = [
    "AttemptEnded",
    "ReplanPolicy",
    "SupervisionEvent",
    "does_not_fit_line",
    "kept_line",
    "placed_stages",
    "placements_of",
    "supervision_line",
]

SupervisionEvent = Literal["member_lost", "replan", "member_joined"]


@dataclass
class ReplanPolicy:
    """Whether the run survives a lost member: the config's ``on_member_loss``, ``min_members`` and
    ``max_replans_per_hour``, and the re-plans done so far."""

    on_member_loss: str
    min_members: int
    max_replans_per_hour: int
    clock: Callable[[], float] = time.monotonic
    replans: list[float] = field(default_factory=list)

    @property
    def continues(self) -> bool:
        """Whether a loss is survived at all (``on_member_loss: continue``)."""
        return self.on_member_loss == "continue"

    def refusal(self, remaining: int) -> str | None:
        """Why the run stops instead of re-planning over ``remaining`` members, or None to re-plan."""
        if not self.continues:
            return "shardpool.on_member_loss is stop"
        if remaining < self.min_members:
            return (
                f"only {remaining} member{'s' if remaining != 1 else ''} remain, "
                f"fewer than shardpool.min_members ({self.min_members})"
            )
        hour_ago = self.clock() - 3600.0
        recent = [moment for moment in self.replans if moment > hour_ago]
        if len(recent) >= self.max_replans_per_hour:
            return (
                f"{len(recent)} re-plans in the last hour already "
                f"(shardpool.max_replans_per_hour: {self.max_replans_per_hour})"
            )
        return None

    def note_replan(self) -> None:
        """Count one re-plan now (against ``max_replans_per_hour``)."""
        self.replans.append(self.clock())


def kept_line(checkpoint: Path | None) -> str:
    """The end of a stop line: what is kept and how to go on."""
    if checkpoint is None:
        return "no checkpoint yet; run again once a member is back"
    return f"{checkpoint.name} is kept; `shardpool finetune --resume` continues once a member is back"


def does_not_fit_line(lost: str, planner_error: str, checkpoint: Path | None) -> str:
    """The one line of a run that no longer fits on the members left after losing ``lost``."""
    first = planner_error.strip().splitlines()[0] if planner_error.strip() else "the model does not fit"
    return f"after losing member {lost!r} the remaining members cannot hold the model: {first}; {kept_line(checkpoint)}"


def supervision_line(
    event: SupervisionEvent,
    *,
    member: str,
    step: int,
    reason: str,
    steps_lost: int = 0,
    unreported_steps_redone: int = 0,
    now: Callable[[], float] = time.time,
) -> dict[str, Any]:
    """The ``metrics.jsonl`` line of a loss, re-plan or join (also a ``finetune --json`` event).

    ``steps_lost``: steps that had been reported and are trained again (0 unless a copy that
    was complete is missing); ``unreported_steps_redone``: steps the stages had finished whose
    copies were still in flight, trained again with the interrupted one (never reported).
    """
    return {
        "event": event,
        "member": member,
        "step": step,
        "reason": reason,
        "steps_lost": steps_lost,
        "unreported_steps_redone": unreported_steps_redone,
        "time": round(now(), 3),
    }


def placements_of(plan: Plan) -> list[StagePlacement]:
    """The job's stage placements of a plan."""
    return [placement_of(stage) for stage in plan.stages]


def placed_stages(plan: Plan) -> str:
    """Where a plan puts its stages, for a console line: ``a[0, 4) b[4, 6)``."""
    return " ".join(f"{stage.host}[{stage.start}, {stage.stop})" for stage in plan.stages)


class AttemptEnded(Exception):  # noqa: N818 - not an error: the supervisor goes on from it
    """One attempt of a run ended early: a member was lost, or one joined and the run re-plans.

    ``step`` is the newest step the stages finished, ``reported_step`` the newest one reported
    (its copy complete; default ``step``). ``newest_copy`` is the newest complete step-boundary
    copy when it ended (read while the attempt's store was still there), None when there was none.
    """

    def __init__(
        self,
        kind: SupervisionEvent,
        *,
        member: str,
        reason: str,
        step: int,
        newest_copy: int | None,
        agent_answered: bool = False,
        reported_step: int | None = None,
    ):
        super().__init__(f"{kind}: {member} at step {step}: {reason}")
        self.kind, self.member, self.reason, self.step, self.newest_copy = (
            kind,
            member,
            reason,
            step,
            newest_copy,
        )
        #: A lost member's agent still answered (see :attr:`MemberLost.agent_answered`).
        self.agent_answered = agent_answered
        self.reported_step = step if reported_step is None else reported_step
