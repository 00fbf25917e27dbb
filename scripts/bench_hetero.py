"""Benchmark a heterogeneous pool: mesh hosts throttled by cgroup CPU quotas, pooled against the fastest alone.

    sudo python scripts/bench_hetero.py                       # 2 hosts, 0.6 + 0.3 CPU (issue 10's setup)
    sudo python scripts/bench_hetero.py --hosts 1.0,0.5,0.25  # the 3-host fleet
    sudo python scripts/bench_hetero.py --swap-profiles       # the pooled run starts from swapped profiles
    sudo python scripts/bench_hetero.py --quick               # a tiny model, few steps (the test's version)
    sudo python scripts/bench_hetero.py --modes fastest_alone,pooled --repeats 2  # side by side, ABBA
    sudo python scripts/bench_hetero.py --modes fastest_alone,all_alone,pooled --repeats 2  # + the others busy beside a
    sudo python scripts/bench_hetero.py --modes fastest_alone,pooled_pipeline,pooled_data_parallel --repeats 2

It needs what the mesh tests need (root, ``ip``, ``wireguard-go``, ``wg``, ``ping``,
``/dev/net/tun``) and a writable cgroup hierarchy with the ``cpu`` controller: cgroup v2's
``cpu.max`` where the unified hierarchy has the controller, else cgroup v1's ``cpu.cfs_quota_us``
(:func:`choose_cgroup` picks). Where it cannot run it prints ``{"skipped": reason}`` and exits 0.
Everything happens in a temporary directory, in network namespaces and in cgroups made for the run;
every one of them, and every process the run started, is removed by name or pid at the end, also on
failure or Ctrl-C:

  1. builds a random Llama (default 16 layers, hidden 512) and a completion dataset;
  2. builds hosts a, b (, c) with ``mesh.lab.Lab`` and forms the mesh with the real CLI (``mesh init``
     on a, ``mesh join`` on the others), unthrottled; then throttles each host by a cgroup with
     its CPU quota (:data:`SCOPES`): in ``stage`` scope (the default) its agent, restarted inside
     it, and the stages and profilers the agent starts, while WireGuard, the sync daemon and the
     launcher run in an unthrottled cgroup beside it, as they would beside a GPU; in ``host``
     scope every process of the host, as on a smaller machine;
  3. trains the same config three ways with ``shardpool finetune``:
     *fastest alone* (``placement: local``, ``layers: [N]``: one stage process on host a, as its
     owner would train on it alone; not through the mesh, where the planner would pick the host
     from profiles, which are what is under test), *even split* (``placement: mesh`` with
     ``shardpool.layers`` as even as the layers allow over every host; the planner picks only the
     order) and *pooled* (``placement: mesh``: the planner's split and stage count); the launcher
     always runs on host a. Fastest-alone and even runs have ``rebalance: off``, so they stay
     the baselines, and the pooled ones ``rebalance: auto``; ``--modes`` runs only some ways, or
     adds *all alone*: the fastest-alone run again while every other host trains the same model
     alone beside it (its own ``shardpool finetune``, its stage under its quota, started first and
     stopped when host a's run ends). On one VM two busy hosts slow each other (shared caches,
     memory bandwidth, the hypervisor); separate machines do not. This run gives host a a
     neighbour as busy as in the pooled run, so pooled ÷ it (``pooled_over_fastest_beside``)
     compares the two at the same contention, and pooled ÷ every host's tokens/s alone at once
     (``pooled_over_every_host_alone``) says how much of the hosts' separate throughput the pool
     keeps;
  4. with ``--swap-profiles``, before the pooled run, swaps the fastest and the slowest host's
     cached layer profiles (``<agent work dir>/profile/profiles.json``) and restarts both agents so
     they forget the profiles they hold in memory, then runs *pooled_swapped*: the pooled run again,
     planned from the wrong profiles, which must re-balance to recover; the plain pooled run's
     tokens/s is "the best plan's" it is measured against.

With ``--repeats N`` each chosen way runs N times on the same mesh, in ABBA order
(:func:`abba_order`: fastest, pooled, pooled, fastest, ...), so that a slow drift of the machine's
load favours neither; tokens/s is then each way's median, and pooled ÷ fastest the median of the
ratios of the rounds (the i-th run of each way), with their min and max under ``repeats``.
During every run, :class:`CgroupCpuSampler` counts the CPU seconds each kind of process used in
each host's throttled cgroup (``cgroup_cpu_s``).

The JSON holds tokens/s of each run, pooled ÷ fastest, plan.json's ``predicted_step_s`` ÷ the
median measured step after ``warmup`` steps, per-stage compute and wait (``metrics.jsonl``), the
per-layer seconds of each host (its profile, and its measured compute in the even split), and the
re-balancing events (``{"event": "rebalance", ...}`` lines of ``metrics.jsonl``) where any.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mesh.files import write_json  # noqa: E402
from mesh.lab import Host, Lab, LabError, netns_skip_reason  # noqa: E402
from scripts.bench_mesh import (  # noqa: E402 - needs ROOT on sys.path
    BenchError,
    build_inputs,
    form_mesh,
    log_tail,
    stop_launcher,
    wait_for_agents,
    wait_until,
    write_yaml,
)
from scripts.bench_pipeline import training_config  # noqa: E402
from scripts.report_run import run_and_report  # noqa: E402

LABELS = "abc"
PERIOD_US = 10_000
"""The CFS period of every quota (``--period-ms``), by default 10 ms, so a host is slow at every
timescale its work has (a layer pass takes milliseconds). Under the kernel's default 100 ms, a burst
shorter than the quota runs at full speed, and a host that waits less than its throttled part of a
period loses no work by waiting. Either way the quota is an emulation of a slower device: at 10 ms
the slow host pays for its short slices (0.3 CPU, 3 ms runs: 7 % more CPU for the same work than at
0.6), at 100 ms much less, but it absorbs waits that a slower device would lose."""
PERIOD_MS_RANGE = (10, 1000)
"""The periods ``--period-ms`` takes: up to the kernel's 1 s, and from 10 ms, under which a small
quota would meet the kernel's 1 ms floor."""
SCOPES = ("stage", "host")
"""What a host's CPU quota throttles (``--quota-scope``). ``stage`` (the default): only the stage
processes and the profilers, the work a real fleet runs on its accelerator, which the quota stands
in for; the host's agent (their parent, so that they inherit the quota and the thread count from
their first instruction) stays with them. The launcher, WireGuard (``wireguard-go`` encrypts every
activation in user space) and the sync daemon run on the host's CPU, unthrottled, as they would
beside a GPU. ``host``: every process of the host, as on a smaller machine (last session's figures)."""
MODES = ("fastest_alone", "all_alone", "even_split", "pooled", "pooled_pipeline", "pooled_data_parallel")
"""Every way the bench can run (``--modes``). ``all_alone``: the fastest host's run alone again, with
every other host training the same model alone beside it (:func:`beside_runs`), so host a shares
the VM with as busy a neighbour as in the pooled run; not run unless asked for.
``pooled_pipeline`` (``data_parallel: off``) and ``pooled_data_parallel`` (``data_parallel: on``):
the planner's best pipeline and its best whole-model replicas, each whatever the other predicts,
beside ``pooled``, which is the planner's choice between them."""
DEFAULT_MODES = ("fastest_alone", "even_split", "pooled")
LOCAL_MODES = ("fastest_alone", "all_alone")
"""The ways whose host-a run is one local stage process (``placement: local``) under a's quota."""
SWAPPED = "pooled_swapped"
"""With ``--swap-profiles``: the pooled run again, planned from the swapped profiles."""
POOLED_MODES = ("pooled", "pooled_pipeline", "pooled_data_parallel", SWAPPED)
"""The ways the planner places, with re-balancing on as a user's run has it."""

