"""Keep a mesh run going when a member is lost or joins (issue 16): the launcher's decisions.

A mesh run with ``shardpool.on_member_loss: continue`` has its stages beat and copy their
step-boundary state (:mod:`shardpool.contract.liveness`). This module holds what the launcher
decides from them, each part pure or given its side effects, so that it is tested with fakes:

* :class:`~shardpool.launch.beats.BeatWatch` (its own module): a stage whose beat counter stopped moving for :func:`stall_bound` seconds is
  stalled (a suspended laptop, a ``SIGSTOP``), named as the member that stopped, not its waiting
  neighbour; a stage that has not beaten yet is still starting and is not stalled;
* :func:`complete_live_steps`, :func:`prune_live_copies`, :func:`take_live_copy`: which
  step-boundary copies are complete (their counter equals the world size), which go, and the
  newest complete one turned into a checkpoint directory;
* :class:`ReplanPolicy`: whether a loss is survived (``on_member_loss``, ``min_members``,
  ``max_replans_per_hour``), with the one line that stops the run when it is not;
* :func:`look_for_joins` (a :class:`JoinCheck`): whether a plan with a member that came back is
  at least :data:`JOIN_GAIN` faster than the plan without it, both from one measurement of the
  fleet (:func:`join_gain` / :func:`worth_joining`), and why not in words; a member lost while
  its agent answered is held back (:data:`REJOIN_HOLD_OFF_S`) so that it does not flap;
* :func:`supervision_line`: the ``metrics.jsonl`` (and ``finetune --json``) line of a loss,
  re-plan or join;
* :meth:`Supervisor.commit_gate`: each attempt's :class:`~shardpool.launch.commit.CommitGate`,
  which reports a step only once every rank's copy of it is complete, so that a reported step is
  never trained again (``steps_lost``); steps whose copies were in flight when a member went are
  trained again unreported (``unreported_steps_redone``).

Torch-free: the store is reached through the callables the launcher passes in.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from shardpool.agent.client import AgentRefused, AgentUnreachable
from shardpool.config import Config
from shardpool.contract.events import StageEvent
from shardpool.contract.grow import encode_growth, grow_key, in_place_ranks, ready_key, step_key
from shardpool.contract.job import Job, StagePlacement
from shardpool.contract.liveness import (
    LIVE_ROOT,
    beat_key,
    live_dir,
    live_key,
    live_step,
    rng_file_name,
    stage_file_name,
)
from shardpool.errors import ShardpoolError
from shardpool.launch.beats import BeatWatch
from shardpool.launch.commit import CommitGate, passing
from shardpool.launch.mesh_launcher import (
    LOST_AFTER_S,
    GrowOrder,
    Interrupted,
    MemberLost,
    MeshLauncher,
    ranks_by_member,
)
from shardpool.launch.mesh_members import MeshMember
from shardpool.launch.rebalancing import replanned_json
from shardpool.launch.run import placement_of
from shardpool.plan.calibrate import growth_shortfalls
from shardpool.plan.result import Plan

__all__ = [
    "JOIN_GAIN",
    "KEEP_LIVE_COPIES",
    "REPLAN_CHECK_EVERY_STEPS",
    "REJOIN_HOLD_OFF_S",
    "REPLAN_CHECK_MIN_S",
    "AttemptEnded",
    "Checkpoints",
    "Supervisor",
    "JoinCheck",
    "JoinCheckClock",
    "ReplanPolicy",
    "clear_live_copies",
    "complete_live_steps",
    "copy_files_count",
    "grown_job",
    "placed_stages",
    "does_not_fit_line",
    "join_gain",
    "look_for_joins",
    "live_steps",
    "placements_of",
    "prune_live_copies",
    "supervision_line",
    "take_live_copy",
    "worth_joining",
    "join_gain_needed",
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
#: Complete step-boundary copies kept while the run goes on; older ones are deleted.
KEEP_LIVE_COPIES = 2

SupervisionEvent = Literal["member_lost", "replan", "member_joined"]


def live_steps(output_dir: Path) -> list[int]:
    """Steps of the step-boundary copy directories under ``output_dir``, ascending."""
    root = output_dir / LIVE_ROOT
    if not root.is_dir():
        return []
    steps = (live_step(child.name) for child in root.iterdir() if child.is_dir())
    return sorted(step for step in steps if step is not None)


def copy_files_count(output_dir: Path, step: int, job: Job) -> int:
    """``job.world_size`` when every file of step ``step``'s copy is on disk (each is renamed into
    place whole), else 0.

    The files are the copy; the store counter only says so sooner. A rank stopped between its last
    file and its count (a ``SIGSTOP`` in that instant) leaves a complete copy the counter misses.
    """
    directory = output_dir / live_dir(step)
    names = [stage_file_name(index) for index in range(job.num_stages)]
    names += [rng_file_name(rank) for rank in range(job.world_size)]
    return job.world_size if all((directory / name).is_file() for name in names) else 0


WorldSize = (
    int | Callable[[int], int]
)  # the ranks that copy a step: one number, or by step (a job grown in place)


def _ranks_at(world_size: WorldSize, step: int) -> int:
    return world_size(step) if callable(world_size) else world_size


def complete_live_steps(output_dir: Path, count: Callable[[int], int], world_size: WorldSize) -> list[int]:
    """Steps whose copy every rank finished (``count(step)`` reads ``live_key(step)``), ascending."""
    complete = []
    for step in live_steps(output_dir):
        try:
            if int(count(step)) >= _ranks_at(world_size, step):
                complete.append(step)
        except Exception:  # noqa: BLE001 - an unreadable counter: not known complete
            continue
    return complete


def prune_live_copies(
    output_dir: Path, count: Callable[[int], int], world_size: WorldSize, *, keep: int = KEEP_LIVE_COPIES
) -> list[int]:
    """Delete the copies older than the ``keep`` newest complete ones; return the steps deleted.

    Copies newer than the newest complete one are being written and stay.
    """
    complete = complete_live_steps(output_dir, count, world_size)
    if len(complete) < keep:
        return []
    oldest_kept = complete[-keep]
    deleted = [step for step in live_steps(output_dir) if step < oldest_kept]
    for step in deleted:
        shutil.rmtree(output_dir / live_dir(step), ignore_errors=True)
    return deleted


def take_live_copy(output_dir: Path, step: int, partial: Path) -> Path:
    """Move step ``step``'s copy to ``partial`` (a ``checkpoint-N.partial`` to finalize); return it."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(partial, ignore_errors=True)
    (output_dir / live_dir(step)).rename(partial)
    return partial


