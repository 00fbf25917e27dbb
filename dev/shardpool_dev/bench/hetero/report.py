"""The pool benchmark's JSON report: each mode's figures and the ratios that answer its question."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

from shardpool_dev.bench.cgroups import PERIOD_US, CgroupChoice
from shardpool_dev.bench.hetero.modes import DEFAULT_MODES, MODES, SWAPPED
from shardpool_dev.bench.hetero.summary import (
    profiled_quotas,
    profiled_seconds_per_layer,
    rebalance_events,
    repeats_summary,
    swapped_summary,
)
from shardpool_dev.bench.stats import ratio
from shardpool_dev.bench.workload import run_settings


def report(
    *,
    quick: bool,
    size: dict[str, Any],
    quotas: dict[str, float],
    choice: CgroupChoice,
    scope: str,
    period_us: int,
    runs: dict[str, list[dict[str, Any]]],
    plans: dict[str, list[dict[str, Any]]],
    records: dict[str, list[list[dict[str, Any]]]],
    order: Sequence[tuple[str, int]],
    swapped: int | None,
    moved: dict[str, int],
    hf_config: dict[str, Any],
    mesh_setup_s: float,
    seconds: float,
) -> dict[str, Any]:
    """Assemble the JSON report. ``runs``, ``plans`` and ``records`` hold each way's runs in repeat
    order. ``tokens_per_s`` is each way's median over its runs, ``pooled_over_fastest`` and
    ``even_over_fastest`` the median of the per-round ratios (:func:`shardpool_dev.bench.hetero.summary.repeats_summary`); the
    per-run figures (``runs``, ``stage_compute_s``, ``rebalances``, ...) are each way's first run's,
    and ``repeats.runs`` holds every run's."""
    first_runs = {mode: summaries[0] for mode, summaries in runs.items()}
    first_plans = {mode: found[0] for mode, found in plans.items()}
    repeated = {mode: summaries for mode, summaries in runs.items() if mode != SWAPPED}
    side_by_side = repeats_summary([(mode, repeat) for mode, repeat in order if mode != SWAPPED], repeated)
    first = first_runs_report(
        quick=quick,
        size=size,
        quotas=quotas,
        choice=choice,
        scope=scope,
        period_us=period_us,
        runs=first_runs,
        plans=first_plans,
        records={mode: found[0] for mode, found in records.items()},
        swapped=swapped,
        moved=moved,
        hf_config=hf_config,
        mesh_setup_s=mesh_setup_s,
        seconds=seconds,
        repeats=side_by_side["count"],
    )
    return first | {
        "tokens_per_s": first["tokens_per_s"] | side_by_side["tokens_per_s_median"],
        "pooled_over_fastest": side_by_side["pooled_over_fastest"]["median"],
        "pooled_over_fastest_min": side_by_side["pooled_over_fastest"]["min"],
        "pooled_over_fastest_max": side_by_side["pooled_over_fastest"]["max"],
        "even_over_fastest": side_by_side["even_over_fastest"]["median"],
        "pooled_over_fastest_beside": side_by_side["pooled_over_fastest_beside"]["median"],
        "pooled_over_every_host_alone": side_by_side["pooled_over_every_host_alone"]["median"],
        "cgroup_cpu_s": first_runs.get("pooled", {}).get("cgroup_cpu_s"),
        "repeats": side_by_side | {"runs": runs},
    }


