"""Pipelined QLoRA on local CPU stages: step time, efficiency, bytes between stages and peak memory."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardpool_dev.bench.child import run_json_child, thread_env
from shardpool_dev.bench.cpu import cpu_accounting, least_disturbed, pinned, threads_per_stage
from shardpool_dev.bench.stats import WARMUP_STEPS
from shardpool_dev.bench.workload import (
    FP32_BYTES,
    FULL,
    QUICK,
    count_adapter_parameters,
    count_parameters,
    model_facts,
    scratch,
    tiny_llama_and_rows,
    training_config,
    versions,
)


def pipeline_efficiency(stage_compute_s: Sequence[float], step_seconds: float) -> float:
    """Sum of per-stage compute over ``S × step time``: 1.0 means no stage ever waited or idled."""
    return sum(stage_compute_s) / (len(stage_compute_s) * step_seconds)


def ring_allreduce_bytes_per_worker(payload_bytes: int, workers: int) -> float:
    """Bytes each worker sends in a ring all-reduce of ``payload_bytes``: ``2 (N - 1) / N × payload``."""
    if workers < 1:
        raise ValueError("an all-reduce needs at least one worker")
    return 2 * (workers - 1) / workers * payload_bytes


def boundary_bytes_per_step(
    *,
    stages: int,
    microbatches: int,
    micro_batch_size: int,
    sequence_len: int,
    hidden_size: int,
    wire_bytes: int,
) -> int:
    """Bytes a pipeline sends between stages per optimizer step, over all boundaries.

    Every micro-batch crosses each of the ``S - 1`` boundaries twice: activations forward, their
    gradients backward, each ``[micro_batch_size, sequence_len, hidden_size]`` in the wire dtype.
    """
    per_tensor = micro_batch_size * sequence_len * hidden_size * wire_bytes
    return 2 * (stages - 1) * microbatches * per_tensor


def summarize_steps(records: Sequence[dict[str, Any]], warmup: int = WARMUP_STEPS) -> dict[str, Any]:
    """Medians over the steps after ``warmup`` of one run's ``metrics.jsonl`` records (eval lines are skipped)."""
    records = sorted(
        (record for record in records if "step_seconds" in record), key=lambda record: record["step"]
    )
    kept = records[warmup:] or records
    stages = len(kept[0]["stage_compute_s"])
    step_s = [float(r["step_seconds"]) for r in kept]
    return {
        "steps_measured": len(kept),
        "step_seconds": statistics.median(step_s),
        "step_seconds_min": min(step_s),
        "step_seconds_max": max(step_s),
        "tokens_per_s": statistics.median(float(r["tokens_per_s"]) for r in kept),
        "stage_compute_s": [
            statistics.median(float(r["stage_compute_s"][i]) for r in kept) for i in range(stages)
        ],
        "stage_wait_s": [statistics.median(float(r["stage_wait_s"][i]) for r in kept) for i in range(stages)],
        "pipeline_efficiency": statistics.median(
            pipeline_efficiency(r["stage_compute_s"], float(r["step_seconds"])) for r in kept
        ),
        "bytes_sent_per_step": int(statistics.median(int(r["bytes_sent"]) for r in kept)),
        "final_loss": float(records[-1]["loss"]),
    }


