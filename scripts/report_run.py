"""How the lab and cgroup benchmarks run their measurement and hand over its JSON report.

They build things the machine keeps unless they are removed (network namespaces, cgroups,
processes), so a stop signal must reach their clean-up, and their report must be the only thing on
stdout (``python scripts/bench_hetero.py > report.json``).
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["run_and_report"]


def run_and_report(
    tool: str,
    measure: Callable[[], dict[str, Any]],
    *,
    errors: tuple[type[Exception], ...],
    cleaned: str,
    indent: int = 2,
) -> int:
    """Run ``measure()`` and print its report as JSON on stdout; return the exit status.

    While it runs, SIGTERM and SIGINT raise :class:`KeyboardInterrupt`, so its own clean-up runs
    (SIGINT too: a background job starts with it ignored), and what it prints goes to stderr. One
    of ``errors`` becomes one line and status 1; an interrupt says what was ``cleaned`` (``the lab
    was removed``) and gives 130. The signals' handlers are put back afterwards.
    """
    before = {stop: signal.signal(stop, _interrupt) for stop in (signal.SIGTERM, signal.SIGINT)}
    try:
        with contextlib.redirect_stdout(sys.stderr):
            report = measure()
    except errors as error:
        print(f"{tool}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{tool}: interrupted; {cleaned}", file=sys.stderr)
        return 130
    finally:
        for stop, handler in before.items():
            signal.signal(stop, handler)
    print(json.dumps(report, indent=indent))
    return 0


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
