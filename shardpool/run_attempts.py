"""Start a run's stages and follow them to the end: one attempt, or one after the other when a supervised
mesh run loses or gains a member.

:func:`train_attempts` is the "train" part of ``shardpool finetune`` (:mod:`shardpool.finetune`):
per attempt it hosts the rendezvous store, writes the job, starts the stages through the launcher
and relays their events with :func:`relay_stages`: the progress, ``metrics.jsonl`` and the
trackers, the re-balance check's answer (:mod:`shardpool.elastic.rebalancing`), and each
checkpoint finalized as it arrives. A supervised run (:class:`~shardpool.elastic.supervisor.Supervisor`)
reports a step only once its step-boundary copies are complete (its commit gate), and an attempt
that ended with a lost or joined member is followed by the next one from the newest complete copy.
What the stages send last (their final LoRA tensors) is only noted here; the caller writes the
adapter once the stages are done.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from rich.console import Console

from shardpool.console import RunEvents, format_sample_lines, training_progress
from shardpool.contract.events import StageEvent
from shardpool.contract.job import Job
from shardpool.contract.names import resolve_inside
from shardpool.contract.rebalance import check_step
from shardpool.elastic.commit import CommitGate, passing
from shardpool.elastic.messages import ControlStore, control_key
from shardpool.elastic.policy import AttemptEnded
from shardpool.elastic.rebalancing import RebalanceCheck
from shardpool.elastic.states import RunMachine, RunState
from shardpool.elastic.supervisor import Supervisor
from shardpool.launch.mesh_launcher import Interrupted, MemberLost, MeshLauncher
from shardpool.launch.run import (
    Launcher,
    OnEvent,
    PlannedRun,
    RunRecord,
    build_job,
    sample_decoder,
    write_job,
)
from shardpool.plan.result import Plan
from shardpool.trackers import Trackers
from shardpool.train.rendezvous import rendezvous_store
from shardpool.train.run_outputs import RunOutputs
from shardpool.train.runfiles import job_inputs

__all__ = ["Relayed", "StagedRun", "relay_stages", "train_attempts"]


class StagedRun(PlannedRun, Protocol):
    """What an attempt reads of a run (finetune's ``PreparedRun``): what its job is built from,
    where it resumes and its plan."""

    @property
    def resume_from(self) -> Path | None: ...
    @property
    def plan(self) -> dict[str, Any]: ...
    @property
    def planned(self) -> Plan | None: ...


Run = TypeVar("Run", bound=StagedRun)


@dataclass
class Relayed:
    """What the stages of a run left: the record of their events and where they sent the final LoRA tensors."""

    record: RunRecord
    final_dir: Path | None = None


def train_attempts(
    run: Run,
    run_dir: Path,
    launcher: Launcher,
    *,
    outputs: RunOutputs,
    console: Console,
    events: RunEvents,
    trackers: Trackers,
    supervisor: Supervisor | None,
) -> tuple[Run, Relayed]:
    """Train ``run`` to its last step; return it as it ended (a growth in place changes its plan) and what its stages left.

    Without ``supervisor`` there is one attempt, and a lost member stops the run; with it, each
    lost or joined member ends an attempt and the supervisor starts the next one.
    """
    relayed: Relayed | None = None
    while True:
        try:
            relayed = _attempt(
                run, run_dir, launcher, outputs, console, events, trackers, relayed, supervisor
            )
        except AttemptEnded as ended:
            assert supervisor is not None and isinstance(launcher, MeshLauncher)
            run, launcher = supervisor.next_attempt(supervisor.current(run), launcher, ended)
            continue
        if supervisor is not None:
            supervisor.finished()
            run = supervisor.current(run)
        return run, relayed


def _attempt(
    run: StagedRun,
    run_dir: Path,
    launcher: Launcher,
    outputs: RunOutputs,
    console: Console,
    events: RunEvents,
    trackers: Trackers,
    relayed: Relayed | None,
    supervisor: Supervisor | None,
) -> Relayed:
    """One start of the run's stages, from ``run.first_step`` to the end (or to a lost or joined
    member, :class:`AttemptEnded`, when ``supervisor`` keeps the run going)."""
    config = run.config
    inputs = job_inputs(config, run_dir, run.resume_from)
    with launcher.serving(inputs, Path(config.output_dir)) as files_url:
        hosted = rendezvous_store(launcher.address, port=launcher.port)
        store = ControlStore(
            hosted, control_key(launcher.control_secret, addr=launcher.address, port=hosted.port)
        )
        check_at = check_step(
            config.shardpool.rebalance,
            first_step=run.first_step,
            total_steps=run.total_steps,
            num_stages=len(run.placements),
            data_parallel=run.planned is not None and run.planned.is_data_parallel,
        )
        job = build_job(
            run,
            inputs=inputs,
            master_addr=launcher.address,
            master_port=store.port,
            files_url=files_url,
            rebalance_at=check_at,
        )
        job_file = write_job(job, run_dir)
        supervised = supervisor if isinstance(launcher, MeshLauncher) else None
        if supervised is not None:
            supervised.begin(launcher, run, job, store)  # type: ignore[arg-type]
        rebalance = _rebalance_check(run, check_at, store, supervised)
        try:
            return relay_stages(
                console,
                events,
                run,
                job,
                start=lambda on_event: launcher.start(job, job_file, on_event),
                outputs=outputs,
                trackers=trackers,
                rebalance=rebalance,
                relayed=relayed,
                observe=supervised.observe if supervised is not None else None,
                gate=supervised.commit_gate() if supervised is not None else None,
            )
        except (MemberLost, Interrupted) as stopped:
            if supervised is None:
                raise
            raise supervised.ended(stopped) from stopped
        finally:
            del store, hosted


def _rebalance_check(
    run: StagedRun, check_at: int | None, store: Any, supervisor: Supervisor | None
) -> RebalanceCheck | None:
    """The launcher's re-balance check of ``run``, answering at ``store``; None when the run has none.

    A supervised run's check moves the supervisor's state and tells it the new plan.
    """
    if check_at is None or run.planned is None:
        return None
    return RebalanceCheck(
        plan=run.planned,
        plan_json=dict(run.plan),
        config=run.config,
        check_at=check_at,
        first_step=run.first_step,
        publish=store.set,
        plan_path=Path(run.config.output_dir) / "plan.json",
        resharded=supervisor.resharded if supervisor is not None else None,
        machine=supervisor.machine if supervisor is not None else RunMachine(RunState.TRAINING),
    )


def relay_stages(
    console: Console,
    events: RunEvents,
    run: StagedRun,
    job: Job,
    *,
    start: Callable[[OnEvent], None],
    outputs: RunOutputs,
    trackers: Trackers | None = None,
    rebalance: RebalanceCheck | None = None,
    relayed: Relayed | None = None,
    observe: OnEvent | None = None,
    gate: CommitGate | None = None,
) -> Relayed:
    """Start the stages with ``start`` and relay their events until all finish; return what they left.

    ``rebalance`` answers the stages' re-balance check (and records a re-shard); None: the job has none.
    ``relayed`` goes on with an earlier attempt's record; ``observe`` sees every reported event
    first (the supervisor). ``gate`` holds each step's reports until its step-boundary copy is
    complete (a supervised run); the re-balance check is answered at once, the stages wait for it.
    """
    gate = gate if gate is not None else passing()
    output_dir = Path(job.output_dir)
    record = relayed.record if relayed is not None else RunRecord(
        output_dir, run.config.logging_steps, run.total_steps, run.first_step, eval_before=job.eval_before,
        on_metrics=trackers.log if trackers is not None else None,
        sample_prompts=run.config.shardpool.sample_prompts, decode=sample_decoder(outputs.tokenizer),
    )  # fmt: skip
    result = Relayed(record, relayed.final_dir if relayed is not None else None)
    with training_progress(
        console,
        total_steps=run.total_steps,
        first_step=run.first_step,
        logging_steps=run.config.logging_steps,
    ) as progress:
        if rebalance is not None:
            rebalance.say = progress.say

        def on_event(event: dict[str, Any]) -> None:
            if event.get("event") != StageEvent.STEP:
                gate.then(lambda: report(event))
                return
            line = rebalance.on_step(event) if rebalance is not None else None
            gate.step(int(event["step"]), lambda: report(event))
            if line is not None:
                gate.then(lambda: rebalanced(line))

        def rebalanced(line: dict[str, Any]) -> None:
            record.record_rebalance(line)
            progress.say(rebalance_message(line))
            events.emit(line["event"], **_fields(line))

        def report(event: dict[str, Any]) -> None:
            if observe is not None:
                observe(event)
            record.record(event)
            kind = event.get("event")
            if kind == StageEvent.STEP:
                progress.step(event)
                events.emit("step", total_steps=run.total_steps, **_fields(event))
            elif kind == StageEvent.EVAL:
                events.emit("eval", **_fields(event))
            elif kind == StageEvent.SAMPLES:
                line = record.samples_line(event)
                for said in format_sample_lines(line):
                    progress.say(said)
                events.emit("samples", step=line["step"], samples=line["samples"])
            elif kind == StageEvent.CHECKPOINT_WRITTEN:
                partial = resolve_inside(output_dir, event["partial"], "checkpoint directory")
                final, deleted = outputs.finalize_checkpoint(partial, event["step"], event.get("eval_before"))
                progress.say(f"checkpoint saved: {final}")
                for old in deleted:
                    progress.say(f"checkpoint deleted (save_total_limit): {old}")
                events.emit(
                    "checkpoint", step=event["step"], path=str(final), deleted=[str(old) for old in deleted]
                )
            elif kind == StageEvent.FINAL_WRITTEN:
                result.final_dir = resolve_inside(output_dir, event["directory"], "final adapter directory")

        record.timed(start, on_event)
        gate.release_all()
    record.write_summary()
    return result


def rebalance_message(line: dict[str, Any]) -> str:
    """The console line of a re-shard, or of a check whose better split the stages' room rules out."""
    moved = " ".join(f"[{start}, {stop})" for start, stop in line["to"])
    if line["event"] == "rebalance_held":
        return (
            f"re-balance after step {line['step']} held back, keeping the plan: layers {moved} would "
            f"predict {line['predicted_step_s']:.3f} s/step (measured {line['current_step_s']:.3f}), "
            f"but {line['reason']}"
        )
    return (
        f"re-balanced after step {line['step']}: layers now {moved} ({line['reason']}; "
        f"predicted {line['predicted_step_s']:.3f} s/step, measured {line['current_step_s']:.3f} s/step)"
    )


def _fields(event: dict[str, Any]) -> dict[str, Any]:
    """A stage event's fields without its ``event`` name."""
    return {key: value for key, value in event.items() if key != "event"}
