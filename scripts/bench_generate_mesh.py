"""Per-token latency of generation with two stages on two mesh hosts, against the stages' compute
and the link's round trip (see shardpool_dev/bench/generation_mesh.py), as one JSON object.

    sudo python scripts/bench_generate_mesh.py

It needs root, ``ip``, ``wireguard-go``, ``wg``, ``ping`` and ``/dev/net/tun`` (the same as the
mesh tests). The hosts are network namespaces removed at the end, with every process the lab
started stopped by pid, also on failure or Ctrl-C. ``per_token_over_parts`` is the per-token
latency ÷ (the two stages' per-token compute, each timed after a wait as long as the other's, as
in the ring + one link round trip); the target is at most 1.2.
``per_token_over_parts_back_to_back`` is the same against compute timed back to back.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from shardpool_dev.bench.child import run_and_report
from shardpool_dev.bench.generation_mesh import NEW_TOKENS, ROUNDS, benchmark
from shardpool_dev.bench.mesh import BenchError
from shardpool_dev.lab import LabError, netns_skip_reason


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, check for root and the tools, run the benchmark, print its JSON report."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"sequences timed (default {ROUNDS})")
    parser.add_argument(
        "--tokens", type=int, default=NEW_TOKENS, help=f"tokens per sequence (default {NEW_TOKENS})"
    )
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it")
    args = parser.parse_args(argv)
    reason = netns_skip_reason()
    if reason is not None:
        print(f"bench_generate_mesh: {reason}", file=sys.stderr)
        return 2
    return run_and_report(
        "bench_generate_mesh",
        lambda: benchmark(keep=args.keep, rounds=args.rounds, new_tokens=args.tokens),
        errors=(BenchError, LabError),
        cleaned="the lab was removed",
    )


if __name__ == "__main__":
    sys.exit(main())
