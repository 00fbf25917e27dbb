"""Benchmark the planner and print JSON: plan vs even and memory-proportional splits, planning time,
scale (80 layers over 64 devices), and the profiler's time for a tiny model on this CPU.

    python scripts/bench_planner.py > planner-bench.json

Baselines use every device of the fleet that can run the workload, in file order, like a
hand-written split: the seed fleet's M40 too, which computes its NF4 layers in plain PyTorch
(bitsandbytes has no kernels for compute capability 5.2; docs/planner.md). The
workloads plan as a config does by default (``warmup_lead: auto``, ``data_parallel: auto``), with
``bf16: true``: each device computes in the dtype it supports (the V100 in fp16, the M40 in fp32);
``planner_lead_1`` is the same search at the textbook 1F1B warm-up.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from shardpool_dev.bench.planner import WORKLOADS, compare, profile_tiny, scale
from shardpool_dev.bench.workload import REPO_ROOT


def main(argv: Sequence[str] | None = None) -> int:
    """Run every comparison, the scale run and the profiler, and print one JSON document."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    fleets = sorted((REPO_ROOT / "configs").glob("fleet-*.yaml"))
    result = {
        "workloads": {
            name: w.__dict__ | {"lora_targets": list(w.lora_targets)} for name, w in WORKLOADS.items()
        },
        "comparisons": [compare(path, model) for path in fleets for model in WORKLOADS],
        "scale": scale(),
        "profile": profile_tiny(),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
