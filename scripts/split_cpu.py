"""CPU seconds a step of bench_hetero's model costs whole and split into stages, under the bench's quotas.

    sudo python scripts/split_cpu.py                    # 16 | 11,5 | 6,5,5 at 0.6 + 0.3 CPU, 8 steps, ABBA x 2
    sudo python scripts/split_cpu.py --splits 16@a 11,5@a,b --repeats 3
    sudo python scripts/split_cpu.py --quick            # a tiny model, a few steps (the test's version)

bench_hetero compares the pool with the fastest host alone over the mesh; this script takes the
mesh away to show what splitting the layers itself costs. Each split is a local ``finetune``
(``placement: local``, ``shardpool.layers``, one thread per stage) of bench_hetero's model and
config. A split is written ``LAYERS@HOSTS``: ``11,5@a,b`` runs 11 layers (and the embedding) under
host a's quota and 5 (and ``lm_head``) under b's; ``6,5,5@a,b,a`` puts the first and the last
stage under a's quota together (two stage processes sharing one host's CPU). Each host is a cgroup
with bench_hetero's quota and period (``--hosts``, default 0.6,0.3; ``--period-ms``, default 10); a stage process is moved
into its host's cgroup by its rank as soon as it starts. ``--repeats N`` runs the splits in ABBA
order (the list, then the list reversed, ...).

The JSON gives, per run, between the end of step 2 and the end of step ``--steps`` (a run trains
one step more, so that no stage has ended when the window closes): wall seconds per step,
each stage process's CPU seconds per step (user and system) and minor page faults per step, the
CPU seconds per step of every host (its stages together), and ``metrics.jsonl``'s compute and wait; per split, the median step
and CPU over its runs; and each split's ratios to the first one's (``step_over_first``,
``cpu_over_first``). Needs root and a writable cgroup ``cpu`` controller (v1 or v2); where it has
neither it prints ``{"skipped": reason}`` and exits 0. Every cgroup and process it starts is
removed at the end, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from shardpool_dev.bench.cgroups import PERIOD_US, cgroup_skip_reason
from shardpool_dev.bench.child import run_and_report
from shardpool_dev.bench.hetero.modes import FULL, QUICK, parse_hosts, parse_period_ms
from shardpool_dev.bench.split import (
    DEFAULT_SPLITS,
    FIRST_STEP,
    QUICK_SPLITS,
    SplitError,
    measure,
    parse_split,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, skip where the machine cannot run it, run it, print the JSON report."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and few steps (hosts 1.0,0.5)")
    parser.add_argument(
        "--hosts", type=parse_hosts, help="CPU quota of each host (default 0.6,0.3; 1.0,0.5 with --quick)"
    )
    parser.add_argument(
        "--splits", nargs="+", help="LAYERS@HOSTS each (default " + " ".join(DEFAULT_SPLITS) + ")"
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of each split, in ABBA order (default 2)"
    )
    parser.add_argument("--steps", type=int, help="optimizer steps a run (default 8; 4 with --quick)")
    parser.add_argument(
        "--period-ms",
        type=parse_period_ms,
        default=PERIOD_US,
        help=f"the CFS period of every quota, in ms (default {PERIOD_US // 1000}, as bench_hetero's)",
    )
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    quotas = args.hosts or size["hosts"]
    steps = args.steps or (4 if args.quick else 8)
    if steps <= FIRST_STEP or args.repeats < 1:
        parser.error(f"--steps must be over {FIRST_STEP} and --repeats at least 1")
    texts = args.splits or (QUICK_SPLITS if args.quick else DEFAULT_SPLITS)
    try:
        splits = [parse_split(text, len(quotas), size["model"]["num_layers"]) for text in texts]
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    if os.geteuid() != 0:
        reason = "needs root (cgroup quotas)"
    else:
        reason = cgroup_skip_reason()
    if reason is not None:
        print(f"split_cpu: skipped: {reason}", file=sys.stderr)
        print(json.dumps({"skipped": reason}))
        return 0
    return run_and_report(
        "split_cpu",
        lambda: measure(
            splits, quotas, quick=args.quick, repeats=args.repeats, steps=steps, period_us=args.period_ms
        ),
        errors=(SplitError,),
        cleaned="the cgroups were removed",
    )


if __name__ == "__main__":
    sys.exit(main())
