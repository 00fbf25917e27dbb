"""Paired benchmark: what the step-boundary state copies (``job.keep_state``) cost a 2-stage run.

    python scripts/bench_state_copy.py                 # 3 pairs, bench_pipeline's quick model, 8 steps
    python scripts/bench_state_copy.py --pairs 5 --steps 12
    python scripts/bench_state_copy.py --pairs 1 --steps 5 --no-warmup   # a short look (noisy)
    python scripts/bench_state_copy.py --size full --pairs 2 --steps 6    # bench_pipeline's full model

It prints one JSON object on stdout. Side A is a 2-stage LOCAL ``finetune`` with keep_state on
(the stage processes beat on the rendezvous store and, after every step, write CPU clones of their
checkpoint files into ``checkpoints/live/step-N`` in a background thread); side B is the same run
with it off. keep_state is turned on through the bench hook ``SHARDPOOL_TEST_KEEP_STATE=1`` (read
by ``shardpool.elastic.rank``), the only difference between the sides. Runs alternate A B, B A, ...
(``shardpool_dev.bench.stats.run_order``), each in a fresh process, and the report gives the per-pair ratio
A ÷ B of the median step seconds (``shardpool_dev.bench.pipeline.summarize_steps``: steps after the warm-up)
and of the whole run's seconds (the clones are taken between steps, outside ``step_seconds``),
and the bytes one step's copy writes (all ranks). Target: a cost under 3 % (ratio < 1.03).
On a shared machine the paired figures are noisy; read the spread.

The A runs also give the cost directly, step by step, from their ``metrics.jsonl`` lines:
``blocked_over_step`` (the slowest rank's ``stage_copy_blocked_s``, the time it spent handing a
copy over between steps, over the step) and ``copy_cpu_over_stage_cpu`` (the copy threads' CPU,
``stage_copy_cpu_s`` summed over ranks, over the ranks' step time: what the copies can take from
compute when every core is busy). Their sum bounds the cost without the run-to-run noise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from shardpool_dev.bench.state_copy import benchmark


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, run the paired benchmark print JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="A/B pairs (default 3)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8)")
    parser.add_argument(
        "--no-warmup", action="store_true", help="skip the unrecorded warm-up pair (a short look only)"
    )
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it")
    parser.add_argument(
        "--size", choices=("quick", "full"), default="quick", help="bench_pipeline's model (default quick)"
    )
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.steps < 2:
        parser.error("--pairs must be at least 1 and --steps at least 2")
    with contextlib.redirect_stdout(sys.stderr):
        report = benchmark(
            pairs=args.pairs, steps=args.steps, warmup=not args.no_warmup, keep=args.keep, size_name=args.size
        )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
