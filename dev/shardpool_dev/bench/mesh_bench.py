"""Pipelined QLoRA over a WireGuard mesh of namespaced hosts against the same split over loopback."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardpool.plan.device_facts import cpu_model_name
from shardpool_dev.bench.mesh import (
    MB,
    MESH_ADDRESSES,
    MIB,
    ONE_GBIT_BYTES_PER_S,
    ROOT,
    BenchError,
    CpuMeter,
    form_mesh,
    ping_rtt,
    read_metrics,
    repeated_tcp,
    run_on_loopback,
    run_on_mesh,
    wg_public_keys,
    write_yaml,
)
from shardpool_dev.bench.pipeline import boundary_bytes_per_step, ring_allreduce_bytes_per_worker
from shardpool_dev.bench.workload import (
    count_adapter_parameters,
    count_parameters,
    model_facts,
    run_settings,
    tiny_llama_and_rows,
    training_config,
)
from shardpool_dev.lab import Lab

FP32_BYTES = 4


WARMUP_STEPS = 2


WORKERS = 3


FULL: dict[str, Any] = {
    "model": {
        "num_layers": 6,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_heads": 4,
        "num_kv_heads": 2,
        "vocab_size": 1024,
    },
    "sequence_len": 128,
    "micro_batch_size": 4,
    "gradient_accumulation_steps": 4,
    "max_steps": 12,
    "lora_r": 8,
    "tcp_bytes": 128 * MIB,
    "tcp_repeats": 3,
    "pings": 20,
}


QUICK: dict[str, Any] = {
    "model": {
        "num_layers": 6,
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_heads": 4,
        "num_kv_heads": 2,
        "vocab_size": 1024,
    },
    "sequence_len": 64,
    "micro_batch_size": 2,
    "gradient_accumulation_steps": 4,
    "max_steps": 5,
    "lora_r": 4,
    "tcp_bytes": 32 * MIB,
    "tcp_repeats": 1,
    "pings": 10,
}


def summarize_steps(records: Sequence[dict[str, Any]], warmup: int = WARMUP_STEPS) -> dict[str, Any]:
    """Medians over the steps after ``warmup`` of one run's ``metrics.jsonl`` records."""
    records = sorted(records, key=lambda record: record["step"])
    kept = records[warmup:] or records
    stages = len(kept[0]["stage_compute_s"])
    step_s = [float(record["step_seconds"]) for record in kept]
    compute = [statistics.median(float(r["stage_compute_s"][i]) for r in kept) for i in range(stages)]
    return {
        "steps_measured": len(kept),
        "step_s": round(statistics.median(step_s), 4),
        "step_s_min": round(min(step_s), 4),
        "step_s_max": round(max(step_s), 4),
        "tokens_per_s": round(statistics.median(float(record["tokens_per_s"]) for record in kept), 1),
        "bytes_per_step": int(statistics.median(int(record["bytes_sent"]) for record in kept)),
        "stage_compute_s": [round(value, 4) for value in compute],
        "stage_wait_s": [
            round(statistics.median(float(r["stage_wait_s"][i]) for r in kept), 4) for i in range(stages)
        ],
        "bottleneck_compute_s": round(max(compute), 4),
        "final_loss": round(float(records[-1]["loss"]), 6),
    }


def hop_bytes(
    before: dict[str, dict[str, tuple[int, int]]],
    after: dict[str, dict[str, tuple[int, int]]],
    keys: dict[str, str],
) -> dict[str, int]:
    """Bytes that crossed each hop ``"x-y"`` (both directions) between two counter snapshots.

    ``before``/``after`` map a host label to its ``wg show transfer`` counters; ``keys`` maps a
    host label to its public key. Each direction is counted once, from the sender's tx counter.
    """
    labels = sorted(keys)
    crossed = {}
    for index, first in enumerate(labels):
        for second in labels[index + 1 :]:
            total = 0
            for sender, receiver in ((first, second), (second, first)):
                key = keys[receiver]
                total += after[sender].get(key, (0, 0))[1] - before[sender].get(key, (0, 0))[1]
            crossed[f"{first}-{second}"] = total
    return crossed


