"""One shardpool stage against a plain peft loop (or the PyTorch NF4 path), ranked by interleaved pairs."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from shardpool_dev.bench.child import run_json_child, thread_env
from shardpool_dev.bench.cpu import pinned, wait_for_idle
from shardpool_dev.bench.pipeline import summarize_steps, train_and_read
from shardpool_dev.bench.stats import WARMUP_STEPS, pair_ratios, ratio_summary, run_order
from shardpool_dev.bench.workload import (
    FULL,
    GPU,
    QUICK,
    scratch,
    tiny_llama_and_rows,
    training_config,
    versions,
)


def dequantized_linear_bytes(hf_config: dict[str, Any], *, compute_bytes: int) -> int:
    """The largest linear weight of one decoder layer in the compute dtype: what the PyTorch NF4
    path holds dequantized at once (the MLP's intermediate x hidden, or the attention's widest)."""
    hidden, intermediate = int(hf_config["hidden_size"]), int(hf_config["intermediate_size"])
    heads = int(hf_config["num_attention_heads"])
    head_dim = int(hf_config.get("head_dim") or hidden // heads)
    return max(hidden * intermediate, hidden * heads * head_dim) * compute_bytes


def peak_memory(run: dict[str, Any]) -> int:
    """A run's peak memory: the device's peak allocation where there is one, else the peak RSS."""
    device_bytes = run.get("peak_device_bytes")
    return int(device_bytes) if device_bytes is not None else int(run["peak_rss_bytes"])


def shardpool_worker(spec_path: str) -> dict[str, Any]:
    """Side A, run in a fresh interpreter: ``finetune`` with one stage; step medians and the stage's peak RSS."""
    spec = json.loads(Path(spec_path).read_text())
    records, summary = train_and_read(spec["config"])
    measured = summarize_steps(records)
    return {
        "step_seconds": measured["step_seconds"],
        "step_seconds_min": measured["step_seconds_min"],
        "tokens_per_s": measured["tokens_per_s"],
        "steps_measured": measured["steps_measured"],
        "final_loss": measured["final_loss"],
        "peak_rss_bytes": max(int(rank["peak_rss_bytes"]) for rank in summary["ranks"]),
        "peak_device_bytes": _max_or_none(rank.get("peak_device_bytes") for rank in summary["ranks"]),
        "stages": len(summary["ranks"]),
    }


def _max_or_none(values: Any) -> int | None:
    present = [int(value) for value in values if value is not None]
    return max(present) if present else None


def run_side(
    side: str,
    config: dict[str, Any],
    *,
    threads: int,
    device: str,
    work: Path,
    label: str,
    plain_b: bool = True,
) -> dict[str, Any]:
    """Run one side in a fresh process with ``threads`` torch threads; add the foreign CPU time."""
    spec = work / f"{label}.json"
    spec.write_text(json.dumps({"config": config, "threads": threads, "device": device}))
    worker = "plain" if side == "B" and plain_b else "shardpool"
    return run_json_child(worker, spec, env=thread_env(threads), label=label)