FULL: dict[str, Any] = {
    "model": {
        "num_layers": 16,
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_heads": 8,
        "num_kv_heads": 2,
        "vocab_size": 2048,
    },
    "sequence_len": 128,
    "micro_batch_size": 1,
    "gradient_accumulation_steps": 16,
    "max_steps": 14,
    "lora_r": 8,
    "warmup": 2,
    "hosts": (0.6, 0.3),
    "run_timeout_s": 3600,
}
QUICK: dict[str, Any] = {
    "model": {
        "num_layers": 4,
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_heads": 4,
        "num_kv_heads": 2,
        "vocab_size": 512,
    },
    "sequence_len": 32,
    "micro_batch_size": 1,
    "gradient_accumulation_steps": 4,
    "max_steps": 3,
    "lora_r": 4,
    "warmup": 1,
    "hosts": (1.0, 0.5),
    "run_timeout_s": 300,
}


# ---------------------------------------------------------------------------- pure helpers


@dataclass(frozen=True)
class CgroupChoice:
    """Which cgroup hierarchy throttles the hosts: ``v2`` (``cpu.max``) or ``v1`` (CFS files), mounted where."""

    version: Literal["v1", "v2"]
    mount: Path


def choose_cgroup(mounts: str, unified_controllers: Mapping[str, str]) -> CgroupChoice | None:
    """The hierarchy to put CPU quotas in, from the text of ``/proc/self/mounts``.

    cgroup v2 where a ``cgroup2`` mount lists ``cpu`` in its ``cgroup.controllers`` (given in
    ``unified_controllers``, mount point -> file text); else the cgroup v1 mount with the ``cpu``
    controller among its options; None when neither exists.
    """
    v1: Path | None = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        kind, mount, options = fields[2], fields[1], fields[3].split(",")
        if kind == "cgroup2" and "cpu" in unified_controllers.get(mount, "").split():
            return CgroupChoice("v2", Path(mount))
        if kind == "cgroup" and "cpu" in options and v1 is None:
            v1 = Path(mount)
    return CgroupChoice("v1", v1) if v1 is not None else None


def quota_files(version: Literal["v1", "v2"], cpus: float, period_us: int = PERIOD_US) -> dict[str, str]:
    """The files (name -> text, in write order) that cap a cgroup at ``cpus`` CPUs."""
    quota_us = max(1000, round(cpus * period_us))  # the kernel refuses quotas under 1 ms
    if version == "v2":
        return {"cpu.max": f"{quota_us} {period_us}"}
    return {"cpu.cfs_period_us": str(period_us), "cpu.cfs_quota_us": str(quota_us)}


def parse_hosts(text: str) -> tuple[float, ...]:
    """``"0.6,0.3"`` -> (0.6, 0.3): two or three CPU quotas, fastest first, each in (0, 64]."""
    try:
        quotas = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hosts {text!r}: give CPU quotas like 0.6,0.3") from None
    if not 2 <= len(quotas) <= len(LABELS):
        raise argparse.ArgumentTypeError(f"--hosts {text!r}: give 2 or {len(LABELS)} quotas")
    if any(not 0 < quota <= 64 for quota in quotas):
        raise argparse.ArgumentTypeError(f"--hosts {text!r}: each quota must be above 0 and at most 64 CPUs")
    if list(quotas) != sorted(quotas, reverse=True):
        raise argparse.ArgumentTypeError(
            f"--hosts {text!r}: list the fastest host first (host a runs the launcher)"
        )
    return quotas


def parse_period_ms(text: str) -> int:
    """``"100"`` -> 100_000: the CFS period in microseconds, from whole milliseconds in :data:`PERIOD_MS_RANGE`."""
    low, high = PERIOD_MS_RANGE
    try:
        period_ms = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--period-ms {text!r}: give whole milliseconds, like 100") from None
    if not low <= period_ms <= high:
        raise argparse.ArgumentTypeError(f"--period-ms {text!r}: give {low} to {high} milliseconds")
    return period_ms * 1000


