"""Cost model pieces against bitsandbytes' real storage and a measured layer."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from shardpool.config import load_config, parse_config
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.fleet import Device
from shardpool.plan.memory_model import (
    activation_bytes_per_layer,
    held_boundary_bytes,
    in_flight_microbatches,
    lora_params_per_layer,
    nf4_bytes,
)
from shardpool.plan.stage_costs import stage_costs
from shardpool.plan.time_model import (
    OPTIMIZER_SECONDS_PER_PARAM,
    bubble_fraction,
    layer_flops,
    layer_forward_flops,
    modeled_times,
    step_seconds,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = ModelShape.from_config_dir(ROOT / "configs/models/tiny-llama.json")


def test_nf4_bytes_matches_bitsandbytes_storage() -> None:
    import bitsandbytes as bnb
    import torch

    weight = torch.randn(688, 256)
    param = bnb.nn.Params4bit(
        weight, requires_grad=False, quant_type="nf4", blocksize=64, compress_statistics=True
    )
    param = param.to("cpu")
    state = param.quant_state
    stored = param.numel() * param.element_size() + state.absmax.numel() * state.absmax.element_size()
    stored += sum(
        t.numel() * t.element_size() for t in (state.state2.absmax, state.state2.code, state.offset)
    )
    assert nf4_bytes(weight.numel()) == pytest.approx(stored, rel=0.01)


def test_in_flight_and_pipeline_formulas() -> None:
    w = Workload(gradient_accumulation_steps=8)
    # 1F1B: stage i warms up with S - i forwards (the textbook S - 1 - i plus one) and runs one more
    # before its first backward, so it holds S - i + 1; the last stage runs F, B, F, B: 1.
    assert [in_flight_microbatches(w, index=i, num_stages=4) for i in range(4)] == [5, 4, 3, 1]
    # Never more than M: with M = 2 stage 0 runs both forwards, then both backwards.
    assert in_flight_microbatches(replace(w, gradient_accumulation_steps=2), index=0, num_stages=4) == 2
    assert in_flight_microbatches(replace(w, schedule="gpipe"), index=3, num_stages=4) == 8
    assert step_seconds(2.0, microbatches=8, num_stages=4) == pytest.approx(22.0)
    assert bubble_fraction(microbatches=8, num_stages=4) == pytest.approx(3 / 11)


@pytest.mark.slow
@pytest.mark.parametrize("compute_bytes", [4, 2])
def test_activation_estimate_close_to_measured(compute_bytes: int) -> None:
    from shardpool.plan.profiler import profile_layer

    w = Workload(micro_batch_size=2, sequence_len=64, lora_r=8, compute_bytes=compute_bytes)
    measured = profile_layer(TINY, w, use_cache=False, repeats=1).activation_bytes
    assert activation_bytes_per_layer(TINY, w) == pytest.approx(measured, rel=0.15)


def test_stage_memory_parts_and_checkpointing() -> None:
    w = Workload(micro_batch_size=1, sequence_len=128, gradient_accumulation_steps=4)
    times = modeled_times(TINY, w, layer_s=0.01, kind="cuda")
    common = dict(times=times, capacity_bytes=2**30, kind="cuda", num_stages=3)
    first = stage_costs(TINY, w, index=0, **common)
    middle = stage_costs(TINY, w, index=1, **common)
    last = stage_costs(TINY, w, index=2, **common)
    assert "embeddings" in first.fixed_breakdown and "lm_head" not in first.fixed_breakdown
    assert "lm_head" in last.fixed_breakdown and last.fixed_s > middle.fixed_s
    # 1F1B at S = 3, M = 4: the first stage holds S - 0 + 1 = 4 micro-batches, the middle 3.
    act = first.per_layer_breakdown["activations"]
    assert (first.in_flight, middle.in_flight, last.in_flight) == (4, 3, 1)
    assert act == pytest.approx(4 / 3 * middle.per_layer_breakdown["activations"])
    checkpointed = stage_costs(TINY, replace(w, gradient_checkpointing=True), index=0, **common)
    assert checkpointed.per_layer_breakdown["activations"] < act / 5
    assert sum(first.breakdown(3).values()) == pytest.approx(first.memory(3), abs=8)
    assert first.memory(first.max_layers()) <= 2**30 < first.memory(first.max_layers() + 1)


def test_a_stage_holds_its_outputs_in_flight_and_a_cpu_stage_the_gradients_not_yet_proven_received() -> None:
    workload = Workload(
        micro_batch_size=2, sequence_len=64, gradient_accumulation_steps=16, compute_bytes=2, wire_bytes=2
    )
    per_tensor = 2 * 64 * TINY.hidden_size * 2
    middle = held_boundary_bytes(TINY, workload, kind="cuda", index=1, num_stages=3, in_flight=3)
    assert middle == {"stage_outputs": 3 * per_tensor}
    assert held_boundary_bytes(TINY, workload, kind="cuda", index=2, num_stages=3, in_flight=1) == {}
    # Under 1F1B gloo holds a gradient sent back until an activation proves it arrived: 4 at most
    # here (stage 0's warm-up is 3 forwards), not all 16 until the step's end as under GPipe.
    cpu = held_boundary_bytes(TINY, workload, kind="cpu", index=1, num_stages=3, in_flight=3)
    assert cpu == {"stage_outputs": 3 * per_tensor, "sent_gradients": 4 * per_tensor}
    gpipe = held_boundary_bytes(
        TINY, replace(workload, schedule="gpipe"), kind="cpu", index=1, num_stages=3, in_flight=16
    )
    assert gpipe == {"stage_outputs": 16 * per_tensor, "sent_gradients": 16 * per_tensor}
    # An fp32 wire copies each bf16 output; the first stage sends no gradient.
    wide = held_boundary_bytes(
        TINY, replace(workload, wire_bytes=4), kind="cpu", index=0, num_stages=3, in_flight=3
    )
    assert wide == {"stage_outputs": 3 * per_tensor * 3}


def test_device_times_measured_or_modeled() -> None:
    w = Workload(micro_batch_size=1, sequence_len=128, gradient_accumulation_steps=4, lora_r=8)
    modeled = modeled_times(TINY, w, layer_s=0.3, kind="cpu")
    assert modeled.layer_s == pytest.approx(0.3)
    assert modeled.layer_forward_s == pytest.approx(0.3 * layer_forward_flops(TINY, w) / layer_flops(TINY, w))
    # Frozen NF4 base: backward is about one forward of the Linear layers plus LoRA and attention.
    assert 0.9 < modeled.layer_backward_s / modeled.layer_forward_s < 1.6
    assert modeled.head_forward_s == modeled.head_backward_s > 0 and modeled.embed_s == 0.0
    assert modeled.optimizer_per_layer_s == pytest.approx(
        OPTIMIZER_SECONDS_PER_PARAM["cpu"] * lora_params_per_layer(TINY, w)
    )
    measured = Device(
        name="cpu", memory_bytes=2**30, kind="cpu", seconds_per_layer=0.3, forward_seconds_per_layer=0.1,
        embed_seconds=0.001, head_forward_seconds=0.02, head_backward_seconds=0.03,
        optimizer_seconds_per_layer=0.004,
    ).times(TINY, w)  # fmt: skip
    assert (measured.layer_forward_s, measured.layer_backward_s) == pytest.approx((0.1, 0.2))
    assert (measured.embed_s, measured.head_forward_s, measured.head_backward_s) == (0.001, 0.02, 0.03)
    assert measured.optimizer_per_layer_s == 0.004
    first = stage_costs(TINY, w, times=measured, capacity_bytes=2**30, kind="cpu", index=0, num_stages=2)
    last = stage_costs(TINY, w, times=measured, capacity_bytes=2**30, kind="cpu", index=1, num_stages=2)
    assert (first.forward(3), first.backward(3)) == pytest.approx((0.301, 0.6))
    assert (last.forward(3), last.backward(3)) == pytest.approx((0.32, 0.63))
    assert first.after(3) == pytest.approx(0.012)
    # Replicas all-reduce each stage's LoRA gradients (fp32) in a ring over their link.
    replicated = stage_costs(
        TINY, replace(w, replicas=3), times=measured, capacity_bytes=2**30, kind="cpu", index=0,
        num_stages=2, replica_link=(1e9, 1e-4),
    )  # fmt: skip
    ring = 2 * 2 / 3 * 3 * lora_params_per_layer(TINY, w) * 4 / 1e9 + 4 * 1e-4
    assert replicated.after(3) == pytest.approx(0.012 + ring)


def test_flops_grow_with_tokens_and_recompute() -> None:
    w = Workload(micro_batch_size=1, sequence_len=128)
    assert layer_flops(TINY, replace(w, micro_batch_size=2)) == pytest.approx(2 * layer_flops(TINY, w))
    assert layer_flops(TINY, replace(w, gradient_checkpointing=True)) > 1.3 * layer_flops(TINY, w)


def test_workload_from_config() -> None:
    config = load_config(ROOT / "configs/quickstart.yaml")
    w = Workload.from_config(config)
    assert (w.micro_batch_size, w.sequence_len, w.gradient_accumulation_steps) == (
        config.micro_batch_size,
        config.sequence_len,
        config.gradient_accumulation_steps,
    )
    assert w.lora_r == config.lora_r and w.stages == config.shardpool.stages
    assert w.replicas == config.shardpool.replicas
    assert w.compute_bytes == (4 if config.compute_dtype_name == "float32" else 2)
    assert w.schedule == config.shardpool.schedule
    raw = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    raw.update(bf16=True, lora_target_linear=False, lora_target_modules=["q_proj"])
    raw["shardpool"] = {**raw.get("shardpool", {}), "wire_dtype": "fp32"}
    other = Workload.from_config(parse_config(raw))
    assert (other.compute_bytes, other.wire_bytes, other.lora_targets) == (2, 4, ("q_proj",))
    assert w.layers is None
    raw["shardpool"] = {"placement": "mesh", "layers": [1, 1]}  # on the mesh too: the planner keeps the split
    pinned = Workload.from_config(parse_config(raw))
    assert pinned.layers == (1, 1) and "layers" not in pinned.profile_request()


def _profile_and_run(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, float]]:
    """Profile afresh, train 12 steps on two 1-thread CPU stages, and pair each stage's plan with the run."""
    import statistics

    from rich.console import Console

    from shardpool.config import parse_config
    from shardpool.finetune import finetune
    from shardpool.model.tinymodel import make_tiny_llama
    from tests.helpers.training import base_config, completion_rows, read_metrics, write_jsonl

    monkeypatch.setenv("SHARDPOOL_CACHE", str(workdir / "cache"))  # profile now, under this run's load
    model = make_tiny_llama(
        workdir / "model", num_layers=6, hidden_size=256, intermediate_size=768, num_heads=4, seed=4
    )
    data = write_jsonl(workdir / "data.jsonl", completion_rows(96))
    config = base_config(
        model, data, workdir / "out", max_steps=12, val_set_size=0, sequence_len=64, micro_batch_size=4,
        gradient_accumulation_steps=4, shardpool={"stages": 2, "devices": ["cpu", "cpu"], "threads_per_stage": 1},
    )  # fmt: skip
    output = finetune(parse_config(config), console=Console(quiet=True))
    plan = json.loads((output / "plan.json").read_text())
    summary = json.loads((output / "run_summary.json").read_text())
    metrics = read_metrics(output)[2:]  # the first steps warm up allocators and caches
    return [
        {
            "stage": index,
            "measured_ms": statistics.median(
                record["stage_compute_s"][index] / 4 * 1000 for record in metrics
            ),
            "predicted_ms": stage["compute_ms"],
            "measured_peak_bytes": summary["ranks"][index]["peak_rss_bytes"],
            "predicted_bytes": stage["memory_bytes"],
            # How the prediction was made, for a failure to say which part missed.
            "layer_ms_alone": stage["measured"]["seconds_median"] * 1000,
            "co_run": stage["measured"]["co_run"],
        }
        for index, stage in enumerate(plan["stages"])
    ]


