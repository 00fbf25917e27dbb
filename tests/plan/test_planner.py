"""The planner: optimal against brute force, aware of speed and memory, fast at scale, and its CLI."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardpool.contract.schedule import MAX_LEAD
from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan import planner as planner_module
from shardpool.plan.costmodel import Workload
from shardpool.plan.device_facts import DeviceInfo, LayerProfile
from shardpool.plan.fleet import Device, Fleet, LinkSpec, heterogeneous_fleet
from shardpool.plan.local_fleet import local_fleet
from shardpool.plan.memory_model import boundary_bytes, reserve_bytes
from shardpool.plan.pipeline_sim import Transfer, simulate_step
from shardpool.plan.planner import STEP_TIE_S, evaluate_split, plan_pipeline
from shardpool.plan.result import Plan
from shardpool.plan.splits import even_split, proportional_split
from shardpool.plan.stage_costs import stage_costs
from shardpool.plan.time_model import modeled_times

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
EIGHT_B = ModelShape.from_config_dir(ROOT / "configs/models/llama-3-8b.json")
SEVENTY_B = ModelShape.from_config_dir(ROOT / "configs/models/llama-2-70b.json")
BIG_WORKLOAD = Workload(
    micro_batch_size=1,
    sequence_len=2048,
    gradient_accumulation_steps=16,
    gradient_checkpointing=True,
    compute_bytes=2,
    wire_bytes=2,
)


def small_shape(layers: int, hidden: int, vocab: int) -> ModelShape:
    return ModelShape.from_config_json(
        {
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": 3 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": vocab,
        },
        name="small",
    )


def brute_force(shape: ModelShape, workload: Workload, fleet: Fleet) -> float | None:
    """Best simulated step over every ordered device subset and every contiguous split, straight
    from stage_costs and the simulation."""
    layers, n = shape.num_layers, len(fleet.devices)
    nbytes = boundary_bytes(shape, workload)
    best = None

    def transfer(a: Device, b: Device) -> Transfer:
        link = fleet.link(a.host, b.host)
        return Transfer(nbytes / link.bandwidth, link.latency)

    counts_allowed = [workload.stages] if workload.stages else range(1, min(n, layers) + 1)
    for s in counts_allowed:
        for seq in itertools.permutations(fleet.devices, s):
            costs = []
            for i, device in enumerate(seq):
                loopback = fleet.link(device.host, device.host)
                costs.append(
                    stage_costs(
                        shape,
                        workload,
                        times=device.times(shape, workload),
                        capacity_bytes=device.memory_bytes,
                        kind=device.kind,
                        index=i,
                        num_stages=s,
                        to_next=transfer(device, seq[i + 1]) if i < s - 1 else Transfer(),
                        to_previous=transfer(device, seq[i - 1]) if i > 0 else Transfer(),
                        replica_link=(loopback.bandwidth, loopback.latency),
                    )
                )
            for cuts in itertools.combinations(range(1, layers), s - 1):
                bounds = (0, *cuts, layers)
                counts = [b - a for a, b in itertools.pairwise(bounds)]
                if any(c.memory(k) > c.capacity_bytes for c, k in zip(costs, counts, strict=True)):
                    continue
                step = simulate_step(
                    [c.times(k) for c, k in zip(costs, counts, strict=True)],
                    microbatches=workload.gradient_accumulation_steps,
                    schedule=workload.schedule,
                ).step_s
                best = step if best is None else min(best, step)
    return best


@st.composite
def planning_cases(draw: st.DrawFn) -> tuple[ModelShape, Workload, Fleet]:
    shape = small_shape(
        draw(st.integers(1, 8)),
        draw(st.sampled_from([64, 128, 256])),
        draw(st.sampled_from([64, 4096, 32000])),
    )
    workload = Workload(
        micro_batch_size=draw(st.integers(1, 2)),
        sequence_len=draw(st.sampled_from([16, 64, 256])),
        gradient_accumulation_steps=draw(st.integers(1, 24)),
        lora_r=draw(st.sampled_from([0, 4, 16])),
        gradient_checkpointing=draw(st.booleans()),
        schedule=draw(st.sampled_from(["1f1b", "gpipe"])),
        compute_bytes=draw(st.sampled_from([2, 4])),
        wire_bytes=draw(st.sampled_from([2, 4])),
        replicas=draw(st.sampled_from([1, 1, 2, 3])),
    )
    hosts = ["a", "b", "c"][: draw(st.integers(1, 3))]
    # Memory is drawn relative to what the model needs, so most cases are tight somewhere.
    whole = stage_costs(
        shape,
        workload,
        times=modeled_times(shape, workload, layer_s=1.0, kind="cpu"),
        capacity_bytes=0,
        kind="cpu",
        index=0,
        num_stages=1,
    )
    devices = []
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["cpu", "cuda"]))
        room = whole.fixed_bytes * draw(st.floats(0.6, 1.3)) + whole.per_layer_bytes * draw(
            st.floats(0.5, shape.num_layers)
        )
        reserve = reserve_bytes(kind, room)
        measured = draw(st.booleans())
        devices.append(
            Device(
                name=f"d{i}",
                host=draw(st.sampled_from(hosts)),
                memory_bytes=int(room + reserve),
                tflops=draw(st.floats(0.01, 10.0)),
                kind=kind,
                # Some devices carry profiled ends of the model and forward share, like local ones.
                forward_seconds_per_layer=draw(st.floats(1e-4, 1e-2)) if measured else None,
                seconds_per_layer=draw(st.floats(2e-2, 5e-2)) if measured else None,
                head_forward_seconds=draw(st.floats(0, 0.05)) if measured else None,
                embed_seconds=draw(st.floats(0, 0.01)) if measured else None,
            )
        )
    links = {}
    for a, b in itertools.combinations(hosts, 2):
        if draw(st.booleans()):
            links[frozenset((a, b))] = LinkSpec(draw(st.floats(1e7, 1e11)), draw(st.floats(0, 0.001)))
    return shape, workload, Fleet(devices=tuple(devices), links=links)


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planning_cases())
def test_planner_matches_brute_force(case: tuple[ModelShape, Workload, Fleet]) -> None:
    shape, workload, fleet = case
    optimum = brute_force(shape, workload, fleet)
    if optimum is None:
        with pytest.raises(ShardpoolError, match="does not fit"):
            plan_pipeline(shape, workload, fleet)
        return
    plan = plan_pipeline(shape, workload, fleet)
    assert plan.search == "exact"
    assert plan.predicted_step_s == pytest.approx(optimum, rel=1e-9)
    assert [s.start for s in plan.stages] == [0, *[s.stop for s in plan.stages[:-1]]]
    assert plan.stages[-1].stop == shape.num_layers
    for stage in plan.stages:
        assert stage.memory_bytes <= fleet.device(stage.slot).memory_bytes
        assert stage.free_bytes >= 0
    again = evaluate_split(
        shape, workload, fleet, devices=[s.slot for s in plan.stages], layers=plan.layer_ranges()
    )
    assert again.predicted_step_s == pytest.approx(plan.predicted_step_s, rel=1e-12) and again.fits


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("seed", range(6))
def test_exact_search_matches_brute_force_when_everything_fits(schedule: str, seed: int) -> None:
    """Roomy devices, so every order and every split of 8 layers over up to 4 devices is feasible and
    the pruning of the exact search (sequence bounds, path bounds, one-layer completions) is what
    decides; slow links make overlap and the 1F1B cycle matter, replicas add the all-reduce."""
    rng = random.Random(seed)
    shape = small_shape(8, 256, 4096)
    workload = Workload(
        micro_batch_size=1,
        sequence_len=256,
        gradient_accumulation_steps=rng.choice([1, 2, 3, 5, 8, 12]),
        schedule=schedule,
        replicas=rng.choice([1, 2]),
    )
    devices = tuple(
        Device(
            name=f"d{i}",
            host=f"h{rng.randrange(2)}",
            memory_bytes=8 * GIB,
            tflops=rng.uniform(0.5, 8),
            kind="cpu",
        )
        for i in range(4)
    )
    fleet = Fleet(
        devices=devices,
        links={frozenset(("h0", "h1")): LinkSpec(rng.uniform(1e6, 1e8), rng.uniform(0, 1e-2))},
        loopback=LinkSpec(rng.uniform(1e7, 1e9), 1e-4),
    )
    plan = plan_pipeline(shape, workload, fleet, exact_simulations=10**7)
    assert plan.search == "exact"
    assert plan.predicted_step_s == pytest.approx(brute_force(shape, workload, fleet), rel=1e-9)


def test_forced_stage_count_matches_brute_force() -> None:
    shape = small_shape(6, 128, 4096)
    fleet = Fleet(devices=tuple(Device(name=f"d{i}", memory_bytes=GIB, tflops=1 + i) for i in range(4)))
    workload = Workload(micro_batch_size=1, sequence_len=256, gradient_accumulation_steps=4, stages=3)
    plan = plan_pipeline(shape, workload, fleet)
    assert len(plan.stages) == 3
    assert plan.predicted_step_s == pytest.approx(brute_force(shape, workload, fleet), rel=1e-9)


def test_a_fixed_split_keeps_its_counts_and_takes_the_fastest_order_of_devices() -> None:
    # shardpool.layers on the mesh: the split is the user's, the devices and their order the planner's.
    shape = small_shape(6, 128, 4096)
    fleet = Fleet(devices=tuple(Device(name=f"d{i}", memory_bytes=GIB, tflops=1 + i) for i in range(3)))
    workload = Workload(micro_batch_size=1, sequence_len=256, gradient_accumulation_steps=4, layers=(3, 3))
    plan = plan_pipeline(shape, workload, fleet)
    assert [stage.num_layers for stage in plan.stages] == [3, 3] and plan.search == "given"
    orders = [
        evaluate_split(shape, workload, fleet, devices=[a.name, b.name], layers=[3, 3])
        for a, b in itertools.permutations(fleet.devices, 2)
    ]
    assert plan.predicted_step_s == pytest.approx(min(order.predicted_step_s for order in orders), rel=1e-12)
    assert plan.left_out == ["d0"], "the slowest device is left out of a two-stage split"
    with pytest.raises(ShardpoolError, match="sums to 5 but the model has 6"):
        plan_pipeline(shape, Workload(layers=(2, 3)), fleet)
    with pytest.raises(ShardpoolError, match="asks for 4 stages but 3 devices"):
        plan_pipeline(shape, Workload(layers=(1, 1, 2, 2)), fleet)


def test_three_times_faster_device_gets_three_times_the_layers() -> None:
    fleet = Fleet(
        devices=(
            Device(name="slow", memory_bytes=48 * GIB, tflops=30, host="box"),
            Device(name="fast", memory_bytes=48 * GIB, tflops=90, host="box"),
        )
    )
    plan = plan_pipeline(EIGHT_B, BIG_WORKLOAD, fleet)
    # Counted in layers' worth of compute (a stage's compute over its own time per layer), so that
    # the end that carries lm_head + loss (358.6 ms on the slow device, 1.5 of its layers) counts:
    # fast 26 layers (2062.8 ms) then slow 6 (1786.7 ms), 26 / 7.5 = 3.47. The fast first stage
    # gets the extra layer because, holding one more warm-up forward, it never waits as the
    # bottleneck (33.45 s); slow 8 then fast 24 (3.0, which the textbook warm-up chose) is 34.29 s.
    work = {
        stage.slot: stage.compute_ms / (stage.costs.per_layer_s * 1e3)
        for stage in plan.stages
        if stage.costs is not None
    }
    assert 2.5 <= work["fast"] / work["slow"] <= 3.5, work


def test_small_memory_device_gets_only_what_fits() -> None:
    fleet = Fleet(
        devices=(
            Device(name="tiny-fast", memory_bytes=3 * GIB, tflops=300, host="box"),
            Device(name="big-slow", memory_bytes=40 * GIB, tflops=30, host="box"),
        )
    )
    plan = plan_pipeline(EIGHT_B, BIG_WORKLOAD, fleet)
    even = evaluate_split(
        EIGHT_B, BIG_WORKLOAD, fleet, devices=["tiny-fast", "big-slow"], layers=even_split(32, 2)
    )
    assert not even.fits
    tiny = [stage for stage in plan.stages if stage.slot == "tiny-fast"]
    for stage in plan.stages:
        assert stage.memory_bytes <= stage.capacity_bytes
    if tiny:
        assert tiny[0].num_layers < 16
    starved = Fleet(devices=(Device(name="crumb", memory_bytes=GIB // 2, tflops=300), *fleet.devices[1:]))
    assert [s.slot for s in plan_pipeline(EIGHT_B, BIG_WORKLOAD, starved).stages] == ["big-slow"]


def test_slow_device_is_left_out() -> None:
    fleet = Fleet(
        devices=(
            Device(name="a", memory_bytes=40 * GIB, tflops=80, host="box"),
            Device(name="b", memory_bytes=40 * GIB, tflops=80, host="box"),
            Device(name="snail", memory_bytes=40 * GIB, tflops=0.5, host="box"),
        )
    )
    plan = plan_pipeline(EIGHT_B, BIG_WORKLOAD, fleet)
    assert plan.left_out == ["snail"]


@pytest.mark.slow
def test_seventy_b_on_64_devices_plans_with_the_heuristic_search() -> None:
    """80 layers over 64 devices on 8 hosts: the heuristic search places every layer where it
    fits. How long it takes is a benchmark figure (scripts/bench_planner.py, docs/performance.md),
    not a test's bound."""
    fleet = heterogeneous_fleet(num_devices=64, num_hosts=8)
    plan = plan_pipeline(SEVENTY_B, BIG_WORKLOAD, fleet)
    assert plan.search == "heuristic" and plan.stages[-1].stop == 80
    assert all(stage.free_bytes >= 0 for stage in plan.stages)