def stage_hops(plan: dict[str, Any]) -> list[str]:
    """The hops ``"x-y"`` (labels sorted) between the hosts of neighbouring stages in ``plan.json``."""
    hosts = [stage["host"] for stage in plan["stages"]]
    return ["-".join(sorted(pair)) for pair in zip(hosts, hosts[1:], strict=False)]


def layer_counts(plan: dict[str, Any]) -> list[int]:
    """Layers per stage of a ``plan.json``, as ``shardpool: {layers: [...]}`` takes them."""
    return [int(stop) - int(start) for start, stop in (stage["layers"] for stage in plan["stages"])]


def wire_bytes_per_step(
    snapshots: dict[int, dict[str, dict[str, tuple[int, int]]]], keys: dict[str, str], warmup: int
) -> dict[str, Any]:
    """Bytes per step on each hop from the counter snapshots after step ``warmup`` and after the last step."""
    last = max(snapshots)
    first = min((key for key in snapshots if key >= warmup), default=last)
    if last <= first:
        raise BenchError(f"too few counter snapshots to measure per-step wire bytes: {sorted(snapshots)}")
    crossed = hop_bytes(snapshots[first], snapshots[last], keys)
    return {
        "from_step": first,
        "to_step": last,
        "per_hop": {hop: int(total / (last - first)) for hop, total in crossed.items()},
    }


def versions() -> dict[str, str]:
    """Versions of everything that shapes the numbers."""
    import bitsandbytes
    import peft
    import torch
    import transformers

    wireguard_go = subprocess.run(
        ["wireguard-go", "--version"], capture_output=True, text=True
    ).stdout.split()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "bitsandbytes": bitsandbytes.__version__,
        "wireguard_go": wireguard_go[1] if len(wireguard_go) > 1 else "unknown",
        "kernel": platform.release(),
    }


