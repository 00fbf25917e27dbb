"""Chaos benchmark of keeping a mesh run alive (issue 16): N runs, each losing a random member at a random step.

    sudo python scripts/bench_chaos.py             # 20 runs (the figures in docs/performance.md)
    sudo python scripts/bench_chaos.py --runs 2    # a quick check

It needs what the mesh tests need (root, ``ip``, ``wireguard-go``, ``wg``, ``ping``,
``/dev/net/tun``); where it cannot run it prints ``{"skipped": reason}`` and exits 0. Everything
happens in a temporary directory and in network namespaces removed at the end, every process the
lab started stopped by pid, also on failure or Ctrl-C:

  1. builds the tiny Llama of the mesh tests (6 layers, hidden 64) and a completion dataset, and
     trains one uninterrupted *reference* with three local stage processes (split 2/2/2);
  2. builds hosts a, b, c (``shardpool_dev.lab.Lab``) once and forms the mesh with the real CLI;
  3. runs ``shardpool finetune`` on host a (``placement: mesh``, three stages,
     ``on_member_loss: continue``) N times; in each, at a random moment of the step after a random
     step (a delay drawn up to the median step time so far), every process of a random host
     other than a (the launcher's) is killed with ``SIGKILL``
     (:meth:`shardpool_dev.lab.Lab.kill_host`: WireGuard, sync daemon, agent, stage). The run must finish
     by itself; afterwards the host is started again with ``mesh up`` for the next run.

The JSON report: runs, how many finished by themselves (exit 0); the steps lost per loss, twice:
the ``member_lost`` event's ``steps_lost`` (reported steps the launcher trains again) and, counted
here from the polled ``metrics.jsonl``, the newest step line seen before the loss minus the step
the run went on from (a reported step trained again, which the launcher's commit gate must
prevent); the steps trained again *unreported* (``unreported_steps_redone``: a kill that lands
after a step ended but before every stage's copy of it was written; the launcher had held that
step's line, and it is trained again with the interrupted one), with each run's median copy
window (the slowest rank's ``stage_copy_s``) over its median step, the chance that a kill at a
random moment lands in it; the worst max-abs difference of a finished run's adapter from the
reference's; and the time from the kill to training again (the kill to the first step line of
``metrics.jsonl`` after the ``member_lost`` line, polled every 0.1 s): median and max, with every
run's record.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from shardpool_dev.bench.chaos import benchmark
from shardpool_dev.bench.child import run_and_report
from shardpool_dev.bench.mesh import BenchError
from shardpool_dev.lab import LabError, netns_skip_reason


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, run the rounds (or say why not), print the JSON report."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="chaos rounds, each with one kill (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the victims and kill steps (default 0)")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (outputs, logs)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    reason = netns_skip_reason()
    if reason is not None:
        print(json.dumps({"skipped": reason}))
        return 0
    return run_and_report(
        "bench_chaos",
        lambda: benchmark(runs=args.runs, seed=args.seed, keep=args.keep),
        errors=(BenchError, LabError),
        cleaned="the lab was removed",
    )


if __name__ == "__main__":
    sys.exit(main())
