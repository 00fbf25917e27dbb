"""Paired benchmark: one shardpool stage (S = 1) against a plain peft + bitsandbytes loop.

    python scripts/bench_paired.py                 # 7 pairs on the model of bench_pipeline.py
    python scripts/bench_paired.py --pairs 3 --quick
    python scripts/bench_paired.py --device cuda --size gpu --with-s2   # one GPU, hidden 2048
    python scripts/bench_paired.py --b torch-nf4   # B: one stage on the PyTorch NF4 path

It prints one JSON object on stdout. Two implementations on a noisy machine are ranked by
*pairs*: A (``shardpool.finetune.finetune`` with one stage) and B (the plain loop of
``scripts/bench_pipeline.py``) run alternately, A B B A A B ..., each in a fresh process pinned to
the same cores with the same thread count, on the same model, data and micro-batches. A slow
minute on the machine then hits both members of a pair alike, and the per-pair ratio
A ÷ B tokens/s cancels it; the report gives the median ratio over the pairs and its spread
(max - min). An unrecorded warm-up pair comes first (it fills the profile cache and the page
cache). Before each run it waits (up to ``--max-wait-idle`` seconds) for other processes to
leave the CPUs, and for every run it reports the CPU time other processes used while it ran.
A second figure, ``fastest_step_ratio_a_over_b``, compares each pair's fastest steps (B's fastest
step time ÷ A's, so above 1 means A is faster, like the tokens/s ratio): other load can only make
a step slower, so the fastest steps are the least disturbed view of both sides.

Memory: the peak RSS (VmHWM) of the stage process next to that of the plain process on CPU;
``torch.cuda.max_memory_allocated`` of each on CUDA.

``--b torch-nf4`` makes side B shardpool's own one-stage run on the PyTorch NF4 path
(``shardpool.nf4_backend: torch``) instead of the plain loop, so A ÷ B is what bitsandbytes' kernels
gain over it, and the report sets B's extra peak memory against one dequantized linear weight
(the largest of a layer, in the compute dtype): the PyTorch path's bound.

``--with-s2`` adds side C to every pair: ``finetune`` with two stages on the same device (two
processes; on CPU each gets half the threads), reported as C ÷ A, what splitting one device costs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import bench_pipeline as bench  # scripts/ is on sys.path when this file runs as a script

ROOT = bench.ROOT


# ---------------------------------------------------------------------------- pure helpers


def pair_ratios(a_values: Sequence[float], b_values: Sequence[float]) -> list[float]:
    """A ÷ B for each pair, in run order."""
    if len(a_values) != len(b_values) or not a_values:
        raise ValueError("pairs need as many A as B values, at least one")
    return [a / b for a, b in zip(a_values, b_values, strict=True)]


def ratio_summary(ratios: Sequence[float]) -> dict[str, float]:
    """Median, min, max and spread (max - min) of per-pair ratios."""
    if not ratios:
        raise ValueError("no ratios to summarize")
    return {
        "median": float(statistics.median(ratios)),
        "min": float(min(ratios)),
        "max": float(max(ratios)),
        "spread": float(max(ratios) - min(ratios)),
    }


def run_order(pairs: int, sides: Sequence[str] = ("A", "B")) -> list[tuple[int, str]]:
    """The interleaved order of the runs, pair by pair: A B, then B A, then A B, ...

    Every other pair runs its sides in reverse, so whatever favours the first (or the second)
    run of a pair favours each side equally often.
    """
    return [
        (pair, side) for pair in range(pairs) for side in (sides if pair % 2 == 0 else tuple(reversed(sides)))
    ]


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


# ---------------------------------------------------------------------------- one run, in its own process


def shardpool_worker(spec_path: str) -> dict[str, Any]:
    """Side A, run in a fresh interpreter: ``finetune`` with one stage; step medians and the stage's peak RSS."""
    spec = json.loads(Path(spec_path).read_text())
    from rich.console import Console

    from shardpool.config import parse_config
    from shardpool.finetune import finetune

    config = spec["config"]
    output_dir = Path(config["output_dir"])
    finetune(parse_config(config), console=Console(quiet=True))
    records = [
        json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    summary = json.loads((output_dir / "run_summary.json").read_text())
    measured = bench.summarize_steps(records)
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
    flag = "--plain-worker" if side == "B" and plain_b else "--shardpool-worker"
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
    )
    load: dict[str, Any] = {}
    with bench.cpu_accounting(load):
        result = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), flag, str(spec)],
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
            preexec_fn=bench._die_with_parent,
            check=False,
        )
    if result.returncode != 0:
        raise RuntimeError(f"run {label} failed:\n{result.stderr[-4000:]}")
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    measured["load"] = load
    return measured