def stage_threads() -> int:
    """Torch threads per stage: this machine's CPUs shared by the three stages (at least 1 each)."""
    return max(1, len(os.sched_getaffinity(0)) // WORKERS)


def build_inputs(work: Path, size: dict[str, Any]) -> tuple[Path, Path]:
    """The random tiny Llama and a dataset with exactly enough rows for ``max_steps`` steps."""
    rows = size["max_steps"] * size["micro_batch_size"] * size["gradient_accumulation_steps"]
    return tiny_llama_and_rows(work, size, rows=rows)


def measure_network(lab: Lab, size: dict[str, Any]) -> dict[str, Any]:
    """Raw TCP a -> b over the mesh and over the underlay, and ping RTTs."""
    a = lab.hosts["a"]
    return {
        "wireguard_tcp": repeated_tcp(lab, MESH_ADDRESSES["b"], size),
        "underlay_tcp": repeated_tcp(lab, lab.hosts["b"].underlay, size),
        "mesh_ping_ms": ping_rtt(lab, a, MESH_ADDRESSES["b"], size["pings"]),
        "underlay_ping_ms": ping_rtt(lab, a, lab.hosts["b"].underlay, size["pings"]),
    }


def benchmark(*, quick: bool, keep: Path | None, max_wait_idle_s: float) -> dict[str, Any]:
    """Build the model, the lab and the mesh; measure the link; run mesh and loopback; return the report."""
    size = QUICK if quick else FULL
    threads = stage_threads()
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="shardpool-bench-mesh-")) if keep is None else keep
    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o755)
    try:
        model_dir, data = build_inputs(work, size)
        hf_config = json.loads((model_dir / "config.json").read_text())
        parameters = count_parameters(model_dir)
        mesh_out, loop_out = work / "out-mesh", work / "out-loopback"
        mesh_config = write_yaml(
            work / "mesh.yaml",
            training_config(
                model_dir,
                data,
                mesh_out,
                size,
                {"placement": "mesh", "stages": WORKERS, "threads_per_stage": threads, "rebalance": "off"},
            ),
        )
        load: dict[str, dict[str, Any]] = {}
        (work / "lab").mkdir(exist_ok=True)
        with Lab(work / "lab") as lab:
            for octet, label in enumerate("abc", start=1):
                lab.add_host(label, octet)
            mesh_setup_s = form_mesh(lab)
            meter = CpuMeter(lab)
            network: dict[str, Any] = {"idle_wait_s": meter.wait_for_idle(max_wait_idle_s)}
            with meter.measure(load.setdefault("network", {})):
                network.update(measure_network(lab, size))
            keys = wg_public_keys(lab)
            idle_wait_mesh = meter.wait_for_idle(max_wait_idle_s)
            with meter.measure(load.setdefault("mesh_run", {})):
                snapshots = run_on_mesh(lab, mesh_config, mesh_out, work / "mesh-run.log", timeout_s=1800)
        plan = json.loads((mesh_out / "plan.json").read_text())
        loop_config = write_yaml(
            work / "loopback.yaml",
            training_config(
                model_dir,
                data,
                loop_out,
                size,
                {
                    "placement": "local",
                    "layers": layer_counts(plan),
                    "threads_per_stage": threads,
                    "rebalance": "off",
                },
            ),
        )
        env = dict(os.environ, SHARDPOOL_CACHE=str(work / "cache"), COLUMNS="200", PYTHONPATH=str(ROOT))
        meter = CpuMeter()
        idle_wait_loop = meter.wait_for_idle(max_wait_idle_s)
        with meter.measure(load.setdefault("loopback_run", {})):
            run_on_loopback(loop_config, work / "loopback-run.log", env, timeout_s=1800)
        return report(
            quick=quick,
            size=size,
            hf_config=hf_config,
            parameters=parameters,
            lora_parameters=count_adapter_parameters(mesh_out),
            network=network,
            mesh_out=mesh_out,
            loop_out=loop_out,
            plan=plan,
            wire=wire_bytes_per_step(snapshots, keys, WARMUP_STEPS),
            load=load,
            idle_waits={
                "network": network.pop("idle_wait_s"),
                "mesh_run": idle_wait_mesh,
                "loopback_run": idle_wait_loop,
            },
            mesh_setup_s=mesh_setup_s,
            seconds=time.monotonic() - started,
        )
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)