def random_fleet(rng: random.Random, size: int) -> Fleet:
    devices = tuple(
        Device(
            name=f"d{i}",
            host=f"h{rng.randrange(3)}",
            memory_bytes=int(rng.uniform(4, 24) * GIB),
            tflops=rng.uniform(5, 150),
        )
        for i in range(size)
    )
    return Fleet(devices=devices, links={frozenset(("h0", "h1")): LinkSpec(1.25e8, 1e-3)})


def test_heuristic_close_to_exact() -> None:
    rng = random.Random(7)
    shape = small_shape(12, 1024, 32000)
    workload = Workload(micro_batch_size=1, sequence_len=1024, gradient_accumulation_steps=8, compute_bytes=2)
    for size in (4, 5, 6):
        fleet = random_fleet(rng, size)
        exact = plan_pipeline(shape, workload, fleet, exact_simulations=10**6)
        heuristic = plan_pipeline(shape, workload, fleet, exact_limit=0)
        assert exact.search == "exact" and heuristic.search == "heuristic"
        assert exact.predicted_step_s <= heuristic.predicted_step_s * (1 + 1e-9)
        assert heuristic.predicted_step_s <= 1.1 * exact.predicted_step_s


@pytest.mark.slow
def test_unfinished_exact_search_hands_over_to_the_local_search() -> None:
    fleet = random_fleet(random.Random(7), 7)
    plan = plan_pipeline(EIGHT_B, BIG_WORKLOAD, fleet, exact_simulations=50)
    assert plan.search == "heuristic"
    again = plan_pipeline(EIGHT_B, BIG_WORKLOAD, fleet, exact_simulations=50)
    assert again.to_json() == plan.to_json()


