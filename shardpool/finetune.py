"""``shardpool finetune``: from a YAML config to a PEFT adapter in ``output_dir``.

The story of a run, top to bottom:
  1. load the config and pick the launcher: this machine, or the mesh members this machine's
     agent reports (a user it refuses stops here, with the fix);
  2. check everything that can fail before any process starts (the model directory, LoRA
     targets, stage count, datasets), tokenize the data once, and plan the stages on the
     launcher's devices (accelerators measured in a child process that ends before any stage
     starts, :mod:`shardpool.plan.probe_process`); bad input fails here, and nothing is written;
  3. write what every stage reads (the tokenized data, ``plan.json``, ``.shardpool/job.json``),
     serve it to remote stages, and host the rendezvous store;
  4. start one process per stage and replica, ``python -m shardpool.train.worker job.json RANK``
     (:mod:`shardpool.train.worker`), and relay their events: the progress (a bar on a terminal,
     else a log line per logged step) and ``metrics.jsonl`` per step and periodic eval, the
     re-balance check after the warm-up steps answered (:mod:`shardpool.launch.rebalancing`),
     checkpoints finalized (the oldest deleted past ``save_total_limit``), and
     at the end the stages' LoRA tensors merged into the adapter, saved with the tokenizer; a mesh
     run with ``on_member_loss: continue`` that loses a member (or gains one worth a restart)
     goes on from its newest complete step-boundary copy with a new plan, one attempt after the
     other (:class:`~shardpool.launch.supervise.Supervisor`);
  5. write the model card (``README.md``), report eval loss before and after, and how to load
     the adapter.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from mesh.files import write_json
from shardpool.config import Config, load_config
from shardpool.console import RunEvents, print_placement, print_result, training_progress
from shardpool.contract.events import StageEvent
from shardpool.contract.job import Job, StagePlacement
from shardpool.contract.names import resolve_inside
from shardpool.contract.rebalance import check_step
from shardpool.data.hub import with_local_sources
from shardpool.data.prepare import configure_tokenizer, prepare_data
from shardpool.data.prepared_file import save_prepared
from shardpool.data.rows import PreparedData
from shardpool.data.steps import config_step_batches
from shardpool.data.tokenizing import load_tokenizer, save_tokenizer
from shardpool.errors import ShardpoolError
from shardpool.launch.commit import CommitGate, passing
from shardpool.launch.mesh_launcher import Interrupted, MemberLost, MeshLauncher
from shardpool.launch.model_card import earlier_splits, render_model_card, write_model_card
from shardpool.launch.output_lock import locked_output_dir
from shardpool.launch.rebalancing import RebalanceCheck, carried_plan, resumed_json
from shardpool.launch.run import (
    METRICS_FILE,
    RUN_DIR_NAME,
    Launcher,
    OnEvent,
    RunRecord,
    append_metrics_line,
    build_job,
    launcher_for,
    replica_places_of,
    trim_metrics,
    write_job,
)
from shardpool.launch.supervise import (
    AttemptEnded,
    ReplanPolicy,
    Supervisor,
    clear_live_copies,
    placed_stages,
    placements_of,
)
from shardpool.model.footprint import stage_footprints
from shardpool.model.lora import LoraSettings, base_model_reference, lora_settings, write_adapter
from shardpool.model.shape import ModelInfo, check_sequence_len, check_stage_count, read_model_info
from shardpool.plan.probe_process import ProcessProbe
from shardpool.plan.result import Plan
from shardpool.trackers import Trackers, check_trackers, open_trackers
from shardpool.train import checkpoint as ckpt
from shardpool.train.rendezvous import rendezvous_store
from shardpool.train.runfiles import DATA_INPUT, job_inputs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["PreparedRun", "finetune", "finetune_from_file", "finish_run", "prepare_run"]


@dataclass(frozen=True)
class PreparedRun:
    """A run that passed every check: what will be trained, where, on what data, from which step."""

    config: Config
    model: ModelInfo
    lora: LoraSettings
    placements: list[StagePlacement]
    data: PreparedData
    total_steps: int
    resume_from: Path | None
    plan: dict[str, Any]
    first_step: int = 0
    eval_before: float | None = None
    tokenizer: PreTrainedTokenizerBase | None = None
    base_model_reference: str | None = (
        None  # what the adapter names as its base: a hub id or an absolute path
    )
    planned: Plan | None = None  # the plan behind ``plan`` (its JSON), for the re-balance check


def finetune_from_file(
    config_path: str | Path, *, resume: bool = False, console: Console | None = None
) -> Path:
    """Validate the config at ``config_path``, train, and return the adapter directory."""
    return finetune(load_config(config_path), resume=resume, console=console)


def finetune(
    config: Config,
    *,
    resume: bool = False,
    console: Console | None = None,
    events: RunEvents | None = None,
    agent_socket: str | None = None,
) -> Path:
    """Train ``config`` on its stages (local processes, or mesh members) and return the adapter directory.

    ``events`` receives the run's events (``finetune --json``); ``agent_socket`` is the local
    agent's socket for ``placement: mesh`` (default: :func:`~shardpool.agent.local_client.agent_socket_path`).
    """
    console = console or Console()
    events = events or RunEvents()
    check_trackers(config)
    as_written, config = config, with_local_sources(config)
    reference = base_model_reference(as_written.base_model)
    probe = ProcessProbe()  # a local plan's accelerators are measured in a child process
    launcher = launcher_for(config, say=console.print, probe=probe, agent_socket=agent_socket)
    with _output_dir_held(config.output_dir):
        return _finetune_holding_output_dir(
            as_written, config, reference, launcher, probe, resume=resume, console=console, events=events
        )


@contextmanager
def _output_dir_held(output_dir: str) -> Iterator[None]:
    """Hold ``output_dir`` for this run (a second run into it is refused); a run that fails before
    it writes anything leaves no directory it created behind."""
    created = not Path(output_dir).exists()
    with locked_output_dir(output_dir) as lock_file:
        try:
            yield
        except BaseException:
            if created and not (lock_file.parent / RUN_DIR_NAME).exists():
                lock_file.unlink(missing_ok=True)
                with suppress(OSError):
                    lock_file.parent.rmdir()
            raise


def _finetune_holding_output_dir(
    as_written: Config,
    config: Config,
    reference: str,
    launcher: Launcher,
    probe: ProcessProbe,
    *,
    resume: bool,
    console: Console,
    events: RunEvents,
) -> Path:
    """Train ``config`` (hub ids resolved to local paths; ``as_written`` is the user's) in the held output_dir.

    ``probe`` is the one ``launcher`` measures this machine with: its child process, holding the
    measured accelerators' memory, ends with the planning, before any stage starts.
    """
    with probe:
        run = replace(
            prepare_run(config, resume=resume, planner=launcher.plan), base_model_reference=reference
        )
    run_dir = _write_run_inputs(run, console)
    if run.plan.get("source") == "resume" and run.planned is not None:
        console.print(
            f"resuming with the interrupted run's re-balanced split: {placed_stages(run.planned)}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    events.emit(
        "plan",
        output_dir=config.output_dir,
        model=run.model.base_name,
        num_layers=run.model.num_layers,
        total_steps=run.total_steps,
        first_step=run.first_step,
        train_rows=len(run.data.train),
        eval_rows=len(run.data.eval),
        plan=run.plan,
    )
    supervisor = _supervisor(run, launcher, console, events)
    record: RunRecord | None = None
    trackers = open_trackers(as_written, Path(config.output_dir))
    try:
        while True:
            try:
                record = _attempt(run, run_dir, launcher, console, events, trackers, record, supervisor)
                if supervisor is not None:
                    run = supervisor.current(run)  # a member that joined in place changed the plan
                break
            except AttemptEnded as ended:
                assert supervisor is not None and isinstance(launcher, MeshLauncher)
                run, launcher = supervisor.next_attempt(supervisor.current(run), launcher, ended)
    finally:
        trackers.close()
    assert record is not None
    if supervisor is not None:
        clear_live_copies(Path(config.output_dir))  # the run is over: its step-boundary copies are spent
    finish_run(as_written, config, run, record, console, events)
    return Path(config.output_dir)


def _attempt(
    run: PreparedRun,
    run_dir: Path,
    launcher: Launcher,
    console: Console,
    events: RunEvents,
    trackers: Trackers,
    record: RunRecord | None,
    supervisor: Supervisor | None,
) -> RunRecord:
    """One start of the run's stages, from ``run.first_step`` to the end (or to a lost or joined
    member, :class:`AttemptEnded`, when ``supervisor`` keeps the run going)."""
    config = run.config
    inputs = job_inputs(config, run_dir, run.resume_from)
    with launcher.serving(inputs, Path(config.output_dir)) as files_url:
        store = rendezvous_store(launcher.address, port=launcher.port)
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
        rebalance = _rebalance_check(run, check_at, store)
        if supervisor is not None and isinstance(launcher, MeshLauncher):
            supervisor.begin(launcher, run, job, store)
            if rebalance is not None:
                rebalance.resharded = supervisor.resharded
        try:
            return _train(
                console,
                events,
                run,
                job,
                start=lambda on_event: launcher.start(job, job_file, on_event),
                trackers=trackers,
                rebalance=rebalance,
                record=record,
                observe=supervisor.observe if supervisor is not None else None,
                gate=supervisor.commit_gate() if supervisor is not None else None,
            )
        except (MemberLost, Interrupted) as stopped:
            if supervisor is None:
                raise
            raise supervisor.ended(stopped) from stopped
        finally:
            del store


def _supervisor(
    run: PreparedRun, launcher: Launcher, console: Console, events: RunEvents
) -> Supervisor | None:
    """What keeps a mesh run going when a member is lost or joins; None for a run that stops instead."""
    config = run.config
    if not Supervisor.wanted(config, launcher):
        return None
    output_dir = Path(config.output_dir)
    settings = config.shardpool
    return Supervisor(
        config=config,
        policy=ReplanPolicy(settings.on_member_loss, settings.min_members, settings.max_replans_per_hour),
        checkpoints=_RunCheckpoints(run),
        say=lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True),
        emit=events.emit,
        record=lambda line: append_metrics_line(output_dir / METRICS_FILE, line),
        trim=lambda step: trim_metrics(output_dir / METRICS_FILE, keep_through_step=step),
        write_plan=lambda plan_json: write_json(output_dir / "plan.json", plan_json),
        output_dir=output_dir,
    )


@dataclass(frozen=True)
class _RunCheckpoints:
    """The run's checkpoints as the supervisor asks for them (see :class:`~shardpool.launch.supervise.Checkpoints`)."""

    run: PreparedRun

    def partial(self, step: int) -> Path:
        return ckpt.partial_dir(self.run.config.output_dir, step)

    def finalize(self, partial: Path, step: int, eval_before: float | None) -> Path:
        run = self.run
        final = ckpt.finalize_checkpoint(
            partial,
            step=step,
            settings=run.lora,
            base_model=run.base_model_reference or run.config.base_model,
            extra={"eval_before": eval_before, "total_steps": run.total_steps},
        )
        ckpt.prune_checkpoints(run.config.output_dir, keep=run.config.save_total_limit)
        return final

    def newest(self) -> Path | None:
        return ckpt.newest_checkpoint(self.run.config.output_dir)

    def step_of(self, checkpoint: Path) -> int:
        return ckpt.checkpoint_step(checkpoint)

    def eval_before_of(self, checkpoint: Path) -> float | None:
        return ckpt.checkpoint_eval_before(checkpoint)


