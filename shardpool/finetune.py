"""``shardpool finetune``: from a YAML config to a PEFT adapter in ``output_dir``.

The story of a run, top to bottom (:func:`finetune`, then ``_finetune_holding_output_dir``):
  1. **prepare**: load the config and pick the launcher (this machine, or the mesh members this
     machine's agent reports; a user it refuses stops here, with the fix); check everything that
     can fail before any process starts (the model directory, LoRA targets, stage count,
     datasets) and tokenize the data once (:func:`prepare_run`); bad input fails here, and
     nothing is written;
  2. **plan**: place the stages on the launcher's devices (accelerators measured in a child
     process that ends before any stage starts, :mod:`shardpool.plan.probe_process`), or go on
     with an interrupted run's re-balanced split; write what every stage reads (the tokenized
     data, ``plan.json``);
  3. **launch** and 4. **train** (:func:`shardpool.run_attempts.train_attempts`): write the job,
     host the rendezvous store, start one process per stage and replica
     (``python -m shardpool.elastic.rank job.json RANK``) and relay their events: the progress,
     ``metrics.jsonl``, the re-balance check's answer, each checkpoint finalized; a mesh run with
     ``on_member_loss: continue`` that loses a member (or gains one worth a restart) goes on from
     its newest complete step-boundary copy with a new plan, one attempt after the other
     (:class:`~shardpool.elastic.supervisor.Supervisor`);
  5. **write**: the stages' LoRA tensors merged into the adapter with the tokenizer
     (:meth:`~shardpool.train.run_outputs.RunOutputs.write_adapter`), the model card
     (``README.md``), the eval loss before and after, and how to load the adapter (:func:`finish_run`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from mesh.files import write_json
from shardpool.config import Config, load_config
from shardpool.console import RunEvents, print_placement, print_result
from shardpool.contract.job import StagePlacement
from shardpool.data.hub import with_local_sources
from shardpool.data.prepare import configure_tokenizer, prepare_data
from shardpool.data.prepared_file import save_prepared
from shardpool.data.rows import PreparedData
from shardpool.data.steps import config_step_batches
from shardpool.data.tokenizing import load_tokenizer
from shardpool.elastic.copies import clear_live_copies
from shardpool.elastic.policy import ReplanPolicy, placed_stages, placements_of
from shardpool.elastic.rebalancing import carried_plan, resumed_json
from shardpool.elastic.supervisor import Supervisor
from shardpool.errors import ShardpoolError
from shardpool.launch.mesh_launcher import MeshLauncher
from shardpool.launch.model_card import earlier_splits, render_model_card, write_model_card
from shardpool.launch.output_lock import locked_output_dir
from shardpool.launch.run import (
    METRICS_FILE,
    RUN_DIR_NAME,
    Launcher,
    RunRecord,
    append_metrics_line,
    launcher_for,
    replica_places_of,
    trim_metrics,
)
from shardpool.model.footprint import stage_footprints
from shardpool.model.lora import LoraSettings, base_model_reference, lora_settings
from shardpool.model.shape import ModelInfo, check_sequence_len, check_stage_count, read_model_info
from shardpool.plan.probe_process import ProcessProbe
from shardpool.plan.result import Plan
from shardpool.run_attempts import train_attempts
from shardpool.trackers import check_trackers, open_trackers
from shardpool.train import checkpoint as ckpt
from shardpool.train.run_outputs import RunOutputs
from shardpool.train.runfiles import DATA_INPUT

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
    #: ``shardpool.sample_prompts`` tokenized, and the ids a sample stops at (the job carries both).
    sample_prompt_ids: tuple[tuple[int, ...], ...] = ()
    eos_token_ids: tuple[int, ...] = ()


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
    # prepare and plan: every check before anything is written
    with probe:
        run = replace(
            prepare_run(config, resume=resume, planner=launcher.plan), base_model_reference=reference
        )
    # write what every stage reads
    run_dir = _write_run_inputs(run, console)
    _announce(run, console, events)
    # launch and train, one attempt after the other when a supervised run loses or gains a member
    outputs = run_outputs(run)
    supervisor = _supervisor(run, outputs, launcher, console, events)
    if supervisor is not None and isinstance(launcher, MeshLauncher):
        launcher = launcher.supervised_by(supervisor)
    trackers = open_trackers(as_written, Path(config.output_dir))
    try:
        run, relayed = train_attempts(
            run, run_dir, launcher, outputs=outputs, console=console, events=events, trackers=trackers,
            supervisor=supervisor,
        )  # fmt: skip
    finally:
        trackers.close()
    if supervisor is not None:
        clear_live_copies(Path(config.output_dir))  # the run is over: its step-boundary copies are spent
    # write the adapter, the model card and the result
    if relayed.final_dir is not None:
        outputs.write_adapter(relayed.final_dir)
    finish_run(as_written, config, run, relayed.record, console, events)
    return Path(config.output_dir)


def _announce(run: PreparedRun, console: Console, events: RunEvents) -> None:
    """Say what will be trained: the resumed split (if carried over) and the ``plan`` event."""
    if run.plan.get("source") == "resume" and run.planned is not None:
        console.print(
            f"resuming with the interrupted run's re-balanced split: {placed_stages(run.planned)}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    events.emit(
        "plan",
        output_dir=run.config.output_dir,
        model=run.model.base_name,
        num_layers=run.model.num_layers,
        total_steps=run.total_steps,
        first_step=run.first_step,
        train_rows=len(run.data.train),
        eval_rows=len(run.data.eval),
        plan=run.plan,
    )


def _supervisor(
    run: PreparedRun, outputs: RunOutputs, launcher: Launcher, console: Console, events: RunEvents
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
        checkpoints=outputs,
        say=lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True),
        emit=events.emit,
        record=lambda line: append_metrics_line(output_dir / METRICS_FILE, line),
        trim=lambda step: trim_metrics(output_dir / METRICS_FILE, keep_through_step=step),
        write_plan=lambda plan_json: write_json(output_dir / "plan.json", plan_json),
        output_dir=output_dir,
    )


def run_outputs(run: PreparedRun) -> RunOutputs:
    """Where ``run``'s checkpoints and adapter go (``output_dir``), and what they record."""
    output_dir = Path(run.config.output_dir).resolve()
    return RunOutputs(
        output_dir=output_dir,
        lora=run.lora,
        base_model=run.base_model_reference or run.config.base_model,
        total_steps=run.total_steps,
        keep=run.config.save_total_limit,
        scratch=output_dir / RUN_DIR_NAME,
        tokenizer=run.tokenizer,
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
    sample_prompt_ids = _sample_prompt_ids(config, tokenizer)
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
        sample_prompt_ids=sample_prompt_ids,
        eos_token_ids=_eos_token_ids(config.base_model) if sample_prompt_ids else (),
    )


def _sample_prompt_ids(config: Config, tokenizer: PreTrainedTokenizerBase) -> tuple[tuple[int, ...], ...]:
    """``shardpool.sample_prompts`` as the tokenizer encodes them (its special tokens added, as a
    user's ``tokenizer(prompt)`` for ``generate`` does)."""
    encoded = []
    for prompt in config.shardpool.sample_prompts:
        ids = tuple(int(token) for token in tokenizer(prompt)["input_ids"])
        if not ids:
            raise ShardpoolError(
                f"the sample prompt {prompt[:40]!r} encodes to no tokens; write a longer one"
            )
        encoded.append(ids)
    return tuple(encoded)


def _eos_token_ids(model_dir: str) -> tuple[int, ...]:
    """The end-of-sequence ids ``generate`` stops at for the model in ``model_dir``: its generation
    config's (``generation_config.json``, else the model config's), none when it names none."""
    from transformers import AutoConfig, GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json: transformers derives one from config.json
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir))
    eos = generation.eos_token_id
    if eos is None:
        return ()
    return tuple(int(token) for token in (eos if isinstance(eos, list) else [eos]))


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