def test_same_fleet_same_plan_whatever_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The local search's budget counts evaluations: a slow machine (here a clock that jumps a
    minute per reading) gets the same plan as a fast one, and so does a second run."""
    fleet = heterogeneous_fleet(num_devices=24, num_hosts=4)
    first = plan_pipeline(SEVENTY_B, BIG_WORKLOAD, fleet, evaluations=400)
    assert first.search == "heuristic"
    assert plan_pipeline(SEVENTY_B, BIG_WORKLOAD, fleet, evaluations=400).to_json() == first.to_json()
    now = [0.0]

    def slow_clock() -> float:
        now[0] += 60.0
        return now[0]

    monkeypatch.setattr(time, "perf_counter", slow_clock)
    monkeypatch.setattr(time, "monotonic", slow_clock)
    monkeypatch.setattr(time, "time", slow_clock)
    assert plan_pipeline(SEVENTY_B, BIG_WORKLOAD, fleet, evaluations=400).to_json() == first.to_json()


@pytest.mark.slow
def test_fleet_file_plans_identically_in_two_processes(tmp_path: Path) -> None:
    """Same fleet file, same plan: two separate processes (fresh hash seeds) agree byte for byte."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "".join(
            f"- {{name: g{i}, memory_gib: {8 + 4 * (i % 5)}, tflops: {10 + 17 * (i % 7)}, host: h{i % 4}}}\n"
            for i in range(24)
        )
    )
    args = ("plan", "configs/quickstart.yaml", "--fleet", str(fleet), "--model",
            "configs/models/llama-2-70b.json", "--json")  # fmt: skip
    outputs = [run_cli(*args, env={"PYTHONHASHSEED": seed}) for seed in ("1", "2")]
    assert all(result.returncode == 0 for result in outputs), outputs[0].stderr
    assert outputs[0].stdout == outputs[1].stdout
    assert json.loads(outputs[0].stdout)["search"] == "heuristic"