def report(
    *,
    quick: bool,
    size: dict[str, Any],
    hf_config: dict[str, Any],
    parameters: int,
    lora_parameters: int,
    network: dict[str, Any],
    mesh_out: Path,
    loop_out: Path,
    plan: dict[str, Any],
    wire: dict[str, Any],
    load: dict[str, dict[str, Any]],
    idle_waits: dict[str, float],
    mesh_setup_s: float,
    seconds: float,
) -> dict[str, Any]:
    """Assemble the JSON report from the measurements."""
    mesh = summarize_steps(read_metrics(mesh_out))
    loopback = summarize_steps(read_metrics(loop_out))
    mesh_config = json.loads((mesh_out / ".shardpool" / "job.json").read_text())["config"]
    hops = stage_hops(plan)
    microbatches = size["gradient_accumulation_steps"]
    expected = boundary_bytes_per_step(
        stages=WORKERS,
        microbatches=microbatches,
        micro_batch_size=size["micro_batch_size"],
        sequence_len=size["sequence_len"],
        hidden_size=hf_config["hidden_size"],
        wire_bytes=FP32_BYTES,
    )
    ddp_full = ring_allreduce_bytes_per_worker(parameters * FP32_BYTES, WORKERS)
    ddp_lora = ring_allreduce_bytes_per_worker(lora_parameters * FP32_BYTES, WORKERS)
    per_hop = wire["per_hop"]
    busiest = max(per_hop[hop] for hop in hops)
    wireguard_MBps = network["wireguard_tcp"]["MBps"]
    needed_MBps = mesh["bytes_per_step"] / mesh["step_s"] / MB
    mesh.update(
        {
            "bytes_per_step_expected": expected,
            "bytes_per_boundary_per_step": mesh["bytes_per_step"] // (WORKERS - 1),
            "stage_hops": hops,
            "wireguard_bytes_per_step_per_hop": per_hop,
            "wireguard_counters_steps": [wire["from_step"], wire["to_step"]],
            "wireguard_bytes_vs_payload_busiest_hop": round(
                busiest / (mesh["bytes_per_step"] / (WORKERS - 1)), 3
            ),
            "run_seconds": json.loads((mesh_out / "run_summary.json").read_text())["seconds"],
        }
    )
    loopback["run_seconds"] = json.loads((loop_out / "run_summary.json").read_text())["seconds"]
    return {
        "benchmark": "mesh",
        "quick": quick,
        "command": "sudo python scripts/bench_mesh.py" + (" --quick" if quick else ""),
        "wireguard_tcp_MBps": wireguard_MBps,
        "underlay_tcp_MBps": network["underlay_tcp"]["MBps"],
        "mesh_ping_ms": network["mesh_ping_ms"]["avg"],
        "underlay_ping_ms": network["underlay_ping_ms"]["avg"],
        "mesh": mesh,
        "loopback": loopback,
        "ddp_workers": WORKERS,
        "ddp_full_grad_bytes_per_step": int(ddp_full),
        "ddp_lora_bytes_per_step": int(ddp_lora),
        "ddp_bytes_note": "per worker (= per ring hop, one direction) per step: 2 (N-1)/N x params x 4 bytes",
        "mesh_bytes_per_worker_per_step": mesh["bytes_per_step"] // WORKERS,
        "ddp_full_vs_mesh_busiest_hop": round(ddp_full / busiest, 2),
        "slowdown_mesh_vs_loopback": round(mesh["step_s"] / loopback["step_s"], 3),
        "slowdown_bottleneck_compute_mesh_vs_loopback": round(
            mesh["bottleneck_compute_s"] / loopback["bottleneck_compute_s"], 3
        ),
        "mesh_bytes_per_step_MBps_needed": round(needed_MBps, 3),
        "link_utilisation": round(needed_MBps / wireguard_MBps, 4),
        "busiest_hop_MBps_needed": round(busiest / mesh["step_s"] / MB, 3),
        "busiest_hop_utilisation": round(busiest / mesh["step_s"] / MB / wireguard_MBps, 4),
        "seconds_per_step_at_1_gbit": {
            "mesh_busiest_hop": round(busiest / ONE_GBIT_BYTES_PER_S, 4),
            "ddp_full_grad": round(ddp_full / ONE_GBIT_BYTES_PER_S, 4),
            "ddp_lora": round(ddp_lora / ONE_GBIT_BYTES_PER_S, 4),
        },
        "network": network,
        "plan": [{"host": s["host"], "layers": s["layers"], "device": s["device"]} for s in plan["stages"]],
        "threads_per_stage": mesh_config["shardpool"]["threads_per_stage"],
        "threads_note": (
            "set explicitly in both runs: the three lab hosts share this machine's cores, and by default a "
            "mesh stage alone on its host would take all of them (oversubscribing the cores 3x here)"
        ),
        "model": model_facts(hf_config, parameters=parameters, lora_parameters=lora_parameters),
        "config": run_settings(size)
        | {
            "val_set_size": 0,
            "wire_dtype": "fp32",
            "schedule": "1f1b",
            "warmup_steps_skipped": WARMUP_STEPS,
            "tcp_bytes": size["tcp_bytes"],
            "tcp_repeats": size["tcp_repeats"],
        },
        "machine": {
            "cpu": cpu_model_name(),
            "logical_cpus": os.cpu_count(),
            "load": load,
            "idle_wait_s": idle_waits,
        },
        "versions": versions(),
        "mesh_setup_s": round(mesh_setup_s, 1),
        "seconds": round(seconds, 1),
    }