def _rebalance_check(run: PreparedRun, check_at: int | None, store: Any) -> RebalanceCheck | None:
    """The launcher's re-balance check of ``run``, answering at ``store``; None when the run has none."""
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
    )


def finish_run(
    as_written: Config,
    config: Config,
    run: PreparedRun,
    record: RunRecord,
    console: Console,
    events: RunEvents | None = None,
) -> None:
    """After the stages finished: write the model card (of the config as written) and report the result.

    The card shows the split the run ended with and the ones before it: ``plan.json`` as a
    re-balance or a re-plan last rewrote it (the run's own placements where it cannot be read).
    """
    placements, earlier, shares = _trained_splits(run)
    card = render_model_card(
        as_written,
        base_model=run.base_model_reference or base_model_reference(as_written.base_model),
        target_modules=run.lora.target_modules,
        placements=placements,
        outcome=record.outcome(run.total_steps),
        earlier=earlier,
        shares=shares,
    )
    write_model_card(config.output_dir, card)
    print_result(console, config, record)
    (events or RunEvents()).emit(
        "done",
        output_dir=config.output_dir,
        steps=run.total_steps,
        final_train_loss=record.last_loss,
        eval_loss_before=record.eval_before,
        eval_loss_after=record.eval_after,
        seconds=round(record.seconds, 3),
    )


