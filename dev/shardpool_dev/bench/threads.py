"""Per-thread CPU time and wake-ups of a stage and of the plain loop, sampled from /proc/PID/task."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shardpool_dev.bench import plain
from shardpool_dev.bench.child import child_argv, thread_env
from shardpool_dev.bench.workload import FULL, QUICK

SIZES = {"full": FULL, "quick": QUICK}


SAMPLE_EVERY_S = 0.1


FIRST_MARK = 2  # the window starts when step 2 has ended (step 1 warms up)


ThreadKey = tuple[int, int]  # (pid, tid)


ThreadSample = tuple[str, float, int]  # (thread name, CPU seconds, voluntary context switches)


def parse_task_stat(text: str, clock_ticks: int) -> tuple[str, float]:
    """A thread's name and CPU seconds (utime + stime) from its ``/proc/PID/task/TID/stat``."""
    name = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    return name, (int(fields[11]) + int(fields[12])) / clock_ticks


def parse_wakeups(status: str) -> int:
    """A thread's voluntary context switches (each one a sleep it woke from) from its ``status``."""
    for line in status.splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    return 0


def window_rows(
    before: dict[ThreadKey, ThreadSample], after: dict[ThreadKey, ThreadSample], seconds: float
) -> list[dict[str, Any]]:
    """Each thread alive at the window's end: CPU ms and wake-ups per second over the window, busiest first."""
    rows = []
    for key, (name, cpu, wakeups) in after.items():
        _, cpu_before, wakeups_before = before.get(key, (name, 0.0, 0))
        rows.append(
            {
                "pid": key[0],
                "tid": key[1],
                "thread": name,
                "cpu_seconds": round(cpu - cpu_before, 3),
                "cpu_ms_per_s": round(1000 * (cpu - cpu_before) / seconds, 3),
                "wakeups_per_s": round((wakeups - wakeups_before) / seconds, 2),
            }
        )
    return sorted(rows, key=lambda row: (-row["cpu_seconds"], -row["wakeups_per_s"]))


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    found = [pid]
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split():
                found += process_tree(int(child))
    except OSError:
        pass
    return found


def sample_threads(pids: Iterable[int]) -> dict[ThreadKey, ThreadSample]:
    """Name, CPU seconds and wake-ups of every thread of ``pids`` (threads that exit meanwhile are skipped)."""
    ticks = os.sysconf("SC_CLK_TCK")
    samples: dict[ThreadKey, ThreadSample] = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                name, cpu = parse_task_stat(Path(f"/proc/{pid}/task/{tid}/stat").read_text(), ticks)
                wakeups = parse_wakeups(Path(f"/proc/{pid}/task/{tid}/status").read_text())
            except (OSError, ValueError):
                continue
            samples[(pid, int(tid))] = (name, cpu, wakeups)
    return samples


def marked_plain_loop(spec_path: str, marks_path: str) -> dict[str, Any]:
    """Side B, with a line appended to ``marks_path`` as each step ends (the sampler's step clock)."""
    steps_of = plain.plain_steps

    def plain_steps(model: Any, params: Any, optimizer: Any, scheduler: Any, data: Any, steps: Any, *rest: Any, **named: Any) -> Any:  # fmt: skip
        def marked() -> Any:
            for step in steps:
                yield step
                with open(marks_path, "a", encoding="utf-8") as marks:
                    marks.write("step\n")

        return steps_of(model, params, optimizer, scheduler, data, marked(), *rest, **named)

    plain.plain_steps = plain_steps  # plain_loop looks it up in its module: every step now marks
    return plain.plain_loop(spec_path)


def run_side(side: str, config: dict[str, Any], work: Path, *, threads: int) -> dict[str, Any]:
    """Run one side in a fresh process and sample its threads until it ends."""
    spec = work / f"{side}.json"
    spec.write_text(json.dumps({"config": config, "threads": threads, "device": "cpu"}))
    marks = work / f"{side}.steps"
    counted = Path(config["output_dir"]) / "metrics.jsonl" if side == "A" else marks
    command = (
        child_argv("stage", str(spec)) if side == "A" else child_argv("marked-plain", str(spec), str(marks))
    )
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=thread_env(threads), text=True
    )
    total = int(config["max_steps"])
    window: dict[str, tuple[float, dict[ThreadKey, ThreadSample]]] = {}
    while process.poll() is None:
        sample = sample_threads(process_tree(process.pid))
        done = len(counted.read_text().splitlines()) if counted.exists() else 0
        if done >= FIRST_MARK and "first" not in window:
            window["first"] = (time.monotonic(), sample)
        if done >= total and "last" not in window:
            window["last"] = (time.monotonic(), sample)
        time.sleep(SAMPLE_EVERY_S)
    output, _ = process.communicate()
    if process.returncode != 0 or "last" not in window:
        raise RuntimeError(f"side {side} failed (exit {process.returncode}) or ran fewer than {total} steps")
    (started, before), (ended, after) = window["first"], window["last"]
    measured = json.loads(output.strip().splitlines()[-1])
    return {
        "window_seconds": round(ended - started, 2),
        "step_seconds": measured["step_seconds"],
        "threads": window_rows(before, after, ended - started),
    }
