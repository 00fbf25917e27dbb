"""Benchmark pipelined QLoRA on local CPU stages and print one JSON object on stdout.

    python scripts/bench_pipeline.py            # the full run recorded in docs/performance.md
    python scripts/bench_pipeline.py --quick    # a smaller model and fewer steps, for a smoke run

What it does, all inside one temporary directory that is removed at the end:
  1. builds a random tiny Llama (``shardpool.model.tinymodel.make_tiny_llama``, 8 decoder layers) and a
     completion dataset;
  2. trains it with ``shardpool.finetune.finetune`` as S = 1, 2 and 4 pipeline stages, every run
     pinned to the same CPU cores (the affinity is set on this process and inherited by the stage
     processes) with the same total thread budget: S = 1 gets all of it, S > 1 gets budget // S
     threads per stage, at least 1 (so S = 4 on 2 cores oversubscribes, 4 threads on 2 cores);
  3. reads ``metrics.jsonl`` (per step), ``run_summary.json`` (peak RSS per stage) and ``plan.json``
     (the planner's prediction) of each run, skips the warm-up steps and reports medians;
  4. runs a plain single-process peft + bitsandbytes QLoRA loop on the same micro-batches, in a
     subprocess with the whole thread budget, for reference throughput and peak memory.

Before each run it waits for other processes to leave the CPUs, records how much CPU time they
used during the run (``other_cpu_seconds``), and re-runs a disturbed measurement (``--retries``),
keeping the least disturbed attempt: 2-thread runs on 2 cores are very sensitive to other load.

Step time, pipeline efficiency (sum of per-stage compute / (S x step time)), bytes sent between
stages per step next to what a DDP ring all-reduce of the gradients would move, and peak RSS per
stage next to one process holding the whole model. See docs/performance.md for a recorded run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardpool.plan.device_facts import cpu_model_name  # noqa: E402 - needs ROOT on sys.path

FP32_BYTES = 4
WARMUP_STEPS = 2

FULL = {
    "model": {
        "num_layers": 8,
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_heads": 8,
        "num_kv_heads": 2,
        "vocab_size": 2048,
    },
    "rows": 128,
    "sequence_len": 128,
    "micro_batch_size": 1,
    "gradient_accumulation_steps": 8,
    "max_steps": 10,
    "lora_r": 8,
}
QUICK = {
    "model": {
        "num_layers": 8,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_heads": 4,
        "num_kv_heads": 2,
        "vocab_size": 1024,
    },
    "rows": 64,
    "sequence_len": 32,
    "micro_batch_size": 2,
    "gradient_accumulation_steps": 4,
    "max_steps": 4,
    "lora_r": 4,
}
# A model that keeps one GPU busy (issue 17's GPU row): hidden 2048, NF4, bf16 where supported.
GPU = {
    "model": {
        "num_layers": 8,
        "hidden_size": 2048,
        "intermediate_size": 5504,
        "num_heads": 16,
        "num_kv_heads": 4,
        "vocab_size": 4096,
    },
    "rows": 256,
    "sequence_len": 512,
    "micro_batch_size": 4,
    "gradient_accumulation_steps": 8,
    "max_steps": 12,
    "lora_r": 16,
}


# ---------------------------------------------------------------------------- pure helpers


def threads_per_stage(budget: int, stages: int) -> int:
    """Torch threads per stage so all stages together use about ``budget`` threads (at least 1 each)."""
    return max(1, budget // stages)


def median_after_warmup(values: Sequence[float], warmup: int = WARMUP_STEPS) -> float:
    """Median of ``values`` without the first ``warmup`` (all of them if nothing would be left)."""
    kept = list(values[warmup:]) or list(values)
    if not kept:
        raise ValueError("no values to take a median of")
    return float(statistics.median(kept))


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


def completion_rows(count: int, *, examples_per_row: int = 6) -> list[dict[str, str]]:
    """Deterministic completion rows, each several quickstart examples long.

    Long rows fill ``sequence_len`` (they are truncated, never padded), so every position the
    model computes is a real token and tokens/s counts the work done.
    """
    from shardpool.model.tinymodel import quickstart_corpus, quickstart_rows

    texts = quickstart_corpus(quickstart_rows(count * examples_per_row))
    return [
        {"text": "\n\n".join(texts[index * examples_per_row : (index + 1) * examples_per_row])}
        for index in range(count)
    ]


# ---------------------------------------------------------------------------- set-up


def training_config(
    model_dir: Path, data: Path, output_dir: Path, size: dict[str, Any], shardpool: dict[str, Any]
) -> dict[str, Any]:
    """The run config every benchmark run shares (only ``output_dir`` and the ``shardpool`` block differ)."""
    return {
        "base_model": str(model_dir),
        "adapter": "qlora",
        "load_in_4bit": True,
        "lora_r": size["lora_r"],
        "lora_alpha": 2 * size["lora_r"],
        "lora_dropout": 0.0,
        "lora_target_linear": True,
        "datasets": [{"path": str(data), "type": "completion"}],
        "val_set_size": 0,
        "sequence_len": size["sequence_len"],
        "micro_batch_size": size["micro_batch_size"],
        "gradient_accumulation_steps": size["gradient_accumulation_steps"],
        "max_steps": size["max_steps"],
        "learning_rate": 2e-4,
        "lr_scheduler": "constant",
        "max_grad_norm": 1.0,
        "seed": 0,
        "output_dir": str(output_dir),
        "logging_steps": 1,
        "shardpool": {**shardpool, "rebalance": "off"},  # a benchmark measures the split it was given
    }


def count_parameters(model_dir: Path) -> int:
    """Parameters in the model's safetensors files (from the headers; no tensor data is read)."""
    from shardpool.model.weights import WeightReader

    total = 0
    with WeightReader(model_dir) as reader:
        for name in reader.names():
            count = 1
            for dim in reader.shape(name):
                count *= dim
            total += count
    return total