def parse_modes(text: str) -> tuple[str, ...]:
    """``"even_split,pooled"`` -> those ways, in the order of :data:`MODES`; at least one."""
    names = {part.strip() for part in text.split(",") if part.strip()}
    unknown = sorted(names - set(MODES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--modes {text!r}: choose among {', '.join(MODES)}")
    return tuple(mode for mode in MODES if mode in names)


def parse_repeats(text: str) -> int:
    """``"2"`` -> 2: how many times each way runs (at least 1)."""
    try:
        repeats = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--repeats {text!r}: give a whole number, 1 or more") from None
    if repeats < 1:
        raise argparse.ArgumentTypeError(f"--repeats {text!r}: give a whole number, 1 or more")
    return repeats


def abba_order(modes: Sequence[str], repeats: int) -> list[tuple[str, int]]:
    """The runs as (way, repeat index from 0), in ABBA order: round 0 runs ``modes`` forwards, round 1
    backwards, round 2 forwards again, ... (fastest, pooled, pooled, fastest, fastest, pooled).

    Within a round the ways run back to back, so the i-th run of each way forms a side-by-side
    group; reversing every other round puts each way first as often as last, so a load that drifts
    slowly over the invocation favours neither."""
    order: list[tuple[str, int]] = []
    for repeat in range(repeats):
        ways = list(modes) if repeat % 2 == 0 else list(reversed(modes))
        order.extend((mode, repeat) for mode in ways)
    return order


def run_name(mode: str, repeat: int) -> str:
    """The name of a run's files (``<name>.yaml``, ``<name>.log``, ``out-<name>``): the way's own
    name for its first run (as without ``--repeats``), ``<way>-<n>`` for its n-th (``pooled-2``)."""
    return mode if repeat == 0 else f"{mode}-{repeat + 1}"


def paired_ratios(
    tokens_by_run: Mapping[str, Sequence[float | None]], numerator: str, denominator: str
) -> list[float | None]:
    """Per round, ``numerator``'s tokens/s ÷ ``denominator``'s in that round (None where either is
    missing); as many as the rounds both ways ran."""
    tops, bottoms = tokens_by_run.get(numerator, ()), tokens_by_run.get(denominator, ())
    return [ratio(top, bottom) for top, bottom in zip(tops, bottoms, strict=False)]


def spread(values: Sequence[float | None], places: int = 3) -> dict[str, float | None]:
    """``median``, ``min`` and ``max`` of the values that are not None (each None when none are)."""
    present = [value for value in values if value is not None]
    if not present:
        return {"median": None, "min": None, "max": None}
    return {
        "median": round(statistics.median(present), places),
        "min": round(min(present), places),
        "max": round(max(present), places),
    }


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


def cgroupfs_mounts(choice: CgroupChoice) -> str:
    """Shell commands that mount the cgroup filesystem at ``/sys/fs/cgroup`` as this machine has it.

    ``ip netns exec`` mounts a fresh ``/sys`` (in a mount namespace of its own, whose mounts do not
    reach the machine's) that lacks the cgroup filesystems, so a process in a lab host could not
    read its own CPU quota, which a profile records (``shardpool.host.cpu_quota``); a real host can.
    """
    if choice.version == "v2":
        return "mount -t cgroup2 cgroup2 /sys/fs/cgroup"
    hierarchy = choice.mount.name  # "cpu", or "cpu,cpuacct" where the controllers are mounted together
    return (
        f"mount -t tmpfs cgroup /sys/fs/cgroup && mkdir -p /sys/fs/cgroup/{hierarchy}"
        f" && mount -t cgroup -o {hierarchy} cgroup /sys/fs/cgroup/{hierarchy}"
    )


def gated_argv(argv: Sequence[str], prepare: str = ":") -> list[str]:
    """``argv`` behind a gate: a shell runs ``prepare`` (its failure is ignored), waits for one line
    on its standard input, then becomes ``argv``. Moving the shell into a cgroup before opening the
    gate throttles the command and everything it forks from their first instruction. (A command
    inside a lab host cannot join a cgroup itself: its ``/sys`` has no cgroup filesystem.)"""
    return ["sh", "-c", f'{{ {prepare}; }} >/dev/null 2>&1; read -r _ && exec "$@"', "gated", *argv]


def even_counts(num_layers: int, stages: int) -> list[int]:
    """Layer counts as even as possible, the larger ones first (16 over 3: [6, 5, 5])."""
    base, extra = divmod(num_layers, stages)
    return [base + (1 if index < extra else 0) for index in range(stages)]


def step_records(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-step lines of ``metrics.jsonl`` (not eval or event lines), by step."""
    steps = [r for r in records if "event" not in r and "step_seconds" in r and "stage_compute_s" in r]
    return sorted(steps, key=lambda record: int(record["step"]))


def rebalance_events(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``{"event": "rebalance", ...}`` lines of ``metrics.jsonl``, in order."""
    return [record for record in records if record.get("event") == "rebalance"]


def median_of(values: Sequence[float]) -> float | None:
    """The median, or None for no values."""
    return statistics.median(values) if values else None


def ratio(numerator: float | None, denominator: float | None, places: int = 3) -> float | None:
    """``numerator / denominator`` rounded, or None where either is missing or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, places)


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


def _rounded(value: float | None, places: int = 4) -> float | None:
    return None if value is None else round(value, places)


# ---------------------------------------------------------------------------- cgroups


def detect_cgroup() -> CgroupChoice | None:
    """:func:`choose_cgroup` on this machine's mounts."""
    mounts = Path("/proc/self/mounts").read_text()
    controllers: dict[str, str] = {}
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            with contextlib.suppress(OSError):
                controllers[fields[1]] = (Path(fields[1]) / "cgroup.controllers").read_text()
    return choose_cgroup(mounts, controllers)


@dataclass
class HostCgroups:
    """One cgroup per host under ``<mount>/shardpool-bench-<pid>``, each capped at its CPU quota.

    A context manager: on exit every process still in them is killed by pid and the cgroups are removed.
    """

    choice: CgroupChoice
    quotas: dict[str, float]
    unthrottled: tuple[str, ...] = ()
    period_us: int = PERIOD_US
    parent: Path = field(init=False)

    def __post_init__(self) -> None:
        self.parent = self.choice.mount / f"shardpool-bench-{os.getpid()}"

    def __enter__(self) -> HostCgroups:
        self.parent.mkdir()
        try:
            if self.choice.version == "v2":
                (self.choice.mount / "cgroup.subtree_control").write_text("+cpu")
                (self.parent / "cgroup.subtree_control").write_text("+cpu")
            for label, cpus in self.quotas.items():
                self.path(label).mkdir()
                for name, text in quota_files(self.choice.version, cpus, self.period_us).items():
                    (self.path(label) / name).write_text(text)
            for label in self.unthrottled:
                self.path(label).mkdir()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def path(self, label: str) -> Path:
        """The cgroup directory of host ``label``."""
        return self.parent / label

    def procs(self, label: str) -> Path:
        """The ``cgroup.procs`` file of host ``label`` (write a pid to move that process in)."""
        return self.path(label) / "cgroup.procs"

    def add(self, label: str, pid: int) -> None:
        """Move process ``pid`` (all its threads) into host ``label``'s cgroup."""
        self.procs(label).write_text(str(pid))

    def pids(self, label: str) -> list[int]:
        """The processes in host ``label``'s cgroup now."""
        try:
            return [int(pid) for pid in self.procs(label).read_text().split()]
        except OSError:
            return []

    def close(self) -> None:
        """Kill what is left in the cgroups (by pid) and remove them, the parent last."""
        for label in (*self.quotas, *self.unthrottled):
            directory = self.path(label)
            if not directory.is_dir():
                continue
            deadline = time.monotonic() + 10
            while (pids := self.pids(label)) and time.monotonic() < deadline:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.1)
            with contextlib.suppress(OSError):
                directory.rmdir()
        with contextlib.suppress(OSError):
            self.parent.rmdir()


def cgroup_skip_reason() -> str | None:
    """Why the hosts cannot be throttled here, or None: no ``cpu`` controller, or no write to it."""
    choice = detect_cgroup()
    if choice is None:
        return "needs a cgroup hierarchy with the cpu controller (v2 cpu.max or v1 cpu.cfs_quota_us)"
    try:
        with HostCgroups(choice, {"probe": 0.5}):
            pass
    except OSError as error:
        return f"cannot create a throttled {choice.version} cgroup under {choice.mount}: {error}"
    return None


def skip_reason() -> str | None:
    """Why this benchmark cannot run here (no root, namespaces, wireguard-go or cgroup write), or None."""
    return netns_skip_reason() or cgroup_skip_reason()


# ---------------------------------------------------------------------------- the lab


def namespace_pids(host: Host) -> list[int]:
    """Every process in ``host``'s network namespace."""
    listed = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True)
    return [int(pid) for pid in listed.stdout.split() if pid.isdigit()]


def overhead_cgroup(label: str, scope: str) -> str:
    """The cgroup of host ``label``'s own processes (launcher, WireGuard, sync daemon): its throttled
    one in ``host`` scope, an unthrottled ``<label>-host`` beside it in ``stage`` scope."""
    return label if scope == "host" else f"{label}-host"


def parent_pids(proc: Path = Path("/proc")) -> dict[int, int]:
    """Every process's parent, from ``/proc/<pid>/stat``."""
    parents: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
        parents[int(entry.name)] = int(fields[1])
    return parents


PROCESS_KINDS = ("stage", "profiler", "agent", "other")
"""What :func:`process_kind` calls a process in a host's throttled cgroup."""


def process_kind(pid: int, cmdline: str, agent: int | None) -> str:
    """``agent`` (the host's agent, by pid), ``stage`` (``shardpool.train.worker``), ``profiler``
    (``shardpool.plan.report``) or ``other``, from ``/proc/<pid>/cmdline`` (NULs as spaces)."""
    if pid == agent:
        return "agent"
    if "shardpool.train.worker" in cmdline:
        return "stage"
    if "shardpool.plan.report" in cmdline:
        return "profiler"
    return "other"


def stat_cpu_ticks(stat: str) -> tuple[str, int]:
    """``(command name, utime + stime)`` from the text of ``/proc/<pid>/stat``, in clock ticks: the
    CPU the process itself used (its reaped children's, cutime and cstime, left out)."""
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()  # fields[0] is the state, field 3 of the file
    return name, int(fields[11]) + int(fields[12])  # fields 14 and 15: utime, stime


def command_label(name: str, cmdline: str, words: int = 4) -> str:
    """A process's name for ``other_by_name``: the first ``words`` words of its command line without
    paths (``python -m mesh.node.syncd``), or its command name where the line is empty (a kernel
    thread, or a process gone meanwhile)."""
    parts = [part.rsplit("/", 1)[-1] for part in cmdline.split()[:words]]
    return " ".join(parts) or name


@dataclass(frozen=True)
class ProcessCpu:
    """One process seen in a cgroup: its kind, command name and utime + stime (ticks) when last seen,
    and when (``time.monotonic``) it was first and last seen."""

    kind: str
    name: str
    ticks: int
    first_seen_s: float = 0.0
    last_seen_s: float = 0.0


def merged_sample(last: Mapping[int, ProcessCpu], now: Mapping[int, ProcessCpu]) -> dict[int, ProcessCpu]:
    """Each process's latest ticks, keeping the kind and name it was first given one by: an exited
    process not yet reaped (a zombie) has an empty command line, and would turn ``other``, as
    would one sampled between fork and exec."""
    merged = dict(last)
    for pid, seen in now.items():
        before = last.get(pid)
        if before is not None:
            kept = before if seen.kind == "other" and before.kind != "other" else seen
            seen = ProcessCpu(kept.kind, kept.name, seen.ticks, before.first_seen_s, seen.last_seen_s)
        merged[pid] = seen
    return merged


def cpu_seconds_by_kind(
    first: Mapping[int, ProcessCpu], last: Mapping[int, ProcessCpu], ticks_per_s: float
) -> dict[str, Any]:
    """CPU seconds each kind of process used between two samples of a cgroup: per pid, its ticks
    when last seen less its ticks at ``first`` (0 for a process started after it), summed by
    :data:`PROCESS_KINDS`; ``other_by_name`` splits ``other`` by command name. ``stage_seen_s`` is
    the seconds the stage processes were seen for (first to last sighting, summed), and
    ``stage_cpus`` their CPU seconds over it: the CPUs a stage got while it lived (against its
    quota), which the run's wall time, with the stage's start and the launcher's end in it, does
    not give."""
    by_kind = dict.fromkeys(PROCESS_KINDS, 0.0)
    other: dict[str, float] = {}
    stage_seen_s = 0.0
    for pid, seen in last.items():
        before = first[pid].ticks if pid in first else 0
        seconds = max(0, seen.ticks - before) / ticks_per_s
        by_kind[seen.kind] = by_kind.get(seen.kind, 0.0) + seconds
        if seen.kind == "other":
            other[seen.name] = other.get(seen.name, 0.0) + seconds
        if seen.kind == "stage":
            stage_seen_s += seen.last_seen_s - seen.first_seen_s
    result: dict[str, Any] = {kind: round(seconds, 3) for kind, seconds in by_kind.items()}
    result["other_by_name"] = {name: round(seconds, 3) for name, seconds in sorted(other.items())}
    result["stage_seen_s"] = round(stage_seen_s, 1)
    result["stage_cpus"] = ratio(by_kind["stage"], stage_seen_s)
    return result


def seen_windows(seen: Mapping[int, ProcessCpu], since: float) -> dict[str, list[list[float]]]:
    """When each stage and profiler process was seen, as ``[first, last]`` seconds after ``since``
    (the run's start), by kind, earliest first: shows whether a profiler ran beside a stage, on the
    same quota."""
    windows: dict[str, list[list[float]]] = {"stage": [], "profiler": []}
    for process in seen.values():
        if process.kind in windows:
            window = [round(process.first_seen_s - since, 1), round(process.last_seen_s - since, 1)]
            windows[process.kind].append(window)
    return {kind: sorted(found) for kind, found in windows.items()}


def cpu_stat_delta(before: str, after: str) -> dict[str, int]:
    """The growth of each counter of a cgroup's ``cpu.stat`` text (``name value`` lines) between two
    reads: v1's ``nr_periods``, ``nr_throttled``, ``throttled_time`` (ns); v2's also ``usage_usec``."""

    def counters(text: str) -> dict[str, int]:
        pairs = (line.split() for line in text.splitlines())
        return {pair[0]: int(pair[1]) for pair in pairs if len(pair) == 2 and pair[1].isdigit()}

    start, end = counters(before), counters(after)
    return {name: end[name] - start.get(name, 0) for name in end}


def process_tree(root: int, parents: Mapping[int, int]) -> set[int]:
    """``root`` and all its descendants, given each process's parent."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, ()))
    return tree


def settle_scope(lab: Lab, cgroups: HostCgroups, scope: str) -> None:
    """In ``stage`` scope, move every process of each host but its agent's tree (the agent, its
    stages and profilers) out of the quota, into ``<label>-host``; ``mesh up`` may have started
    WireGuard or the sync daemon inside it. Nothing to do in ``host`` scope."""
    from mesh.daemon import read_pid

    if scope == "host":
        return
    parents = parent_pids()
    for label, host in lab.hosts.items():
        agent = read_pid(agent_pid_file(host))
        if agent is None:
            raise BenchError(f"host {label} has no agent to keep under its quota")
        device = process_tree(agent, parents)
        for pid in namespace_pids(host):
            with contextlib.suppress(ProcessLookupError, OSError):
                cgroups.add(label if pid in device else overhead_cgroup(label, scope), pid)


def throttle(lab: Lab, cgroups: HostCgroups, scope: str = "host") -> dict[str, int]:
    """Move every process of every host into the host's cgroup (``host`` scope) or its unthrottled
    ``<label>-host`` one (``stage`` scope: the restarted agents bring the quota to what they start);
    how many each had."""
    moved: dict[str, int] = {}
    for label, host in lab.hosts.items():
        pids = namespace_pids(host)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, OSError):  # gone meanwhile
                cgroups.add(overhead_cgroup(label, scope), pid)
        moved[label] = len(pids)
        if not pids:
            raise BenchError(f"host {label} runs no process to throttle (is its agent up?)")
    return moved


def agent_pid_file(host: Host) -> Path:
    """The agent's pid file in ``host``'s state directory (``mesh.cli.agent_process``)."""
    return host.home / "run" / "shardpool-agent.pid"


def start_in_cgroup(
    lab: Lab,
    host: Host,
    cgroups: HostCgroups,
    argv: Sequence[str],
    cgroup: str | None = None,
    **popen: Any,
) -> subprocess.Popen[Any]:
    """Start ``argv`` inside ``host`` and inside ``cgroup`` (default: the host's throttled one; see
    :func:`gated_argv`)."""
    gated = gated_argv(argv, cgroupfs_mounts(cgroups.choice))
    process = subprocess.Popen(lab.command(host, *gated), stdin=subprocess.PIPE, **popen)
    try:
        cgroups.add(
            cgroup or host.label, process.pid
        )  # ``ip netns exec`` and ``env`` exec in place: same pid
        assert process.stdin is not None
        process.stdin.write(b"go\n")
        process.stdin.close()
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process


def restart_agent(lab: Lab, host: Host, cgroups: HostCgroups) -> None:
    """Stop ``host``'s agent by pid and start it again with ``mesh up``, inside the host's cgroup."""
    from mesh.daemon import read_pid

    pid = read_pid(agent_pid_file(host))
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: read_pid(agent_pid_file(host)) is None, 30, f"agent of {host.label} stopping")
    log = host.home.parent / f"{host.label}-mesh-up.log"
    with open(log, "w") as sink:  # not a pipe: the detached agent must not hold our end open
        process = start_in_cgroup(
            lab, host, cgroups, [sys.executable, "-m", "shardpool", "mesh", "up"], stdout=sink, stderr=sink
        )
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise BenchError(f"restarting the agent of {host.label} took over 120 s") from None
    if process.returncode != 0 or read_pid(agent_pid_file(host)) is None:
        raise BenchError(f"restarting the agent of {host.label}: {log_tail(log, 3)}")


def profiles_file(host: Host) -> Path:
    """Where ``host``'s agent caches its layer profiles (its work dir's profiler directory)."""
    return host.home.with_name(host.home.name + "-work") / "profile" / "profiles.json"


def swap_profiles(lab: Lab, cgroups: HostCgroups, first: str, second: str, scope: str = "host") -> int:
    """Swap two hosts' cached profiles and restart both agents; how many entries were swapped."""
    paths = [profiles_file(lab.hosts[label]) for label in (first, second)]
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise BenchError(f"no cached profiles to swap at {missing}; the agents have not profiled yet")
    contents = [json.loads(path.read_text()) for path in paths]
    new_first, new_second, swapped = swap_profile_entries(*contents)
    if not swapped:
        raise BenchError(f"the profiles of {first} and {second} share no model and workload to swap")
    for path, content in zip(paths, (new_first, new_second), strict=True):
        owner = path.stat()
        write_json(path, content, mode=owner.st_mode & 0o777)
        os.chown(path, owner.st_uid, owner.st_gid)
    for label in (first, second):
        restart_agent(lab, lab.hosts[label], cgroups)
    wait_for_agents(lab, "".join(lab.hosts))
    settle_scope(lab, cgroups, scope)
    return swapped


