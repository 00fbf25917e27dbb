"""Growing a running job in place when a member joins: the launcher's side (issue 16).

:func:`grown_job` says whether the running job can grow into a plan with the joined member (every
place keeps its ranks; :func:`~shardpool.elastic.handover_plan.in_place_ranks`). A :class:`GrowOrder` is
one such growth between the supervisor and the mesh launcher's event loop; its progress is the
run's state (:mod:`shardpool.elastic.states`: growing, joining, grown, then training again), not
flags of its own. :class:`GrowingInPlace` is the supervisor's part: order the growth, publish the
decision once the joining ranks are ready, and take the grown job once the stages moved.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shardpool.contract.job import Job
from shardpool.elastic.handover_plan import in_place_ranks
from shardpool.elastic.messages import decode_step, encode_growth, grow_key, ranks_ready, step_key
from shardpool.elastic.policy import placed_stages, placements_of
from shardpool.elastic.rebalancing import replanned_json
from shardpool.elastic.states import RunEvent, RunMachine, RunState
from shardpool.launch.mesh_launcher import ranks_by_member
from shardpool.launch.mesh_members import MeshMember
from shardpool.launch.supervision import StallWatch
from shardpool.plan.result import Plan
from shardpool.plan.room import growth_shortfalls

__all__ = ["GrowOrder", "GrowingInPlace", "grown_job"]


def grown_job(job: Job, plan: Plan) -> tuple[Job, dict[int, int]] | None:
    """``job`` grown to ``plan`` (the next generation, its new ranks ``joining``) and each running
    rank's rank in it; None when it cannot grow in place (:func:`~shardpool.elastic.handover_plan.in_place_ranks`),
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


@dataclass(eq=False)
class GrowOrder:
    """A job growing in place (:mod:`shardpool.elastic.messages`), between the supervisor and the event loop.

    ``job`` is the grown job (its new ranks start it ``joining``), ``joined`` the ranks to start on
    each joining member, ``renumber`` each running rank's rank in it. Its progress is ``machine``
    (the run's, or one of its own): the event loop starts the joining ranks (:meth:`joiners_started`,
    or :meth:`abandon` with why); the supervisor notes that the stages moved (:meth:`stages_moved`)
    and gives ``watch``; the loop then follows the grown job (:meth:`followed`). ``started``,
    ``grown``, ``applied`` and ``failed`` read that progress.
    """

    job: Job
    joined: dict[str, tuple[MeshMember, list[int]]]
    renumber: dict[int, int]
    machine: RunMachine = field(default_factory=lambda: RunMachine(RunState.GROWING))
    watch: StallWatch | None = None
    #: How the growth ended: :attr:`RunEvent.GROWN_FOLLOWED` or :attr:`RunEvent.GROWTH_FAILED` (None: under way).
    ended_by: RunEvent | None = None
    failure: str | None = None

    def joiners_started(self) -> None:
        """The event loop started every joining rank."""
        self.machine.move(RunEvent.JOINERS_STARTED)

    def stages_moved(self) -> None:
        """The running stages moved to the grown job (rank 0 wrote the step they grew after)."""
        self.machine.move(RunEvent.STAGES_MOVED)

    def followed(self) -> None:
        """The event loop follows the grown job now: the growth is done."""
        self.machine.move(RunEvent.GROWN_FOLLOWED)
        self.ended_by = RunEvent.GROWN_FOLLOWED

    def abandon(self, reason: str) -> None:
        """The growth failed (``reason``): the joining ranks are stopped, the job goes on as it was."""
        self.machine.move(RunEvent.GROWTH_FAILED)
        self.ended_by, self.failure = RunEvent.GROWTH_FAILED, reason

    @property
    def applied(self) -> bool:
        """Whether the event loop follows the grown job."""
        return self.ended_by is RunEvent.GROWN_FOLLOWED

    @applied.setter
    def applied(self, value: bool) -> None:
        if value and not self.applied:
            self.followed()

    @property
    def grown(self) -> bool:
        """Whether the stages moved to the grown job."""
        return self.applied or (self.ended_by is None and self.machine.is_in(RunState.GROWN))

    @grown.setter
    def grown(self, value: bool) -> None:
        if value and not self.grown:
            self.stages_moved()

    @property
    def started(self) -> bool:
        """Whether the joining ranks were started."""
        return self.grown or (self.ended_by is None and self.machine.is_in(RunState.JOINING))

    @started.setter
    def started(self, value: bool) -> None:
        if value and not self.started:
            self.joiners_started()

    @property
    def failed(self) -> str | None:
        """Why the growth failed, or None."""
        return self.failure if self.ended_by is RunEvent.GROWTH_FAILED else None

    @failed.setter
    def failed(self, reason: str | None) -> None:
        if reason is not None and self.failed is None:
            self.abandon(reason)


class GrowingInPlace:
    """The supervisor's part of a growth in place (mixed into
    :class:`~shardpool.elastic.supervisor.Supervisor`, whose fields it reads)."""

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
        the joining ranks (the run is growing); the event loop starts them (joining); :meth:`_tick`
        publishes the decision once they are ready and notes when the stages moved (grown), when
        the loop switches to the grown job (training again). When a running rank lacks the room the
        grown plan gives it (:meth:`_outgrown`), the join becomes a restart (:meth:`interrupt`).
        """
        if not self._keeps_state:
            return None
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
        self.machine.move(RunEvent.GROWTH_ORDERED)
        self._growing, self._grow_published = GrowOrder(job, joined, renumber, machine=self.machine), False
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
            joining = [rank for _, ranks in order.joined.values() for rank in ranks]
            if len(ranks_ready(store, generation, joining)) == len(joining):
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
        step = store.peek(step_key(generation))  # a forged or garbled step is refused and logged
        if step is not None:
            self._grew(order, decode_step(step))

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
        order.watch = self.watch(grown)
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
        order.stages_moved()
