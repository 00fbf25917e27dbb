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
import sys
from collections.abc import Sequence
from pathlib import Path

from shardpool_dev.bench.paired import DEFAULT_PAIRS, SIZES, benchmark


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, run the paired benchmark, print its JSON report."""
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
    args = parser.parse_args(argv)
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
