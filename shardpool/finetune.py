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
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from shardpool.architecture import DECODER_LINEAR_NAMES, ModelInfo, read_model_info
from shardpool.atomic import write_bytes_atomic, write_json_atomic
from shardpool.checkpoint import checkpoint_step, newest_checkpoint
from shardpool.config import Config, load_config
from shardpool.data import PreparedData, load_tokenizer, prepare_data, save_prepared, step_batches
from shardpool.errors import ShardpoolError
from shardpool.job import Job, StagePlacement
from shardpool.launcher import free_port, run_local_job
from shardpool.lora import LoraSettings, lora_settings
from shardpool.planner import plan_for_config
from shardpool.stage import StageSpec, owned_tensor_names
from shardpool.weights import WeightReader

__all__ = ["finetune_from_file", "finetune", "prepare_run", "PreparedRun", "check_stage_count", "RUN_DIR_NAME"]

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


def finetune_from_file(config_path: str | Path, *, resume: bool = False, console: Console | None = None) -> Path:
    """Validate the config at ``config_path``, train, and return the adapter directory."""
    return finetune(load_config(config_path), resume=resume, console=console)


def finetune(config: Config, *, resume: bool = False, console: Console | None = None) -> Path:
    """Train ``config`` on local stage processes and return the adapter directory."""
    console = console or Console()
    run = prepare_run(config, resume=resume)
    output_dir = Path(config.output_dir)
    run_dir = output_dir / RUN_DIR_NAME
    run_dir.mkdir(parents=True, exist_ok=True)
    data_file = run_dir / "data.safetensors"
    save_prepared(run.data, data_file)
    write_json_atomic(output_dir / "plan.json", run.plan)
    eval_before = _eval_before(run.resume_from)
    job = Job(
        config=config.model_dump(mode="json"),
        stages=run.placements,
        replicas=config.shardpool.replicas,
        data_file=str(data_file),
        output_dir=str(output_dir),
        run_dir=str(run_dir),
        master_addr="127.0.0.1",
        master_port=config.shardpool.master_port or free_port(),
        total_steps=run.total_steps,
        threads_per_process=_threads_per_process(config, len(run.placements) * config.shardpool.replicas),
        resume_from=str(run.resume_from) if run.resume_from else None,
        eval_before=eval_before,
    )
    job_file = run_dir / "job.json"
    job.write(job_file)
    _print_placement(console, run)
    first_step = checkpoint_step(run.resume_from) if run.resume_from else 0
    _trim_metrics(output_dir / "metrics.jsonl", keep_through_step=first_step)
    outcome = _follow(console, job, job_file, run, first_step=first_step)
    _print_result(console, run, outcome)
    return output_dir


# ----- validation -------------------------------------------------------------------------------
def prepare_run(config: Config, *, resume: bool) -> PreparedRun:
    """Check everything that can fail before training, and tokenize the data. Writes nothing."""
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
    plan = plan_for_config(config)
    placements = [
        StagePlacement(start=stage.start, stop=stage.stop, device=stage.device, host=stage.host) for stage in plan.stages
    ]
    plan_json = plan.to_json()
    plan_json.update({"replicas": config.shardpool.replicas, "source": "manual" if config.shardpool.layers else "planner"})
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
            raise ShardpoolError(f"--resume: no checkpoint in {output_dir / 'checkpoints'}; run without --resume")
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
        quantized = name.startswith("model.layers.") and any(f".{linear}." in name for linear in DECODER_LINEAR_NAMES)
        nf4_bytes += count * (_NF4_BYTES_PER_PARAM if quantized else 4)
    return params, nf4_bytes / 2**20


def _print_placement(console: Console, run: PreparedRun) -> None:
    table = Table(title=f"placement of {run.model.base_name} ({run.model.num_layers} layers)")
    for column in ("stage", "device", "host", "layers", "parameters", "NF4 MiB", "predicted ms/mb"):
        table.add_column(column, justify="left" if column in {"stage", "device", "host", "layers"} else "right")
    with WeightReader(run.model.path) as reader:
        for index, placement in enumerate(run.placements):
            spec = StageSpec(index, len(run.placements), placement.start, placement.stop, placement.device)
            params, mib = _stage_footprint(reader, spec, run.model.tie_word_embeddings)
            extras = (["embed"] if spec.is_first else []) + (["norm+lm_head"] if spec.is_last else [])
            layers = f"[{placement.start}, {placement.stop})" + (f" +{'+'.join(extras)}" if extras else "")
            predicted = run.plan["stages"][index].get("predicted_ms_per_microbatch")
            shown = "-" if predicted is None else f"{predicted:.1f}"
            table.add_row(str(index), placement.device, placement.host, layers, f"{params:,}", f"{mib:.2f}", shown)
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
    stages: dict[int, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0


def _follow(console: Console, job: Job, job_file: Path, run: PreparedRun, *, first_step: int) -> _Outcome:
    outcome = _Outcome(eval_before=job.eval_before)
    metrics_path = Path(job.output_dir) / "metrics.jsonl"
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
            if kind == "step":
                outcome.last_loss = event["loss"]
                progress.update(
                    task, completed=event["step"], loss=f"{event['loss']:.4f}", tps=f"{event['tokens_per_s']:.0f}"
                )
                if event["step"] % logging_steps == 0 or event["step"] == run.total_steps:
                    _append_metrics(metrics_path, event)
            elif kind == "checkpoint":
                progress.console.print(f"checkpoint saved: {event['path']}")
            elif kind == "stage_done":
                outcome.stages[int(event["rank"])] = {key: value for key, value in event.items() if key != "event"}
            elif kind == "done":
                outcome.eval_before = event.get("eval_before")
                outcome.eval_after = event.get("eval_after")

        started = time.monotonic()
        run_local_job(job, job_file, log_dir=Path(job.run_dir) / "logs", on_event=on_event)
        outcome.seconds = time.monotonic() - started
    _write_summary(Path(job.output_dir) / "run_summary.json", outcome, first_step=first_step, total_steps=run.total_steps)
    return outcome


def _write_summary(path: Path, outcome: _Outcome, *, first_step: int, total_steps: int) -> None:
    """Record how the run ended: eval losses, time, and each stage process's peak memory."""
    write_json_atomic(
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
    kept = [line for line in path.read_text(encoding="utf-8").splitlines() if json.loads(line)["step"] <= keep_through_step]
    write_bytes_atomic(path, ("\n".join(kept) + "\n").encode("utf-8") if kept else b"")


def _print_result(console: Console, run: PreparedRun, outcome: _Outcome) -> None:
    output_dir = Path(run.config.output_dir)
    if outcome.eval_before is not None and outcome.eval_after is not None:
        console.print(f"eval loss: {outcome.eval_before:.4f} before → {outcome.eval_after:.4f} after")
    elif outcome.last_loss is not None:
        console.print(f"final train loss: {outcome.last_loss:.4f} (no eval split: set val_set_size)")
    run_dir = output_dir / RUN_DIR_NAME
    shutil.rmtree(run_dir / "final", ignore_errors=True)
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
    load_args = f'"{run.config.base_model}", dtype=torch.{dtype}' + (", quantization_config=bnb" if quant else "")
    snippet.append(f"base = AutoModelForCausalLM.from_pretrained({load_args})")
    snippet.append(f'model = PeftModel.from_pretrained(base, "{output_dir}")')
    console.print(f"adapter written to {output_dir}; load it with:")
    console.print("\n".join(f"    {line}" for line in snippet), markup=False, highlight=False)