def train_and_read(config: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Train ``config`` with ``shardpool.finetune``, quietly; its ``metrics.jsonl`` records and ``run_summary.json``."""
    from rich.console import Console

    from shardpool.config import parse_config
    from shardpool.finetune import finetune

    output_dir = Path(config["output_dir"])
    finetune(parse_config(config), console=Console(quiet=True))
    records = [
        json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    return records, json.loads((output_dir / "run_summary.json").read_text())


def run_pipeline(config: dict[str, Any], *, stages: int) -> dict[str, Any]:
    """Train one config with ``shardpool.finetune`` and summarize its metrics, memory and plan."""
    output_dir = Path(config["output_dir"])
    load: dict[str, Any] = {}
    with cpu_accounting(load):
        records, summary = train_and_read(config)
    plan = json.loads((output_dir / "plan.json").read_text())
    measured = summarize_steps(records)
    return {
        "stages": stages,
        "threads_per_stage": config["shardpool"]["threads_per_stage"],
        "total_threads": stages * config["shardpool"]["threads_per_stage"],
        "layers": [stage["layers"] for stage in plan["stages"]],
        **measured,
        "predicted_step_seconds": plan["predicted_step_s"],
        "predicted_ms_per_microbatch": [stage["predicted_ms_per_microbatch"] for stage in plan["stages"]],
        "predicted_bubble_fraction": plan["bubble_fraction"],
        "peak_rss_bytes": [int(rank["peak_rss_bytes"]) for rank in summary["ranks"]],
        "run_seconds": round(summary["seconds"], 2),
        "load": load,
    }


def run_plain(config: dict[str, Any], *, threads: int, work_dir: Path) -> dict[str, Any]:
    """Run the plain peft + bitsandbytes loop in a fresh interpreter (its own peak RSS) with ``threads`` threads."""
    spec = work_dir / "plain.json"
    spec.write_text(json.dumps({"config": config, "threads": threads}))
    return run_json_child("plain", spec, env=thread_env(threads), label="plain peft + bitsandbytes loop")


def benchmark(
    *,
    quick: bool,
    cores: list[int],
    stage_counts: list[int],
    keep: Path | None,
    max_wait_idle_s: float,
    retries: int,
) -> dict[str, Any]:
    """Build the model and data, run every S and the plain loop, and return the JSON report."""
    size = QUICK if quick else FULL
    budget = len(cores)
    started = time.monotonic()
    with scratch("shardpool-bench-", keep) as work:
        model_dir, data = tiny_llama_and_rows(work, size)
        hf_config = json.loads((model_dir / "config.json").read_text())
        parameters = count_parameters(model_dir)
        runs = []
        with pinned(cores):
            for stages in stage_counts:
                threads = threads_per_stage(budget, stages)

                def one_run(attempt: int, stages: int = stages, threads: int = threads) -> dict[str, Any]:
                    config = training_config(
                        model_dir,
                        data,
                        work / f"out-s{stages}-{attempt}",
                        size,
                        {"stages": stages, "threads_per_stage": threads},
                    )
                    return run_pipeline(config, stages=stages)

                runs.append(
                    least_disturbed(
                        one_run,
                        label=f"S={stages}, {threads} thread(s) per stage",
                        cores=cores,
                        max_wait_idle_s=max_wait_idle_s,
                        retries=retries,
                    )
                )

            def plain_run(attempt: int) -> dict[str, Any]:
                reference_config = training_config(
                    model_dir,
                    data,
                    work / f"out-plain-{attempt}",
                    size,
                    {"stages": 1, "threads_per_stage": budget},
                )
                return run_plain(reference_config, threads=budget, work_dir=work)

            plain = least_disturbed(
                plain_run,
                label=f"plain peft + bitsandbytes loop, {budget} thread(s)",
                cores=cores,
                max_wait_idle_s=max_wait_idle_s,
                retries=retries,
            )
        lora_parameters = count_adapter_parameters(work / f"out-s{stage_counts[0]}-0")
        wire_bytes = FP32_BYTES
        microbatches = size["gradient_accumulation_steps"]
        for run in runs:
            workers = run["stages"]
            run["bytes_sent_expected"] = boundary_bytes_per_step(
                stages=workers,
                microbatches=microbatches,
                micro_batch_size=size["micro_batch_size"],
                sequence_len=size["sequence_len"],
                hidden_size=hf_config["hidden_size"],
                wire_bytes=wire_bytes,
            )
            run["bytes_sent_per_stage_per_step"] = run["bytes_sent_per_step"] / workers
            full = ring_allreduce_bytes_per_worker(parameters * FP32_BYTES, workers)
            lora = ring_allreduce_bytes_per_worker(lora_parameters * FP32_BYTES, workers)
            run["ddp_workers"] = workers
            run["ddp_full_grad_bytes_per_worker"] = int(full)
            run["ddp_full_grad_bytes_total"] = int(full * workers)
            run["ddp_lora_grad_bytes_per_worker"] = int(lora)
            run["ddp_lora_grad_bytes_total"] = int(lora * workers)
            run["max_stage_peak_rss_bytes"] = max(run["peak_rss_bytes"])
            # What the stage holds beyond an interpreter with torch, transformers, peft and
            # bitsandbytes imported (measured in the plain process before it loads the model).
            run["peak_rss_above_runtime_bytes"] = [
                rss - plain["runtime_only_rss_bytes"] for rss in run["peak_rss_bytes"]
            ]
            run["speedup_vs_s1"] = runs[0]["step_seconds"] / run["step_seconds"]
        return {
            "benchmark": "pipeline",
            "quick": quick,
            "command": "python scripts/bench_pipeline.py" + (" --quick" if quick else ""),
            "machine": {**versions(), "cores_pinned": cores, "thread_budget": budget},
            "model": {
                **model_facts(hf_config, parameters=parameters, lora_parameters=lora_parameters),
                "fp32_bytes": parameters * FP32_BYTES,
            },
            "workload": {
                "rows": size["rows"],
                "sequence_len": size["sequence_len"],
                "micro_batch_size": size["micro_batch_size"],
                "microbatches_per_step": microbatches,
                "tokens_per_step": microbatches * size["micro_batch_size"] * size["sequence_len"],
                "steps": size["max_steps"],
                "warmup_steps_skipped": WARMUP_STEPS,
                "lora_r": size["lora_r"],
                "lora_targets": "all 7 decoder Linear modules",
                "dtype": "float32 compute, NF4 base (double quant), fp32 on the wire",
                "schedule": "1f1b",
            },
            "threads_note": (
                f"all runs pinned to cores {cores}; S=1 uses {budget} threads, S>1 uses max(1, {budget}//S) per stage, "
                f"so S={max(stage_counts)} runs {max(stage_counts) * threads_per_stage(budget, max(stage_counts))} threads "
                f"on {budget} cores (oversubscribed)"
                if max(stage_counts) * threads_per_stage(budget, max(stage_counts)) > budget
                else f"all runs pinned to cores {cores} with {budget} threads in total"
            ),
            "pipeline": runs,
            "plain_peft_bnb": plain,
            "plain_vs_s1_step_time": runs[0]["step_seconds"] / plain["step_seconds"],
            "plain_peak_rss_above_runtime_bytes": plain["peak_rss_bytes"] - plain["runtime_only_rss_bytes"],
            "seconds": round(time.monotonic() - started, 1),
        }
