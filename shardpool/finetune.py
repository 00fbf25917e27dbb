"""``shardpool finetune``: from a YAML config to a PEFT adapter in ``output_dir``.

The flow, top to bottom:
  1. validate everything that can be checked before any process starts (config, model directory,
     LoRA targets, layer split, datasets) — bad input fails here, and nothing is written;
  2. tokenize the data once, into one safetensors file every stage reads;
  3. write ``plan.json`` and the job description, print the placement;
  4. start one process per stage and replica, follow their events with a progress bar, and write
     ``metrics.jsonl``;
  5. report eval loss before and after, and where the adapter is.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from mesh.files import atomic_write, write_json
from shardpool.config import Config, load_config
from shardpool.contract.jobfile import Job, StagePlacement
from shardpool.contract.spec import RESUME_PREFIX, StageEvent, resolve_inside
from shardpool.data.prepare import prepare_data
from shardpool.data.prepared_file import save_prepared
from shardpool.data.rows import PreparedData
from shardpool.data.steps import step_batches
from shardpool.data.tokenizing import load_tokenizer
from shardpool.errors import ShardpoolError
from shardpool.launch.local_launcher import run_local_job
from shardpool.model.architecture import DECODER_LINEAR_NAMES, ModelInfo, read_model_info
from shardpool.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraSettings, lora_settings, write_adapter
from shardpool.model.shape import ModelShape
from shardpool.model.stage import StageSpec, owned_tensor_names
from shardpool.model.weights import WeightReader
from shardpool.plan.costmodel import Workload
from shardpool.plan.planner import Plan, plan_for_config, plan_pipeline
from shardpool.train.checkpoint import (
    checkpoint_step,
    clear_partials,
    finalize_checkpoint,
    merge_stage_lora,
    newest_checkpoint,
)
from shardpool.train.pipeline import DATA_INPUT, INIT_ADAPTER_PREFIX
from shardpool.train.runfiles import MODEL_PREFIX, model_file_names

__all__ = [
    "finetune_from_file",
    "finetune",
    "prepare_run",
    "PreparedRun",
    "check_stage_count",
    "RUN_DIR_NAME",
]

RUN_DIR_NAME = ".shardpool"
_NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit codes + 8-bit absmax + fp32 per 256 absmax


@dataclass(frozen=True)
class PreparedRun:
    """A run that passed every check: what will be trained, where, on what data."""

    config: Config
    model: ModelInfo
    lora: LoraSettings
    placements: list[StagePlacement]
    data: PreparedData
    total_steps: int
    resume_from: Path | None
    plan: dict[str, Any]


def finetune_from_file(
    config_path: str | Path, *, resume: bool = False, console: Console | None = None
) -> Path:
    """Validate the config at ``config_path``, train, and return the adapter directory."""
    return finetune(load_config(config_path), resume=resume, console=console)


def finetune(config: Config, *, resume: bool = False, console: Console | None = None) -> Path:
    """Train ``config`` on its stages (local processes, or mesh members) and return the adapter directory."""
    console = console or Console()
    if config.shardpool.placement == "mesh":
        return _finetune_on_mesh(config, resume=resume, console=console)
    run = prepare_run(config, resume=resume)
    output_dir, run_dir, first_step = _begin_outputs(run, console)
    store = rendezvous_store("127.0.0.1", port=config.shardpool.master_port or 0)
    inputs = job_inputs(config, run_dir, run.resume_from)
    job = _make_job(
        run, inputs=inputs, master_addr="127.0.0.1", master_port=store.port, first_step=first_step
    )
    job_file = run_dir / "job.json"
    job.write(job_file)
    outcome = _follow(console, job, run, first_step=first_step, start=lambda on_event: run_local_job(
        job, job_file, log_dir=run_dir / "logs", on_event=on_event
    ))  # fmt: skip
    del store
    _print_result(console, run, outcome)
    return output_dir


def _finetune_on_mesh(config: Config, *, resume: bool, console: Console) -> Path:
    """The same run with stages on mesh members: plan over their devices, serve them the files.

    Everything goes through this machine's agent, over its Unix socket. Asking it for the members
    comes first, so a user it refuses gets the one-line fix before anything is prepared anywhere.
    """
    from shardpool.agent.client import LocalAgentClient
    from shardpool.files.server import FileServer
    from shardpool.launch.mesh_launcher import mesh_fleet, new_job_id, online_members, run_mesh_job

    members = online_members(LocalAgentClient())
    me = next((member for member in members if member.is_self), None)
    if me is None:
        raise ShardpoolError("this machine's mesh interface is down; run `shardpool mesh up` first")
    console.print(f"mesh members online: {', '.join(member.name for member in members)}")

    def plan_on_mesh(shape: ModelShape, workload: Workload) -> Plan:
        fleet = mesh_fleet(members, model_config=shape_config(config), workload=workload, say=console.print)
        if workload.stages is not None and workload.stages > len(fleet.devices):
            console.print(f"only {len(fleet.devices)} devices online: planning {len(fleet.devices)} stages")
            workload = replace(workload, stages=len(fleet.devices))
        return plan_pipeline(shape, workload, fleet)

    run = prepare_run(config, resume=resume, planner=plan_on_mesh)
    output_dir, run_dir, first_step = _begin_outputs(run, console)
    inputs = job_inputs(config, run_dir, run.resume_from)
    files = {name: Path(path) for name, path in inputs.items()}
    files_secret = secrets.token_hex(32)
    with FileServer(me.address, 0, files=files, upload_root=output_dir, secret=files_secret) as server:
        store = rendezvous_store(me.address)
        job = _make_job(
            run,
            inputs=inputs,
            master_addr=me.address,
            master_port=store.port,
            first_step=first_step,
            files_url=server.url,
        )
        job.write(run_dir / "job.json")
        by_name = {member.name: member for member in members}
        assignments: dict[str, tuple[Any, list[int]]] = {}
        for rank in range(job.world_size):
            host = job.stages[job.stage_index(rank)].host
            assignments.setdefault(host, (by_name[host], []))[1].append(rank)
        job_id = new_job_id()
        outcome = _follow(console, job, run, first_step=first_step, start=lambda on_event: run_mesh_job(
            job, job_id, assignments, on_event=on_event, files_secret=files_secret
        ))  # fmt: skip
        del store
    _print_result(console, run, outcome)
    return output_dir


def shape_config(config: Config) -> dict[str, Any]:
    """The base model's config.json, as agents need it to profile a layer."""
    return json.loads((Path(config.base_model) / "config.json").read_text(encoding="utf-8"))