# ---------------------------------------------------------------------------- runs


def quota_threads(cpus: float) -> int:
    """The threads a stage under ``cpus`` CPUs runs (``host.cpu_quota.usable_cpus`` on this machine's
    cores): what the launcher would give its local stage had it run under that quota itself."""
    from shardpool.host.cpu_quota import usable_cpus

    return usable_cpus(len(os.sched_getaffinity(0)), cpus)


def rebalance_setting(config: dict[str, Any], value: str) -> dict[str, Any]:
    """``config`` with ``shardpool.rebalance: value`` where this shardpool knows the key (as is otherwise)."""
    from shardpool.config.schema import ShardpoolSection

    if "rebalance" in ShardpoolSection.model_fields:
        config["shardpool"]["rebalance"] = value
    return config


def mode_settings(mode: str, num_layers: int, hosts: int) -> dict[str, Any]:
    """The ``shardpool`` block of each way of running (``all_alone``: each host's own run)."""
    if mode in LOCAL_MODES:
        return {"placement": "local", "layers": [num_layers]}
    if mode == "even_split":
        return {"placement": "mesh", "layers": even_counts(num_layers, hosts)}
    if mode == "pooled_pipeline":  # the planner's best pipeline, even where replicas would be faster
        return {"placement": "mesh", "data_parallel": "off"}
    if (
        mode == "pooled_data_parallel"
    ):  # whole-model replicas on shares, even where a pipeline is predicted faster
        return {"placement": "mesh", "data_parallel": "on"}
    return {"placement": "mesh"}


