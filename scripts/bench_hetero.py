"""Benchmark a heterogeneous pool: mesh hosts throttled by cgroup CPU quotas, pooled against the fastest alone.

    sudo python scripts/bench_hetero.py                       # 2 hosts, 0.6 + 0.3 CPU (issue 10's setup)
    sudo python scripts/bench_hetero.py --hosts 1.0,0.5,0.25  # the 3-host fleet
    sudo python scripts/bench_hetero.py --swap-profiles       # the pooled run starts from swapped profiles
    sudo python scripts/bench_hetero.py --quick               # a tiny model, few steps (the test's version)
    sudo python scripts/bench_hetero.py --modes fastest_alone,pooled --repeats 2  # side by side, ABBA
    sudo python scripts/bench_hetero.py --modes fastest_alone,all_alone,pooled --repeats 2  # + the others busy beside a
    sudo python scripts/bench_hetero.py --modes fastest_alone,pooled_pipeline,pooled_data_parallel --repeats 2

It needs what the mesh tests need (root, ``ip``, ``wireguard-go``, ``wg``, ``ping``,
``/dev/net/tun``) and a writable cgroup hierarchy with the ``cpu`` controller: cgroup v2's
``cpu.max`` where the unified hierarchy has the controller, else cgroup v1's ``cpu.cfs_quota_us``
(``shardpool_dev.bench.cgroups.choose_cgroup`` picks). Where it cannot run it prints ``{"skipped": reason}`` and exits 0.
Everything happens in a temporary directory, in network namespaces and in cgroups made for the run;
every one of them, and every process the run started, is removed by name or pid at the end, also on
failure or Ctrl-C:

  1. builds a random Llama (default 16 layers, hidden 512) and a completion dataset;
  2. builds hosts a, b (, c) with ``shardpool_dev.lab.Lab`` and forms the mesh with the real CLI (``mesh init``
     on a, ``mesh join`` on the others), unthrottled; then throttles each host by a cgroup with
     its CPU quota (``--quota-scope``): in ``stage`` scope (the default) its agent, restarted inside
     it, and the stages and profilers the agent starts, while WireGuard, the sync daemon and the
     launcher run in an unthrottled cgroup beside it, as they would beside a GPU; in ``host``
     scope every process of the host, as on a smaller machine;
  3. trains the same config three ways with ``shardpool finetune``:
     *fastest alone* (``placement: local``, ``layers: [N]``: one stage process on host a, as its
     owner would train on it alone; not through the mesh, where the planner would pick the host
     from profiles, which are what is under test), *even split* (``placement: mesh`` with
     ``shardpool.layers`` as even as the layers allow over every host; the planner picks only the
     order) and *pooled* (``placement: mesh``: the planner's split and stage count); the launcher
     always runs on host a. Fastest-alone and even runs have ``rebalance: off``, so they stay
     the baselines, and the pooled ones ``rebalance: auto``; ``--modes`` runs only some ways, or
     adds *all alone*: the fastest-alone run again while every other host trains the same model
     alone beside it (its own ``shardpool finetune``, its stage under its quota, started first and
     stopped when host a's run ends). On one VM two busy hosts slow each other (shared caches,
     memory bandwidth, the hypervisor); separate machines do not. This run gives host a a
     neighbour as busy as in the pooled run, so pooled ÷ it (``pooled_over_fastest_beside``)
     compares the two at the same contention, and pooled ÷ every host's tokens/s alone at once
     (``pooled_over_every_host_alone``) says how much of the hosts' separate throughput the pool
     keeps;
  4. with ``--swap-profiles``, before the pooled run, swaps the fastest and the slowest host's
     cached layer profiles (``<agent work dir>/profile/profiles.json``) and restarts both agents so
     they forget the profiles they hold in memory, then runs *pooled_swapped*: the pooled run again,
     planned from the wrong profiles, which must re-balance to recover; the plain pooled run's
     tokens/s is "the best plan's" it is measured against.

With ``--repeats N`` each chosen way runs N times on the same mesh, in ABBA order
(``shardpool_dev.bench.stats.abba_order``: fastest, pooled, pooled, fastest, ...), so that a slow drift of the machine's
load favours neither; tokens/s is then each way's median, and pooled ÷ fastest the median of the
ratios of the rounds (the i-th run of each way), with their min and max under ``repeats``.
During every run, :class:`CgroupCpuSampler` counts the CPU seconds each kind of process used in
each host's throttled cgroup (``cgroup_cpu_s``).

The JSON holds tokens/s of each run, pooled ÷ fastest, plan.json's ``predicted_step_s`` ÷ the
median measured step after ``warmup`` steps, per-stage compute and wait (``metrics.jsonl``), the
per-layer seconds of each host (its profile, and its measured compute in the even split), and the
re-balancing events (``{"event": "rebalance", ...}`` lines of ``metrics.jsonl``) where any.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from shardpool_dev.bench.cgroups import PERIOD_US, detect_cgroup
from shardpool_dev.bench.child import run_and_report
from shardpool_dev.bench.hetero.lab import skip_reason
from shardpool_dev.bench.hetero.modes import (
    DEFAULT_MODES,
    FULL,
    MODES,
    QUICK,
    SCOPES,
    parse_hosts,
    parse_modes,
    parse_period_ms,
    parse_repeats,
)
from shardpool_dev.bench.hetero.runs import benchmark
from shardpool_dev.bench.mesh import BenchError
from shardpool_dev.lab import LabError


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, skip where the machine cannot run it, run it, print the JSON report."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and few steps (hosts 1.0,0.5)")
    parser.add_argument(
        "--hosts",
        type=parse_hosts,
        help="CPU quota of each host, fastest first (default 0.6,0.3; 1.0,0.5 with --quick)",
    )
    parser.add_argument(
        "--swap-profiles",
        action="store_true",
        help="then swap the fastest and slowest host's cached profiles and run pooled again from them",
    )
    parser.add_argument(
        "--quota-scope",
        choices=SCOPES,
        default=SCOPES[0],
        help="throttle only the stages and profilers (stage, default) or every process of a host (host)",
    )
    parser.add_argument(
        "--modes",
        type=parse_modes,
        default=DEFAULT_MODES,
        help="the ways to run, comma-separated, among "
        + ",".join(MODES)
        + " (default "
        + ",".join(DEFAULT_MODES)
        + "; all_alone: the fastest alone while every other host trains alone beside it)",
    )
    parser.add_argument(
        "--repeats",
        type=parse_repeats,
        default=1,
        help="run each way this many times in ABBA order (fastest, pooled, pooled, fastest, ...) on the"
        " same mesh; the ratios are the median of each round's (default 1)",
    )
    parser.add_argument(
        "--period-ms",
        type=parse_period_ms,
        default=PERIOD_US,
        help=f"the CFS period of every quota, in ms (default {PERIOD_US // 1000}; the kernel's own is 100)",
    )
    parser.add_argument(
        "--warmup-lead",
        type=int,
        choices=range(1, 9),
        metavar="1..8",
        help="fix the 1F1B warm-up lead of every mesh run (default: the planner's choice)",
    )
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (model, outputs, logs)")
    args = parser.parse_args(argv)
    reason = skip_reason()
    if reason is not None:
        print(f"bench_hetero: skipped: {reason}", file=sys.stderr)
        print(json.dumps({"skipped": reason}))
        return 0
    choice = detect_cgroup()
    assert choice is not None  # skip_reason checked it
    quotas = args.hosts or (QUICK if args.quick else FULL)["hosts"]
    if args.swap_profiles and "pooled" not in args.modes:
        parser.error("--swap-profiles compares with the pooled run: keep pooled in --modes")
    return run_and_report(
        "bench_hetero",
        lambda: benchmark(
            quick=args.quick,
            quotas=quotas,
            swap=args.swap_profiles,
            keep=args.keep,
            choice=choice,
            scope=args.quota_scope,
            only=args.modes,
            repeats=args.repeats,
            period_us=args.period_ms,
            warmup_lead=args.warmup_lead,
        ),
        errors=(BenchError, LabError),
        cleaned="the lab and the cgroups were removed",
    )


if __name__ == "__main__":
    sys.exit(main())