def clear_live_copies(output_dir: Path) -> None:
    """Delete every step-boundary copy (a new attempt writes its own)."""
    shutil.rmtree(output_dir / LIVE_ROOT, ignore_errors=True)


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


def grown_job(job: Job, plan: Plan) -> tuple[Job, dict[int, int]] | None:
    """``job`` grown to ``plan`` (the next generation, its new ranks ``joining``) and each running
    rank's rank in it; None when it cannot grow in place (:func:`~shardpool.contract.grow.in_place_ranks`),
    when either is data-parallel (replicas on shares of the step restart from the step copy), or
    when the plan runs another 1F1B warm-up lead (the running ranks keep their schedule's order; a
    restart from the step copy takes the new one)."""
    if job.shares is not None or plan.is_data_parallel or plan.warmup_lead != job.warmup_lead:
        return None
    grown = Job.model_validate(
        job.model_dump(mode="json")
        | {
            "stages": [placement.model_dump(mode="json") for placement in placements_of(plan)],
            "generation": job.generation + 1,
            "joining": True,
            "rebalance_at": None,
        }
    )
    renumber = in_place_ranks(
        _rank_hosts(job), _rank_hosts(grown), old_replicas=job.replicas, new_replicas=grown.replicas
    )
    return None if renumber is None else (grown, renumber)


def _rank_hosts(job: Job) -> list[str]:
    """Where each rank runs, member and device: a running process keeps both when the job grows."""
    return [f"{place.host}/{place.device}" for place in (job.placement(r) for r in range(job.world_size))]


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


