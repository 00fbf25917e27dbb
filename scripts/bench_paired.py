"""Paired benchmark: one shardpool stage (S = 1) against a plain peft + bitsandbytes loop.

    python scripts/bench_paired.py                 # 7 pairs on the model of bench_pipeline.py
    python scripts/bench_paired.py --pairs 3 --quick

It prints one JSON object on stdout. Two implementations on a noisy machine are ranked by
*pairs*: A (``shardpool.finetune.finetune`` with one stage) and B (the plain loop of
``scripts/bench_pipeline.py``) run alternately, A B A B ..., each in a fresh process pinned to
the same cores with the same thread count, on the same model, data and micro-batches. A slow
minute on the machine then hits both members of a pair alike, and the per-pair ratio
A ÷ B tokens/s cancels it; the report gives the median ratio over the pairs and its spread
(max - min). An unrecorded warm-up pair comes first (it fills the profile cache and the page
cache). For every run the report also gives the CPU time other processes used while it ran.

Memory: the peak RSS (VmHWM) of the stage process next to that of the plain process.
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


def run_order(pairs: int) -> list[tuple[int, str]]:
    """The interleaved order of the runs: (pair, "A") then (pair, "B") for every pair."""
    return [(pair, side) for pair in range(pairs) for side in ("A", "B")]


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
        "tokens_per_s": measured["tokens_per_s"],
        "steps_measured": measured["steps_measured"],
        "final_loss": measured["final_loss"],
        "peak_rss_bytes": int(summary["ranks"][0]["peak_rss_bytes"]),
    }


def run_side(side: str, config: dict[str, Any], *, threads: int, work: Path, label: str) -> dict[str, Any]:
    """Run side A or B in a fresh process with ``threads`` torch threads; add the foreign CPU time."""
    spec = work / f"{label}.json"
    spec.write_text(json.dumps({"config": config, "threads": threads}))
    flag = "--shardpool-worker" if side == "A" else "--plain-worker"
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


def benchmark(*, quick: bool, pairs: int, cores: list[int], keep: Path | None) -> dict[str, Any]:
    """Build the model and data once, run the warm-up pair and ``pairs`` A/B pairs, return the report."""
    import bitsandbytes
    import peft
    import torch
    import transformers

    from shardpool.model.tinymodel import DEFAULT_CORPUS, make_tiny_llama, write_jsonl

    size = bench.QUICK if quick else bench.FULL
    threads = len(cores)
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

        def config_for(label: str) -> dict[str, Any]:
            return bench.training_config(
                model_dir, data, work / f"out-{label}", size, {"stages": 1, "threads_per_stage": threads}
            )

        runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
        with bench.pinned(cores):
            for side in ("A", "B"):
                print(f"bench: warm-up {side}", file=sys.stderr, flush=True)
                run_side(
                    side, config_for(f"warmup-{side}"), threads=threads, work=work, label=f"warmup-{side}"
                )
            for pair, side in run_order(pairs):
                label = f"{side}{pair}"
                print(f"bench: pair {pair + 1}/{pairs}, {side}", file=sys.stderr, flush=True)
                runs[side].append(run_side(side, config_for(label), threads=threads, work=work, label=label))
        tokens_ratio = pair_ratios(
            [run["tokens_per_s"] for run in runs["A"]], [run["tokens_per_s"] for run in runs["B"]]
        )
        memory_ratio = pair_ratios(
            [run["peak_rss_bytes"] for run in runs["A"]], [run["peak_rss_bytes"] for run in runs["B"]]
        )
        return {
            "benchmark": "paired",
            "command": "python scripts/bench_paired.py"
            + (" --quick" if quick else "")
            + (f" --pairs {pairs}" if pairs != DEFAULT_PAIRS else ""),
            "A": "shardpool finetune, one stage (S = 1)",
            "B": "plain transformers + bitsandbytes NF4 + peft loop, same micro-batches",
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
            },
            "pairs": pairs,
            "tokens_per_s_ratio_a_over_b": ratio_summary(tokens_ratio),
            "tokens_per_s_ratio_per_pair": [round(ratio, 4) for ratio in tokens_ratio],
            "peak_rss_ratio_a_over_b": ratio_summary(memory_ratio),
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


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, run the paired benchmark (or one side of it), print JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pairs", type=int, default=DEFAULT_PAIRS, help=f"A/B pairs (default {DEFAULT_PAIRS})"
    )
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    parser.add_argument(
        "--cores", help="comma-separated CPU ids to pin every run to (default: this process's affinity)"
    )
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it")
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
    cores = [int(c) for c in args.cores.split(",")] if args.cores else sorted(os.sched_getaffinity(0))
    with contextlib.redirect_stdout(sys.stderr):
        report = benchmark(quick=args.quick, pairs=args.pairs, cores=cores, keep=args.keep)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