def run_finetune(
    lab: Lab, cgroups: HostCgroups, config_path: Path, log: Path, timeout_s: float, scope: str = "host"
) -> None:
    """``shardpool finetune`` on host a, in a's overhead cgroup (:func:`overhead_cgroup`); in ``stage``
    scope what the launcher starts itself (the fastest-alone run's stage) is moved under a's quota
    as it appears. Raise BenchError with the log's tail on failure."""
    host = lab.hosts[LABELS[0]]
    argv = [sys.executable, "-m", "shardpool", "finetune", str(config_path)]
    with open(log, "w") as sink:
        launcher = start_in_cgroup(
            lab,
            host,
            cgroups,
            argv,
            overhead_cgroup(host.label, scope),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        mover = None if scope == "host" else ChildMover(cgroups, host.label, launcher.pid)
        try:
            if mover is not None:
                mover.start()
            launcher.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as error:
            raise BenchError(
                f"{config_path.stem} took over {timeout_s:.0f} s; log {log}:\n{log_tail(log)}"
            ) from error
        finally:
            if mover is not None:
                mover.stop()
            stop_launcher(launcher)
    if launcher.returncode != 0:
        raise BenchError(f"{config_path.stem} failed (exit {launcher.returncode}):\n{log_tail(log)}")


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


class ChildMover:
    """Moves the processes ``parent`` starts into cgroup ``label`` as they appear (every 20 ms).

    A stage imports torch for about a second before it computes, so the few milliseconds it may
    run outside the quota do not count; its thread count comes from the config
    (``threads_per_stage``), not from the quota it sees at start."""

    def __init__(self, cgroups: HostCgroups, label: str, parent: int, period_s: float = 0.02) -> None:
        import threading

        self.cgroups, self.label, self.parent, self.period_s = cgroups, label, parent, period_s
        self.moved: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="child-mover", daemon=True)

    def start(self) -> None:
        """Start watching."""
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (the processes stay where they were moved)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with contextlib.suppress(OSError):
                for pid in process_tree(self.parent, parent_pids()) - {self.parent} - self.moved:
                    with contextlib.suppress(ProcessLookupError, OSError):
                        self.cgroups.add(self.label, pid)
                        self.moved.add(pid)