class Checkpoints(Protocol):
    """The run's checkpoints, as the supervisor needs them (the train layer's, given by finetune)."""

    def partial(self, step: int) -> Path:
        """The ``checkpoint-N.partial`` directory a checkpoint of ``step`` is assembled in."""
        ...

    def finalize(self, partial: Path, step: int, eval_before: float | None) -> Path:
        """Turn an assembled ``partial`` into ``checkpoint-N`` (adapter merged, step recorded); return it."""
        ...

    def newest(self) -> Path | None:
        """The newest complete checkpoint in ``output_dir``, or None."""
        ...

    def step_of(self, checkpoint: Path) -> int:
        """The step a checkpoint was taken after."""
        ...

    def eval_before_of(self, checkpoint: Path) -> float | None:
        """The eval loss before training that a checkpoint recorded."""
        ...


class SupervisedRun(Protocol):
    """What the supervisor reads of a run (finetune's PreparedRun), and replaces for the next attempt."""

    @property
    def config(self) -> Config: ...
    @property
    def plan(self) -> dict[str, Any]: ...
    @property
    def planned(self) -> Plan | None: ...
    @property
    def first_step(self) -> int: ...
    @property
    def eval_before(self) -> float | None: ...


Run = TypeVar("Run", bound=SupervisedRun)

#: A join check (listing, profiling, planning) that takes longer than this is ignored.
JOIN_CHECK_TIMEOUT_S = 180.0
#: How long a join waits for a step-boundary copy of the very last step before it takes an older one.
JOIN_COPY_WAIT_S = 30.0


@dataclass(frozen=True)
class _JoinFound:
    launcher: MeshLauncher
    plan: Plan
    members: list[str]
    step: int
    reason: str
    found_at: float
    #: The grown job and each running rank's new rank, when the job can grow into ``plan`` in place.
    in_place: tuple[Job, dict[int, int]] | None = None


