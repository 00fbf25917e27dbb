"""Per-thread CPU time and wake-ups of one shardpool stage (S = 1) and of the plain peft loop.

    python scripts/thread_cpu.py > threads.json              # bench_pipeline's model, 10 steps
    python scripts/thread_cpu.py --size quick --steps 8      # a small model, a few minutes

It runs side A (``finetune`` with one stage: the launcher process and the stage it starts) and
side B (the plain transformers + bitsandbytes + peft loop) of ``scripts/bench_paired.py`` once
each, and samples every thread of each process tree from ``/proc/PID/task/*/stat`` (utime +
stime) and ``/proc/PID/task/*/status`` (voluntary context switches: wake-ups) ten times a second.
It prints one JSON object: per thread, its CPU seconds and wake-ups per second of training,
between the end of step 2 and the end of the last step. These figures do not need a quiet
machine: a thread that wakes 100 times a second does so under any load. CPU seconds per *step* of
the compute threads do depend on the load (OpenMP threads spin while a partner is descheduled), so
compare those only between runs on the same quiet machine. Linux only.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from shardpool_dev.bench.threads import FIRST_MARK, SIZES, run_side
from shardpool_dev.bench.workload import scratch, tiny_llama_and_rows, training_config


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run both sides print JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per side (at least 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each side (default 2)")
    args = parser.parse_args(argv)
    if args.steps < FIRST_MARK + 1:
        parser.error(f"--steps must be at least {FIRST_MARK + 1}")
    size = dict(SIZES[args.size], max_steps=args.steps)
    with scratch("shardpool-threads-", None) as work:
        model, data = tiny_llama_and_rows(work, size)
        placement = {"stages": 1, "threads_per_stage": args.threads}
        report: dict[str, Any] = {"benchmark": "thread_cpu", "size": args.size, "steps": args.steps}
        for side in ("A", "B"):
            config = training_config(model, data, work / f"out-{side}", size, placement)
            print(f"thread_cpu: side {side}", file=sys.stderr, flush=True)
            report[side] = run_side(side, config, work, threads=args.threads)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
