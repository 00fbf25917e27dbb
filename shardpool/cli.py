"""The ``shardpool`` command: argument parsing, and turning known errors into one line.

Heavy modules (torch, transformers) are imported inside the command that needs them, so
``shardpool mesh ...`` and ``--help`` stay fast and never load torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mesh.errors import MeshError
from shardpool.errors import ShardpoolError

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with one sub-command per user action."""
    parser = argparse.ArgumentParser(
        prog="shardpool",
        description="QLoRA fine-tuning across mismatched devices over a WireGuard mesh.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    finetune = commands.add_parser("finetune", help="train a LoRA adapter from an axolotl-style config")
    finetune.add_argument("config", help="path to the YAML config")
    finetune.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    finetune.set_defaults(handler=_run_finetune)

    from mesh.cli import add_mesh_commands

    add_mesh_commands(commands)
    return parser


def _run_finetune(args: argparse.Namespace) -> int:
    from shardpool.finetune import finetune_from_file

    finetune_from_file(args.config, resume=args.resume)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script: run one command, print known errors as one line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (ShardpoolError, MeshError) as error:
        print(f"shardpool: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shardpool: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
