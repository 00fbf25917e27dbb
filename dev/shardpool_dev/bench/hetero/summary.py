"""What one pool run's metrics, plans and profiles say: step medians, calibration, re-balances, repeats."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shardpool_dev.bench.hetero.modes import run_name
from shardpool_dev.bench.stats import _rounded, median_of, paired_ratios, ratio, spread


def repeats_summary(
    order: Sequence[tuple[str, int]], runs: Mapping[str, Sequence[dict[str, Any]]]
) -> dict[str, Any]:
    """The side-by-side figures of an invocation that ran each way ``repeats`` times in ``order``:
    every run's tokens/s and the median per way, and per round the ratio of pooled (and of the even
    split) to fastest alone, with their median, min and max; with ``all_alone`` runs also pooled ÷
    the fastest alone beside the others, and pooled ÷ every host alone at once
    (:func:`every_host_tokens`). ``runs`` holds each way's summaries in repeat order."""
    by_run = {mode: [run.get("tokens_per_s") for run in summaries] for mode, summaries in runs.items()}
    pooled = paired_ratios(by_run, "pooled", "fastest_alone")
    pipeline = paired_ratios(by_run, "pooled_pipeline", "fastest_alone")
    replicas = paired_ratios(by_run, "pooled_data_parallel", "fastest_alone")
    even = paired_ratios(by_run, "even_split", "fastest_alone")
    beside = paired_ratios(by_run, "pooled", "all_alone")
    every_host = [every_host_tokens(run) for run in runs.get("all_alone", [])]
    together = paired_ratios(
        {"pooled": by_run.get("pooled", []), "every_host": every_host}, "pooled", "every_host"
    )
    return {
        "count": max((len(summaries) for summaries in runs.values()), default=0),
        "order": [run_name(mode, repeat) for mode, repeat in order],
        "tokens_per_s_by_run": by_run,
        "tokens_per_s_median": {mode: spread(values, 1)["median"] for mode, values in by_run.items()},
        "pooled_over_fastest_by_round": pooled,
        "pooled_over_fastest": spread(pooled),
        "even_over_fastest_by_round": even,
        "even_over_fastest": spread(even),
        "pipeline_over_fastest_by_round": pipeline,
        "pipeline_over_fastest": spread(pipeline),
        "data_parallel_over_fastest_by_round": replicas,
        "data_parallel_over_fastest": spread(replicas),
        "every_host_alone_tokens_per_s_by_round": every_host,
        "pooled_over_fastest_beside_by_round": beside,
        "pooled_over_fastest_beside": spread(beside),
        "pooled_over_every_host_alone_by_round": together,
        "pooled_over_every_host_alone": spread(together),
    }


def every_host_tokens(all_alone: Mapping[str, Any]) -> float | None:
    """The tokens/s of every host alone at once (an ``all_alone`` run: the fastest host's, plus each
    host's beside it); None when any is missing."""
    beside = [run.get("tokens_per_s") for run in (all_alone.get("beside") or {}).values()]
    figures = [all_alone.get("tokens_per_s"), *beside]
    if not beside or any(figure is None for figure in figures):
        return None
    return round(sum(figures), 1)


