"""Measurements that run in a fresh interpreter and hand back one JSON object.

A run measured in its own process gets its own peak RSS and its own thread count, and a crash in
it cannot take the benchmark down. :func:`run_json_child` starts ``python -m
shardpool_dev.bench.child WORKER SPEC`` with the environment it is given; the child calls
the worker named in :data:`WORKERS` on the JSON spec file and prints its result as the last line
of stdout (everything else it prints goes to stderr). :func:`run_and_report` is the same contract
for a benchmark's own process: its report is the only thing on stdout.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from shardpool_dev.bench.cpu import cpu_accounting

WORKERS: dict[str, str] = {
    "plain": "shardpool_dev.bench.plain:plain_loop",
    "shardpool": "shardpool_dev.bench.paired:shardpool_worker",
    "state-copy": "shardpool_dev.bench.state_copy:run_worker",
    "marked-plain": "shardpool_dev.bench.threads:marked_plain_loop",
    "stage": "shardpool_dev.bench.paired:shardpool_worker",
    "engine-generate": "shardpool_dev.bench.generation:engine_worker",
    "peft-generate": "shardpool_dev.bench.generation:peft_worker",
}
"""The functions a child can run, by the name given on its command line."""
CHILD_TIMEOUT_S = 1800


class ChildError(RuntimeError):
    """A measured child process failed; the message carries the end of its stderr."""


def die_with_parent() -> None:
    """Ask the kernel to kill this process when its parent dies (run in the child before exec)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def thread_env(threads: int) -> dict[str, str]:
    """This process's environment with ``threads`` OpenMP/MKL threads and quiet tokenizers."""
    return dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
    )


def child_argv(worker: str, *args: str) -> list[str]:
    """The command line that runs ``worker`` (a name in :data:`WORKERS`) in a fresh interpreter."""
    if worker not in WORKERS:
        raise ValueError(f"unknown child worker {worker!r}; use one of {', '.join(sorted(WORKERS))}")
    return [sys.executable, "-m", "shardpool_dev.bench.child", worker, *args]


def last_json_line(stdout: str) -> dict[str, Any]:
    """The JSON object a child printed last."""
    return json.loads(stdout.strip().splitlines()[-1])


def run_json_child(
    worker: str,
    spec: Path,
    *,
    env: Mapping[str, str],
    label: str,
) -> dict[str, Any]:
    """Run ``worker`` on ``spec`` in a fresh process with ``env``; its JSON result, with the CPU time
    other processes used meanwhile as ``load``."""
    load: dict[str, Any] = {}
    with cpu_accounting(load):
        result = subprocess.run(
            child_argv(worker, str(spec)),
            capture_output=True,
            text=True,
            env=dict(env),
            timeout=CHILD_TIMEOUT_S,
            preexec_fn=die_with_parent,
            check=False,
        )
    if result.returncode != 0:
        raise ChildError(f"run {label} failed:\n{result.stderr[-4000:]}")
    measured = last_json_line(result.stdout)
    measured["load"] = load
    return measured


def worker_function(worker: str) -> Callable[..., dict[str, Any]]:
    """The function :data:`WORKERS` names for ``worker``."""
    module, _, name = WORKERS[worker].partition(":")
    return getattr(importlib.import_module(module), name)


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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shardpool_dev.bench.child WORKER ARG...``: run one worker, print its JSON last."""
    worker, *args = list(sys.argv[1:] if argv is None else argv)
    with contextlib.redirect_stdout(sys.stderr):
        result = worker_function(worker)(*args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