def prepare_run(config: Config, *, resume: bool, planner: Callable[[Config], Plan]) -> PreparedRun:
    """Check everything that can fail before training, tokenize the data, and place the stages.

    Writes nothing. ``planner`` places the stages on the launcher's devices.
    """
    model = read_model_info(config.base_model)
    lora = lora_settings(config)
    check_stage_count(config, model)
    check_sequence_len(config, model)
    tokenizer = load_tokenizer(config.base_model)
    configure_tokenizer(config, tokenizer)
    data = prepare_data(config, tokenizer)
    total_steps = len(config_step_batches(config, len(data.train), replicas=config.shardpool.replicas))
    resume_from = ckpt.resume_point(
        Path(config.output_dir),
        resume=resume,
        explicit=config.resume_from_checkpoint,
        auto=config.auto_resume_from_checkpoints,
    )
    plan = planner(config)
    source = "manual" if config.shardpool.layers else "planner"
    interrupted = _read_plan_json(Path(config.output_dir)) if resume_from else None
    first_step = ckpt.checkpoint_step(resume_from) if resume_from else 0
    carried = carried_plan(
        interrupted,
        plan,
        replicas=config.shardpool.replicas,
        resumed_from_step=first_step,
        rebalance=config.shardpool.rebalance,
    )
    if carried is not None:
        plan, source = carried, "resume"
    placements = placements_of(plan)
    plan_json = plan.to_json() | {"replicas": config.shardpool.replicas, "source": source}
    if resume_from:
        plan_json = resumed_json(interrupted, plan_json, resumed_from_step=first_step)
    eval_before = ckpt.checkpoint_eval_before(resume_from) if resume_from else None
    return PreparedRun(
        config,
        model,
        lora,
        placements,
        data,
        total_steps,
        resume_from,
        plan_json,
        first_step,
        eval_before,
        tokenizer,
        planned=plan,
    )