def step_records(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-step lines of ``metrics.jsonl`` (not eval or event lines), by step."""
    steps = [r for r in records if "event" not in r and "step_seconds" in r and "stage_compute_s" in r]
    return sorted(steps, key=lambda record: int(record["step"]))


def rebalance_events(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``{"event": "rebalance", ...}`` lines of ``metrics.jsonl``, in order."""
    return [record for record in records if record.get("event") == "rebalance"]


def summarize_run(records: Sequence[dict[str, Any]], plan: dict[str, Any], warmup: int) -> dict[str, Any]:
    """One run's figures: medians over its steps after ``warmup``, per stage and against the plan.

    With re-balancing, ``predicted_over_measured_step`` compares the first plan with the steps
    before the first re-shard, and ``after_rebalance`` the last event's prediction with the
    steps after it (the step of the re-shard itself left out).
    """
    steps = step_records(records)
    events = rebalance_events(records)
    kept = steps[warmup:] or steps
    first_reshard = int(events[0]["step"]) if events else None
    before = [r for r in kept if first_reshard is None or int(r["step"]) <= first_reshard]
    stages = len(kept[-1]["stage_compute_s"]) if kept else 0
    staged = [r for r in kept if len(r["stage_compute_s"]) == stages]  # a re-shard may change the count
    step_s = median_of([float(r["step_seconds"]) for r in kept])
    compute = [median_of([float(r["stage_compute_s"][i]) for r in staged]) or 0.0 for i in range(stages)]
    wait = [median_of([float(r["stage_wait_s"][i]) for r in staged]) or 0.0 for i in range(stages)]
    synced = [r for r in staged if r.get("stage_sync_s") is not None]  # older runs have no sync figure
    sync = [median_of([float(r["stage_sync_s"][i]) for r in synced]) or 0.0 for i in range(stages)]
    placed = plan.get("data_parallel") or plan["stages"]  # a data-parallel plan: one entry per replica
    shares = plan.get("shares")
    layers = [int(stop) - int(start) for start, stop in (stage["layers"] for stage in placed)]
    if shares:  # a replica computes its share of the step: per layer of a whole step, as a stage does
        step_micro = sum(shares)
        layers = [count * share / step_micro for count, share in zip(layers, shares, strict=True)]
    predicted = initial_prediction(plan)
    summary: dict[str, Any] = {
        "steps_trained": len(steps),
        "steps_measured": len(kept),
        "plan": [
            {"host": stage["host"], "layers": stage["layers"], "device": stage["device"]} for stage in placed
        ],
        "shares": shares,
        "warmup_lead": plan.get("warmup_lead", 1),
        "predicted_step_s": predicted,
        "step_s": _rounded(step_s),
        "tokens_per_s": _rounded(median_of([float(r["tokens_per_s"]) for r in kept]), 1),
        "predicted_over_measured_step": ratio(
            predicted, median_of([float(r["step_seconds"]) for r in before])
        ),
        "stage_compute_s": [round(value, 4) for value in compute],
        "stage_wait_s": [round(value, 4) for value in wait],
        "stage_wait_over_step": [ratio(value, step_s) for value in wait],
        "stage_sync_s": [round(value, 4) for value in sync] if synced else None,
        "stage_sync_over_step": [ratio(value, step_s) for value in sync] if synced else None,
        "final_loss": round(float(steps[-1]["loss"]), 6) if steps else None,
        "tokens_per_s_by_step": [round(float(r["tokens_per_s"]), 1) for r in steps],
    }
    if events or len(layers) != stages:
        summary["compute_s_per_layer_by_host"] = None  # the stages' layers changed mid-run
    else:
        summary["compute_s_per_layer_by_host"] = {
            stage["host"]: round(seconds / count, 5)
            for stage, seconds, count in zip(placed, compute, layers, strict=True)
        }
    if events:
        last = events[-1]
        after = [float(r["step_seconds"]) for r in steps if int(r["step"]) > int(last["step"]) + 1]
        summary["after_rebalance"] = {
            "steps_measured": len(after),
            "predicted_step_s": last.get("predicted_step_s"),
            "step_s": _rounded(median_of(after)),
            "predicted_over_measured_step": ratio(last.get("predicted_step_s"), median_of(after)),
        }
    return summary


def initial_plan_json(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan a run started with: the oldest of plan.json's history after a re-shard, else plan.json."""
    history = plan.get("history")
    if isinstance(history, list) and history and isinstance(history[0], dict):
        return history[0]
    return plan


def calibrated_figures(
    plan: dict[str, Any], records: Sequence[dict[str, Any]], config_path: Path, check_after: int = 3
) -> dict[str, Any] | None:
    """The started plan's split under the model calibrated as the launcher calibrates it (on steps 2
    to ``check_after``, ``plan.calibrate``), against the median of the later steps it did not see
    (before any re-shard). None for a plan without stage costs or too few steps."""
    from shardpool.config import load_config
    from shardpool.errors import ShardpoolError
    from shardpool.plan.calibrate import StepMeasurement, calibrated_plan, calibrated_shares_step
    from shardpool.plan.result import Plan

    steps = step_records(records)
    events = rebalance_events(records)
    last = int(events[0]["step"]) if events else None
    window = [r for r in steps if 1 < int(r["step"]) <= check_after]
    last_step = last if last is not None else len(steps) + 1  # after a re-shard another split ran
    later = [float(r["step_seconds"]) for r in steps if check_after < int(r["step"]) <= last_step]
    if not window or not later:
        return None
    measured = [
        StepMeasurement(
            step=int(r["step"]),
            step_seconds=float(r["step_seconds"]),
            stage_compute_s=tuple(float(x) for x in r["stage_compute_s"]),
            stage_wait_s=tuple(float(x) for x in r["stage_wait_s"]),
        )
        for r in window
    ]
    try:
        started = Plan.from_json(initial_plan_json(plan))
        if started.is_data_parallel:  # replicas: their shares at the measured seconds per micro-batch
            predicted = calibrated_shares_step(started, measured)
            return {
                "calibrated_on_steps": [m.step for m in measured],
                "speed": None,
                "predicted_step_s": round(predicted, 4),
                "measured_step_s": _rounded(median_of(later)),
                "predicted_over_measured_step": ratio(predicted, median_of(later)),
            }
        calibrated = calibrated_plan(started, measured, load_config(config_path))
    except ShardpoolError:
        return None
    return {
        "calibrated_on_steps": [m.step for m in measured],
        "speed": calibrated.calibration.get("speed") if calibrated.calibration else None,
        "predicted_step_s": round(calibrated.predicted_step_s, 4),
        "measured_step_s": _rounded(median_of(later)),
        "predicted_over_measured_step": ratio(calibrated.predicted_step_s, median_of(later)),
    }


def initial_prediction(plan: dict[str, Any]) -> float | None:
    """The predicted step of the plan the run started with: the oldest of plan.json's history where
    it keeps one (after a re-shard), else its own ``predicted_step_s``."""
    history = plan.get("history")
    if isinstance(history, list) and history and isinstance(history[0], dict):
        first = history[0].get("predicted_step_s", history[0].get("plan", {}).get("predicted_step_s"))
        if first is not None:
            return float(first)
    value = plan.get("predicted_step_s")
    return None if value is None else float(value)


def first_step_reaching(tokens_per_s: Sequence[float], target: float | None) -> int | None:
    """The first step (1-based) from which every step's tokens/s is at least ``target`` (None: never)."""
    if target is None:
        return None
    for index in range(len(tokens_per_s)):
        if all(value >= target for value in tokens_per_s[index:]):
            return index + 1
    return None


def swapped_summary(
    swapped: dict[str, Any], pooled: dict[str, Any], events: Sequence[dict[str, Any]], share: float = 0.9
) -> dict[str, Any]:
    """How the run from swapped profiles recovered: its tokens/s against the plain pooled run's
    (the best plan's), and the first step from which it stays at ``share`` of it."""
    best = pooled["tokens_per_s"]
    return {
        "tokens_per_s": swapped["tokens_per_s"],
        "over_pooled": ratio(swapped["tokens_per_s"], best),
        "first_step_at_90pct_of_pooled": first_step_reaching(
            swapped["tokens_per_s_by_step"], None if best is None else share * best
        ),
        "tokens_per_s_by_step": swapped["tokens_per_s_by_step"],
        "rebalanced": bool(events),
        "rebalances": list(events),
    }


def swap_profile_entries(
    first: dict[str, Any], second: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """Two hosts' ``profiles.json`` with the measurements of the same model and workload exchanged.

    A key is ``device label|threads=..|quota=..|shape|workload|...``; entries whose keys agree
    past the first three fields are swapped, each keeping its own key (so each host's profiler
    finds the other's numbers). Returns both new contents and how many pairs were swapped.
    """

    def tail(key: str) -> str:
        return key.split("|", 3)[-1]

    by_tail = {tail(key): key for key in second}
    new_first, new_second, swapped = dict(first), dict(second), 0
    for key, value in first.items():
        other = by_tail.get(tail(key))
        if other is not None:
            new_first[key], new_second[other] = second[other], value
            swapped += 1
    return new_first, new_second, swapped


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a ``.jsonl`` file, up to its last whole line (one still being written is left out)."""
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


def profiled_seconds_per_layer(plans: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Each host's profiled seconds per layer, from the ``measured`` block of the plans' stages."""
    found: dict[str, float] = {}
    for plan in plans:
        for stage in plan.get("data_parallel") or plan["stages"]:
            median = (stage.get("measured") or {}).get("seconds_median")
            if median is not None:
                found.setdefault(stage["host"], round(float(median), 5))
    return dict(sorted(found.items()))


def profiled_quotas(plans: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """The CPU quota each host's profile says it was measured under (None: unlimited or unseen)."""
    found: dict[str, float | None] = {}
    for plan in plans:
        for stage in plan.get("data_parallel") or plan["stages"]:
            found.setdefault(stage["host"], (stage.get("measured") or {}).get("cpu_quota"))
    return dict(sorted(found.items()))
