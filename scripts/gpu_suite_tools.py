"""The Python half of scripts/gpu_wheels.sh and scripts/gpu_suite.sh: sizes, the report, the tests.

    python scripts/gpu_suite_tools.py size-check [--wheels .whl] [--limit-mib 64]
    python scripts/gpu_suite_tools.py versions
    python scripts/gpu_suite_tools.py cuda-tests
    python scripts/gpu_suite_tools.py init --out DIR [--dry-run] [--budget S]
    python scripts/gpu_suite_tools.py record --out DIR --part NAME --rc N --seconds S --limit S --log FILE
    python scripts/gpu_suite_tools.py finish --out DIR [--only PART ...]

A GPU machine lent for a few minutes takes the working tree plus the carried wheels (64 MiB in
all, ``size-check``), and gives back at most 8 files. The suite therefore keeps one report,
``suite.json`` (every part with its status, rewritten after each part, so a run cut short still
says what finished) and its table ``suite.md``, beside ``suite.log`` and the parts' own JSON
(``gpu-check.json``, ``bench.json``). Standard library only: it also runs before the wheels are
installed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from shardpool_dev.bench.gpu.suite import MIB, TRAVEL_LIMIT_BYTES, SuiteError, cuda_test_ids, size_check
from shardpool_dev.bench.gpu.suite_report import finish, new_report, record, skip, versions, write_report

REPO_ROOT = Path(__file__).resolve().parents[1]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    size = commands.add_parser("size-check", help="tree + wheels against the device tool's 64 MiB")
    size.add_argument("--wheels", type=Path, default=REPO_ROOT / ".whl")
    size.add_argument("--limit-mib", type=float, default=TRAVEL_LIMIT_BYTES / MIB)
    commands.add_parser("versions", help="print the versions of the stack and the GPU as JSON")
    commands.add_parser("cuda-tests", help="print the node ids of the tests that skip without CUDA")
    init = commands.add_parser("init", help="write the report with every part pending")
    init.add_argument("--out", type=Path, required=True)
    init.add_argument("--dry-run", action="store_true")
    init.add_argument("--budget", type=float, required=True)
    rec = commands.add_parser("record", help="record one part's result")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--part", required=True)
    rec.add_argument("--rc", type=int, required=True)
    rec.add_argument("--seconds", type=float, required=True)
    rec.add_argument("--limit", type=float, required=True)
    rec.add_argument("--log", type=Path, required=True)
    rec.add_argument("--work", type=Path)
    skipped = commands.add_parser("skip", help="record a part that did not run")
    skipped.add_argument("--out", type=Path, required=True)
    skipped.add_argument("--part", required=True)
    skipped.add_argument("--reason", required=True)
    done = commands.add_parser("finish", help="fill the parts read off gpu-check.json; mark complete")
    done.add_argument("--out", type=Path, required=True)
    done.add_argument("--only", nargs="*", default=[], help="the parts chosen (default: all)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand (see the module docstring)."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "size-check":
            return size_check(REPO_ROOT, args.wheels, int(args.limit_mib * MIB))
        if args.command == "versions":
            print(json.dumps(versions()))
        elif args.command == "cuda-tests":
            print("\n".join(cuda_test_ids(REPO_ROOT / "tests", REPO_ROOT)))
        elif args.command == "init":
            args.out.mkdir(parents=True, exist_ok=True)
            write_report(args.out, new_report(dry_run=args.dry_run, budget_s=args.budget))
        elif args.command == "record":
            print(record(args.out, args.part, rc=args.rc, seconds=args.seconds, limit_s=args.limit,
                         log=args.log, work=args.work))  # fmt: skip
        elif args.command == "skip":
            skip(args.out, args.part, args.reason)
        elif args.command == "finish":
            return finish(args.out, args.only)
    except SuiteError as error:
        print(f"gpu_suite: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