# ---------------------------------------------------------------------------- the benchmark


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
    import bitsandbytes
    import peft
    import torch
    import transformers

    from shardpool.model.tinymodel import DEFAULT_CORPUS, make_tiny_llama, write_jsonl

    size = SIZES[size_name]
    threads = len(cores)
    sides = ("A", "B", "C") if with_s2 else ("A", "B")
    bf16 = device.startswith("cuda") and torch.cuda.is_bf16_supported()
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="shardpool-paired-")) if keep is None else keep
    work.mkdir(parents=True, exist_ok=True)
    saved_cache = os.environ.get("SHARDPOOL_CACHE")
    os.environ["SHARDPOOL_CACHE"] = str(work / "cache")
    try:
        rows = bench.completion_rows(size["rows"])
        data = write_jsonl(rows, work / "data.jsonl")
        model_dir = make_tiny_llama(
            work / "model",
            seed=0,
            initializer_range=0.1,
            corpus=[row["text"] for row in rows] + list(DEFAULT_CORPUS),
            **size["model"],
        )
        hf_config = json.loads((model_dir / "config.json").read_text())

        def config_for(side: str, label: str) -> dict[str, Any]:
            stages = 2 if side == "C" else 1
            placement = {"stages": stages, "threads_per_stage": max(1, threads // stages)}
            if device != "cpu":
                placement = {"stages": stages, "devices": [device] * stages}
            if side == "B" and side_b == "torch-nf4":
                placement["nf4_backend"] = "torch"
            config = bench.training_config(model_dir, data, work / f"out-{label}", size, placement)
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
        with bench.pinned(cores):
            for side in sides:
                print(f"bench: warm-up {side}", file=sys.stderr, flush=True)
                run(side, f"warmup-{side}")
            for pair, side in run_order(pairs, sides):
                waited = bench.wait_for_idle(max_wait_idle_s)
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
                "cpu": bench.cpu_model_name(),
                "logical_cpus": os.cpu_count(),
                "cores_pinned": cores,
                "threads": threads,
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "peft": peft.__version__,
                "bitsandbytes": bitsandbytes.__version__,
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
                "warmup_steps_skipped": bench.WARMUP_STEPS,
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
    finally:
        if saved_cache is None:
            os.environ.pop("SHARDPOOL_CACHE", None)
        else:
            os.environ["SHARDPOOL_CACHE"] = saved_cache
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)


DEFAULT_PAIRS = 7
SIZES = {"full": bench.FULL, "quick": bench.QUICK, "gpu": bench.GPU}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, run the paired benchmark (or one side of it), print JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pairs", type=int, default=DEFAULT_PAIRS, help=f"A/B pairs (default {DEFAULT_PAIRS})"
    )
    parser.add_argument("--quick", action="store_true", help="the same as --size quick")
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="full",
        help="full: bench_pipeline's model (default); quick: a small one; gpu: hidden 2048, for one GPU",
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu (default) or a CUDA device such as cuda or cuda:0"
    )
    parser.add_argument("--with-s2", action="store_true", help="add side C: two stages on the same device")
    parser.add_argument(
        "--b",
        choices=("peft", "torch-nf4"),
        default="peft",
        help="side B: peft: the plain peft + bitsandbytes loop (default); torch-nf4: one stage on the PyTorch NF4 path",
    )
    parser.add_argument(
        "--cores", help="comma-separated CPU ids to pin every run to (default: this process's affinity)"
    )
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it")
    parser.add_argument(
        "--max-wait-idle",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="before each run, wait up to this long for other processes to leave the CPUs (default 60)",
    )
    parser.add_argument("--shardpool-worker", help=argparse.SUPPRESS)
    parser.add_argument("--plain-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.shardpool_worker or args.plain_worker:
        with contextlib.redirect_stdout(sys.stderr):
            if args.shardpool_worker:
                report = shardpool_worker(args.shardpool_worker)
            else:
                report = bench.plain_loop(args.plain_worker)
        print(json.dumps(report))
        return 0
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device {args.device}: use cpu or a CUDA device (cuda, cuda:N)")
    cores = [int(c) for c in args.cores.split(",")] if args.cores else sorted(os.sched_getaffinity(0))
    with contextlib.redirect_stdout(sys.stderr):
        report = benchmark(
            size_name="quick" if args.quick else args.size,
            device=args.device,
            with_s2=args.with_s2,
            pairs=args.pairs,
            cores=cores,
            keep=args.keep,
            max_wait_idle_s=args.max_wait_idle,
            side_b=args.b,
        )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