@dataclass
class Supervisor:
    """Keeps one mesh run going across lost and joined members (``on_member_loss: continue``).

    Per attempt, :meth:`begin` hooks the launcher (stall watch, loss bound, join interrupt) and
    the attempt's store; :meth:`observe` sees every stage event (prunes the step-boundary
    copies, notes the eval loss before training, schedules join checks); :meth:`ended` turns a
    lost member or a join into :class:`AttemptEnded` while the store still answers, and
    :meth:`next_attempt` restores the newest complete copy as ``checkpoint-N`` and re-plans.
    ``say`` prints a console line, ``emit`` writes a ``finetune --json`` event, ``record`` appends
    a ``metrics.jsonl`` line, ``trim`` drops metrics lines past a step, ``write_plan`` rewrites
    ``plan.json``.
    """

    config: Config
    policy: ReplanPolicy
    checkpoints: Checkpoints
    say: Callable[[str], None]
    emit: Callable[..., None]
    record: Callable[[dict[str, Any]], None]
    trim: Callable[[int], None]
    write_plan: Callable[[dict[str, Any]], None]
    output_dir: Path
    join_clock: JoinCheckClock = field(default_factory=JoinCheckClock)
    clock: Callable[[], float] = time.monotonic
    _count: Callable[[int], int] = field(default=lambda step: 0)
    #: The attempt's job, and from which step each grown job of it copies (``[(0, job), (S, grown)]``).
    _jobs: list[tuple[int, Job]] = field(default_factory=list)
    _store: Any = None
    _growing: GrowOrder | None = None
    _grow_published: bool = False
    #: The plan the run has now (after a growth in place), and its plan.json.
    _plan: Plan | None = None
    _plan_json: dict[str, Any] | None = None
    _last_step: int = 0
    _eval_before: float | None = None
    _launcher: MeshLauncher | None = None
    _current_step_s: float | None = None
    _join_lock: threading.Lock = field(default_factory=threading.Lock)
    _join_thread: threading.Thread | None = None
    _join_started: float = 0.0
    _found: _JoinFound | None = None
    _lost: list[str] = field(default_factory=list)
    _held: dict[str, float] = field(default_factory=dict)
    #: Members whose stages failed to join in place: since when, and why (held back like ``_held``).
    _join_failed: dict[str, tuple[float, str]] = field(default_factory=dict)
    _keeps_state: bool = False
    _gate: CommitGate | None = None
    #: The room each rank of the current job measured after its newest reported step (a growth in place respects it).
    _rooms: list[float] | None = None

    @classmethod
    def wanted(cls, config: Config, launcher: object) -> bool:
        """Whether a run is supervised: a mesh launcher and ``on_member_loss: continue``."""
        return isinstance(launcher, MeshLauncher) and config.shardpool.on_member_loss == "continue"

    def begin(self, launcher: MeshLauncher, run: SupervisedRun, job: Job, store: Any) -> None:
        """Hook one attempt: ``launcher`` about to start ``job``, its stages meeting at ``store``."""
        timeout_s = self.config.shardpool.member_timeout_s
        self._count = lambda step: max(
            int(store.add(live_key(step), 0)), copy_files_count(self.output_dir, step, self._job_at(step))
        )
        self._jobs = [(0, job)]
        self._store = store
        self._growing, self._grow_published = None, False
        self._plan, self._plan_json = run.planned, dict(run.plan)
        self._rooms = None
        launcher.grow = self.grow if job.keep_state else None
        self._last_step = job.resume_step
        self._keeps_state = job.keep_state
        self._gate = None
        launcher.tick = None
        self._eval_before = job.eval_before
        self._launcher = launcher
        self._current_step_s = run.planned.predicted_step_s if run.planned is not None else None
        with self._join_lock:
            self._found, self._join_thread = None, None
        launcher.lost_after_s = min(LOST_AFTER_S, timeout_s)
        launcher.interrupt = self.interrupt
        if job.keep_state:
            launcher.watch = lambda started: BeatWatch(
                beats=lambda rank: int(store.add(beat_key(rank, started.generation), 0)),
                ranks={
                    name: ranks for name, (_, ranks) in ranks_by_member(started, launcher.members).items()
                },
                member_timeout_s=timeout_s,
            )
        else:
            launcher.watch = None

    def commit_gate(self) -> CommitGate:
        """This attempt's gate for its reports: a step is reported once every rank's copy of it is
        complete (a gate that holds nothing when the job makes no copies). The launcher's event
        loop releases it."""
        if not self._keeps_state:
            return passing()
        gate = CommitGate(lambda step: self._count(step) >= self._ranks_at(step))
        gate.newest_step = gate.reported_step = self._last_step
        self._gate = gate
        if self._launcher is not None:
            self._launcher.tick = self._tick
        return gate

    def _job_at(self, step: int) -> Job:
        """The job whose ranks copy step ``step``: the grown one from the step it grew after."""
        return next(job for since, job in reversed(self._jobs) if step >= since)

    def _ranks_at(self, step: int) -> int:
        return self._job_at(step).world_size

    def _tick(self) -> None:
        """Every turn of the launcher's event loop: release the steps whose copies are complete,
        and move a growth in place on (:meth:`grow`)."""
        if self._gate is not None:
            self._gate.release()
        self._advance_growth()

    def _newest_step(self) -> int:
        """The newest step the stages finished (reported or not)."""
        return self._gate.newest_step if self._gate is not None else self._last_step

    def observe(self, event: dict[str, Any]) -> None:
        """See one reported stage event: a step prunes old copies and may start a join check; a
        checkpoint tells the eval loss before training."""
        kind = event.get("event")
        if kind == StageEvent.STEP:
            self._last_step = int(event["step"])
            rooms = event.get("stage_room_bytes")
            if rooms is not None and self._jobs and len(rooms) == self._jobs[-1][1].world_size:
                self._rooms = [float(room) for room in rooms]  # the current job's, not the one it grew from
            prune_live_copies(self.output_dir, self._count, self._ranks_at)
            self._maybe_look_for_joins(self._last_step)
        elif kind == StageEvent.CHECKPOINT_WRITTEN and event.get("eval_before") is not None:
            self._eval_before = float(event["eval_before"])

    def ended(self, stopped: MemberLost | Interrupted) -> AttemptEnded:
        """The attempt's end as :class:`AttemptEnded`, with the newest complete copy (read now, while the store answers)."""
        complete = complete_live_steps(self.output_dir, self._count, self._ranks_at)
        newest = complete[-1] if complete else None
        if isinstance(stopped, MemberLost):
            reason = str(stopped).split(": ", 1)[-1]
            return AttemptEnded(
                "member_lost",
                member=stopped.member,
                reason=reason,
                step=max(stopped.step, self._newest_step()),
                newest_copy=newest,
                agent_answered=stopped.agent_answered,
                reported_step=self._last_step,
            )
        found = self._found
        names = ", ".join(found.members) if found else "?"
        return AttemptEnded(
            "member_joined", member=names, reason=found.reason if found else str(stopped),
            step=self._newest_step(), newest_copy=newest, reported_step=self._last_step,
        )  # fmt: skip

    def interrupt(self) -> bool:
        """Whether to stop the stages now for a join: a faster plan was found that the job cannot
        grow into in place (:meth:`grow`), and the step-boundary copy of the last completed step is
        complete (so no completed step is lost)."""
        with self._join_lock:
            found = self._found
        if found is None or self._growing is not None or found.in_place is not None:
            return False
        complete = complete_live_steps(self.output_dir, self._count, self._ranks_at)
        if not complete or complete[-1] < found.step:
            return False
        return complete[-1] >= self._newest_step() or self.clock() - found.found_at > JOIN_COPY_WAIT_S

    def resharded(self, plan: Plan, plan_json: dict[str, Any]) -> None:
        """The re-balance check moved the running stages' layer boundaries to ``plan``'s (its
        ``plan_json`` has the plan they started with in its history): a growth in place starts from
        those layers, and a re-plan keeps that history."""
        if not self._jobs:
            return
        since, job = self._jobs[-1]
        stages = [
            placement.model_copy(update={"start": stage.start, "stop": stage.stop})
            for placement, stage in zip(job.stages, plan.stages, strict=True)
        ]
        shares = {"shares": list(plan.shares)} if job.shares is not None else {}
        self._jobs[-1] = (since, job.model_copy(update={"stages": stages} | shares))
        self._plan, self._plan_json = plan, dict(plan_json)
        self._current_step_s = plan.predicted_step_s

    # ----- growing in place (issue 16: a member that joins, without a restart) -----------------------
    def _grows_in_place(self, plan: Plan) -> tuple[Job, dict[int, int]] | None:
        """The grown job and each running rank's new rank, when the running job can grow into ``plan``."""
        job = self._jobs[-1][1] if self._jobs else None
        if job is None or not job.keep_state or job.world_size < 2:
            return None
        return grown_job(job, plan)

    def grow(self) -> GrowOrder | None:
        """The launcher's event loop asks every turn: the growth in place to carry out, if any.

        Once a join check found a plan worth taking that the running job can grow into
        (:func:`grown_job`), and the job is past its re-balance check, this is the order to start
        the joining ranks; the event loop starts them and sets ``started``; :meth:`_tick` publishes
        the decision once they are ready and sets ``grown`` once the stages moved, when the loop
        switches to the grown job and sets ``applied``. When a running rank lacks the room the
        grown plan gives it (:meth:`_outgrown`), the join becomes a restart (:meth:`interrupt`).
        """
        order = self._growing
        if order is not None:
            return None if order.applied else order
        with self._join_lock:
            found = self._found
        if found is None or self._launcher is None:
            return None
        check_at = self._jobs[-1][1].rebalance_at
        if found.in_place is None or (check_at is not None and self._newest_step() <= check_at):
            return None
        job, renumber = found.in_place
        if short := self._outgrown(found.plan, renumber):
            with self._join_lock:
                if self._found is found:
                    self._found = replace(found, in_place=None)  # :meth:`interrupt` restarts with it instead
            names = ", ".join(found.members)
            self.say(
                f"growing the job in place would need more memory than its stages have ({'; '.join(short)}): "
                f"restarting it with {names} from the newest step copy instead"
            )
            return None
        running = set(renumber.values())
        joined: dict[str, tuple[MeshMember, list[int]]] = {}
        for name, (member, ranks) in ranks_by_member(job, found.launcher.members).items():
            fresh = [rank for rank in ranks if rank not in running]
            if fresh:
                joined[name] = (member, fresh)
        self._growing, self._grow_published = GrowOrder(job, joined, renumber), False
        self.say(f"growing the job in place: starting {', '.join(sorted(joined))}'s stages")
        return self._growing

    def _outgrown(self, plan: Plan, renumber: dict[int, int]) -> list[str]:
        """Why the running ranks cannot grow in place into ``plan`` for lack of memory (empty when
        they can, or when no room or memory model is known)."""
        if self._rooms is None or self._plan is None or len(self._rooms) != len(renumber):
            return []
        return growth_shortfalls(self._plan, plan, renumber, self._rooms)

    def _advance_growth(self) -> None:
        """Publish the grow decision once every joining rank is ready; note the growth once the
        stages moved (rank 0 wrote the step they grew after)."""
        order, store = self._growing, self._store
        if order is None or order.grown or store is None:
            return
        if order.failed is not None:
            self.say(f"growing in place failed, the run goes on as it is: {order.failed}")
            self._growing = None
            with self._join_lock:
                self._found = None
                for name in order.joined:  # not tried again at the next check, every few steps
                    self._join_failed[name] = (self.clock(), order.failed)
            return
        if not order.started:
            return
        generation = order.job.generation
        if not self._grow_published:
            if int(store.add(ready_key(generation), 0)) >= sum(
                len(ranks) for _, ranks in order.joined.values()
            ):
                running = self._jobs[-1][1]
                store.set(
                    grow_key(generation),
                    encode_growth(
                        order.job.model_dump(mode="json") | {"joining": False},
                        order.renumber,
                        [(stage.start, stage.stop) for stage in running.stages],
                    ),
                )
                self._grow_published = True
            return
        if store.check([step_key(generation)]):
            self._grew(order, int(store.get(step_key(generation))))

    def _grew(self, order: GrowOrder, step: int) -> None:
        """The stages grew after ``step``: the run's job, members, plan and watch are now the grown ones."""
        with self._join_lock:
            found, self._found = self._found, None
        assert found is not None and self._launcher is not None
        launcher = self._launcher
        grown = order.job.model_copy(update={"joining": False})
        order.job = grown
        self._jobs.append((step, grown))
        self._rooms = None  # measured by the old ranks; the grown job's come with its next step
        launcher.members = list(found.launcher.members)
        order.watch = launcher.watch(grown) if launcher.watch is not None else None
        self._current_step_s = found.plan.predicted_step_s
        self._plan = found.plan
        self._plan_json = replanned_json(self._plan_json or {}, found.plan, ended_at_step=step) | {
            "source": "join"
        }
        self.write_plan(self._plan_json)
        self.policy.note_replan()
        names = ", ".join(found.members)
        self._visible(
            "member_joined", member=names, step=step, reason=f"{found.reason}; in place", steps_lost=0
        )
        placed = placed_stages(found.plan)
        self._visible(
            "replan",
            member=names,
            step=step,
            reason=f"member {names!r} joined; stages now {placed}, grown in place (no restart)",
            steps_lost=0,
        )
        order.grown = True

    def current(self, run: Run) -> Run:
        """``run`` with the plan the run has now (a growth in place changes it within an attempt)."""
        if self._plan is None or self._plan_json is None or self._plan is run.planned:
            return run
        return replace(
            run,  # type: ignore[type-var]
            placements=placements_of(self._plan),
            plan=self._plan_json,
            planned=self._plan,
        )

    def next_attempt(self, run: Run, launcher: MeshLauncher, ended: AttemptEnded) -> tuple[Run, MeshLauncher]:
        """Restore the newest complete copy and re-plan; return the next attempt's run and launcher.

        Raises :class:`ShardpoolError` with one line when the run cannot go on (``min_members``,
        ``max_replans_per_hour``, the model no longer fits); the checkpoint stays for ``--resume``.
        """
        checkpoint = self._restore(ended.newest_copy, run)
        first_step = self.checkpoints.step_of(checkpoint) if checkpoint is not None else 0
        steps_lost = max(0, ended.reported_step - first_step)
        unreported = max(0, ended.step - max(first_step, ended.reported_step))
        if ended.kind == "member_lost":
            self._visible(
                "member_lost",
                member=ended.member,
                step=ended.step,
                reason=ended.reason,
                steps_lost=steps_lost,
                unreported=unreported,
            )
            if ended.member not in self._lost:
                self._lost.append(ended.member)
            if ended.agent_answered:
                self._held[ended.member] = self.clock()
            else:
                self._held.pop(ended.member, None)
            remaining = [member for member in launcher.members if member.name != ended.member]
            refusal = self.policy.refusal(len(remaining))
            if refusal is not None:
                raise ShardpoolError(
                    f"member {ended.member!r} was lost at step {ended.step} ({ended.reason}); "
                    f"stopping: {refusal}; {kept_line(checkpoint)}"
                )
            successor = launcher.over(remaining, say=self.say)
            try:
                plan = successor.plan(run.config)
            except ShardpoolError as error:
                raise ShardpoolError(does_not_fit_line(ended.member, str(error), checkpoint)) from None
            reason = f"member {ended.member!r} lost"
        else:
            found = self._found
            assert found is not None, "a join ends an attempt only once one was found"
            self._visible(
                "member_joined",
                member=ended.member,
                step=ended.step,
                reason=ended.reason,
                steps_lost=steps_lost,
                unreported=unreported,
            )
            successor, plan, reason = found.launcher, found.plan, f"member {ended.member!r} joined"
        self.policy.note_replan()
        plan_json = replanned_json(run.plan, plan, ended_at_step=ended.step) | {"source": "replan"}
        self.write_plan(plan_json)
        placed = placed_stages(plan)
        self._visible(
            "replan",
            member=ended.member,
            step=first_step,
            reason=f"{reason}; stages now {placed}",
            steps_lost=0,
        )
        eval_before = self.checkpoints.eval_before_of(checkpoint) if checkpoint is not None else None
        following = replace(
            run,  # type: ignore[type-var]
            placements=placements_of(plan),
            plan=plan_json,
            planned=plan,
            resume_from=checkpoint,
            first_step=first_step,
            eval_before=eval_before,
        )
        return following, successor

    def _restore(self, newest_copy: int | None, run: SupervisedRun) -> Path | None:
        """The checkpoint the next attempt starts from: the newest complete copy made a
        ``checkpoint-N``, or the newest regular checkpoint when that is newer or there is no copy."""
        newest = self.checkpoints.newest()
        newest_step = self.checkpoints.step_of(newest) if newest is not None else -1
        restored = newest
        if newest_copy is not None and newest_copy > newest_step:
            partial = take_live_copy(self.output_dir, newest_copy, self.checkpoints.partial(newest_copy))
            restored = self.checkpoints.finalize(partial, newest_copy, self._eval_before)
        clear_live_copies(self.output_dir)
        self.trim(self.checkpoints.step_of(restored) if restored is not None else 0)
        return restored

    def _visible(
        self,
        kind: SupervisionEvent,
        *,
        member: str,
        step: int,
        reason: str,
        steps_lost: int,
        unreported: int = 0,
    ) -> None:
        """A loss, join or re-plan shown everywhere: metrics.jsonl, the console, ``finetune --json``."""
        line = supervision_line(
            kind, member=member, step=step, reason=reason, steps_lost=steps_lost,
            unreported_steps_redone=unreported,
        )  # fmt: skip
        self.record(line)
        self.emit(kind, **{key: value for key, value in line.items() if key != "event"})
        what = {"member_lost": "lost member", "member_joined": "member joined", "replan": "re-planned"}[kind]
        lost = f", {steps_lost} steps lost" if steps_lost else ""
        if unreported:
            lost += f", {unreported} unreported step{'s' if unreported > 1 else ''} (copy in flight) trained again"
        self.say(f"{what} {member!r} at step {step}: {reason}{lost}")

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
                    self._found = _JoinFound(successor, plan, joined, step, reason, self.clock(), in_place)
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
