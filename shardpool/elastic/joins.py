"""Whether a member that came back is worth taking, and the supervisor's join checks.

Every few steps (:class:`JoinCheckClock`) the supervisor lists the members online off the event
loop (:class:`JoinWatching`) and :func:`look_for_joins` measures the fleet once and plans with and
without the members outside the plan: a plan with one is taken when it predicts a step at least
:data:`JOIN_GAIN` faster (:func:`worth_joining`), and why not is said in words. A member lost
while its agent answered is held back (:data:`REJOIN_HOLD_OFF_S`) so that it does not flap.
Torch-free.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from shardpool.agent.client import AgentRefused, AgentUnreachable
from shardpool.config import Config
from shardpool.contract.job import Job
from shardpool.elastic.policy import placed_stages
from shardpool.launch.mesh_launcher import MeshLauncher
from shardpool.plan.result import Plan

__all__ = [
    "JOIN_CHECK_TIMEOUT_S",
    "JOIN_COPY_WAIT_S",
    "JOIN_GAIN",
    "REJOIN_HOLD_OFF_S",
    "REPLAN_CHECK_EVERY_STEPS",
    "REPLAN_CHECK_MIN_S",
    "JoinCheck",
    "JoinCheckClock",
    "JoinFound",
    "JoinWatching",
    "join_check_every_steps",
    "join_check_min_s",
    "join_gain",
    "join_gain_needed",
    "look_for_joins",
    "worth_joining",
]

#: A plan with a joined member must predict a step at least this much faster to be worth a restart.
JOIN_GAIN = 0.10


#: The launcher looks for joined members every this many steps ...
REPLAN_CHECK_EVERY_STEPS = 10


#: ... and no more often than this many seconds (``SHARDPOOL_TEST_JOIN_CHECK_MIN_S`` replaces it
#: in tests' runs, whose steps take anywhere from 1 to 30 s on a shared machine).
REPLAN_CHECK_MIN_S = 60.0


_TEST_JOIN_CHECK_MIN_S = "SHARDPOOL_TEST_JOIN_CHECK_MIN_S"


#: Test hook: the steps between two join checks, instead of :data:`REPLAN_CHECK_EVERY_STEPS` (a
#: test's run is a few dozen steps; ten of them between checks would be most of its length).
_TEST_JOIN_CHECK_EVERY_STEPS = "SHARDPOOL_TEST_JOIN_CHECK_EVERY_STEPS"


#: Test hook: the gain a join must predict, instead of :data:`JOIN_GAIN` (the tests' tiny model
#: predicts -1 to 15 % with a third host, from profiles taken under whatever load there was: too
#: near any rule to test the join path reliably; ``-inf`` takes any plan that uses the member).
_TEST_JOIN_GAIN = "SHARDPOOL_TEST_JOIN_GAIN"


#: A member lost while its agent still answered (a stall, a killed stage) looks healthy again as
#: soon as its stage is stopped: it is taken back only once a join check found it away (its agent
#: not answering: a restart), or this many seconds after it was lost, so that it does not flap.
REJOIN_HOLD_OFF_S = 600.0


#: A join check (listing, profiling, planning) that takes longer than this is ignored.
JOIN_CHECK_TIMEOUT_S = 180.0


#: How long a join waits for a step-boundary copy of the very last step before it takes an older one.
JOIN_COPY_WAIT_S = 30.0


def join_gain(current_step_s: float, candidate_step_s: float) -> float:
    """How much faster (a fraction of the current predicted step) a candidate plan's step is."""
    if current_step_s <= 0:
        return 0.0
    return (current_step_s - candidate_step_s) / current_step_s


def worth_joining(current_step_s: float, candidate_step_s: float, *, gain: float | None = None) -> bool:
    """Whether a plan with joined members predicts a step at least ``gain`` faster (same cost model).

    ``gain`` defaults to :func:`join_gain_needed`.
    """
    needed = join_gain_needed() if gain is None else gain
    return join_gain(current_step_s, candidate_step_s) >= needed - 1e-12


_Value = TypeVar("_Value", int, float)


def _hook(
    name: str, parse: Callable[[str], _Value], default: _Value, environ: dict[str, str] | None
) -> _Value:
    """A test hook's value from the environment, parsed; ``default`` when unset or malformed."""
    text = (os.environ if environ is None else environ).get(name, "")
    try:
        return parse(text) if text else default
    except ValueError:
        return default


def join_gain_needed(environ: dict[str, str] | None = None) -> float:
    """The predicted gain a join needs: :data:`JOIN_GAIN`, or the test hook's value."""
    return _hook(_TEST_JOIN_GAIN, float, JOIN_GAIN, environ)