#: How far a stage's measured compute time may be from the plan's on this noisy host.
TIME_TOLERANCE = 0.4


def _within(measured: float, predicted: float, tolerance: float = 0.25) -> bool:
    return abs(measured - predicted) <= tolerance * measured


@pytest.mark.slow
@pytest.mark.timing
def test_predictions_match_a_real_local_pipeline_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's per-stage peak memory is within 25% of a real CPU run, its compute time within 40%.

    Timing takes one fresh re-measurement (profile and run again) when the first is off: this
    shared 2-core host drifts by up to a third from one minute to the next (a plain matmul loop
    swings 52-85 it/s), and how much the two stages slow each other moves too (here the stages ran
    1.0 to 1.36 times their profile taken alone within an hour), so 25% failed about one CI run in
    three in either direction (77 ms measured against 56 predicted; 59 against 76). A model that
    is really off (a stage's layers or threads miscounted, the backward left out: a factor of 2 or
    more) fails both. Each row printed names the profile's layer time and the measured co-run
    slowdown, so a failure says which part of the prediction missed.
    """
    attempts = [_profile_and_run(tmp_path / "first", monkeypatch)]
    if not all(_within(row["measured_ms"], row["predicted_ms"], TIME_TOLERANCE) for row in attempts[0]):
        attempts.append(_profile_and_run(tmp_path / "again", monkeypatch))
    for attempt, rows in enumerate(attempts):
        for row in rows:
            print(json.dumps({"attempt": attempt, **row}))
            assert _within(row["measured_peak_bytes"], row["predicted_bytes"]), row
    for row in attempts[-1]:
        assert _within(row["measured_ms"], row["predicted_ms"], TIME_TOLERANCE), (len(attempts), row)
