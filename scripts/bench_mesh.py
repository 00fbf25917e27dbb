"""Benchmark pipelined QLoRA over a WireGuard mesh of namespaced hosts and print one JSON object.

    sudo python scripts/bench_mesh.py            # the run recorded in docs/performance.md (Mesh)
    sudo python scripts/bench_mesh.py --quick    # a smaller model, fewer steps, smaller transfers

It needs root, ``ip``, ``wireguard-go``, ``wg``, ``ping`` and ``/dev/net/tun`` (the same as the
mesh tests). Everything happens in a temporary directory and in network namespaces that are
removed at the end, with every process the lab started stopped by pid, also on failure or Ctrl-C:

  1. builds a random tiny Llama (``shardpool.model.tinymodel.make_tiny_llama``) and a completion dataset;
  2. builds three hosts a, b, c (``shardpool_dev.lab.Lab``: namespaces + veth + bridge on
     192.0.2.0/24) and forms the mesh with the real CLI (``mesh init`` on a, ``mesh join`` on b, c),
     then waits for pings and for every agent's ``/v1/health``;
  3. measures the raw TCP throughput a -> b over the mesh (198.51.100.1 -> 198.51.100.2, in the
     lab's mesh CIDR ``shardpool_dev.lab.MESH_CIDR``) and over the underlay (192.0.2.1 -> 192.0.2.2) with a
     stdlib socket sender/receiver, and the ping RTT;
  4. runs ``shardpool finetune`` on host a with ``shardpool: {placement: mesh, stages: 3}`` (and
     ``threads_per_stage`` = CPUs // 3, since the three hosts share this machine's cores); while
     it trains, snapshots the WireGuard transfer counters of every host after each step, so the
     bytes that cross each hop per step are measured on the wire too;
  5. tears the lab down and runs the same config with the mesh run's split
     (``shardpool: {placement: local, layers: [...]}``) as three local stage processes over loopback;
  6. compares the bytes the pipeline sends per step with what a DDP ring all-reduce of the full
     fp32 gradients (and of the LoRA gradients only) would move for the same model and N = 3.

Step metrics come from each run's ``metrics.jsonl``; the first ``WARMUP_STEPS`` steps are skipped
and medians are reported. MB means 10**6 bytes. See docs/performance.md (Mesh) for a recorded run.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from shardpool_dev.bench.child import run_and_report
from shardpool_dev.bench.mesh import BenchError
from shardpool_dev.bench.mesh_bench import benchmark
from shardpool_dev.lab import LabError, netns_skip_reason


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, check for root and the tools, run the benchmark, print its JSON report."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="a smaller model, fewer steps and smaller transfers"
    )
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (model, outputs, logs)")
    parser.add_argument(
        "--max-wait-idle",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="before each measurement, wait up to this long for other processes to leave the CPUs (default 60)",
    )
    args = parser.parse_args(argv)
    reason = netns_skip_reason()
    if reason is not None:
        hint = "; run it as `sudo python scripts/bench_mesh.py`" if os.geteuid() != 0 else ""
        print(f"bench_mesh: error: {reason}{hint}", file=sys.stderr)
        return 2
    return run_and_report(
        "bench_mesh",
        lambda: benchmark(quick=args.quick, keep=args.keep, max_wait_idle_s=args.max_wait_idle),
        errors=(BenchError, LabError),
        cleaned="the lab was removed",
    )


if __name__ == "__main__":
    sys.exit(main())
