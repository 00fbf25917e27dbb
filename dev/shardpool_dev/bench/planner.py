"""The planner against hand-made splits, its planning time at scale, and the profiler's time on this CPU."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.fleet import heterogeneous_fleet, load_fleet
from shardpool.plan.planner import evaluate_split, plan_pipeline
from shardpool.plan.search_context import refusals
from shardpool.plan.splits import even_split, proportional_split
from shardpool_dev.bench.workload import REPO_ROOT as ROOT

GIB = 2**30


WORKLOADS = {
    "llama-2-70b": Workload(
        micro_batch_size=1,
        sequence_len=2048,
        gradient_accumulation_steps=16,
        lora_r=16,
        gradient_checkpointing=True,
        compute_bytes=2,
        wire_bytes=2,
        data_parallel="auto",
        warmup_lead=None,
        precision="bf16",
    ),
    "llama-3-8b": Workload(
        micro_batch_size=2,
        sequence_len=2048,
        gradient_accumulation_steps=16,
        lora_r=16,
        gradient_checkpointing=True,
        compute_bytes=2,
        wire_bytes=2,
        data_parallel="auto",
        warmup_lead=None,
        precision="bf16",
    ),
}


def summarize(plan) -> dict:
    """The numbers compared in docs/performance.md (Planner section)."""
    return {
        "predicted_step_s": round(plan.predicted_step_s, 3),
        "bottleneck_ms": round(plan.bottleneck_ms, 1),
        "fits": plan.fits,
        "stages": [f"{s.slot}[{s.start},{s.stop})" for s in plan.stages],
        "warmup_lead": plan.warmup_lead,
        "shares": list(plan.shares) or None,
    }


def compare(fleet_path: Path, model: str) -> dict:
    """Planner vs even vs memory-proportional on one fleet and model."""
    fleet = load_fleet(fleet_path)
    shape = ModelShape.from_config_dir(ROOT / f"configs/models/{model}.json")
    workload = WORKLOADS[model]
    refused = refusals(fleet, workload)  # as a user would: a card that cannot run the workload gets no layers
    usable = [device for device in fleet.devices if device.name not in refused]
    names = [device.name for device in usable]
    row: dict = {"fleet": fleet_path.name, "model": model, "baselines_leave_out": sorted(refused)}
    start = time.perf_counter()
    try:
        plan = plan_pipeline(shape, workload, fleet)
        row["planner"] = summarize(plan) | {"left_out": plan.left_out, "search": plan.search}
    except ShardpoolError as error:
        row["planner"] = {"error": str(error)}
        plan = None
    row["planning_s"] = round(time.perf_counter() - start, 4)
    try:  # the same search with the warm-up lead fixed at 1 (the textbook 1F1B)
        row["planner_lead_1"] = summarize(plan_pipeline(shape, replace(workload, warmup_lead=1), fleet))
    except ShardpoolError as error:
        row["planner_lead_1"] = {"error": str(error)}
    baselines = {
        "even": even_split(shape.num_layers, len(names)),
        "memory_proportional": proportional_split(
            shape.num_layers, [device.memory_bytes for device in usable]
        ),
    }
    for label, split in baselines.items():
        row[label] = summarize(evaluate_split(shape, workload, fleet, devices=names, layers=split))
        if plan is not None:
            row[label]["planner_speedup"] = round(row[label]["predicted_step_s"] / plan.predicted_step_s, 2)
    return row


def scale() -> dict:
    """80 layers (Llama-2-70B) over 64 heterogeneous devices on 8 hosts."""
    fleet = heterogeneous_fleet(num_devices=64, num_hosts=8)
    shape = ModelShape.from_config_dir(ROOT / "configs/models/llama-2-70b.json")
    start = time.perf_counter()
    plan = plan_pipeline(shape, WORKLOADS["llama-2-70b"], fleet)
    return {
        "layers": 80,
        "devices": 64,
        "planning_s": round(time.perf_counter() - start, 3),
        "stages_used": len(plan.stages),
        "warmup_lead": plan.warmup_lead,
        "search": plan.search,
        "predicted_step_s": round(plan.predicted_step_s, 3),
    }


def profile_tiny() -> dict:
    """Wall time of profiling one tiny-llama layer on the CPU: imports, first (uncached) call, cached call."""
    with tempfile.TemporaryDirectory() as cache:
        os.environ["SHARDPOOL_CACHE"] = cache
        start = time.perf_counter()
        import bitsandbytes  # noqa: F401
        import peft  # noqa: F401
        import transformers  # noqa: F401

        from shardpool.plan.profiler import profile_layer

        imports = time.perf_counter() - start
        shape = ModelShape.from_config_dir(ROOT / "configs/models/tiny-llama.json")
        workload = Workload(micro_batch_size=2, sequence_len=128, lora_r=8)
        start = time.perf_counter()
        profile = profile_layer(shape, workload, device="cpu")
        cold = time.perf_counter() - start
        start = time.perf_counter()
        profile_layer(shape, workload, device="cpu")
        cached = time.perf_counter() - start
    return {
        "model": "tiny-llama (h=256, 8 layers)",
        "micro_batch_size": 2,
        "sequence_len": 128,
        "import_s": round(imports, 2),
        "profile_wall_s_first_call": round(cold, 2),
        "profile_wall_s_cached": round(cached, 4),
        "ms_per_layer": round(profile.seconds_per_layer * 1e3, 2),
        "activation_mib_per_layer": round(profile.activation_bytes / 2**20, 2),
    }