class CgroupCpuSampler:
    """CPU seconds per kind of process (:func:`process_kind`) in each host's throttled cgroup over a
    run: ``/proc/<pid>/stat`` utime + stime of the cgroup's processes at :meth:`start`, every
    ``period_s`` while it trains (a stage or profiler exits before the run ends; up to its last
    ``period_s`` of CPU goes uncounted) and at :meth:`stop`; and the growth of the cgroup's
    ``cpu.stat`` (its throttling counters). Tells whether the agent or anything beside the stage
    uses a host's quota."""

    def __init__(self, cgroups: HostCgroups, agents: Mapping[str, int | None], period_s: float = 0.5) -> None:
        import threading

        self.cgroups, self.agents, self.period_s = cgroups, dict(agents), period_s
        self.first: dict[str, dict[int, ProcessCpu]] = {}
        self.last: dict[str, dict[int, ProcessCpu]] = {}
        self.cpu_stat: dict[str, str] = {}
        self.started = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cgroup-cpu", daemon=True)

    def start(self) -> None:
        """Take the first sample and start sampling."""
        self.started = time.monotonic()
        self.cpu_stat = {label: self._cpu_stat(label) for label in self.cgroups.quotas}
        self.first = self._sample()
        self.last = {label: dict(seen) for label, seen in self.first.items()}
        self._thread.start()

    def stop(self) -> dict[str, dict[str, Any]]:
        """Take the last sample; per host, CPU seconds by kind, the wall seconds sampled, the CPU
        seconds its quota allowed over them, and the growth of its ``cpu.stat``."""
        self._stop.set()
        self._thread.join(timeout=10)
        self._merge(self._sample())
        wall = time.monotonic() - self.started
        ticks_per_s = float(os.sysconf("SC_CLK_TCK"))
        result: dict[str, dict[str, Any]] = {}
        for label, quota in self.cgroups.quotas.items():
            used = cpu_seconds_by_kind(self.first.get(label, {}), self.last.get(label, {}), ticks_per_s)
            total = sum(used[kind] for kind in PROCESS_KINDS)
            result[label] = used | {
                "total": round(total, 3),
                "wall_s": round(wall, 1),
                "quota_cpu_s": round(quota * wall, 1),
                "total_over_quota": ratio(total, quota * wall),
                "cpu_stat": cpu_stat_delta(self.cpu_stat.get(label, ""), self._cpu_stat(label)),
                "seen_s": seen_windows(self.last.get(label, {}), self.started),
            }
        return result

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._merge(self._sample())

    def _merge(self, sample: dict[str, dict[int, ProcessCpu]]) -> None:
        for label, seen in sample.items():
            self.last[label] = merged_sample(self.last.get(label, {}), seen)

    def _cpu_stat(self, label: str) -> str:
        try:
            return (self.cgroups.path(label) / "cpu.stat").read_text()
        except OSError:
            return ""

    def _sample(self) -> dict[str, dict[int, ProcessCpu]]:
        sample: dict[str, dict[int, ProcessCpu]] = {}
        now = time.monotonic()
        for label in self.cgroups.quotas:
            seen: dict[int, ProcessCpu] = {}
            for pid in self.cgroups.pids(label):
                try:
                    name, ticks = stat_cpu_ticks(Path(f"/proc/{pid}/stat").read_text())
                    cmdline = (
                        Path(f"/proc/{pid}/cmdline")
                        .read_bytes()
                        .replace(b"\0", b" ")
                        .decode(errors="replace")
                    )
                except (OSError, ValueError, IndexError):
                    continue  # gone meanwhile
                kind = process_kind(pid, cmdline, self.agents.get(label))
                seen[pid] = ProcessCpu(kind, command_label(name, cmdline), ticks, now, now)
            sample[label] = seen
        return sample


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


