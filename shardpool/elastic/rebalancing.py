"""The launcher's side of re-balancing: measure the warm-up steps, decide, answer the stages, record it.

:class:`RebalanceCheck` follows the run's ``step`` events. At the job's check step
(``Job.rebalance_at``) it asks :func:`shardpool.elastic.rebalance_decision.rebalance_decision` (or takes the
test hook's forced split, :data:`shardpool.contract.rebalance.FORCE_ENV`), within the room each
rank measured at that step (the event's ``stage_room_bytes``), and publishes the answer
at the rendezvous-store key every rank waits on. It always publishes, keep included, so the stages
never wait longer than the launcher takes to decide; a check that fails (a bug in calibration)
says one line and keeps the plan rather than stopping the run. A re-shard rewrites ``plan.json`` with the new
plan and the earlier ones under ``history``, and returns the ``rebalance`` line for ``metrics.jsonl``;
a better split that the room rules out, with nothing else worth a re-shard, returns a
``rebalance_held`` line instead and keeps the plan. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import mean
from typing import Any

from mesh.files import write_json
from shardpool.config import Config
from shardpool.contract.events import StageEvent
from shardpool.contract.rebalance import FORCE_ENV, FORCE_SHARES_ENV, forced_reshard, forced_shares
from shardpool.elastic.messages import check_same_stages, decision_key, encode_decision, encode_shares
from shardpool.elastic.rebalance_decision import Rebalance, rebalance_decision, shares_decision
from shardpool.elastic.states import RunEvent, RunMachine, RunState
from shardpool.errors import ShardpoolError
from shardpool.plan.calibrate import StepMeasurement
from shardpool.plan.result import Plan
from shardpool.plan.room import memory_shortfalls

__all__ = [
    "CARRIED_SOURCES",
    "RebalanceCheck",
    "carried_plan",
    "forced_rebalance",
    "held_line",
    "rebalance_line",
    "replanned_json",
    "resumed_json",
]

Publish = Callable[[str, str], None]  # (store key, value): the rendezvous store's set

#: ``plan.json`` sources whose split a resumed run goes on with: a re-balance's, and one that a
#: resume already carried over (a run resumed twice).
CARRIED_SOURCES = ("rebalance", "resume")


@dataclass
class RebalanceCheck:
    """The check of one run: its plan, the step it checks after, and where the answer goes."""

    plan: Plan
    plan_json: dict[str, Any]
    config: Config
    check_at: int
    first_step: int
    publish: Publish
    plan_path: Path
    measured: list[StepMeasurement] = field(default_factory=list)
    #: ``(plan, measured, config, room_bytes=...)`` -> the re-shard, or None to keep the plan.
    decide: Callable[..., Rebalance | None] = rebalance_decision
    say: Callable[[str], None] = print  # where a failed check's one line goes (the run's console)
    #: Told ``(plan, plan_json)`` after a re-shard is decided (the supervisor: a growth starts from it).
    resharded: Callable[[Plan, dict[str, Any]], None] | None = None
    #: The run's state (a supervised run's is its supervisor's): checking at the check step, then
    #: resharding until the next step when the decision moved layers or shares.
    machine: RunMachine = field(default_factory=lambda: RunMachine(RunState.TRAINING))

    def on_step(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """Note a ``step`` event; at the check step decide and answer. Returns the re-balance line, if any."""
        if event.get("event") != StageEvent.STEP:
            return None
        step = int(event["step"])
        if step > self.check_at and self.machine.is_in(RunState.RESHARDING):
            self.machine.move(RunEvent.RESHARDED)  # a step after the check: the ranks moved
        if step > self.first_step + 1:  # the run's first step is warm-up, not a measurement
            self.measured.append(
                StepMeasurement(
                    step=step,
                    step_seconds=float(event["step_seconds"]),
                    stage_compute_s=tuple(event["stage_compute_s"]),
                    stage_wait_s=tuple(event["stage_wait_s"]),
                )
            )
        if step != self.check_at:
            return None
        self.machine.move(RunEvent.CHECK_STEP_DONE)
        if self.plan.is_data_parallel:
            return self._reshare(step)
        decision: Rebalance | None = None
        held: Rebalance | None = None
        try:
            decision, held = self._decision(event.get("stage_room_bytes"))
        except Exception as error:  # noqa: BLE001 - a failed check keeps the plan; it must not stop the run
            self.say(f"re-balance check after step {step} failed, keeping the plan: {_first_line(error)}")
        if decision is not None and decision.layers == self.plan.layer_ranges():
            decision = None
        self.publish(decision_key(step), encode_decision(decision.layers if decision else None))
        if decision is None:
            self.machine.move(RunEvent.PLAN_KEPT)
            return held_line(step, self.plan, held) if held is not None else None
        self.machine.move(RunEvent.PLAN_MOVED)
        return self._adopt(step, decision, rebalance_line(step, self.plan, decision))

    def _adopt(self, step: int, decision: Rebalance, line: dict[str, Any]) -> dict[str, Any]:
        """Make ``decision``'s plan the run's: ``plan.json`` with the old one in its history, the
        supervisor told; returns ``line`` for ``metrics.jsonl``."""
        self.plan_json = replanned_json(self.plan_json, decision.plan, ended_at_step=step)
        write_json(self.plan_path, self.plan_json)
        self.plan = decision.plan
        if self.resharded is not None:
            self.resharded(self.plan, self.plan_json)
        return line

    def _reshare(self, step: int) -> dict[str, Any] | None:
        """The check of a data-parallel plan: answer with new shares (or keep), and record them.

        Nothing changes hands, so no room is checked: every replica already holds the whole model.
        """
        decision: Rebalance | None = None
        try:
            forced = forced_shares()
            decision = (
                _forced_shares(self.plan, forced[1], self.measured)
                if forced is not None
                else shares_decision(self.plan, list(self.measured))
            )
        except Exception as error:  # noqa: BLE001 - a failed check keeps the plan; it must not stop the run
            self.say(f"re-balance check after step {step} failed, keeping the plan: {_first_line(error)}")
        if decision is not None and decision.plan.shares == self.plan.shares:
            decision = None
        self.publish(decision_key(step), encode_shares(decision.plan.shares if decision else None))
        if decision is None:
            self.machine.move(RunEvent.PLAN_KEPT)
            return None
        self.machine.move(RunEvent.PLAN_MOVED)
        line = rebalance_line(step, self.plan, decision) | {
            "shares_from": list(self.plan.shares),
            "shares_to": list(decision.plan.shares),
        }
        return self._adopt(step, decision, line)

    def _decision(self, room_bytes: list[float] | None) -> tuple[Rebalance | None, Rebalance | None]:
        """(the re-shard to make or None, the better split that the room rules out or None).

        The best split is made when it fits the room. Otherwise the forced split of the test hook
        is held back, and the decision searches again within the room (each stage's, and that of
        stages sharing a device together): its split is made, naming the better one it could not
        make. It is held back only where the search could not bound a shared device (over
        ``plan.room.MAX_SHARED_CAP_CHOICES`` cap vectors) and its stages outgrow it.
        """
        forced = forced_reshard()
        if forced is not None:
            best: Rebalance | None = forced_rebalance(self.plan, forced[1], self.measured)
        else:
            best = self.decide(self.plan, list(self.measured), self.config)
        if room_bytes is None or best is None:
            return best, None
        shortfalls = memory_shortfalls(self.plan, best.layers, room_bytes)
        if not shortfalls:
            return best, None
        held = replace(best, reason="; ".join(shortfalls))
        if forced is not None:
            return None, held
        chosen = self.decide(self.plan, list(self.measured), self.config, room_bytes=room_bytes)
        if chosen is None:
            return None, held
        if short := memory_shortfalls(self.plan, chosen.layers, room_bytes):
            return None, replace(chosen, reason="; ".join(short))  # stages sharing a device
        ruled_out = f"{_ranges(best.layers)} would predict {best.predicted_step_s:.3f} s but {held.reason}"
        return replace(chosen, reason=f"{chosen.reason}; {ruled_out}"), None


def _first_line(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text.strip() else type(error).__name__


def forced_rebalance(plan: Plan, layers: list[tuple[int, int]], measured: list[StepMeasurement]) -> Rebalance:
    """The re-shard the test hook asks for: ``plan`` with ``layers``, predicting nothing new."""
    check_same_stages(plan.layer_ranges(), layers)
    stages = [
        replace(stage, start=start, stop=stop)
        for stage, (start, stop) in zip(plan.stages, layers, strict=True)
    ]
    current = mean(step.step_seconds for step in measured) if measured else 0.0
    return Rebalance(
        plan=replace(plan, stages=stages),
        predicted_step_s=plan.predicted_step_s,
        current_step_s=current,
        reason=f"forced by {FORCE_ENV}",
    )


def _forced_shares(plan: Plan, shares: list[int], measured: list[StepMeasurement]) -> Rebalance:
    """The new shares the test hook asks for: ``plan`` with ``shares``, predicting nothing new."""
    if len(shares) != len(plan.shares) or sum(shares) != sum(plan.shares):
        raise ShardpoolError(f"{FORCE_SHARES_ENV} shares {shares} do not split the plan's {plan.shares}")
    current = mean(step.step_seconds for step in measured) if measured else 0.0
    return Rebalance(
        plan=replace(plan, shares=list(shares)),
        predicted_step_s=plan.predicted_step_s,
        current_step_s=current,
        reason=f"forced by {FORCE_SHARES_ENV}",
    )


def rebalance_line(step: int, old: Plan, decision: Rebalance) -> dict[str, Any]:
    """The ``metrics.jsonl`` line of a re-shard after ``step``."""
    return {
        "event": "rebalance",
        "step": step,
        "from": [list(pair) for pair in old.layer_ranges()],
        "to": [list(pair) for pair in decision.layers],
        "predicted_step_s": round(decision.predicted_step_s, 6),
        "current_step_s": round(decision.current_step_s, 6),
        "reason": decision.reason,
    }


def held_line(step: int, old: Plan, held: Rebalance) -> dict[str, Any]:
    """The ``metrics.jsonl`` line of a check after ``step`` that keeps the plan because the better
    split ``held`` needs more memory than its stages have room for (``reason`` says which, how much)."""
    return rebalance_line(step, old, held) | {"event": "rebalance_held"}


def _ranges(layers: list[tuple[int, int]]) -> str:
    return " ".join(f"[{start}, {stop})" for start, stop in layers)


def resumed_json(interrupted: Any, new_json: dict[str, Any], *, resumed_from_step: int) -> dict[str, Any]:
    """``plan.json`` of a resumed run: its new plan, with the interrupted run's plans under
    ``history``: that run's own history, then the plan it last trained with, marked
    ``resumed_from_step`` (the checkpoint the new plan goes on from; the interrupted run may have
    trained past it). ``interrupted`` is what ``plan.json`` held (anything but a plan: no history)."""
    if not isinstance(interrupted, dict) or not isinstance(interrupted.get("stages"), list):
        return new_json
    return new_json | {"history": _history_after(interrupted, {"resumed_from_step": resumed_from_step})}


def carried_plan(
    interrupted: Any, fresh: Plan, *, replicas: int, resumed_from_step: int, rebalance: str = "auto"
) -> Plan | None:
    """The plan the interrupted run last trained with, when a re-balance made it, the checkpoint
    the run resumes from was trained with it, and the resumed run's own plan (``fresh``) puts
    the same stages on the same slots; None otherwise, and always with ``rebalance: off`` (the
    split is then the planner's or the config's, as asked).

    A re-balanced split is the one the run's measurements chose. Without this, a resumed run
    would start again from the profiles' split and find the measured one only at its own check,
    after its warm-up steps. The split is carried only where it is proven and nothing it was
    chosen for has changed:

    - the checkpoint (``resumed_from_step``) is newer than the step the split began after, so
      the split trained at least one step. A run stopped in its hand-over, or by a split that
      did not fit, plans afresh rather than meet the same failure again;
    - the same model depth, micro-batches, schedule and ``replicas``;
    - each stage on the same host, slot, device and dtype (a data-parallel plan: each replica; its
      re-balanced shares are carried, and a plan of the other kind never is);
    - every carried range fits its slot under the fresh plan's memory model.

    ``interrupted`` is what ``plan.json`` held.
    """
    if rebalance != "auto" or not isinstance(interrupted, dict):
        return None
    if interrupted.get("source") not in CARRIED_SOURCES or interrupted.get("replicas", 1) != replicas:
        return None
    began = _split_began_after(interrupted)
    if began is None or resumed_from_step <= began:
        return None
    try:
        kept = Plan.from_json(interrupted)
    except ShardpoolError:
        return None
    same_run = (kept.num_layers, kept.microbatches, kept.schedule, len(kept.stages)) == (
        fresh.num_layers,
        fresh.microbatches,
        fresh.schedule,
        len(fresh.stages),
    )
    if not same_run:
        return None
    if kept.is_data_parallel or fresh.is_data_parallel:  # re-balanced shares: the same replicas, each whole

        def places(plan: Plan) -> list[tuple[str, str, str, str]]:
            return [(r.host, r.slot, r.device, r.dtype) for r in plan.data_parallel]

        same = kept.is_data_parallel and fresh.is_data_parallel and places(kept) == places(fresh)
        return kept if same else None
    for old, new in zip(kept.stages, fresh.stages, strict=True):
        if (old.host, old.slot, old.device, old.dtype) != (new.host, new.slot, new.device, new.dtype):
            return None
        if new.costs is None or new.costs.memory(old.num_layers) > new.costs.capacity_bytes:
            return None
    return kept


def _split_began_after(current: dict[str, Any]) -> int | None:
    """The step after which ``plan.json``'s current split began: the step its re-balance
    followed, or the checkpoint a resume carried it from; None when the history does not say."""
    history = current.get("history")
    last = history[-1] if isinstance(history, list) and history else None
    key = "ended_at_step" if current.get("source") == "rebalance" else "resumed_from_step"
    step = last.get(key) if isinstance(last, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def replanned_json(current: dict[str, Any], new_plan: Plan, *, ended_at_step: int) -> dict[str, Any]:
    """``plan.json`` after a re-shard: the new plan, the run's keys kept, the current one in ``history``."""
    history = _history_after(current, {"ended_at_step": ended_at_step})
    kept = {key: current[key] for key in ("replicas",) if key in current}
    return new_plan.to_json() | kept | {"source": "rebalance", "history": history}


def _history_after(current: dict[str, Any], ended: dict[str, int]) -> list[Any]:
    """``current``'s history with ``current`` itself appended (without its own history), marked
    with how it ended (``ended``)."""
    earlier = {key: value for key, value in current.items() if key != "history"}
    history = current.get("history")
    return [*(history if isinstance(history, list) else []), earlier | ended]
