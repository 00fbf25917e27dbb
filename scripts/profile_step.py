"""Where a training step's time goes: one shardpool stage (S = 1) next to the plain peft loop.

    pip install py-spy
    python scripts/profile_step.py > step-profile.json

It builds the model and data of ``scripts/bench_pipeline.py``, runs side A (``finetune`` with one
stage) and side B (the plain transformers + bitsandbytes + peft loop) of
``scripts/bench_paired.py`` once each under ``py-spy record --subprocesses`` (50 samples/s,
non-blocking, so the sampled process is never paused), and sorts every sample taken inside the
step loop into a category by the frames on its stack: forward, backward, loss, optimizer,
gradient clip, collectives, logging, data, and Python overhead (samples whose innermost frame is
shardpool's or the loop's own code rather than a torch, peft, transformers or bitsandbytes call).
It prints one JSON object with the counts and shares per side. Samples outside the step loop
(imports, loading, evaluation) are left out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from shardpool_dev.bench.profile import profile_side
from shardpool_dev.bench.workload import FULL, QUICK, scratch, tiny_llama_and_rows, training_config


def main(argv: Sequence[str] | None = None) -> int:
    """Build the model and data, profile both sides, print the JSON breakdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    parser.add_argument("--rate", type=int, default=50, help="py-spy samples per second (default 50)")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (raw profiles too)")
    args = parser.parse_args(argv)
    if shutil.which("py-spy") is None:
        print("profile_step: py-spy is not installed; run `pip install py-spy` first", file=sys.stderr)
        return 2
    size = QUICK if args.quick else FULL
    threads = len(os.sched_getaffinity(0))
    with scratch("shardpool-profile-", args.keep) as work:
        with contextlib.redirect_stdout(sys.stderr):
            model_dir, data = tiny_llama_and_rows(work, size)
        sides = {}
        for side in ("A", "B"):
            config = training_config(
                model_dir, data, work / f"out-{side}", size, {"stages": 1, "threads_per_stage": threads}
            )
            spec = work / f"{side}.json"
            spec.write_text(json.dumps({"config": config, "threads": threads}))
            print(f"profile: side {side}", file=sys.stderr, flush=True)
            sides[side] = profile_side(side, spec, work=work, rate=args.rate)
        report = {
            "profile": "step",
            "command": "python scripts/profile_step.py" + (" --quick" if args.quick else ""),
            "A": "shardpool finetune, one stage (S = 1)",
            "B": "plain transformers + bitsandbytes NF4 + peft loop",
            "sampler": f"py-spy record --nonblocking --subprocesses, {args.rate} samples/s",
            "threads": threads,
            "sides": sides,
        }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
