"""Keep a mesh run going when a member is lost or joins (issue 16): the launcher's supervisor.

A mesh run with ``shardpool.on_member_loss: continue`` has its stages beat and copy their
step-boundary state (:mod:`shardpool.contract.liveness`). :class:`Supervisor` follows one such
run across its attempts and moves its state (:mod:`shardpool.elastic.states`): it is the mesh
launcher's :class:`~shardpool.launch.supervision.Supervision`, reports a step only once every
rank's copy of it is complete (:meth:`Supervisor.commit_gate`, so that a reported step is never
trained again), looks for members that came back (:mod:`shardpool.elastic.joins`), grows the job
in place when it can (:mod:`shardpool.elastic.growth`), and otherwise ends the attempt and starts
the next one from the newest complete copy (:mod:`shardpool.elastic.copies`), as the re-plan
policy allows (:mod:`shardpool.elastic.policy`). Torch-free: the store is reached through the
object the run hands in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from shardpool.config import Config
from shardpool.contract.events import StageEvent
from shardpool.contract.job import Job
from shardpool.elastic.beats import BeatWatch
from shardpool.elastic.commit import CommitGate, passing
from shardpool.elastic.copies import (
    clear_live_copies,
    complete_live_steps,
    copy_files_count,
    prune_live_copies,
    take_live_copy,
)
from shardpool.elastic.growth import GrowingInPlace, GrowOrder
from shardpool.elastic.joins import JOIN_COPY_WAIT_S, JoinCheckClock, JoinFound, JoinWatching
from shardpool.elastic.messages import read_beat
from shardpool.elastic.policy import (
    AttemptEnded,
    ReplanPolicy,
    SupervisionEvent,
    does_not_fit_line,
    kept_line,
    placed_stages,
    placements_of,
    supervision_line,
)
from shardpool.elastic.rebalancing import replanned_json
from shardpool.elastic.states import RunEvent, RunMachine
from shardpool.errors import ShardpoolError
from shardpool.launch.mesh_launcher import (
    LOST_AFTER_S,
    Interrupted,
    MemberLost,
    MeshLauncher,
    ranks_by_member,
)
from shardpool.plan.result import Plan

__all__ = ["Checkpoints", "SupervisedRun", "Supervisor"]


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


@dataclass
class Supervisor(JoinWatching, GrowingInPlace):
    """Keeps one mesh run going across lost and joined members (``on_member_loss: continue``).

    It is the mesh launcher's :class:`~shardpool.launch.supervision.Supervision` (given to it at
    construction): the stall watch, the loss bound, the join interrupt, the growth order and the
    tick of its event loop. Per attempt, :meth:`begin` notes the launcher, the job and its store; :meth:`observe` sees every stage event (prunes the step-boundary
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
    _found: JoinFound | None = None
    _lost: list[str] = field(default_factory=list)
    _held: dict[str, float] = field(default_factory=dict)
    #: Members whose stages failed to join in place: since when, and why (held back like ``_held``).
    _join_failed: dict[str, tuple[float, str]] = field(default_factory=dict)
    _keeps_state: bool = False
    _gate: CommitGate | None = None
    #: The room each rank of the current job measured after its newest reported step (a growth in place respects it).
    _rooms: list[float] | None = None
    #: The run's state (:mod:`shardpool.elastic.states`), shared with its re-balance check and growth orders.
    machine: RunMachine = field(default_factory=RunMachine)

    @classmethod
    def wanted(cls, config: Config, launcher: object) -> bool:
        """Whether a run is supervised: a mesh launcher and ``on_member_loss: continue``."""
        return isinstance(launcher, MeshLauncher) and config.shardpool.on_member_loss == "continue"

    def begin(self, launcher: MeshLauncher, run: SupervisedRun, job: Job, store: Any) -> None:
        """Begin one attempt: ``launcher`` (supervised by this) about to start ``job``, its stages meeting at ``store``."""
        # A copy is complete when its files are on this disk: the store's counter (live_key) carries
        # no MAC, so a process outside the job could count a copy that is not there.
        self._count = lambda step: copy_files_count(self.output_dir, step, self._job_at(step))
        self._jobs = [(0, job)]
        self._store = store
        self._growing, self._grow_published = None, False
        self._plan, self._plan_json = run.planned, dict(run.plan)
        self._rooms = None
        self._last_step = job.resume_step
        self._keeps_state = job.keep_state
        self._gate = None
        self._eval_before = job.eval_before
        self._launcher = launcher
        self._current_step_s = run.planned.predicted_step_s if run.planned is not None else None
        with self._join_lock:
            self._found, self._join_thread = None, None
        self.machine.move(RunEvent.STAGES_STARTED)

    @property
    def lost_after_s(self) -> float:
        """Seconds of agent silence after which a member is lost (at most the config's ``member_timeout_s``)."""
        return min(LOST_AFTER_S, self.config.shardpool.member_timeout_s)

    def watch(self, job: Job) -> BeatWatch | None:
        """The stall watch over ``job``'s beats (None when the job does not beat)."""
        store, launcher = self._store, self._launcher
        if not self._keeps_state or store is None or launcher is None:
            return None
        return BeatWatch(
            beats=lambda rank: read_beat(store, rank, job.generation),
            ranks={name: ranks for name, (_, ranks) in ranks_by_member(job, launcher.members).items()},
            member_timeout_s=self.config.shardpool.member_timeout_s,
        )

    def tick(self) -> None:
        """Every turn of the launcher's event loop (:meth:`_tick`)."""
        self._tick()

    def finished(self) -> None:
        """The run's stages all finished: the run is stopping."""
        self.machine.move(RunEvent.RUN_FINISHED)

    def commit_gate(self) -> CommitGate:
        """This attempt's gate for its reports: a step is reported once every rank's copy of it is
        complete (a gate that holds nothing when the job makes no copies). The launcher's event
        loop releases it."""
        if not self._keeps_state:
            return passing()
        gate = CommitGate(lambda step: self._count(step) >= self._ranks_at(step))
        gate.newest_step = gate.reported_step = self._last_step
        self._gate = gate
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
        self.machine.move(RunEvent.MEMBER_LOST if ended.kind == "member_lost" else RunEvent.JOIN_RESTART)
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
                self.machine.move(RunEvent.RUN_REFUSED)
                raise ShardpoolError(
                    f"member {ended.member!r} was lost at step {ended.step} ({ended.reason}); "
                    f"stopping: {refusal}; {kept_line(checkpoint)}"
                )
            successor = launcher.over(remaining, say=self.say)
            try:
                plan = successor.plan(run.config)
            except ShardpoolError as error:
                self.machine.move(RunEvent.RUN_REFUSED)
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