def _begin_outputs(run: PreparedRun, console: Console) -> tuple[Path, Path, int]:
    """Create output_dir and write what every stage reads: the tokenized data and plan.json."""
    output_dir = Path(run.config.output_dir)
    run_dir = output_dir / RUN_DIR_NAME
    run_dir.mkdir(parents=True, exist_ok=True)
    clear_partials(output_dir)
    save_prepared(run.data, run_dir / DATA_INPUT)
    write_json(output_dir / "plan.json", run.plan)
    first_step = checkpoint_step(run.resume_from) if run.resume_from else 0
    _trim_metrics(output_dir / "metrics.jsonl", keep_through_step=first_step)
    _print_placement(console, run)
    return output_dir, run_dir, first_step


def _make_job(
    run: PreparedRun,
    *,
    inputs: dict[str, str],
    master_addr: str,
    master_port: int,
    first_step: int,
    files_url: str | None = None,
) -> Job:
    config = run.config
    return Job(
        config=config.model_dump(mode="json"),
        stages=run.placements,
        replicas=config.shardpool.replicas,
        inputs=inputs,
        output_dir=str(Path(config.output_dir).resolve()),
        master_addr=master_addr,
        master_port=master_port,
        total_steps=run.total_steps,
        threads_per_process=_threads_per_process(config, len(run.placements) * config.shardpool.replicas),
        resume_step=first_step,
        eval_before=_eval_before(run.resume_from),
        files_url=files_url,
    )


