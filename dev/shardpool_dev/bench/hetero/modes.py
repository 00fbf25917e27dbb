"""The ways the pool benchmark runs (modes, hosts, quotas, repeats) and the run settings each way takes."""

from __future__ import annotations

import argparse
import os
from typing import Any

from shardpool_dev.bench.cgroups import PERIOD_MS_RANGE

LABELS = "abc"


SCOPES = ("stage", "host")
"""What a host's CPU quota throttles (``--quota-scope``). ``stage`` (the default): only the stage
processes and the profilers, the work a real fleet runs on its accelerator, which the quota stands
in for; the host's agent (their parent, so that they inherit the quota and the thread count from
their first instruction) stays with them. The launcher, WireGuard (``wireguard-go`` encrypts every
activation in user space) and the sync daemon run on the host's CPU, unthrottled, as they would
beside a GPU. ``host``: every process of the host, as on a smaller machine (last session's figures)."""


MODES = ("fastest_alone", "all_alone", "even_split", "pooled", "pooled_pipeline", "pooled_data_parallel")
"""Every way the bench can run (``--modes``). ``all_alone``: the fastest host's run alone again, with
every other host training the same model alone beside it (:func:`shardpool_dev.bench.hetero.beside.beside_runs`), so host a shares
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


def run_name(mode: str, repeat: int) -> str:
    """The name of a run's files (``<name>.yaml``, ``<name>.log``, ``out-<name>``): the way's own
    name for its first run (as without ``--repeats``), ``<way>-<n>`` for its n-th (``pooled-2``)."""
    return mode if repeat == 0 else f"{mode}-{repeat + 1}"


def even_counts(num_layers: int, stages: int) -> list[int]:
    """Layer counts as even as possible, the larger ones first (16 over 3: [6, 5, 5])."""
    base, extra = divmod(num_layers, stages)
    return [base + (1 if index < extra else 0) for index in range(stages)]


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