def join_check_min_s(environ: dict[str, str] | None = None) -> float:
    """The fewest seconds between two join checks: :data:`REPLAN_CHECK_MIN_S`, or the test hook's value."""
    return _hook(_TEST_JOIN_CHECK_MIN_S, lambda text: max(0.0, float(text)), REPLAN_CHECK_MIN_S, environ)


def join_check_every_steps(environ: dict[str, str] | None = None) -> int:
    """The fewest steps between two join checks: :data:`REPLAN_CHECK_EVERY_STEPS`, or the test hook's value."""
    return _hook(
        _TEST_JOIN_CHECK_EVERY_STEPS, lambda text: max(1, int(text)), REPLAN_CHECK_EVERY_STEPS, environ
    )


@dataclass
class JoinCheckClock:
    """When the launcher looks for joined members: every ``every_steps`` steps and ``min_s`` seconds, whichever is later."""

    every_steps: int = field(default_factory=lambda: join_check_every_steps())
    min_s: float = field(default_factory=lambda: join_check_min_s())
    clock: Callable[[], float] = time.monotonic
    _last_step: int | None = None
    _last_time: float | None = None

    def due(self, step: int) -> bool:
        """Whether a check is due after ``step`` (the first call only starts the clocks)."""
        now = self.clock()
        if self._last_step is None or self._last_time is None:
            self._last_step, self._last_time = step, now
            return False
        if step - self._last_step >= self.every_steps and now - self._last_time >= self.min_s:
            self._last_step, self._last_time = step, now
            return True
        return False


@dataclass(frozen=True)
class JoinCheck:
    """What one join check found: ``found`` (a launcher and plan with joined members, worth a
    restart) or None, and ``why`` in words either way, for the console line that says so.

    ``candidates`` are the members online but not in the plan (the ones the check was about,
    held-back ones included).
    """

    why: str
    candidates: tuple[str, ...] = ()
    found: tuple[MeshLauncher, Plan, list[str], str] | None = None
    #: Held-back members found away (not online, or their agent not answering).
    away: tuple[str, ...] = ()


def look_for_joins(
    launcher: MeshLauncher,
    config: Config,
    *,
    step: int,
    say: Callable[[str], None],
    held_back: dict[str, str] | None = None,
) -> JoinCheck:
    """Whether the members online but not in ``launcher``'s are worth a restart, and why (not).

    The members are measured once (profiles, links) and planned with and without the ones that
    joined; ``found`` is set when the plan with them uses at least one and predicts a step at
    least :func:`join_gain_needed` faster than the plan without them. The planner's notes (a
    member skipped, a link not measured) are passed to ``say`` and end up in ``why`` too.
    ``held_back`` (name: why) are members not to take back yet: they are only asked whether their
    agent answers (``away`` names those that are gone).
    """
    held_back = held_back or {}
    if launcher.list_members is None:
        return JoinCheck("the launcher cannot list the members online")
    current = {member.name for member in launcher.members}
    online = launcher.list_members()
    outside = [member for member in online if member.name not in current]
    away = tuple(sorted(name for name in held_back if name not in {member.name for member in outside}))
    held: list[str] = []
    for member in (member for member in outside if member.name in held_back):
        try:
            member.agent.health()
            held.append(member.name)
        except (AgentUnreachable, AgentRefused):
            away += (member.name,)
    holding = "; ".join(f"{name!r} held back: {held_back[name]}" for name in held)

    def told(why: str) -> str:
        return f"{why}; {holding}" if holding else why

    joined = [member for member in outside if member.name not in held_back]
    if not joined:
        names = ", ".join(sorted(member.name for member in online)) or "none"
        if held:
            return JoinCheck(holding, tuple(held), away=away)
        silent = sorted({member.name for member in outside} & set(away))
        if silent:
            return JoinCheck(
                f"{', '.join(repr(name) for name in silent)} listed online but its agent does not answer: "
                "seen away, taken back once it answers",
                tuple(silent),
                away=away,
            )
        return JoinCheck(f"no member online outside the plan (online: {names})", away=away)
    candidates = tuple(sorted(member.name for member in joined))
    named = ", ".join(repr(name) for name in candidates)
    notes: list[str] = []

    def note(line: str) -> None:
        notes.append(line)
        say(line)

    candidate = launcher.over([*launcher.members, *joined], say=note)
    plan, without = candidate.plans_with_and_without(config, set(candidates))
    skipped = f" ({'; '.join(notes)})" if notes else ""
    used = sorted({stage.host for stage in plan.stages} - current)
    placed = placed_stages(plan)
    if not used:
        return JoinCheck(
            told(f"{named} online, but the plan with it leaves it out ({placed}){skipped}"),
            candidates,
            away=away,
        )
    gain, needed = join_gain(without.predicted_step_s, plan.predicted_step_s), join_gain_needed()
    prediction = (
        f"the plan with {', '.join(repr(name) for name in used)} predicts {plan.predicted_step_s:.3f} s/step "
        f"vs {without.predicted_step_s:.3f} without ({gain:.0%} faster, needs {needed:.0%}; {placed})"
    )
    if not worth_joining(without.predicted_step_s, plan.predicted_step_s):
        return JoinCheck(told(f"{named} online, {prediction}; not taken{skipped}"), candidates, away=away)
    return JoinCheck(told(prediction), candidates, (candidate, plan, used, prediction), away)