def rendezvous_store(host: str, *, port: int = 0, timeout_s: float = 300.0) -> Any:
    """The torch.distributed TCPStore the stage processes meet at, hosted by the launcher.

    Hosting it here (not in rank 0) lets the OS pick a free port (``port=0``), and keeps rendezvous
    on the launcher's address whichever machine runs stage 0. The store listens on ``host`` only
    (the launcher's mesh address, or loopback): torch's own master socket would listen on every
    interface, so this creates the listening socket itself and hands it over as
    ``master_listen_fd``. The store owns that socket from then on and closes it when it is freed.
    """
    import torch.distributed as dist

    from mesh.errors import MeshError
    from mesh.http.transport import listen_tcp

    try:
        listener = listen_tcp(host, port)
    except MeshError as error:
        raise ShardpoolError(f"cannot host the rendezvous store: {error}") from None
    bound_port = listener.getsockname()[1]
    fd = listener.detach()
    try:
        return dist.TCPStore(
            host,
            bound_port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=fd,
        )
    except BaseException:
        _close_quietly(fd)
        raise


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass  # the store already closed it


def job_inputs(config: Config, run_dir: Path, resume_from: Path | None) -> dict[str, str]:
    """Every file a stage may read, by name, with its path on this machine."""
    model_dir = Path(config.base_model).resolve()
    inputs = {DATA_INPUT: str((run_dir / DATA_INPUT).resolve())}
    inputs.update({MODEL_PREFIX + name: str(model_dir / name) for name in model_file_names(model_dir)})
    if config.lora_model_dir:
        adapter = Path(config.lora_model_dir).resolve()
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            inputs[INIT_ADAPTER_PREFIX + name] = str(adapter / name)
    if resume_from is not None:
        for path in sorted(resume_from.glob("*.safetensors")):
            if path.name.startswith(("stage-", "rng-rank-")):
                inputs[RESUME_PREFIX + path.name] = str(path.resolve())
    return inputs


# ----- validation -------------------------------------------------------------------------------
def prepare_run(
    config: Config, *, resume: bool, planner: Callable[[ModelShape, Workload], Plan] | None = None
) -> PreparedRun:
    """Check everything that can fail before training, tokenize the data, and place the stages.

    Writes nothing. ``planner`` places the stages on a fleet other than this machine's devices.
    """
    model = read_model_info(config.base_model)
    lora = lora_settings(config)
    check_stage_count(config, model)
    data = prepare_data(config, load_tokenizer(config.base_model))
    total_steps = len(
        step_batches(
            len(data.train),
            micro_batch_size=config.micro_batch_size,
            micro_batches_per_step=config.gradient_accumulation_steps * config.shardpool.replicas,
            num_epochs=config.num_epochs,
            max_steps=config.max_steps,
            shuffle_each_epoch=config.shuffle_merged_datasets,
            seed=config.seed,
        )
    )
    resume_from = _resume_point(Path(config.output_dir), resume)
    plan = (
        plan_for_config(config)
        if planner is None
        else planner(ModelShape.from_config_dir(config.base_model), Workload.from_config(config))
    )
    placements = [
        StagePlacement(start=stage.start, stop=stage.stop, device=stage.device, host=stage.host)
        for stage in plan.stages
    ]
    plan_json = plan.to_json()
    plan_json.update(
        {"replicas": config.shardpool.replicas, "source": "manual" if config.shardpool.layers else "planner"}
    )
    return PreparedRun(config, model, lora, placements, data, total_steps, resume_from, plan_json)


def check_stage_count(config: Config, model: ModelInfo) -> None:
    """Refuse more stages than layers, and a manual split that does not cover the model exactly."""
    stages = config.shardpool.num_stages
    if stages > model.num_layers:
        raise ShardpoolError(
            f"{stages} stages but {model.base_name} has only {model.num_layers} decoder layers; "
            f"use at most {model.num_layers} stages"
        )
    layers = config.shardpool.layers
    if layers is not None and sum(layers) != model.num_layers:
        raise ShardpoolError(
            f"shardpool.layers {layers} sums to {sum(layers)} but the model has {model.num_layers} layers; "
            f"make the counts add up to {model.num_layers}"
        )


def _resume_point(output_dir: Path, resume: bool) -> Path | None:
    newest = newest_checkpoint(output_dir)
    if resume:
        if newest is None:
            raise ShardpoolError(
                f"--resume: no checkpoint in {output_dir / 'checkpoints'}; run without --resume"
            )
        return newest
    if newest is not None:
        raise ShardpoolError(
            f"{output_dir} already holds checkpoints; pass --resume to continue, or choose a new output_dir"
        )
    return None