def first_runs_report(
    *,
    quick: bool,
    size: dict[str, Any],
    quotas: dict[str, float],
    choice: CgroupChoice,
    scope: str,
    period_us: int,
    runs: dict[str, dict[str, Any]],
    plans: dict[str, dict[str, Any]],
    records: dict[str, list[dict[str, Any]]],
    swapped: int | None,
    moved: dict[str, int],
    hf_config: dict[str, Any],
    mesh_setup_s: float,
    seconds: float,
    repeats: int,
) -> dict[str, Any]:
    """The report of one run per way (the first of each, under ``--repeats``)."""
    modes = list(runs)
    tokens = {mode: runs[mode]["tokens_per_s"] for mode in modes}
    events = rebalance_events(records.get("pooled", []))
    pooled = runs.get("pooled", {})
    tokens.update({mode: None for mode in DEFAULT_MODES if mode not in tokens})  # runs left out by --modes
    measured_plans = [plans[mode] for mode in ("even_split", "pooled") if mode in plans]
    command = "sudo python scripts/bench_hetero.py"
    if tuple(quotas.values()) != size["hosts"]:
        command += " --hosts " + ",".join(f"{quota:g}" for quota in quotas.values())
    command += (" --swap-profiles" if swapped is not None else "") + (" --quick" if quick else "")
    command += " --quota-scope host" if scope == "host" else ""
    command += f" --period-ms {period_us // 1000}" if period_us != PERIOD_US else ""
    chosen = [mode for mode in MODES if mode in runs]
    command += "" if chosen == list(DEFAULT_MODES) else " --modes " + ",".join(chosen)
    command += f" --repeats {repeats}" if repeats > 1 else ""
    return {
        "benchmark": "hetero",
        "quick": quick,
        "command": command,
        "hosts_cpu_quota": quotas,
        "fastest_host": next(iter(quotas)),
        "quota_scope": scope,
        "cgroup": choice.version,
        "cfs_period_ms": period_us / 1000,
        "tokens_per_s": tokens,
        "pooled_over_fastest": ratio(tokens["pooled"], tokens["fastest_alone"]),
        "even_over_fastest": ratio(tokens["even_split"], tokens["fastest_alone"]),
        "predicted_over_measured_step": {mode: runs[mode]["predicted_over_measured_step"] for mode in modes},
        "pooled_after_calibration_predicted_over_measured": (pooled.get("after_calibration") or {}).get(
            "predicted_over_measured_step"
        ),
        "pooled_after_rebalance_predicted_over_measured": pooled.get("after_rebalance", {}).get(
            "predicted_over_measured_step"
        ),
        "stage_compute_s": {mode: runs[mode]["stage_compute_s"] for mode in modes},
        "stage_wait_s": {mode: runs[mode]["stage_wait_s"] for mode in modes},
        "pooled_stage_wait_over_step_max": max(
            (value for value in pooled.get("stage_wait_over_step", []) if value is not None), default=None
        ),
        "seconds_per_layer_by_host": {
            "profile": profiled_seconds_per_layer(measured_plans),
            "profile_cpu_quota": profiled_quotas(measured_plans),
            "even_split_compute": runs.get("even_split", {}).get("compute_s_per_layer_by_host"),
        },
        "rebalanced": bool(events),
        "rebalances": events,
        "profile_entries_swapped": swapped,
        "from_swapped_profiles": None
        if swapped is None
        else swapped_summary(runs[SWAPPED], runs["pooled"], rebalance_events(records[SWAPPED])),
        "runs": runs,
        "model": {
            "type": hf_config["model_type"],
            "num_layers": hf_config["num_hidden_layers"],
            "hidden_size": hf_config["hidden_size"],
            "intermediate_size": hf_config["intermediate_size"],
            "vocab_size": hf_config["vocab_size"],
        },
        "config": run_settings(size) | {"warmup_steps_skipped": size["warmup"]},
        "processes_throttled_at_start": moved,
        "machine": {
            "logical_cpus": os.cpu_count(),
            "loadavg_1m_end": round(os.getloadavg()[0], 2),
            "kernel": platform.release(),
            "python": platform.python_version(),
        },
        "mesh_setup_s": round(mesh_setup_s, 1),
        "seconds": round(seconds, 1),
    }


def say(line: str) -> None:
    """A progress line on standard error (standard output carries only the JSON)."""
    print(f"bench_hetero: {line}", file=sys.stderr, flush=True)