def count_adapter_parameters(adapter_dir: Path) -> int:
    """Parameters in a PEFT adapter (the LoRA tensors the run trained)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as handle:
        for name in handle.keys():
            count = 1
            for dim in handle.get_slice(name).get_shape():
                count *= dim
            total += count
    return total


@contextlib.contextmanager
def pinned(cores: Sequence[int]) -> Iterator[None]:
    """Run with this process (and every child it starts) on ``cores``; restore the affinity after."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def machine_busy_seconds() -> float:
    """CPU-seconds all CPUs of this machine have been busy since boot (user, nice, system, irq, softirq)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(value) for value in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU-seconds used by this process and its reaped children (the stage processes)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


@contextlib.contextmanager
def cpu_accounting(into: dict[str, Any]) -> Iterator[None]:
    """Record the load average and the CPU time *other* processes used while the block ran.

    ``other_cpu_seconds`` is the machine's busy CPU time minus this process tree's; on an idle
    machine it is near zero, and anything larger competed with the benchmark for the cores.
    """
    load = os.getloadavg()[0]
    busy, own, started = machine_busy_seconds(), own_cpu_seconds(), time.monotonic()
    try:
        yield
    finally:
        into["loadavg_1m_before"] = round(load, 2)
        into["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
        into["own_cpu_seconds"] = round(own_cpu_seconds() - own, 1)
        into["other_cpu_seconds"] = round(
            max(0.0, (machine_busy_seconds() - busy) - (own_cpu_seconds() - own)), 1
        )
        into["elapsed_seconds"] = round(time.monotonic() - started, 1)


def wait_for_idle(max_wait_s: float, *, window_s: float = 2.0, busy_fraction: float = 0.1) -> float:
    """Wait until other processes use under ``busy_fraction`` of one core over a ``window_s`` window.

    Gives up after ``max_wait_s``; returns the seconds waited (``max_wait_s`` or more if it gave up).
    """
    started = time.monotonic()
    while True:
        busy, own = machine_busy_seconds(), own_cpu_seconds()
        time.sleep(window_s)
        other = (machine_busy_seconds() - busy) - (own_cpu_seconds() - own)
        waited = time.monotonic() - started
        if other < busy_fraction * window_s or waited >= max_wait_s:
            return round(waited, 1)


def disturbed(load: dict[str, Any], cores: int, *, tolerance: float = 0.05) -> bool:
    """Whether other processes took more than ``tolerance`` of the pinned cores' time during a run."""
    return load["other_cpu_seconds"] > tolerance * load["elapsed_seconds"] * cores


def least_disturbed(
    run_once: Any, *, label: str, cores: Sequence[int], max_wait_idle_s: float, retries: int
) -> dict[str, Any]:
    """Run ``run_once(attempt)`` after waiting for idle CPUs; if other processes disturbed it, run it
    again (up to ``retries`` more times) and keep the attempt that saw the least foreign CPU time."""
    attempts = []
    for attempt in range(retries + 1):
        waited = wait_for_idle(max_wait_idle_s)
        print(f"bench: {label} (attempt {attempt + 1})", file=sys.stderr, flush=True)
        result = run_once(attempt)
        result["load"]["waited_for_idle_seconds"] = waited
        attempts.append(result)
        if not disturbed(result["load"], len(cores)):
            break
    best = min(attempts, key=lambda result: result["load"]["other_cpu_seconds"])
    best["load"]["attempts"] = len(attempts)
    best["load"]["other_cpu_seconds_per_attempt"] = [
        result["load"]["other_cpu_seconds"] for result in attempts
    ]
    return best


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# ---------------------------------------------------------------------------- the runs