def _trained_splits(run: PreparedRun) -> tuple[list[StagePlacement], list[str], list[int]]:
    """The placements the run ended with (a data-parallel run's replicas), a line per split before
    them, and the replicas' shares (empty for a pipeline), from ``plan.json``."""
    written = _read_plan_json(Path(run.config.output_dir))
    try:
        final = Plan.from_json(written)
    except ShardpoolError:
        return run.placements, [], []
    earlier = earlier_splits(written.get("history"))
    return replica_places_of(final) or placements_of(final), earlier, list(final.shares)


def _read_plan_json(output_dir: Path) -> Any:
    """What ``output_dir/plan.json`` holds, or None when it is missing or unreadable (a resume
    goes on without the interrupted run's plans rather than stop for them)."""
    try:
        return json.loads((output_dir / "plan.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_run_inputs(run: PreparedRun, console: Console) -> Path:
    """Create output_dir, write the tokenized data and plan.json, show the placement; return the run directory."""
    output_dir = Path(run.config.output_dir)
    run_dir = output_dir / RUN_DIR_NAME
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt.clear_partials(output_dir)
    clear_live_copies(output_dir)  # copies an earlier run left behind count for nothing now
    save_prepared(run.data, run_dir / DATA_INPUT)
    write_json(output_dir / "plan.json", run.plan)
    trim_metrics(output_dir / METRICS_FILE, keep_through_step=run.first_step)
    replicas = replica_places_of(run.planned)
    shown = replicas or run.placements
    print_placement(
        console,
        run.config,
        model_name=run.model.base_name,
        num_layers=run.model.num_layers,
        placements=shown,
        footprints=(
            stage_footprints(run.model, replicas[:1]) * len(replicas)  # each holds the whole model
            if replicas
            else stage_footprints(run.model, run.placements)
        ),
        predicted_ms=[  # plan.json lists a data-parallel plan's replicas under "data_parallel"
            stage.get("predicted_ms_per_microbatch")
            for stage in run.plan.get("data_parallel") or run.plan["stages"]
        ],
        total_steps=run.total_steps,
        rows=(len(run.data.train), len(run.data.eval)),
        shares=list(run.planned.shares) if replicas and run.planned is not None else None,
    )
    return run_dir


def _train(
    console: Console,
    events: RunEvents,
    run: PreparedRun,
    job: Job,
    *,
    start: Callable[[OnEvent], None],
    trackers: Trackers | None = None,
    rebalance: RebalanceCheck | None = None,
    record: RunRecord | None = None,
    observe: OnEvent | None = None,
    gate: CommitGate | None = None,
) -> RunRecord:
    """Start the stages with ``start`` and relay their events until all finish; return what was recorded.

    ``rebalance`` answers the stages' re-balance check (and records a re-shard); None: the job has none.
    ``record`` goes on with an earlier attempt's record; ``observe`` sees every reported event
    first (the supervisor). ``gate`` holds each step's reports until its step-boundary copy is
    complete (a supervised run); the re-balance check is answered at once, the stages wait for it.
    """
    gate = gate if gate is not None else passing()
    output_dir = Path(job.output_dir)
    record = record or RunRecord(
        output_dir, run.config.logging_steps, run.total_steps, run.first_step, eval_before=job.eval_before,
        on_metrics=trackers.log if trackers is not None else None,
    )  # fmt: skip
    with training_progress(
        console,
        total_steps=run.total_steps,
        first_step=run.first_step,
        logging_steps=run.config.logging_steps,
    ) as progress:
        if rebalance is not None:
            rebalance.say = progress.say

        def rebalanced(line: dict[str, Any]) -> None:
            record.record_rebalance(line)
            progress.say(_rebalance_message(line))
            events.emit(line["event"], **_fields(line))

        def on_event(event: dict[str, Any]) -> None:
            if event.get("event") != StageEvent.STEP:
                gate.then(lambda: report(event))
                return
            line = rebalance.on_step(event) if rebalance is not None else None
            gate.step(int(event["step"]), lambda: report(event))
            if line is not None:
                gate.then(lambda: rebalanced(line))

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
            elif kind == StageEvent.CHECKPOINT_WRITTEN:
                final = ckpt.finalize_checkpoint(
                    resolve_inside(output_dir, event["partial"], "checkpoint directory"),
                    step=event["step"],
                    settings=run.lora,
                    base_model=run.base_model_reference or run.config.base_model,
                    extra={"eval_before": event.get("eval_before"), "total_steps": run.total_steps},
                )
                progress.say(f"checkpoint saved: {final}")
                deleted = ckpt.prune_checkpoints(output_dir, keep=run.config.save_total_limit)
                for old in deleted:
                    progress.say(f"checkpoint deleted (save_total_limit): {old}")
                events.emit(
                    "checkpoint", step=event["step"], path=str(final), deleted=[str(old) for old in deleted]
                )
            elif kind == StageEvent.FINAL_WRITTEN:
                final_dir = resolve_inside(output_dir, event["directory"], "final adapter directory")
                lora = ckpt.merge_stage_lora(final_dir)
                write_adapter(
                    output_dir, lora, run.lora, base_model=run.base_model_reference or run.config.base_model
                )
                if run.tokenizer is not None:
                    save_tokenizer(run.tokenizer, output_dir, scratch_parent=output_dir / RUN_DIR_NAME)
                shutil.rmtree(final_dir, ignore_errors=True)

        record.timed(start, on_event)
        gate.release_all()
    record.write_summary()
    return record


def _rebalance_message(line: dict[str, Any]) -> str:
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
