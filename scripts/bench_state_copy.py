"""Paired benchmark: what the step-boundary state copies (``job.keep_state``) cost a 2-stage run.

    python scripts/bench_state_copy.py                 # 3 pairs, bench_pipeline's quick model, 8 steps
    python scripts/bench_state_copy.py --pairs 5 --steps 12
    python scripts/bench_state_copy.py --pairs 1 --steps 5 --no-warmup   # a short look (noisy)
    python scripts/bench_state_copy.py --size full --pairs 2 --steps 6    # bench_pipeline's full model

It prints one JSON object on stdout. Side A is a 2-stage LOCAL ``finetune`` with keep_state on
(the stage processes beat on the rendezvous store and, after every step, write CPU clones of their
checkpoint files into ``checkpoints/live/step-N`` in a background thread); side B is the same run
with it off. keep_state is turned on through the bench hook ``SHARDPOOL_TEST_KEEP_STATE=1`` (read
by ``shardpool.train.worker``), the only difference between the sides. Runs alternate A B, B A, ...
(``bench_paired.run_order``), each in a fresh process, and the report gives the per-pair ratio
A ÷ B of the median step seconds (``bench_pipeline.summarize_steps``: steps after the warm-up)
and of the whole run's seconds (the clones are taken between steps, outside ``step_seconds``),
and the bytes one step's copy writes (all ranks). Target: a cost under 3 % (ratio < 1.03).
On a shared machine the paired figures are noisy; read the spread.

The A runs also give the cost directly, step by step, from their ``metrics.jsonl`` lines:
``blocked_over_step`` (the slowest rank's ``stage_copy_blocked_s``, the time it spent handing a
copy over between steps, over the step) and ``copy_cpu_over_stage_cpu`` (the copy threads' CPU,
``stage_copy_cpu_s`` summed over ranks, over the ranks' step time: what the copies can take from
compute when every core is busy). Their sum bounds the cost without the run-to-run noise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import bench_paired as paired  # scripts/ is on sys.path when this file runs as a script
import bench_pipeline as bench

KEEP_STATE_HOOK = "SHARDPOOL_TEST_KEEP_STATE"  # shardpool.train.worker.KEEP_STATE_HOOK
LIVE_ROOT = "checkpoints/live"  # shardpool.contract.liveness.LIVE_ROOT


def copy_bytes_per_step(output_dir: Path) -> int:
    """Bytes of one step's copy (the median over the steps copied), summed over its files."""
    steps = [path for path in (output_dir / LIVE_ROOT).glob("step-*") if path.is_dir()]
    if not steps:
        return 0
    return int(statistics.median(sum(file.stat().st_size for file in step.iterdir()) for step in steps))


def direct_cost(records: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """Medians over the steps after the warm-up of the copies' own cost figures (None: no copies)."""
    steps = sorted(
        (r for r in records if r.get("stage_copy_blocked_s") is not None), key=lambda r: r["step"]
    )[bench.WARMUP_STEPS :]
    if not steps:
        return None
    blocked = [max(r["stage_copy_blocked_s"]) / r["step_seconds"] for r in steps]
    cpu = [sum(r["stage_copy_cpu_s"]) / (r["step_seconds"] * len(r["stage_copy_cpu_s"])) for r in steps]
    return {
        "blocked_over_step": round(statistics.median(blocked), 5),
        "copy_cpu_over_stage_cpu": round(statistics.median(cpu), 5),
        "window_over_step": round(
            statistics.median(max(r["stage_copy_s"]) / r["step_seconds"] for r in steps), 5
        ),
    }


def run_worker(spec_path: str) -> dict[str, Any]:
    """One run, in a fresh interpreter: ``finetune`` with two local stages; step medians and copy size."""
    from rich.console import Console

    from shardpool.config import parse_config
    from shardpool.finetune import finetune

    config = json.loads(Path(spec_path).read_text())["config"]
    output_dir = Path(config["output_dir"])
    finetune(parse_config(config), console=Console(quiet=True))
    records = [
        json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    summary = json.loads((output_dir / "run_summary.json").read_text())
    measured = bench.summarize_steps(records)
    return {
        "step_seconds": measured["step_seconds"],
        "step_seconds_min": measured["step_seconds_min"],
        "steps_measured": measured["steps_measured"],
        "run_seconds": float(summary["seconds"]),
        "final_loss": measured["final_loss"],
        "copy_bytes_per_step": copy_bytes_per_step(output_dir),
        "direct_cost": direct_cost(records),
    }


def run_side(side: str, config: dict[str, Any], *, work: Path, label: str) -> dict[str, Any]:
    """Run one side in a fresh process; A with the keep_state hook set, B without it."""
    spec = work / f"{label}.json"
    spec.write_text(json.dumps({"config": config}))
    env = {key: value for key, value in os.environ.items() if key != KEEP_STATE_HOOK}
    if side == "A":
        env[KEEP_STATE_HOOK] = "1"
    load: dict[str, Any] = {}
    with bench.cpu_accounting(load):
        result = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec)],
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
            preexec_fn=bench._die_with_parent,
            check=False,
        )
    if result.returncode != 0:
        raise RuntimeError(f"run {label} failed:\n{result.stderr[-4000:]}")
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    measured["load"] = load
    return measured