def test_model_that_cannot_fit_says_what_is_missing() -> None:
    fleet = Fleet(
        devices=(
            Device(name="small", memory_bytes=8 * GIB, tflops=50),
            Device(name="smaller", memory_bytes=6 * GIB, tflops=50),
        )
    )
    with pytest.raises(ShardpoolError) as error:
        plan_pipeline(SEVENTY_B, BIG_WORKLOAD, fleet)
    message = str(error.value)
    assert "GiB are missing" in message and "more on small" in message and "\n" not in message


def test_recommended_microbatches_and_bubble() -> None:
    fleet = Fleet(
        devices=tuple(Device(name=f"d{i}", memory_bytes=24 * GIB, tflops=80, host="box") for i in range(4))
    )
    plan = plan_pipeline(EIGHT_B, BIG_WORKLOAD, fleet)
    s = len(plan.stages)
    assert plan.microbatches == 16
    busiest = max(16 * stage.compute_ms / 1e3 for stage in plan.stages)
    assert plan.bubble_fraction == pytest.approx(1 - busiest / plan.predicted_step_s, abs=1e-5)
    assert plan.recommended_microbatches == 4 * s
    gpipe = plan_pipeline(EIGHT_B, Workload(**{**BIG_WORKLOAD.__dict__, "schedule": "gpipe"}), fleet)
    assert 1 <= gpipe.recommended_microbatches <= 4 * len(gpipe.stages)


