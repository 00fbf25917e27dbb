"""Per-thread CPU time and wake-ups of one shardpool stage (S = 1) and of the plain peft loop.

    python scripts/thread_cpu.py > threads.json              # bench_pipeline's model, 10 steps
    python scripts/thread_cpu.py --size quick --steps 8      # a small model, a few minutes

It runs side A (``finetune`` with one stage: the launcher process and the stage it starts) and
side B (the plain transformers + bitsandbytes + peft loop) of ``scripts/bench_paired.py`` once
each, and samples every thread of each process tree from ``/proc/PID/task/*/stat`` (utime +
stime) and ``/proc/PID/task/*/status`` (voluntary context switches: wake-ups) ten times a second.
It prints one JSON object: per thread, its CPU seconds and wake-ups per second of training,
between the end of step 2 and the end of the last step. These figures do not need a quiet
machine: a thread that wakes 100 times a second does so under any load. CPU seconds per *step* of
the compute threads do depend on the load (OpenMP threads spin while a partner is descheduled), so
compare those only between runs on the same quiet machine. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import bench_pipeline as bench  # scripts/ is on sys.path when this file runs as a script

SIZES = {"full": bench.FULL, "quick": bench.QUICK}
SAMPLE_EVERY_S = 0.1
FIRST_MARK = 2  # the window starts when step 2 has ended (step 1 warms up)

ThreadKey = tuple[int, int]  # (pid, tid)
ThreadSample = tuple[str, float, int]  # (thread name, CPU seconds, voluntary context switches)


# ---------------------------------------------------------------------------- pure helpers


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


# ---------------------------------------------------------------------------- sampling /proc


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


# ---------------------------------------------------------------------------- one side


def marked_plain_loop(spec_path: str, marks_path: str) -> dict[str, Any]:
    """Side B, with a line appended to ``marks_path`` as each step ends (the sampler's step clock)."""
    steps_of = bench.plain_steps

    def plain_steps(model: Any, params: Any, optimizer: Any, scheduler: Any, data: Any, steps: Any, *rest: Any, **named: Any) -> Any:  # fmt: skip
        def marked() -> Any:
            for step in steps:
                yield step
                with open(marks_path, "a", encoding="utf-8") as marks:
                    marks.write("step\n")

        return steps_of(model, params, optimizer, scheduler, data, marked(), *rest, **named)

    bench.plain_steps = plain_steps
    return bench.plain_loop(spec_path)


def run_side(side: str, config: dict[str, Any], work: Path, *, threads: int) -> dict[str, Any]:
    """Run one side in a fresh process and sample its threads until it ends."""
    spec = work / f"{side}.json"
    spec.write_text(json.dumps({"config": config, "threads": threads, "device": "cpu"}))
    marks = work / f"{side}.steps"
    counted = Path(config["output_dir"]) / "metrics.jsonl" if side == "A" else marks
    command = [sys.executable, str(Path(__file__).resolve())]
    command += ["--stage-worker", str(spec)] if side == "A" else ["--plain-worker", str(spec), str(marks)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["TOKENIZERS_PARALLELISM"] = "false"
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
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


def stage_worker(spec_path: str) -> dict[str, Any]:
    """Side A: ``finetune`` with one stage, as bench_paired runs it."""
    import bench_paired

    return bench_paired.shardpool_worker(spec_path)


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run both sides (or one, as a worker), print JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per side (at least 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each side (default 2)")
    parser.add_argument("--stage-worker", help=argparse.SUPPRESS)
    parser.add_argument("--plain-worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stage_worker or args.plain_worker:
        sys.stdout, real_stdout = sys.stderr, sys.stdout
        report = (
            stage_worker(args.stage_worker) if args.stage_worker else marked_plain_loop(*args.plain_worker)
        )
        sys.stdout = real_stdout
        print(json.dumps(report))
        return 0
    if args.steps < FIRST_MARK + 1:
        parser.error(f"--steps must be at least {FIRST_MARK + 1}")
    from shardpool.model.tinymodel import DEFAULT_CORPUS, make_tiny_llama, write_jsonl

    size = dict(SIZES[args.size], max_steps=args.steps)
    with tempfile.TemporaryDirectory(prefix="shardpool-threads-") as directory:
        work = Path(directory)
        os.environ["SHARDPOOL_CACHE"] = str(work / "cache")
        rows = bench.completion_rows(size["rows"])
        data = write_jsonl(rows, work / "data.jsonl")
        model = make_tiny_llama(
            work / "model",
            seed=0,
            initializer_range=0.1,
            corpus=[row["text"] for row in rows] + list(DEFAULT_CORPUS),
            **size["model"],
        )
        placement = {"stages": 1, "threads_per_stage": args.threads}
        report: dict[str, Any] = {"benchmark": "thread_cpu", "size": args.size, "steps": args.steps}
        for side in ("A", "B"):
            config = bench.training_config(model, data, work / f"out-{side}", size, placement)
            print(f"thread_cpu: side {side}", file=sys.stderr, flush=True)
            report[side] = run_side(side, config, work, threads=args.threads)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