# ---------------------------------------------------------------------------- main


def benchmark(
    *,
    quick: bool,
    quotas: tuple[float, ...],
    swap: bool,
    keep: Path | None,
    choice: CgroupChoice,
    scope: str = "stage",
    only: Sequence[str] = DEFAULT_MODES,
    repeats: int = 1,
    period_us: int = PERIOD_US,
    warmup_lead: int | None = None,
) -> dict[str, Any]:
    """Build the model, the throttled lab and the mesh; train the three ways (or ``only`` those)
    ``repeats`` times each in ABBA order (:func:`abba_order`), on the same mesh; then, with ``swap``,
    once from swapped profiles; the JSON report. ``warmup_lead`` fixes the 1F1B warm-up lead of
    every mesh run (None: the planner's choice)."""
    size = QUICK if quick else FULL
    chosen = tuple(mode for mode in MODES if mode in only)
    order = abba_order(chosen, repeats) + ([(SWAPPED, 0)] if swap else [])
    labels = LABELS[: len(quotas)]
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="shardpool-bench-hetero-")) if keep is None else keep
    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o755)
    try:
        model_dir, data = build_inputs(work, size)
        hf_config = json.loads((model_dir / "config.json").read_text())
        num_layers = int(hf_config["num_hidden_layers"])
        (work / "lab").mkdir(exist_ok=True)
        runs: dict[str, list[dict[str, Any]]] = {}
        plans: dict[str, list[dict[str, Any]]] = {}
        records: dict[str, list[list[dict[str, Any]]]] = {}
        swapped = 0
        overhead = () if scope == "host" else tuple(overhead_cgroup(label, scope) for label in labels)
        host_quotas = dict(zip(labels, quotas, strict=True))
        with Lab(work / "lab") as lab, HostCgroups(choice, host_quotas, overhead, period_us) as cgroups:
            for octet, label in enumerate(labels, start=1):
                lab.add_host(label, octet)
            mesh_setup_s = form_mesh(lab, labels)
            moved = throttle(lab, cgroups, scope)
            for label in labels:  # so each agent, and what it starts, sees its cgroup's quota
                restart_agent(lab, lab.hosts[label], cgroups)
            wait_for_agents(lab, labels)
            settle_scope(lab, cgroups, scope)
            say(
                f"mesh of {len(labels)} hosts formed in {mesh_setup_s:.1f} s and throttled {dict(cgroups.quotas)}"
            )
            for mode, repeat in order:
                name = run_name(mode, repeat)
                if mode == SWAPPED:
                    swapped = swap_profiles(lab, cgroups, labels[0], labels[-1], scope)
                out = work / f"out-{name}"
                settings = mode_settings(mode, num_layers, len(labels))
                if warmup_lead is not None and settings["placement"] == "mesh":
                    settings["warmup_lead"] = warmup_lead
                config = training_config(model_dir, data, out, size, settings)
                # training_config turns re-balancing off for every benchmark; the pooled runs are
                # the ones that must re-balance, at the default.
                config = rebalance_setting(
                    config, "auto" if mode in ("pooled", "pooled_pipeline", SWAPPED) else "off"
                )
                if mode in LOCAL_MODES and scope == "stage":
                    config["shardpool"]["threads_per_stage"] = quota_threads(quotas[0])
                config_path = write_yaml(work / f"{name}.yaml", config)
                beside_configs = (
                    {
                        label: write_yaml(
                            work / f"{name}-{label}.yaml",
                            beside_config(config, beside_output(work, name, label), quota, scope),
                        )
                        for label, quota in list(host_quotas.items())[1:]
                    }
                    if mode == "all_alone"
                    else {}
                )
                run_started = time.monotonic()
                sampler = CgroupCpuSampler(
                    cgroups, {label: read_pid_of_agent(lab.hosts[label]) for label in labels}
                )
                sampler.start()
                try:
                    with beside_runs(
                        lab, cgroups, beside_configs, work, name, size["run_timeout_s"], scope
                    ) as beside:
                        run_finetune(
                            lab, cgroups, config_path, work / f"{name}.log", size["run_timeout_s"], scope
                        )
                finally:
                    cgroup_cpu_s = sampler.stop()
                plan = json.loads((out / "plan.json").read_text())
                run_records = read_jsonl(out / "metrics.jsonl")
                if mode in LOCAL_MODES:  # a local plan names the machine, not the lab host
                    for stage in plan["stages"]:
                        stage["host"] = labels[0]
                summary = summarize_run(run_records, plan, size["warmup"])
                if beside_configs:
                    summary["beside"] = {
                        label: beside_summary(beside_output(work, name, label)) for label in beside_configs
                    }
                    summary["beside_started_s"] = beside
                if mode not in LOCAL_MODES:
                    summary["after_calibration"] = calibrated_figures(plan, run_records, config_path)
                summary["run_s"] = round(time.monotonic() - run_started, 1)
                summary["cgroup_cpu_s"] = cgroup_cpu_s
                runs.setdefault(mode, []).append(summary)
                plans.setdefault(mode, []).append(plan)
                records.setdefault(mode, []).append(run_records)
                say(f"{name}: {summary['tokens_per_s']} tokens/s, run took {summary['run_s']} s")
        result = report(
            quick=quick,
            size=size,
            quotas=host_quotas,
            choice=choice,
            scope=scope,
            period_us=period_us,
            runs=runs,
            plans=plans,
            records=records,
            order=order,
            swapped=swapped if swap else None,
            moved=moved,
            hf_config=hf_config,
            mesh_setup_s=mesh_setup_s,
            seconds=time.monotonic() - started,
        )
        if warmup_lead is not None:
            result["command"] += f" --warmup-lead {warmup_lead}"
        return result
    finally:
        if keep is None:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


