"""Entry point of one stage process: ``python -m shardpool.train.worker JOB_JSON RANK``.

A failure is reported to the launcher as one JSON ``error`` event naming the stage, with the full
traceback in the stage's log (stderr), and the process exits at once with status 1 so that no
collective is left waiting on it.
"""

from __future__ import annotations

import os
import sys
import traceback

from shardpool.contract.events import StageEvent
from shardpool.errors import ShardpoolError
from shardpool.train.pipeline import emit, run_stage_process


def main(argv: list[str]) -> int:
    """Run one stage process and report how it ended."""
    job_path, rank = argv[0], int(argv[1])
    try:
        run_stage_process(job_path, rank)
    except BaseException as error:  # noqa: BLE001 - every failure must reach the launcher
        traceback.print_exc(file=sys.stderr)
        message = str(error) if isinstance(error, ShardpoolError) else f"{type(error).__name__}: {error}"
        emit(
            {
                "event": StageEvent.ERROR,
                "rank": rank,
                "message": message.splitlines()[0] if message else type(error).__name__,
            }
        )
        sys.stderr.flush()
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