def run_pipeline(config: dict[str, Any], *, stages: int) -> dict[str, Any]:
    """Train one config with ``shardpool.finetune`` and summarize its metrics, memory and plan."""
    from rich.console import Console

    from shardpool.config import parse_config
    from shardpool.finetune import finetune

    output_dir = Path(config["output_dir"])
    load: dict[str, Any] = {}
    with cpu_accounting(load):
        finetune(parse_config(config), console=Console(quiet=True))
    records = [
        json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    summary = json.loads((output_dir / "run_summary.json").read_text())
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
    """Run :func:`plain_loop` in a fresh interpreter (its own peak RSS) with ``threads`` threads."""
    spec = work_dir / "plain.json"
    spec.write_text(json.dumps({"config": config, "threads": threads}))
    env = dict(
        os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false"
    )
    load: dict[str, Any] = {}
    with cpu_accounting(load):
        result = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--plain-worker", str(spec)],
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
            preexec_fn=_die_with_parent,
            check=False,
        )
    if result.returncode != 0:
        raise RuntimeError(f"the plain peft + bitsandbytes loop failed:\n{result.stderr[-4000:]}")
    plain = json.loads(result.stdout.strip().splitlines()[-1])
    plain["load"] = load
    return plain


def _vm_status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def plain_steps(
    model: Any,
    params: list[Any],
    optimizer: Any,
    scheduler: Any,
    data: Any,
    steps: Any,
    config: Any,
    *,
    device: Any,
) -> tuple[list[float], list[float], list[float]]:
    """The plain loop's optimizer steps; per step its seconds, tokens/s and loss."""
    import torch

    from shardpool.train.loss import label_tokens, token_loss_sum

    step_seconds, tokens_per_s, losses = [], [], []
    for step in steps:
        begun = time.perf_counter()
        microbatches = [data.train.select(rows) for rows in step]
        step_tokens = sum(label_tokens(rows.labels) for rows in microbatches)
        loss_total = 0.0
        for rows in microbatches:
            logits = model(
                input_ids=rows.input_ids.to(device),
                attention_mask=rows.attention_mask.to(device),
                position_ids=rows.position_ids.to(device),
            ).logits
            loss = token_loss_sum(logits, rows.labels) / step_tokens
            loss.backward()
            loss_total = loss_total + loss.detach()
        torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - begun
        step_seconds.append(elapsed)
        tokens_per_s.append(sum(int(rows.attention_mask.sum()) for rows in microbatches) / elapsed)
        losses.append(float(loss_total))
    return step_seconds, tokens_per_s, losses


def plain_loop(spec_path: str) -> dict[str, Any]:
    """The reference: one process, transformers + bitsandbytes NF4 + peft LoRA, the same micro-batches.

    Same tokenized rows, step plan, LoRA settings, token-weighted loss, clip and AdamW as the
    pipeline; the LoRA init is peft's own (it does not change the speed).
    """
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(int(spec["threads"]))
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, get_scheduler

    from shardpool.config import parse_config
    from shardpool.data.prepare import prepare_data
    from shardpool.data.steps import step_batches
    from shardpool.data.tokenizing import load_tokenizer
    from shardpool.model.lora import lora_settings
    from shardpool.model.nf4 import bnb_config, keep_exact_cpu_matmul
    from shardpool.train.optim import scheduler_name

    runtime_rss = _vm_status("VmRSS")
    config = parse_config(spec["config"])
    data = prepare_data(config, load_tokenizer(config.base_model))
    steps = step_batches(
        len(data.train),
        micro_batch_size=config.micro_batch_size,
        micro_batches_per_step=config.gradient_accumulation_steps,
        num_epochs=config.num_epochs,
        max_steps=config.max_steps,
        shuffle_each_epoch=config.shuffle_merged_datasets,
        seed=config.seed,
    )
    started = time.perf_counter()
    device = torch.device(spec.get("device", "cpu"))
    compute_dtype = getattr(torch, config.compute_dtype_name)
    model = AutoModelForCausalLM.from_pretrained(
        config.base_model,
        quantization_config=bnb_config(compute_dtype=config.compute_dtype_name),
        dtype=compute_dtype,
        device_map={"": str(device)},
    )
    keep_exact_cpu_matmul(model)
    lora = lora_settings(config)
    model = get_peft_model(
        model,
        LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            task_type="CAUSAL_LM",
        ),
    )
    model.train()
    load_seconds = time.perf_counter() - started
    params = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    scheduler = get_scheduler(
        scheduler_name(config), optimizer, num_warmup_steps=0, num_training_steps=len(steps)
    )
    step_seconds, tokens_per_s, losses = plain_steps(
        model, params, optimizer, scheduler, data, steps, config, device=device
    )
    return {
        "threads": int(spec["threads"]),
        "steps_measured": len(step_seconds[WARMUP_STEPS:] or step_seconds),
        "step_seconds": median_after_warmup(step_seconds),
        "step_seconds_min": min(step_seconds[WARMUP_STEPS:] or step_seconds),
        "tokens_per_s": median_after_warmup(tokens_per_s),
        "final_loss": losses[-1],
        "load_seconds": round(load_seconds, 2),
        "peak_rss_bytes": _vm_status("VmHWM"),
        "peak_device_bytes": int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None,
        "runtime_only_rss_bytes": runtime_rss,
        "lora_parameters": sum(param.numel() for param in params),
    }