def read_pid_of_agent(host: Host) -> int | None:
    """The pid of ``host``'s agent now (None when it runs none)."""
    from mesh.daemon import read_pid

    return read_pid(agent_pid_file(host))


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
    ``even_over_fastest`` the median of the per-round ratios (:func:`repeats_summary`); the
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
        "config": {
            key: size[key]
            for key in (
                "sequence_len",
                "micro_batch_size",
                "gradient_accumulation_steps",
                "max_steps",
                "lora_r",
            )
        }
        | {"warmup_steps_skipped": size["warmup"]},
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


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, skip where the machine cannot run it, run it, print the JSON report."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and few steps (hosts 1.0,0.5)")
    parser.add_argument(
        "--hosts",
        type=parse_hosts,
        help="CPU quota of each host, fastest first (default 0.6,0.3; 1.0,0.5 with --quick)",
    )
    parser.add_argument(
        "--swap-profiles",
        action="store_true",
        help="then swap the fastest and slowest host's cached profiles and run pooled again from them",
    )
    parser.add_argument(
        "--quota-scope",
        choices=SCOPES,
        default=SCOPES[0],
        help="throttle only the stages and profilers (stage, default) or every process of a host (host)",
    )
    parser.add_argument(
        "--modes",
        type=parse_modes,
        default=DEFAULT_MODES,
        help="the ways to run, comma-separated, among "
        + ",".join(MODES)
        + " (default "
        + ",".join(DEFAULT_MODES)
        + "; all_alone: the fastest alone while every other host trains alone beside it)",
    )
    parser.add_argument(
        "--repeats",
        type=parse_repeats,
        default=1,
        help="run each way this many times in ABBA order (fastest, pooled, pooled, fastest, ...) on the"
        " same mesh; the ratios are the median of each round's (default 1)",
    )
    parser.add_argument(
        "--period-ms",
        type=parse_period_ms,
        default=PERIOD_US,
        help=f"the CFS period of every quota, in ms (default {PERIOD_US // 1000}; the kernel's own is 100)",
    )
    parser.add_argument(
        "--warmup-lead",
        type=int,
        choices=range(1, 9),
        metavar="1..8",
        help="fix the 1F1B warm-up lead of every mesh run (default: the planner's choice)",
    )
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (model, outputs, logs)")
    args = parser.parse_args(argv)
    reason = skip_reason()
    if reason is not None:
        print(f"bench_hetero: skipped: {reason}", file=sys.stderr)
        print(json.dumps({"skipped": reason}))
        return 0
    choice = detect_cgroup()
    assert choice is not None  # skip_reason checked it
    quotas = args.hosts or (QUICK if args.quick else FULL)["hosts"]
    if args.swap_profiles and "pooled" not in args.modes:
        parser.error("--swap-profiles compares with the pooled run: keep pooled in --modes")
    return run_and_report(
        "bench_hetero",
        lambda: benchmark(
            quick=args.quick,
            quotas=quotas,
            swap=args.swap_profiles,
            keep=args.keep,
            choice=choice,
            scope=args.quota_scope,
            only=args.modes,
            repeats=args.repeats,
            period_us=args.period_ms,
            warmup_lead=args.warmup_lead,
        ),
        errors=(BenchError, LabError),
        cleaned="the lab and the cgroups were removed",
    )


if __name__ == "__main__":
    sys.exit(main())
