"""One command for anyone with a GPU: does training on CUDA stages give the CPU's result, and does
the plan's memory prediction hold?

    python scripts/gpu_check.py [--json gpu-check.json] [--keep DIR] [--budget SECONDS]
                                [--only NAME ...] [--list]

It trains a small random Llama (6 layers, hidden size 256, NF4 + LoRA, 3 optimizer steps) with
``shardpool finetune`` as

  - one CUDA stage                                  (``cuda``),
  - two CUDA stages on one GPU, two processes       (``cuda+cuda``),
  - a CUDA stage and a CPU stage                    (``cuda+cpu``),

each in fp32, bf16 and fp16 (bf16 only where ``torch.cuda.is_bf16_supported()``), and the two
layouts of two stages once more in fp32 with their split moved in place after step 2
(``cuda+cuda/fp32 re-shard``, ``cuda+cpu/fp32 re-shard``: ``shardpool_dev.bench.gpu.cases.RESHARDS``; each rank measures
its room on its device first, then the LoRA and AdamW state cross between the devices). It
compares every run with one CPU stage in fp32 (the reference, always run first) within the
tolerances of ``shardpool_dev.bench.gpu.cases.TOLERANCES``, and a re-shard run must also have re-sharded to its split with
every rank reporting room above 0. ``--list`` prints the runs' names; ``--only`` picks some.

First a pre-flight: ``python -m bitsandbytes`` (its own diagnostic; every run is NF4, so when it
fails no run starts and the check says why in one line) and the GPU's compute mode
(``Exclusive_Process`` lets one process use the GPU, so the ``cuda+cuda`` runs are skipped with
that reason). The runs then go in ``shardpool_dev.bench.gpu.cases.PRIORITY`` order (most informative first) within
``--budget`` seconds: each run's timeout is the budget left (at most ``shardpool_dev.bench.gpu.cases.RUN_TIMEOUT_S``), and
a run is not started once the longest run so far would not fit (it is reported ``skip budget``).

Memory, against the plan (``plan.json``), whose stage memory is planned tensors plus a reserve
(0.75 GiB per CUDA stage plus 5% of the tensors) for the CUDA context, cuBLAS workspaces, NCCL
buffers and the allocator's fragmentation:

  - per CUDA stage, ``torch.cuda.max_memory_allocated`` (from ``run_summary.json``) against the
    planned tensors, the stage memory without its reserve;
  - per run, the GPU's whole footprint (the peak of its used memory while the run goes, less what
    was used before, read through NVML or ``nvidia-smi``, so this process holds no CUDA context)
    less the stages' allocated peaks, against the CUDA stages' reserves.

A ratio above 1 is marked ``!``: the plan undercounts that part.

It prints the pre-flight and a table, then the same as JSON; ``--json`` is rewritten (atomically)
after every run, so a killed check leaves what finished. It exits 1 when any run fails or falls
outside its tolerance, or when no run was made (the pre-flight or the reference ruled them out, or
every run was skipped); 2 for an unknown run name. Without CUDA it prints one line saying it
skipped, and exits 0 (``.ci/run`` calls it on every machine).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shardpool_dev.bench.gpu.cases import DEFAULT_BUDGET_S, TOLERANCES, UsageError, by_priority, cases, select
from shardpool_dev.bench.gpu.device import GpuMemory, device_facts, nvml_index, preflight_checks, skip_reason
from shardpool_dev.bench.gpu.report import format_preflight, format_table
from shardpool_dev.bench.gpu.runs import run_all
from shardpool_dev.bench.gpu.verdicts import exit_status


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", type=Path, help="also write the JSON report here (rewritten after every run)"
    )
    parser.add_argument(
        "--keep", type=Path, help="work in this directory and keep it (default: a temporary one)"
    )
    parser.add_argument(
        "--budget", type=float, default=DEFAULT_BUDGET_S,
        help=f"seconds for the whole check; runs that no longer fit are skipped (default {DEFAULT_BUDGET_S:g})",
    )  # fmt: skip
    parser.add_argument("--only", nargs="+", metavar="NAME", help="make only these runs (see --list)")
    parser.add_argument(
        "--list", action="store_true", help="print the runs' names, in the order they go, and exit"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Pre-flight, the reference, then the chosen runs within the budget; print the table and the
    JSON. 0 when all that ran are within tolerance (or the machine has no CUDA)."""
    args = _parser().parse_args(argv)
    every = cases(bf16=True)
    if args.list:
        print("\n".join(case.name for case in by_priority(every)))
        return 0
    try:
        chosen = select(every, args.only)
    except UsageError as error:
        print(f"gpu_check: {error}", file=sys.stderr)
        return 2
    reason = skip_reason()
    if reason is not None:
        print(f"gpu_check: skipped: {reason}")
        return 0
    started = time.monotonic()
    gpu = GpuMemory(nvml_index())
    preflight = preflight_checks(gpu)
    print(format_preflight(preflight), file=sys.stderr, flush=True)
    facts = device_facts()
    if isinstance(facts, str):
        print(f"gpu_check: {facts}")
        return 1
    report: dict[str, Any] = facts | {
        "preflight": preflight,
        "budget_s": args.budget,
        "tolerances": TOLERANCES,
    }
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        work = args.keep or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        ruled_out = run_all(
            chosen, report, work=work, gpu=gpu, started=started, budget_s=args.budget, json_path=args.json
        )
    print(format_preflight(preflight))
    print(format_table(report["runs"]))
    print(json.dumps(report, indent=2))
    if ruled_out is not None:
        print(f"gpu_check: no run made: {ruled_out}")
        return 1
    return exit_status(report["runs"])


if __name__ == "__main__":
    sys.exit(main())
