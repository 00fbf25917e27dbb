"""What the step-boundary state copies (``job.keep_state``) cost a 2-stage run, by interleaved pairs."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardpool_dev.bench.child import run_json_child
from shardpool_dev.bench.pipeline import summarize_steps, train_and_read
from shardpool_dev.bench.stats import WARMUP_STEPS, pair_ratios, ratio_summary, run_order
from shardpool_dev.bench.workload import FULL, QUICK, scratch, tiny_llama_and_rows, training_config

KEEP_STATE_HOOK = "SHARDPOOL_TEST_KEEP_STATE"  # shardpool.elastic.rank.KEEP_STATE_HOOK


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
    )[WARMUP_STEPS:]
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
    config = json.loads(Path(spec_path).read_text())["config"]
    output_dir = Path(config["output_dir"])
    records, summary = train_and_read(config)
    measured = summarize_steps(records)
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
    return run_json_child("state-copy", spec, env=env, label=label)


def benchmark(
    *, pairs: int, steps: int, warmup: bool, keep: Path | None, size_name: str = "quick"
) -> dict[str, Any]:
    """Build the quick model and data once, run an unrecorded warm-up pair (``warmup``) and ``pairs`` pairs.

    Without the warm-up the first run also profiles the devices (before its steps, so only its
    ``run_seconds`` carries it, not its step times).
    """

    size = {**(FULL if size_name == "full" else QUICK), "max_steps": steps}
    started = time.monotonic()
    with scratch("shardpool-state-copy-", keep) as work:
        model_dir, data = tiny_llama_and_rows(work, size)

        def config_for(label: str) -> dict[str, Any]:
            placement = {"stages": 2, "threads_per_stage": 1}
            return training_config(model_dir, data, work / f"out-{label}", size, placement)

        for side in ("A", "B") if warmup else ():
            print(f"bench: warm-up {side}", file=sys.stderr, flush=True)
            run_side(side, config_for(f"warmup-{side}"), work=work, label=f"warmup-{side}")
        runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
        for pair, side in run_order(pairs):
            label = f"{side}{pair}"
            print(f"bench: pair {pair + 1}/{pairs}, {side}", file=sys.stderr, flush=True)
            runs[side].append(run_side(side, config_for(label), work=work, label=label))

        def ratios(read: Any) -> list[float]:
            return pair_ratios([read(run) for run in runs["A"]], [read(run) for run in runs["B"]])

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
            "step_seconds_ratio_a_over_b": ratio_summary(step_ratio),
            "step_seconds_ratio_per_pair": [round(ratio, 4) for ratio in step_ratio],
            "run_seconds_ratio_a_over_b": ratio_summary(run_ratio),
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
