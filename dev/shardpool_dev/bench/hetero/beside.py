"""The fastest host alone while every other host trains the same model alone beside it (mode all_alone)."""

from __future__ import annotations

import contextlib
import copy
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardpool_dev.bench.cgroups import ChildMover, HostCgroups
from shardpool_dev.bench.hetero.lab import overhead_cgroup, start_in_cgroup
from shardpool_dev.bench.hetero.modes import quota_threads
from shardpool_dev.bench.hetero.summary import read_jsonl, step_records
from shardpool_dev.bench.mesh import BenchError, log_tail, stop_launcher
from shardpool_dev.bench.stats import _rounded, median_of
from shardpool_dev.lab import Lab

BESIDE_STEPS_FACTOR = 10
"""An ``all_alone`` run's other hosts train this many times the fastest's steps: they are stopped
when its run ends, and must still be training then."""


def beside_config(config: dict[str, Any], output_dir: Path, quota: float, scope: str) -> dict[str, Any]:
    """The config a host trains alone beside the fastest one (``all_alone``): the same model, data
    and workload in its own output directory, its thread count from its quota, with steps enough to
    outlast the fastest host's run."""
    beside = copy.deepcopy(config) | {
        "output_dir": str(output_dir),
        "max_steps": int(config["max_steps"]) * BESIDE_STEPS_FACTOR,
    }
    if scope == "stage":
        beside["shardpool"]["threads_per_stage"] = quota_threads(quota)
    return beside


def beside_output(work: Path, name: str, label: str) -> Path:
    """The output directory of host ``label``'s run beside the fastest one in run ``name``."""
    return work / f"out-{name}-{label}"


def beside_log(work: Path, name: str, label: str) -> Path:
    """The log of host ``label``'s run beside the fastest one in run ``name``."""
    return work / f"{name}-{label}.log"


@contextlib.contextmanager
def beside_runs(
    lab: Lab,
    cgroups: HostCgroups,
    configs: Mapping[str, Path],
    work: Path,
    name: str,
    timeout_s: float,
    scope: str,
) -> Any:
    """Train ``configs`` (host label -> config) alone on their hosts, each stage under its host's
    quota, while the body runs (nothing without configs). The body starts once every one of them
    has logged its first step, so the fastest host's whole run has them computing beside it; they
    are stopped when it ends. Yields the seconds their start took."""
    started = time.monotonic()
    launchers: list[tuple[subprocess.Popen[Any], ChildMover | None]] = []
    try:
        for label, config_path in configs.items():
            with open(beside_log(work, name, label), "w") as sink:
                launcher = start_in_cgroup(
                    lab,
                    lab.hosts[label],
                    cgroups,
                    [sys.executable, "-m", "shardpool", "finetune", str(config_path)],
                    overhead_cgroup(label, scope),
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                )
            mover = None if scope == "host" else ChildMover(cgroups, label, launcher.pid)
            if mover is not None:
                mover.start()
            launchers.append((launcher, mover))
        for (launcher, _), label in zip(launchers, configs, strict=True):
            wait_for_first_step(
                launcher,
                beside_output(work, name, label) / "metrics.jsonl",
                beside_log(work, name, label),
                timeout_s,
            )
        yield round(time.monotonic() - started, 1)
    finally:
        for launcher, mover in launchers:
            if mover is not None:
                mover.stop()
            stop_launcher(launcher)


def wait_for_first_step(launcher: subprocess.Popen[Any], metrics: Path, log: Path, timeout_s: float) -> None:
    """Wait until ``launcher``'s run has logged a step in ``metrics``; BenchError if it ends first or
    takes over ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (metrics.is_file() and step_records(read_jsonl(metrics))):
        if launcher.poll() is not None:
            raise BenchError(
                f"the run of {log.stem} ended (exit {launcher.returncode}) before its first step:\n{log_tail(log)}"
            )
        if time.monotonic() > deadline:
            raise BenchError(f"the run of {log.stem} logged no step within {timeout_s:.0f} s; log {log}")
        time.sleep(0.5)


def beside_summary(output_dir: Path) -> dict[str, Any]:
    """A host's run beside the fastest one: its steps after the first (the body started after that
    one), their median tokens/s and step."""
    steps = step_records(read_jsonl(output_dir / "metrics.jsonl"))[1:]
    return {
        "steps_measured": len(steps),
        "tokens_per_s": _rounded(median_of([float(r["tokens_per_s"]) for r in steps]), 1),
        "step_s": _rounded(median_of([float(r["step_seconds"]) for r in steps])),
    }
