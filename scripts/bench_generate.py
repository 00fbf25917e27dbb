"""Paired benchmark of generation: the inference ring against peft's ``generate``, and the ring's own
figures (see shardpool_dev/bench/generation.py).

    python scripts/bench_generate.py             # 3 pairs
    python scripts/bench_generate.py --pairs 5
    python scripts/bench_generate.py --device cuda:0 --pairs 2   # one GPU, bf16, hidden 2048

It prints one JSON object on stdout: ``one_stage_over_peft`` (decode tokens/s of one sequence on
one stage ÷ peft ``generate``; issue target at least 0.9), ``two_stages_concurrent_over_alone``
(8 requests in flight on two stages ÷ one alone; target at least 1.6) and
``time_to_first_token_s`` for a 512-token prompt, with the per-pair figures and versions.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from shardpool_dev.bench.child import run_and_report
from shardpool_dev.bench.generation import DEFAULT_PAIRS, MODEL_SHAPES, benchmark


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, run the benchmark, print its JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pairs", type=int, default=DEFAULT_PAIRS, help=f"A/B pairs (default {DEFAULT_PAIRS})"
    )
    parser.add_argument(
        "--cores", help="comma-separated CPU ids to pin every run to (default: this process's affinity)"
    )
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it")
    parser.add_argument(
        "--max-wait-idle", type=float, default=60.0, metavar="SECONDS",
        help="before each run, wait up to this long for other processes to leave the CPUs (default 60)",
    )  # fmt: skip
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu (default) or a CUDA device such as cuda:0 (both sides, every stage)",
    )
    parser.add_argument(
        "--size",
        choices=sorted(MODEL_SHAPES),
        help="the model: cpu (hidden 256) or gpu (hidden 2048); default by --device",
    )
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device {args.device}: use cpu or a CUDA device (cuda, cuda:N)")
    size = args.size or ("cpu" if args.device == "cpu" else "gpu")
    cores = [int(c) for c in args.cores.split(",")] if args.cores else sorted(os.sched_getaffinity(0))
    return run_and_report(
        "bench_generate",
        lambda: benchmark(
            pairs=args.pairs,
            cores=cores,
            keep=args.keep,
            max_wait_idle_s=args.max_wait_idle,
            device=args.device,
            size=size,
        ),
        errors=(RuntimeError,),
        cleaned="the stage processes were stopped",
    )


if __name__ == "__main__":
    sys.exit(main())