def benchmark(
    *,
    size_name: str,
    device: str,
    with_s2: bool,
    pairs: int,
    cores: list[int],
    keep: Path | None,
    max_wait_idle_s: float,
    side_b: str = "peft",
) -> dict[str, Any]:
    """Build the model and data once, run the warm-up pair and ``pairs`` pairs, return the report."""
    import torch

    size = SIZES[size_name]
    threads = len(cores)
    sides = ("A", "B", "C") if with_s2 else ("A", "B")
    bf16 = device.startswith("cuda") and torch.cuda.is_bf16_supported()
    started = time.monotonic()
    with scratch("shardpool-paired-", keep) as work:
        model_dir, data = tiny_llama_and_rows(work, size)
        hf_config = json.loads((model_dir / "config.json").read_text())

        def config_for(side: str, label: str) -> dict[str, Any]:
            stages = 2 if side == "C" else 1
            placement = {"stages": stages, "threads_per_stage": max(1, threads // stages)}
            if device != "cpu":
                placement = {"stages": stages, "devices": [device] * stages}
            if side == "B" and side_b == "torch-nf4":
                placement["nf4_backend"] = "torch"
            config = training_config(model_dir, data, work / f"out-{label}", size, placement)
            if bf16:
                config["bf16"] = True
            return config

        def run(side: str, label: str) -> dict[str, Any]:
            return run_side(
                side,
                config_for(side, label),
                threads=threads,
                device=device,
                work=work,
                label=label,
                plain_b=side_b == "peft",
            )

        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
        with pinned(cores):
            for side in sides:
                print(f"bench: warm-up {side}", file=sys.stderr, flush=True)
                run(side, f"warmup-{side}")
            for pair, side in run_order(pairs, sides):
                waited = wait_for_idle(max_wait_idle_s)
                print(f"bench: pair {pair + 1}/{pairs}, {side}", file=sys.stderr, flush=True)
                measured = run(side, f"{side}{pair}")
                measured["load"]["waited_for_idle_seconds"] = waited
                runs[side].append(measured)

        def ratios(top: str, bottom: str, read: Any) -> list[float]:
            return pair_ratios([read(run) for run in runs[top]], [read(run) for run in runs[bottom]])

        tokens_ratio = ratios("A", "B", lambda run: run["tokens_per_s"])
        fastest_step_ratio = ratios("B", "A", lambda run: run["step_seconds_min"])
        memory_ratio = ratios("A", "B", peak_memory)
        s2 = {}
        if with_s2:
            s2_ratio = ratios("C", "A", lambda run: run["tokens_per_s"])
            s2 = {
                "C": "shardpool finetune, two stages (S = 2) as two processes on the same device",
                "tokens_per_s_ratio_c_over_a": ratio_summary(s2_ratio),
                "tokens_per_s_ratio_c_over_a_per_pair": [round(ratio, 4) for ratio in s2_ratio],
            }
        command = "python scripts/bench_paired.py" + (f" --size {size_name}" if size_name != "full" else "")
        command += (f" --device {device}" if device != "cpu" else "") + (" --with-s2" if with_s2 else "")
        command += f" --pairs {pairs}" if pairs != DEFAULT_PAIRS else ""
        command += " --b torch-nf4" if side_b == "torch-nf4" else ""
        dequantized = dequantized_linear_bytes(hf_config, compute_bytes=2 if bf16 else 4)
        extra_memory = [peak_memory(b) - peak_memory(a) for a, b in zip(runs["A"], runs["B"], strict=True)]
        nf4_path = (
            {
                "dequantized_linear_bytes": dequantized,
                "peak_memory_b_minus_a_bytes_per_pair": extra_memory,
                "peak_memory_b_minus_a_median_bytes": int(statistics.median(extra_memory)),
                "b_within_one_dequantized_linear_plus_10_percent": statistics.median(extra_memory)
                <= 1.1 * dequantized,
            }
            if side_b == "torch-nf4"
            else {}
        )
        return {
            "benchmark": "paired",
            "command": command,
            "A": "shardpool finetune, one stage (S = 1)",
            "B": "shardpool finetune, one stage on the PyTorch NF4 path (nf4_backend: torch)"
            if side_b == "torch-nf4"
            else "plain transformers + bitsandbytes NF4 + peft loop, same micro-batches",
            "machine": {
                **versions(),
                "cores_pinned": cores,
                "threads": threads,
                "device": device,
                "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else None,
            },
            "model": {
                key: hf_config[name]
                for key, name in (
                    ("num_layers", "num_hidden_layers"),
                    ("hidden_size", "hidden_size"),
                    ("intermediate_size", "intermediate_size"),
                    ("vocab_size", "vocab_size"),
                )
            },
            "workload": {
                "sequence_len": size["sequence_len"],
                "micro_batch_size": size["micro_batch_size"],
                "microbatches_per_step": size["gradient_accumulation_steps"],
                "steps": size["max_steps"],
                "warmup_steps_skipped": WARMUP_STEPS,
                "compute_dtype": "bfloat16" if bf16 else "float32",
            },
            "pairs": pairs,
            "tokens_per_s_ratio_a_over_b": ratio_summary(tokens_ratio),
            "tokens_per_s_ratio_per_pair": [round(ratio, 4) for ratio in tokens_ratio],
            "fastest_step_ratio_a_over_b": ratio_summary(fastest_step_ratio),
            "peak_memory_kind": "cuda max_memory_allocated"
            if device.startswith("cuda")
            else "peak RSS (VmHWM)",
            "peak_memory_ratio_a_over_b": ratio_summary(memory_ratio),
            **s2,
            **nf4_path,
            "runs": runs,
            "other_cpu_seconds_total": round(
                sum(run["load"]["other_cpu_seconds"] for side in runs.values() for run in side), 1
            ),
            "seconds": round(time.monotonic() - started, 1),
        }


DEFAULT_PAIRS = 7


SIZES = {"full": FULL, "quick": QUICK, "gpu": GPU}