def _threads_per_process(config: Config, processes: int) -> int:
    if config.shardpool.threads_per_stage:
        return config.shardpool.threads_per_stage
    return max(1, (os.cpu_count() or 1) // processes)


def _eval_before(resume_from: Path | None) -> float | None:
    if resume_from is None:
        return None
    return json.loads((resume_from / "checkpoint.json").read_text(encoding="utf-8")).get("eval_before")


# ----- display --------------------------------------------------------------------------------
def _stage_footprint(reader: WeightReader, spec: StageSpec, tied: bool) -> tuple[int, float]:
    names = owned_tensor_names(spec, reader.names(), tie_word_embeddings=tied)
    params, nf4_bytes = 0, 0.0
    for name in names:
        count = 1
        for dim in reader.shape(name):
            count *= dim
        params += count
        quantized = name.startswith("model.layers.") and any(
            f".{linear}." in name for linear in DECODER_LINEAR_NAMES
        )
        nf4_bytes += count * (_NF4_BYTES_PER_PARAM if quantized else 4)
    return params, nf4_bytes / 2**20


def _print_placement(console: Console, run: PreparedRun) -> None:
    table = Table(title=f"placement of {run.model.base_name} ({run.model.num_layers} layers)")
    for column in ("stage", "device", "host", "layers", "parameters", "NF4 MiB", "predicted ms/mb"):
        table.add_column(
            column, justify="left" if column in {"stage", "device", "host", "layers"} else "right"
        )
    with WeightReader(run.model.path) as reader:
        for index, placement in enumerate(run.placements):
            spec = StageSpec(index, len(run.placements), placement.start, placement.stop, placement.device)
            params, mib = _stage_footprint(reader, spec, run.model.tie_word_embeddings)
            extras = (["embed"] if spec.is_first else []) + (["norm+lm_head"] if spec.is_last else [])
            layers = f"[{placement.start}, {placement.stop})" + (f" +{'+'.join(extras)}" if extras else "")
            predicted = run.plan["stages"][index].get("predicted_ms_per_microbatch")
            shown = "-" if predicted is None else f"{predicted:.1f}"
            table.add_row(
                str(index), placement.device, placement.host, layers, f"{params:,}", f"{mib:.2f}", shown
            )
    console.print(table)
    replicas = run.config.shardpool.replicas
    console.print(
        f"{run.total_steps} steps × {run.config.gradient_accumulation_steps} micro-batches of "
        f"{run.config.micro_batch_size} × {replicas} replica{'s' if replicas > 1 else ''}, "
        f"schedule {run.config.shardpool.schedule}, {len(run.data.train)} train rows, {len(run.data.eval)} eval rows"
    )


@dataclass
class _Outcome:
    eval_before: float | None = None
    eval_after: float | None = None
    last_loss: float | None = None
    last_step: int = 0
    stages: dict[int, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0


def _follow(
    console: Console,
    job: Job,
    run: PreparedRun,
    *,
    first_step: int,
    start: Callable[[Callable[[dict[str, Any]], None]], None],
) -> _Outcome:
    outcome = _Outcome(eval_before=job.eval_before)
    output_dir = Path(job.output_dir)
    metrics_path = output_dir / "metrics.jsonl"
    logging_steps = run.config.logging_steps
    columns = (
        TextColumn("[bold]training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("train", total=run.total_steps, completed=first_step, loss="-", tps="-")

        def on_event(event: dict[str, Any]) -> None:
            kind = event.get("event")
            if kind == StageEvent.STEP:
                outcome.last_loss = event["loss"]
                outcome.last_step = event["step"]
                progress.update(
                    task,
                    completed=event["step"],
                    loss=f"{event['loss']:.4f}",
                    tps=f"{event['tokens_per_s']:.0f}",
                )
                if event["step"] % logging_steps == 0 or event["step"] == run.total_steps:
                    _append_metrics(metrics_path, event)
            elif kind == StageEvent.CHECKPOINT_WRITTEN:
                final = finalize_checkpoint(
                    resolve_inside(output_dir, event["partial"], "checkpoint directory"),
                    step=event["step"],
                    settings=run.lora,
                    base_model=run.config.base_model,
                    extra={"eval_before": event.get("eval_before"), "total_steps": run.total_steps},
                )
                progress.console.print(f"checkpoint saved: {final}")
            elif kind == StageEvent.FINAL_WRITTEN:
                final_dir = resolve_inside(output_dir, event["directory"], "final adapter directory")
                write_adapter(
                    output_dir, merge_stage_lora(final_dir), run.lora, base_model=run.config.base_model
                )
                shutil.rmtree(final_dir, ignore_errors=True)
            elif kind == StageEvent.STAGE_DONE:
                outcome.stages[int(event["rank"])] = {
                    key: value for key, value in event.items() if key != "event"
                }
            elif kind == StageEvent.DONE:
                outcome.eval_before = event.get("eval_before")
                outcome.eval_after = event.get("eval_after")

        started = time.monotonic()
        start(on_event)
        outcome.seconds = time.monotonic() - started
    _write_summary(
        output_dir / "run_summary.json", outcome, first_step=first_step, total_steps=run.total_steps
    )
    return outcome


def _write_summary(path: Path, outcome: _Outcome, *, first_step: int, total_steps: int) -> None:
    """Record how the run ended: eval losses, time, and each stage process's peak memory."""
    write_json(
        path,
        {
            "eval_loss_before": outcome.eval_before,
            "eval_loss_after": outcome.eval_after,
            "final_train_loss": outcome.last_loss,
            "steps": total_steps,
            "resumed_from_step": first_step,
            "seconds": round(outcome.seconds, 3),
            "ranks": [outcome.stages[rank] for rank in sorted(outcome.stages)],
        },
    )


def _append_metrics(path: Path, event: dict[str, Any]) -> None:
    record = {key: event[key] for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s")}
    record.update(
        {
            "step_seconds": event["step_seconds"],
            "stage_compute_s": event["stage_compute_s"],
            "stage_wait_s": event["stage_wait_s"],
            "bytes_sent": sum(event["bytes_sent"]),
        }
    )
    with open(path, "a", encoding="utf-8") as file:
        file.write(json.dumps(record) + "\n")


def _trim_metrics(path: Path, *, keep_through_step: int) -> None:
    """Drop metric lines past the step a run restarts from, so a resumed run does not repeat them."""
    if not path.is_file():
        return
    if keep_through_step == 0:
        path.unlink()
        return
    kept = [
        line
        for line in path.read_text(encoding="utf-8").splitlines()
        if json.loads(line)["step"] <= keep_through_step
    ]
    atomic_write(path, ("\n".join(kept) + "\n").encode("utf-8") if kept else b"")


def _print_result(console: Console, run: PreparedRun, outcome: _Outcome) -> None:
    output_dir = Path(run.config.output_dir)
    if outcome.eval_before is not None and outcome.eval_after is not None:
        console.print(f"eval loss: {outcome.eval_before:.4f} before → {outcome.eval_after:.4f} after")
    elif outcome.last_loss is not None:
        console.print(f"final train loss: {outcome.last_loss:.4f} (no eval split: set val_set_size)")
    dtype = run.config.compute_dtype_name
    quant = run.config.adapter == "qlora"
    snippet = [
        "import torch",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM" + (", BitsAndBytesConfig" if quant else ""),
    ]
    if quant:
        kwargs = run.config.bnb_config_kwargs
        snippet.append(
            f'bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="{kwargs.bnb_4bit_quant_type}", '
            f"bnb_4bit_use_double_quant={kwargs.bnb_4bit_use_double_quant}, bnb_4bit_compute_dtype=torch.{dtype})"
        )
    load_args = f'"{run.config.base_model}", dtype=torch.{dtype}' + (
        ", quantization_config=bnb" if quant else ""
    )
    snippet.append(f"base = AutoModelForCausalLM.from_pretrained({load_args})")
    snippet.append(f'model = PeftModel.from_pretrained(base, "{output_dir}")')
    console.print(f"adapter written to {output_dir}; load it with:")
    console.print("\n".join(f"    {line}" for line in snippet), markup=False, highlight=False, soft_wrap=True)
