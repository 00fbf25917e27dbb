"""Paired benchmark: a DPO step (rl: dpo, the reference forward in each step) against an SFT step on
the same chosen and rejected sequences, both on two CPU stages.

    python scripts/bench_preference.py             # 3 pairs
    python scripts/bench_preference.py --pairs 5
    python scripts/bench_preference.py --precompute  # precompute_ref_log_probs on side A

It prints one JSON object on stdout: ``step_seconds_ratio_a_over_b`` (median, min, max, spread of
the per-pair ratios of median step times; issue target: at most 1.45, with ``--precompute`` at most
1.1 plus the one pass, reported as ``reference_pass_seconds``: the slowest stage's) and
``peak_rss_ratio_a_over_b`` (the largest stage's peak RSS; the reference adds nothing but its
log-probabilities). Sides run alternately, A B B A ..., each in a fresh process pinned to the same
cores, after one unrecorded warm-up run of each (see scripts/bench_paired.py for the method).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from shardpool_dev.bench.preference import DEFAULT_PAIRS, benchmark


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
        "--precompute", action="store_true", help="side A with precompute_ref_log_probs: true"
    )
    parser.add_argument(
        "--max-wait-idle", type=float, default=60.0, metavar="SECONDS",
        help="before each run, wait up to this long for other processes to leave the CPUs (default 60)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    cores = [int(c) for c in args.cores.split(",")] if args.cores else sorted(os.sched_getaffinity(0))
    with contextlib.redirect_stdout(sys.stderr):
        report = benchmark(
            pairs=args.pairs,
            cores=cores,
            keep=args.keep,
            max_wait_idle_s=args.max_wait_idle,
            precompute=args.precompute,
        )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
