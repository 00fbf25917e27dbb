"""Benchmark the NAT grid against issue 15's targets and print one JSON object.

    sudo python scripts/bench_nat.py                # the run recorded in docs/performance.md (NAT)
    sudo python scripts/bench_nat.py --repeats 1    # one throughput transfer per path instead of three

It needs what the NAT grid tests need: root, ``ip``, ``wireguard-go``, ``wg``, ``ping``,
``/dev/net/tun``, ``iptables`` and ``conntrack`` (``shardpool_dev.lab.nat_skip_reason`` says what is
missing). Everything happens in network namespaces that are removed at the end, with every
process the lab started stopped by pid, also on failure or Ctrl-C:

  1. builds ``shardpool_dev.lab.grid.STANDARD_GRID`` (coordinator and relay on the internet; r1 cone with
     a LAN pair, r2 cone, r3 and r4 symmetric with one member each; one host that sends UDP only
     to the relay) and forms the mesh with the real CLI, members without ``--endpoint``;
  2. from the moment both members of a pair have joined, pings over their mesh addresses until
     one is answered (*join to ping*), and polls ``mesh status --json`` on every member until
     both sides show the path the grid implies (*join to path*);
  3. reports the pairs connected, and the pairs on a direct (or LAN) path among those where the
     NATs allow one (not both symmetric, no UDP-blocked side, coordinator pairs left out);
  4. measures TCP throughput m3 -> m4 over their mesh addresses (a Python sender, 3 s) while
     both routers are symmetric (relayed), then turns r3 cone, waits for the pair to go direct
     and measures again: relayed ÷ direct, same hosts, same sender.

Targets (issue 15): 100 % connected, 100 % direct where allowed, < 10 s join to a direct path,
< 30 s join to a relayed one, relayed ÷ direct throughput >= 0.8. MB means 10**6 bytes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shardpool_dev.bench.child import run_and_report
from shardpool_dev.bench.mesh import BenchError
from shardpool_dev.bench.nat import benchmark
from shardpool_dev.lab import nat_skip_reason


def main(argv: Sequence[str] | None = None) -> int:
    """Parse options, run the benchmark, print its JSON (exit 2 when the grid cannot run here)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="TCP transfers per path (median; default 3)")
    args = parser.parse_args(argv)
    reason = nat_skip_reason()
    if reason is not None:
        print(f"bench_nat: {reason}", file=sys.stderr)
        return 2
    return run_and_report(
        "bench_nat",
        lambda: benchmark(args.repeats),
        errors=(BenchError,),
        cleaned="the lab was removed",
        indent=1,
    )


if __name__ == "__main__":
    sys.exit(main())