def benchmark(
    *, pairs: int, steps: int, warmup: bool, keep: Path | None, size_name: str = "quick"
) -> dict[str, Any]:
    """Build the quick model and data once, run an unrecorded warm-up pair (``warmup``) and ``pairs`` pairs.

    Without the warm-up the first run also profiles the devices (before its steps, so only its
    ``run_seconds`` carries it, not its step times).
    """
    from shardpool.model.tinymodel import DEFAULT_CORPUS, make_tiny_llama, write_jsonl

    size = {**(bench.FULL if size_name == "full" else bench.QUICK), "max_steps": steps}
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="shardpool-state-copy-")) if keep is None else keep
    work.mkdir(parents=True, exist_ok=True)
    saved_cache = os.environ.get("SHARDPOOL_CACHE")
    os.environ["SHARDPOOL_CACHE"] = str(work / "cache")
    try:
        rows = bench.completion_rows(size["rows"])
        data = write_jsonl(rows, work / "data.jsonl")
        model_dir = make_tiny_llama(
            work / "model",
            seed=0,
            initializer_range=0.1,
            corpus=[row["text"] for row in rows] + list(DEFAULT_CORPUS),
            **size["model"],
        )

        def config_for(label: str) -> dict[str, Any]:
            placement = {"stages": 2, "threads_per_stage": 1}
            return bench.training_config(model_dir, data, work / f"out-{label}", size, placement)

        for side in ("A", "B") if warmup else ():
            print(f"bench: warm-up {side}", file=sys.stderr, flush=True)
            run_side(side, config_for(f"warmup-{side}"), work=work, label=f"warmup-{side}")
        runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
        for pair, side in paired.run_order(pairs):
            label = f"{side}{pair}"
            print(f"bench: pair {pair + 1}/{pairs}, {side}", file=sys.stderr, flush=True)
            runs[side].append(run_side(side, config_for(label), work=work, label=label))

        def ratios(read: Any) -> list[float]:
            return paired.pair_ratios([read(run) for run in runs["A"]], [read(run) for run in runs["B"]])

        step_ratio = ratios(lambda run: run["step_seconds"])
        run_ratio = ratios(lambda run: run["run_seconds"])
        direct = [run["direct_cost"] for run in runs["A"] if run.get("direct_cost")]

        def direct_median(key: str) -> float | None:
            return round(statistics.median(cost[key] for cost in direct), 5) if direct else None

        blocked, cpu = direct_median("blocked_over_step"), direct_median("copy_cpu_over_stage_cpu")
        return {
            "benchmark": "state_copy",
            "command": f"python scripts/bench_state_copy.py --size {size_name} --pairs {pairs} --steps {steps}"
            + ("" if warmup else " --no-warmup"),
            "size": size_name,
            "A": "finetune, 2 local stages, keep_state on (beat + step-boundary copies)",
            "B": "the same run, keep_state off",
            "pairs": pairs,
            "steps": steps,
            "median_step_seconds_a": statistics.median(run["step_seconds"] for run in runs["A"]),
            "median_step_seconds_b": statistics.median(run["step_seconds"] for run in runs["B"]),
            "step_seconds_ratio_a_over_b": paired.ratio_summary(step_ratio),
            "step_seconds_ratio_per_pair": [round(ratio, 4) for ratio in step_ratio],
            "run_seconds_ratio_a_over_b": paired.ratio_summary(run_ratio),
            "copy_bytes_per_step": runs["A"][0]["copy_bytes_per_step"],
            "direct_cost": {
                "blocked_over_step": blocked,
                "copy_cpu_over_stage_cpu": cpu,
                "bound": None if blocked is None or cpu is None else round(blocked + cpu, 5),
                "window_over_step": direct_median("window_over_step"),
            },
            "same_final_loss": len({run["final_loss"] for side in runs.values() for run in side}) == 1,
            "runs": runs,
            "other_cpu_seconds_total": round(
                sum(run["load"]["other_cpu_seconds"] for side in runs.values() for run in side), 1
            ),
            "seconds": round(time.monotonic() - started, 1),
        }
    finally:
        if saved_cache is None:
            os.environ.pop("SHARDPOOL_CACHE", None)
        else:
            os.environ["SHARDPOOL_CACHE"] = saved_cache
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, run the paired benchmark (or one run of it), print JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="A/B pairs (default 3)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8)")
    parser.add_argument(
        "--no-warmup", action="store_true", help="skip the unrecorded warm-up pair (a short look only)"
    )
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it")
    parser.add_argument(
        "--size", choices=("quick", "full"), default="quick", help="bench_pipeline's model (default quick)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        with contextlib.redirect_stdout(sys.stderr):
            report = run_worker(args.worker)
        print(json.dumps(report))
        return 0
    if args.pairs < 1 or args.steps < 2:
        parser.error("--pairs must be at least 1 and --steps at least 2")
    with contextlib.redirect_stdout(sys.stderr):
        report = benchmark(
            pairs=args.pairs, steps=args.steps, warmup=not args.no_warmup, keep=args.keep, size_name=args.size
        )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
