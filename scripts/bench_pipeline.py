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
import sys
from collections.abc import Sequence
from pathlib import Path

from shardpool_dev.bench.pipeline import benchmark


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
    args = parser.parse_args(argv)
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