# ---------------------------------------------------------------------------- main


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
    import bitsandbytes
    import peft
    import torch
    import transformers

    from shardpool.model.tinymodel import make_tiny_llama, write_jsonl

    size = QUICK if quick else FULL
    budget = len(cores)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="shardpool-bench-")) if keep is None else keep
    work.mkdir(parents=True, exist_ok=True)
    saved_cache = os.environ.get("SHARDPOOL_CACHE")
    os.environ["SHARDPOOL_CACHE"] = str(work / "cache")  # profile afresh; never touch the user's cache
    try:
        rows = completion_rows(size["rows"])
        data = write_jsonl(rows, work / "data.jsonl")
        from shardpool.model.tinymodel import DEFAULT_CORPUS

        model_dir = make_tiny_llama(
            work / "model",
            seed=0,
            initializer_range=0.1,
            corpus=[row["text"] for row in rows] + list(DEFAULT_CORPUS),
            **size["model"],
        )
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
            "machine": {
                "cpu": cpu_model_name(),
                "logical_cpus": os.cpu_count(),
                "cores_pinned": cores,
                "thread_budget": budget,
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "peft": peft.__version__,
                "bitsandbytes": bitsandbytes.__version__,
            },
            "model": {
                "type": hf_config["model_type"],
                "num_layers": hf_config["num_hidden_layers"],
                "hidden_size": hf_config["hidden_size"],
                "intermediate_size": hf_config["intermediate_size"],
                "num_heads": hf_config["num_attention_heads"],
                "num_kv_heads": hf_config["num_key_value_heads"],
                "vocab_size": hf_config["vocab_size"],
                "parameters": parameters,
                "fp32_bytes": parameters * FP32_BYTES,
                "lora_parameters": lora_parameters,
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
    finally:
        if saved_cache is None:
            os.environ.pop("SHARDPOOL_CACHE", None)
        else:
            os.environ["SHARDPOOL_CACHE"] = saved_cache
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, run the benchmark, print its JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="a smaller model and fewer steps (about a minute)"
    )
    parser.add_argument(
        "--cores", help="comma-separated CPU ids to pin every run to (default: this process's affinity)"
    )
    parser.add_argument(
        "--stages", default="1,2,4", help="stage counts to run, first one is the baseline (default 1,2,4)"
    )
    parser.add_argument(
        "--keep", type=Path, help="work in this directory and keep it (models, outputs, logs)"
    )
    parser.add_argument(
        "--max-wait-idle",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="before each run, wait up to this long for other processes to leave the CPUs (default 120)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=2,
        help="re-run a measurement disturbed by other processes up to this many times (default 2)",
    )
    parser.add_argument("--plain-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plain_worker:
        with contextlib.redirect_stdout(sys.stderr):
            report = plain_loop(args.plain_worker)
        print(json.dumps(report))
        return 0
    cores = [int(c) for c in args.cores.split(",")] if args.cores else sorted(os.sched_getaffinity(0))
    stage_counts = [int(s) for s in args.stages.split(",")]
    with contextlib.redirect_stdout(sys.stderr):  # only the JSON report goes to stdout
        report = benchmark(
            quick=args.quick,
            cores=cores,
            stage_counts=stage_counts,
            keep=args.keep,
            max_wait_idle_s=args.max_wait_idle,
            retries=args.retries,
        )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