@dataclass(frozen=True)
class JoinFound:
    launcher: MeshLauncher
    plan: Plan
    members: list[str]
    step: int
    reason: str
    found_at: float
    #: The grown job and each running rank's new rank, when the job can grow into ``plan`` in place.
    in_place: tuple[Job, dict[int, int]] | None = None


class JoinWatching:
    """The supervisor's join checks (mixed into :class:`~shardpool.elastic.supervisor.Supervisor`,
    whose fields they read): one at a time, in a thread, as :class:`JoinCheckClock` says."""

    def _maybe_look_for_joins(self, step: int) -> None:
        launcher = self._launcher
        if launcher is None or launcher.list_members is None or self._current_step_s is None:
            return
        with self._join_lock:
            busy = self._found is not None or (
                self._join_thread is not None and self.clock() - self._join_started < JOIN_CHECK_TIMEOUT_S
            )
        if busy or not self.join_clock.due(step):
            return
        thread = threading.Thread(target=self._look_for_joins, args=(launcher, step), daemon=True)
        with self._join_lock:
            self._join_thread, self._join_started = thread, self.clock()
        thread.start()

    def _look_for_joins(self, launcher: MeshLauncher, step: int) -> None:
        """Off the event loop: list the members online, profile and plan with any not in the plan,
        and keep the plan when it is :data:`JOIN_GAIN` faster; say why not when a member is online
        outside the plan or one lost in this run is still away."""
        started = self.clock()
        with self._join_lock:
            held = self._held_back(started)
        try:
            check = look_for_joins(launcher, self.config, step=step, say=lambda line: None, held_back=held)
        except Exception as error:  # noqa: BLE001 - a failed look leaves the run as it is
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            check = JoinCheck(f"failed: {first}", ("?",))
        took = self.clock() - started
        with self._join_lock:
            self._join_thread = None
            for name in check.away:
                self._held.pop(name, None)  # seen away: taken back once it answers again
                self._join_failed.pop(name, None)
            why = check.why
            if check.found is not None:
                if took > JOIN_CHECK_TIMEOUT_S:
                    why = f"{why}; took {took:.0f} s, over {JOIN_CHECK_TIMEOUT_S:.0f} s: not taken"
                elif self._launcher is not launcher:
                    why = f"{why}; the run re-planned meanwhile: not taken"
                elif (refusal := self.policy.refusal(len(check.found[0].members))) is not None:
                    why = f"{why}; not taken: {refusal}"
                else:
                    successor, plan, joined, reason = check.found
                    in_place = self._grows_in_place(plan)
                    self._found = JoinFound(successor, plan, joined, step, reason, self.clock(), in_place)
                    self.say(f"join check after step {step} ({took:.0f} s): {why}; taking it")
                    return
            elif not check.candidates:
                away = self._away()
                if not away:
                    return  # nothing joined and nothing lost: nothing to tell
                names = ", ".join(repr(name) for name in away)
                why = f"{names} (lost in this run) not back: {why}"
        self.say(f"join check after step {step} ({took:.0f} s): {why}")

    def _held_back(self, now: float) -> dict[str, str]:
        """The members that may not (re)join yet, and why: lost in this run while their agent
        answered, or their stages failed to join in place."""
        for name in [name for name, since in self._held.items() if now - since >= REJOIN_HOLD_OFF_S]:
            del self._held[name]
        for name in [
            name for name, (since, _) in self._join_failed.items() if now - since >= REJOIN_HOLD_OFF_S
        ]:
            del self._join_failed[name]
        held = {
            name: (
                f"lost {now - since:.0f} s ago while its agent answered: taken back once it has been away "
                f"(restarted) or {REJOIN_HOLD_OFF_S / 60:.0f} min after it was lost"
            )
            for name, since in self._held.items()
        }
        for name, (since, why) in self._join_failed.items():
            held.setdefault(
                name,
                f"its stages failed to join {now - since:.0f} s ago ({why}): tried again once it has been "
                f"away (restarted) or {REJOIN_HOLD_OFF_S / 60:.0f} min after",
            )
        return held

    def _away(self) -> list[str]:
        """Members this run lost that are not in the current plan (a join check says when they stay away)."""
        launcher = self._launcher
        current = {member.name for member in launcher.members} if launcher is not None else set()
        return [name for name in self._lost if name not in current]
