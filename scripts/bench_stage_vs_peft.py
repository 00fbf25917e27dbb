"""One shardpool stage against a plain transformers + peft + bitsandbytes loop, at Llama-3-8B's layer shape.

    python scripts/bench_stage_vs_peft.py --json bench.json   # on a GPU (cuda:0): 2 layers, 2048 tokens, bf16
    python scripts/bench_stage_vs_peft.py --tiny              # the same plumbing on the CPU, a tiny model
    python scripts/bench_stage_vs_peft.py --plan-only         # print the workload and exit (builds nothing)

The model is a random-weight Llama with Llama-3-8B's layers (hidden 4096, intermediate 14336, 32
heads, 8 KV heads, vocabulary 128256; ``shardpool_dev.bench.stage_vs_peft.LLAMA3_8B``) and ``--layers`` of them (default 2),
written as bf16 safetensors. Both sides train it with NF4 + LoRA r = 16 on every linear layer,
micro-batches of one 2048-token row (rows are longer and truncated, so every position is a real
token), 4 micro-batches per step, 5 steps, in bf16:

  - A: ``shardpool.finetune.finetune`` with one stage on the device (the paired
    benchmark's worker: tokens/s from ``metrics.jsonl``, peak memory from ``run_summary.json``);
  - B: the plain loop of ``shardpool_dev.bench.plain`` (same rows, steps, LoRA, token-weighted
    loss, clip and AdamW; ``torch.cuda.max_memory_allocated``).

Each side runs in its own fresh process, in pairs A B, then B A, ... (``--pairs``, default 1: a
GPU lease is short). Tokens/s is the median over the steps after the first two. The report, one
JSON object, is printed at the end and rewritten to ``--json`` after every side, so a run stopped
early keeps the sides that finished. ``--tiny`` runs a 2-layer hidden-64 model on the CPU in fp32:
the test of this script; its figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from shardpool_dev.bench.stage_vs_peft import FULL, TINY, benchmark, workload


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, run the benchmark (or print its workload), print the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny model on the CPU in fp32 (the plumbing check)"
    )
    parser.add_argument("--device", help="cuda:0 (default) or cpu; --tiny runs on the CPU")
    parser.add_argument(
        "--layers",
        type=int,
        default=FULL["model"]["num_layers"],
        help="decoder layers of the 8B shape (default 2)",
    )
    parser.add_argument("--pairs", type=int, default=1, help="A/B pairs (default 1)")
    parser.add_argument("--json", type=Path, help="also write the report here, after every side")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it")
    parser.add_argument("--plan-only", action="store_true", help="print the workload as JSON and exit")
    args = parser.parse_args(argv)
    if args.pairs < 1 or args.layers < 1:
        parser.error("--pairs and --layers must be at least 1")
    size = TINY if args.tiny else {**FULL, "model": {**FULL["model"], "num_layers": args.layers}}
    device = args.device or ("cpu" if args.tiny else "cuda:0")
    if device != "cpu" and not device.startswith("cuda"):
        parser.error(f"--device {device}: use cpu or a CUDA device (cuda:0)")
    if args.plan_only:
        print(json.dumps(workload(size, device=device, pairs=args.pairs), indent=2))
        return 0
    with contextlib.redirect_stdout(sys.stderr):
        report = benchmark(size, device=device, pairs=args.pairs, json_path=args.json, keep=args.keep)
    print(json.dumps(report, indent=2))
    failed = [
        run["error"].splitlines()[-1] for side in report["runs"].values() for run in side if "error" in run
    ]
    for line in failed:
        print(f"bench: a side failed: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