def test_splits() -> None:
    assert even_split(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert proportional_split(12, [3, 1]) == [(0, 9), (9, 12)]
    assert proportional_split(3, [100, 0, 0]) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ShardpoolError):
        even_split(2, 3)


def test_plan_json_round_trip_and_validation() -> None:
    fleet = Fleet(
        devices=(
            Device(name="a", memory_bytes=24 * GIB, tflops=80),
            Device(name="b", memory_bytes=24 * GIB, tflops=40),
        )
    )
    plan = plan_pipeline(EIGHT_B, BIG_WORKLOAD, fleet)
    data = json.loads(json.dumps(plan.to_json()))
    assert set(data["stages"][0]) >= {
        "device",
        "host",
        "layers",
        "predicted_ms_per_microbatch",
        "memory_bytes",
    }
    again = Plan.from_json(data)
    assert again.layer_ranges() == plan.layer_ranges()
    assert again.predicted_step_s == pytest.approx(plan.predicted_step_s, rel=1e-6)
    minimal = Plan.from_json(
        {"stages": [{"device": "cpu", "layers": [0, 2]}, {"device": "cpu", "layers": [2, 4]}]}
    )
    assert minimal.num_layers == 4
    with pytest.raises(ShardpoolError, match="contiguous"):
        Plan.from_json({"stages": [{"device": "cpu", "layers": [0, 2]}, {"device": "cpu", "layers": [3, 4]}]})
    for malformed in (
        {"stages": [{"device": "cpu", "layers": [0, 2], "memory_bytes": "many"}]},
        {"stages": ["cpu"]},
        {"stages": [{"device": "cpu", "layers": [0, 2]}], "microbatches": [4]},
    ):
        with pytest.raises(
            ShardpoolError, match=r"^plan.json is malformed \(\w+Error: .*\); re-plan to rewrite it$"
        ):
            Plan.from_json(malformed)


class FixedProbe:
    """A DeviceProbe that reports this machine's real CPU but a fixed layer profile and loopback."""

    def __init__(self, profile: LayerProfile, co_run: float = 1.0) -> None:
        self.profile = profile
        self.co_run = co_run
        self.co_run_asked: list[tuple[int, int]] = []

    def device_info(self, name: str) -> DeviceInfo:
        from shardpool.plan.devices import device_info

        return device_info(name)

    def profile_layer(
        self, shape: ModelShape, workload: Workload, *, device: str, threads: int | None
    ) -> LayerProfile:
        return self.profile

    def loopback(self) -> LinkSpec:
        return LinkSpec(bandwidth=8e9, latency=50e-6)

    def co_run_slowdown(self, copies: int, threads: int, *, shape: ModelShape, workload: Workload) -> float:
        self.co_run_asked.append((copies, threads))
        return self.co_run


def test_local_fleet_shares_one_cpu() -> None:
    from shardpool.plan.devices import device_info

    info = device_info("cpu")
    profile = LayerProfile(
        0.01, 1000, None, "cpu", "cpu", None, 1, forward_seconds=0.004, embed_seconds=0.001,
        head_forward_seconds=0.002, head_backward_seconds=0.003, optimizer_seconds=0.0005,
    )  # fmt: skip
    fleet = local_fleet(
        ["cpu", "cpu", "cpu"], shape=EIGHT_B, workload=BIG_WORKLOAD, probe=FixedProbe(profile)
    )
    assert [d.name for d in fleet.devices] == ["cpu#0", "cpu#1", "cpu#2"]
    assert {d.torch_device for d in fleet.devices} == {"cpu"}
    for device in fleet.devices:
        assert device.memory_bytes == pytest.approx(info.free_bytes / 3, rel=0.05)
        threads = max(1, info.threads // 3)
        slowdown = max(1.0, 3 * threads / info.threads)
        assert device.seconds_per_layer == pytest.approx(0.01 * slowdown)
        times = device.times(EIGHT_B, BIG_WORKLOAD)
        assert (times.layer_forward_s, times.layer_backward_s) == pytest.approx(
            (0.004 * slowdown, 0.006 * slowdown)
        )
        assert (times.embed_s, times.head_forward_s, times.head_backward_s) == pytest.approx(
            (0.001 * slowdown, 0.002 * slowdown, 0.003 * slowdown)
        )
        assert times.optimizer_per_layer_s == pytest.approx(0.0005 * slowdown)
    assert len({d.host for d in fleet.devices}) == 1


def test_local_fleet_slots_share_the_cpu_quota() -> None:
    """Slots on a host throttled to one CPU each profiled at that one CPU; together they run at a
    third of it each, whatever the core count says."""
    from shardpool.plan.devices import device_info

    info = device_info("cpu")
    profile = LayerProfile(0.01, 1000, None, "cpu", "cpu", None, 3, cpu_quota=1.0)
    fleet = local_fleet(
        ["cpu", "cpu", "cpu"], shape=EIGHT_B, workload=BIG_WORKLOAD, probe=FixedProbe(profile)
    )
    threads = max(1, info.threads // 3)
    expected = 3 * min(threads, 1.0) / min(info.threads, 1.0)
    assert expected == pytest.approx(3.0)
    assert [d.seconds_per_layer for d in fleet.devices] == pytest.approx([0.01 * expected] * 3)
    assert fleet.devices[0].measurement is not None and fleet.devices[0].measurement.cpu_quota == 1.0
    # Half a CPU's quota, one slot: alone either way, no slowdown.
    alone = local_fleet(
        ["cpu"], shape=EIGHT_B, workload=BIG_WORKLOAD, probe=FixedProbe(replace(profile, cpu_quota=0.5))
    )
    assert alone.devices[0].seconds_per_layer == pytest.approx(0.01)


def test_local_fleet_slots_slow_by_what_running_side_by_side_measured() -> None:
    """Two one-thread slots on a host with enough cores still slow each other (shared caches,
    memory bandwidth, SMT): the measured side-by-side slowdown is charged and recorded in the
    plan; where the counted CPUs say more (a quota), the count wins."""
    profile = LayerProfile(0.01, 1000, None, "cpu", "cpu", None, 3)
    probe = FixedProbe(profile, co_run=1.3)
    fleet = local_fleet(
        ["cpu", "cpu"], shape=EIGHT_B, workload=BIG_WORKLOAD, probe=probe, threads_per_stage=1
    )
    assert probe.co_run_asked == [(2, 1), (2, 1)]
    assert [d.seconds_per_layer for d in fleet.devices] == pytest.approx([0.013, 0.013])
    measured = fleet.devices[0].measurement
    assert measured is not None and measured.co_run == pytest.approx(1.3)
    assert measured.to_json()["co_run"] == pytest.approx(1.3)
    throttled = FixedProbe(replace(profile, cpu_quota=1.0), co_run=1.3)
    counted = local_fleet(
        ["cpu", "cpu"], shape=EIGHT_B, workload=BIG_WORKLOAD, probe=throttled, threads_per_stage=1
    )
    assert [d.seconds_per_layer for d in counted.devices] == pytest.approx([0.02, 0.02])
    alone_probe = FixedProbe(profile, co_run=1.3)
    alone = local_fleet(["cpu"], shape=EIGHT_B, workload=BIG_WORKLOAD, probe=alone_probe, threads_per_stage=1)
    assert alone.devices[0].seconds_per_layer == pytest.approx(0.01)
    assert alone.devices[0].measurement is not None and alone.devices[0].measurement.co_run is None


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardpool", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow
def test_cli_plan_json_on_seed_fleet() -> None:
    result = run_cli(
        "plan",
        "configs/quickstart.yaml",
        "--fleet",
        "configs/fleet-seed.yaml",
        "--model",
        "configs/models/llama-2-70b.json",
        "--set",
        "sequence_len=2048",
        "--set",
        "micro_batch_size=1",
        "--set",
        "gradient_checkpointing=true",
        "--set",
        "bf16=true",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    plan = Plan.from_json(json.loads(result.stdout))
    assert plan.stages[-1].stop == 80 and plan.num_layers == 80
    assert {s.device for s in plan.stages} <= {"rtx3090", "rtx4090", "v100", "m40"}


def test_cli_plan_table_marks_bottleneck() -> None:
    result = run_cli("plan", "configs/quickstart.yaml", "--fleet", "configs/fleet-seed.yaml")
    assert result.returncode == 0, result.stderr
    assert "bottleneck" in result.stdout and "Predicted step" in result.stdout and "bubble" in result.stdout


def test_cli_model_that_cannot_fit(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet-tiny.yaml"
    fleet.write_text(
        "- {name: small, memory_gib: 4, tflops: 20}\n- {name: smaller, memory_gib: 2, tflops: 10}\n"
    )
    result = run_cli(
        "plan", "configs/quickstart.yaml", "--fleet", str(fleet), "--model", "configs/models/llama-2-70b.json"
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "GiB are missing" in lines[0] and "Traceback" not in result.stderr


def _fast_devices_over_slow_links(count: int, latency_s: float, memory_gib: float = 8.0) -> Fleet:
    """``count`` equal devices of 4 ms a layer on hosts of their own, every link ``latency_s`` each way."""
    devices = tuple(
        Device(
            name=f"d{i}",
            host=f"h{i}",
            kind="cpu",
            memory_bytes=int(memory_gib * GIB),
            seconds_per_layer=0.004,
        )
        for i in range(count)
    )
    return Fleet(devices=devices, default_link=LinkSpec(bandwidth=1e8, latency=latency_s))


LEAD_SHAPE = small_shape(16, 512, 1229)
LEAD_WORKLOAD = Workload(
    micro_batch_size=1, sequence_len=128, gradient_accumulation_steps=16, lora_r=8, warmup_lead=None, stages=4
)


def test_auto_deepens_the_warm_up_where_round_trips_stall_the_pipeline() -> None:
    """Four fast stages over 20 ms links: at lead 1 each stage waits for gradients the links hold
    back; the planner's deeper lead predicts a step at least 1.5x shorter, and every stage but the
    last holds the extra micro-batches' activations (its in-flight count and memory)."""
    fleet = _fast_devices_over_slow_links(4, 0.02)
    chosen = plan_pipeline(LEAD_SHAPE, LEAD_WORKLOAD, fleet)
    textbook = plan_pipeline(LEAD_SHAPE, replace(LEAD_WORKLOAD, warmup_lead=1), fleet)
    assert chosen.warmup_lead > 1 and textbook.warmup_lead == 1
    assert textbook.predicted_step_s / chosen.predicted_step_s > 1.5
    for stage, (deep, shallow) in enumerate(zip(chosen.stages, textbook.stages, strict=True)):
        expected = (
            min(16, chosen.warmup_lead * (4 - stage) - (chosen.warmup_lead - 1) + 1) if stage < 3 else 1
        )
        assert deep.in_flight_microbatches == expected
        if stage < 3:
            assert deep.in_flight_microbatches > shallow.in_flight_microbatches
    assert Plan.from_json(json.loads(json.dumps(chosen.to_json()))).warmup_lead == chosen.warmup_lead
    # Two stages over a fast link: nothing stalls the warm-up, and the shallowest lead wins the tie.
    fast_pair = _fast_devices_over_slow_links(2, 1e-4)
    assert plan_pipeline(LEAD_SHAPE, replace(LEAD_WORKLOAD, stages=2), fast_pair).warmup_lead == 1


@pytest.mark.parametrize("latency_s", [0.0, 0.005, 0.02, 0.05])
def test_auto_is_the_best_of_every_lead_where_the_split_search_is_exact(latency_s: float) -> None:
    """Under an exact split search every lead is planned, so auto is the model's optimum over
    leads too: the fixed lead that predicts the shortest step, the shallowest of a tie."""
    fleet = _fast_devices_over_slow_links(3, latency_s)
    workload = replace(LEAD_WORKLOAD, stages=None)
    chosen = plan_pipeline(LEAD_SHAPE, workload, fleet)
    assert chosen.search == "exact"
    fixed = [
        plan_pipeline(LEAD_SHAPE, replace(workload, warmup_lead=lead), fleet)
        for lead in range(1, MAX_LEAD + 1)
    ]
    assert [plan.warmup_lead for plan in fixed] == list(range(1, MAX_LEAD + 1))
    shortest = min(plan.predicted_step_s for plan in fixed)
    assert chosen.predicted_step_s == pytest.approx(shortest, rel=1e-12)
    first_shortest = next(plan for plan in fixed if plan.predicted_step_s <= shortest + STEP_TIE_S)
    assert chosen.warmup_lead == first_shortest.warmup_lead


def test_past_two_leads_that_gain_nothing_an_exact_search_still_finds_a_deeper_gain() -> None:
    """A step that levels off over leads 2 and 3 and falls again at lead 4 (a stand-in plan per
    lead): the heuristic search's patience would stop at lead 3, the exact one plans on."""
    steps = {1: 10.0, 2: 9.0, 3: 9.0, 4: 9.0, 5: 8.0, 6: 8.5, 7: 8.5, 8: 8.5}

    def plan_at(search: str) -> Callable[[Workload], Plan]:
        return lambda workload: Plan(
            stages=[], predicted_step_s=steps[workload.lead], bubble_fraction=0.0, microbatches=16,
            recommended_microbatches=16, search=search, warmup_lead=workload.lead,
        )  # fmt: skip

    auto = replace(LEAD_WORKLOAD, warmup_lead=None)
    assert planner_module._over_leads(auto, plan_at("exact")).warmup_lead == 5
    assert planner_module._over_leads(auto, plan_at("heuristic")).warmup_lead == 2


@pytest.mark.slow
def test_a_deeper_lead_that_fits_nowhere_is_not_taken() -> None:
    """Memory for about one more micro-batch of activations than lead 1 needs: the plan stays at a
    lead whose stages fit, whatever a deeper one would predict."""
    fleet = _fast_devices_over_slow_links(4, 0.05)
    textbook = plan_pipeline(LEAD_SHAPE, replace(LEAD_WORKLOAD, warmup_lead=1), fleet)
    tight = max(stage.memory_bytes for stage in textbook.stages) + 2**20
    small = _fast_devices_over_slow_links(4, 0.05, memory_gib=tight / GIB)
    chosen = plan_pipeline(LEAD_SHAPE, LEAD_WORKLOAD, small)
    assert chosen.fits and all(stage.free_bytes >= 0 for stage in chosen.stages)
    assert chosen.warmup_lead < plan_pipeline(LEAD_SHAPE, LEAD_WORKLOAD, fleet).warmup_lead
