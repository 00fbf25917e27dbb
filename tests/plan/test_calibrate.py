"""Calibration: measured warm-up steps correct each stage's speed, and the same stages are re-split
when the calibrated model predicts a step at least 10% faster (``plan.calibrate``)."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from shardpool.config import Config, parse_config
from shardpool.elastic.rebalance_decision import MIN_GAIN, rebalance_decision
from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.calibrate import StepMeasurement, calibrate, calibrated_plan, predicted_over_measured
from shardpool.plan.costmodel import Workload
from shardpool.plan.fleet import Device, Fleet
from shardpool.plan.planner import evaluate_split, plan_pipeline
from shardpool.plan.result import Plan
from shardpool.plan.room import (
    growth_shortfalls,
    layers_within_room,
    memory_shortfalls,
    shared_room_caps,
    stage_rooms,
)
from shardpool.plan.split_search import SplitProblem, best_split

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
#: The worked example's model (docs/planner.md, "Calibration"): an 8-layer hidden-512 Llama.
SHAPE = ModelShape.from_config_json(
    {
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "vocab_size": 2048,
    },
    name="llama-512",
)


def config_with(**changes: object) -> Config:
    raw = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    raw.update({"gradient_accumulation_steps": 16, **changes})
    return parse_config(raw, source="test")


CONFIG = config_with()
WORKLOAD = Workload.from_config(CONFIG)


def two_hosts(a_s: float, b_s: float, *, a_memory: int = 8 * GIB) -> Fleet:
    """Two CPU hosts whose profiles say ``a_s`` and ``b_s`` seconds per layer."""
    return Fleet(
        devices=(
            Device(name="a", memory_bytes=a_memory, seconds_per_layer=a_s, kind="cpu", host="a"),
            Device(name="b", memory_bytes=8 * GIB, seconds_per_layer=b_s, kind="cpu", host="b"),
        )
    )


def measured_as(
    plan: Plan, speed: list[float], *, steps: int = 3, step_s: float = 1.0, noise: list[float] | None = None
) -> list[StepMeasurement]:
    """Warm-up steps whose stages computed ``speed[s]`` times their planned time (times ``noise[i]`` on step i)."""
    m = plan.microbatches
    out = []
    for i in range(steps):
        jitter = noise[i] if noise else 1.0
        compute = tuple(
            m * stage.compute_ms / 1e3 * f * jitter for stage, f in zip(plan.stages, speed, strict=True)
        )
        out.append(
            StepMeasurement(
                step=i + 1, step_seconds=step_s, stage_compute_s=compute, stage_wait_s=(0.0,) * len(compute)
            )
        )
    return out


def brute_force(fleet: Fleet, devices: list[str]) -> tuple[float, list[int]]:
    """The best split of ``devices`` (in that order) on ``fleet``, trying every split."""
    best = (math.inf, [])
    for cut in itertools.combinations(range(1, SHAPE.num_layers), len(devices) - 1):
        bounds = [0, *cut, SHAPE.num_layers]
        counts = [b - a for a, b in itertools.pairwise(bounds)]
        plan = evaluate_split(SHAPE, WORKLOAD, fleet, devices=devices, layers=counts)
        if plan.fits and plan.predicted_step_s < best[0]:
            best = (plan.predicted_step_s, counts)
    return best


def test_worked_example_a_stage_twice_as_slow_loses_layers() -> None:
    """docs/planner.md, "Calibration": the numbers there come from this test."""
    plan = plan_pipeline(SHAPE, WORKLOAD, two_hosts(0.1, 0.1))
    assert plan.layer_ranges() == [(0, 4), (4, 8)]
    assert plan.predicted_step_s == pytest.approx(7.288, abs=1e-3)
    assert [round(s.compute_ms, 1) for s in plan.stages] == [400.0, 429.2]
    measured = measured_as(plan, [1.0, 2.0], step_s=14.2)
    assert [round(x, 3) for x in measured[0].stage_compute_s] == [6.4, 13.735]

    calibration = calibrate(plan, measured, CONFIG)
    assert calibration.speed == pytest.approx((1.0, 2.0))
    assert calibration.measured_ms_per_layer == pytest.approx((100.0, 200.0))
    decision = rebalance_decision(plan, measured, CONFIG)
    assert decision is not None
    assert decision.layers == [(0, 6), (6, 8)]
    assert decision.current_step_s == pytest.approx(14.156, abs=1e-3)
    # Stage 1 (858.4 ms a micro-batch) is the bottleneck of 4/4 and never waits: stage 0's first
    # forward 196.35 ms + activation 9.39 ms + 16 x 858.45 ms + gradient 9.39 ms + stage 0's last
    # backward 203.65 ms + optimizer 1.64 ms = 14.156 s. In 6/2 stage 0 (600 ms) is; its three
    # warm-up forwards (883.6 ms) outlast the first gradient's round trip (771.8 ms), so it never
    # waits either: 16 x 600 ms + optimizer 2.46 ms = 9.602 s (9.957 s under the textbook warm-up,
    # whose stage 0 waited for the gradient).
    assert decision.predicted_step_s == pytest.approx(9.602, abs=1e-3)
    assert 1 - decision.predicted_step_s / decision.current_step_s == pytest.approx(0.322, abs=1e-3)
    assert "b 2.00x" in decision.reason and "4/4 -> 6/2" in decision.reason
    # The new plan's predictions are the calibrated model's.
    new = decision.plan
    assert new.predicted_step_s == pytest.approx(decision.predicted_step_s)
    assert [s.slot for s in new.stages] == ["a", "b"] and new.search == "calibrated"
    assert [round(s.compute_ms, 1) for s in new.stages] == [600.0, 458.4]
    assert new.calibration["speed"] == [1.0, 2.0] and new.calibration["steps"] == [1, 2, 3]
    # Predicted / measured: 0.51 before calibration, 1.00 after.
    assert predicted_over_measured(plan, measured) == pytest.approx(0.513, abs=1e-3)
    assert predicted_over_measured(calibrated_plan(plan, measured, CONFIG), measured) == pytest.approx(
        0.997, abs=1e-3
    )


def test_measurements_that_match_the_plan_keep_it() -> None:
    plan = plan_pipeline(SHAPE, WORKLOAD, two_hosts(0.1, 0.25))
    assert rebalance_decision(plan, measured_as(plan, [1.0, 1.0]), CONFIG) is None
    # Noise common to all stages, and one outlier step the median ignores.
    noisy = measured_as(plan, [1.0, 1.0], steps=5, noise=[1.03, 0.98, 1.0, 1.01, 4.0])
    assert rebalance_decision(plan, noisy, CONFIG) is None
    calibration = calibrate(plan, noisy, CONFIG)
    assert calibration.speed == pytest.approx((1.01, 1.01))


def test_a_gain_under_ten_percent_keeps_the_plan() -> None:
    plan = plan_pipeline(SHAPE, WORKLOAD, two_hosts(0.1, 0.1))
    # With b k times slower, 4/4 takes 0.4204 s (stage 0's first forward and last backward, two
    # transfers, the optimizer) + 16 x 429.22 ms x k, as stage 1 never waits; 5/3 takes
    # 16 x 500 ms + 2.05 ms = 8.002 s (stage 0 the bottleneck, never waiting) while 3 layers on b
    # stay under 500 ms. The gain reaches 10% at k = 1.233.
    measured = measured_as(plan, [1.0, 1.2])
    assert rebalance_decision(plan, measured, CONFIG) is None
    # A better split exists, only not 10% better: 1 - 8.002 / 8.662 = 7.6%.
    smaller = rebalance_decision(plan, measured, CONFIG, min_gain=0.0)
    assert smaller is not None and smaller.layers == [(0, 5), (5, 8)]
    assert 1 - smaller.predicted_step_s / smaller.current_step_s == pytest.approx(0.0761, abs=1e-4)
    # 1.25x slower: the same move gains 1 - 8.002 / 9.005 = 11.1%, enough.
    enough = rebalance_decision(plan, measured_as(plan, [1.0, 1.25]), CONFIG)
    assert enough is not None and enough.layers == [(0, 5), (5, 8)]
    assert 1 - enough.predicted_step_s / enough.current_step_s == pytest.approx(0.1114, abs=1e-4)


def test_memory_caps_are_respected() -> None:
    roomy = plan_pipeline(SHAPE, WORKLOAD, two_hosts(0.1, 0.1))
    first = roomy.stages[0].costs
    assert first is not None
    # Stage 0's device holds at most 5 layers.
    fleet = two_hosts(0.1, 0.1, a_memory=math.ceil(first.memory(5)) + 1)
    plan = evaluate_split(SHAPE, WORKLOAD, fleet, devices=["a", "b"], layers=[4, 4])
    assert plan.stages[0].costs is not None and plan.stages[0].costs.max_layers() == 5
    unlimited = rebalance_decision(roomy, measured_as(roomy, [1.0, 4.0]), CONFIG)
    assert unlimited is not None and unlimited.layers == [(0, 7), (7, 8)]
    capped = rebalance_decision(plan, measured_as(plan, [1.0, 4.0]), CONFIG)
    assert capped is not None and capped.layers == [(0, 5), (5, 8)]
    assert capped.plan.fits and capped.plan.stages[0].free_bytes >= 0


def test_the_room_the_ranks_measured_caps_what_a_stage_gains() -> None:
    """The plan's memory would let stage 0 take 7 layers; the room its rank measured at the check
    holds it to what its modelled peak can grow into, and a stage with no room gains nothing."""
    plan = plan_pipeline(SHAPE, WORKLOAD, two_hosts(0.1, 0.1))
    first = plan.stages[0].costs
    assert first is not None and [stage.num_layers for stage in plan.stages] == [4, 4]
    measured = measured_as(plan, [1.0, 4.0])
    roomy = rebalance_decision(plan, measured, CONFIG, room_bytes=[64 * GIB, 64 * GIB])
    assert roomy is not None and roomy.layers == [(0, 7), (7, 8)]
    two_more = first.memory(6) - first.memory(4)
    assert layers_within_room(first, 4, two_more, most=8) == 6
    assert layers_within_room(first, 4, two_more - 1, most=8) == 5
    assert layers_within_room(first, 4, 0, most=8) == 4, "giving layers away needs no room"
    held = rebalance_decision(plan, measured, CONFIG, room_bytes=[two_more, 64 * GIB])
    assert held is not None and held.layers == [(0, 6), (6, 8)]
    assert held.predicted_step_s > roomy.predicted_step_s
    assert rebalance_decision(plan, measured, CONFIG, room_bytes=[0, 64 * GIB]) is None
    assert memory_shortfalls(plan, roomy.layers, [two_more, 64 * GIB]) == [
        f"stage 0 (a) needs {(first.memory(7) - first.memory(4)) / 2**20:.1f} MiB more for 7 layers "
        f"and has {two_more / 2**20:.1f} MiB of room"
    ]
    assert memory_shortfalls(plan, held.layers, [two_more, 64 * GIB]) == []


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def test_a_growth_in_place_is_checked_against_each_running_ranks_room() -> None:
    """a and b run 4 + 4 layers; c joins in the middle. A grown split that gives a more layers
    needs room on a's rank; b, which gives layers away, needs none; a rank that keeps its layers
    at a position with more micro-batches in flight needs room too."""
    running = evaluate_split(SHAPE, WORKLOAD, three_hosts([0.1, 0.1, 0.1]), devices=["a", "b"], layers=[4, 4])
    fleet = three_hosts([0.1, 0.1, 0.1])
    grown = evaluate_split(SHAPE, WORKLOAD, fleet, devices=["a", "c", "b"], layers=[6, 1, 1])
    a_then, a_now = running.stages[0].costs, grown.stages[0].costs
    assert a_then is not None and a_now is not None
    need = a_now.memory(6) - a_then.memory(4)
    renumber = {0: 0, 1: 2}
    assert growth_shortfalls(running, grown, renumber, [need, 0.0]) == [], (
        "b gives layers away: no room needed"
    )
    assert growth_shortfalls(running, grown, renumber, [need - 1, 0.0]) == [
        f"rank 0 (a) needs {_mib(need)} more for 6 layers and has {_mib(need - 1)} of room"
    ]
    # c joins first: b keeps its 4 layers but moves from the last stage to the middle one, where
    # 1F1B holds more micro-batches (and their activations) in flight
    first = evaluate_split(SHAPE, WORKLOAD, fleet, devices=["c", "a", "b"], layers=[2, 2, 4])
    b_then, b_now = running.stages[1].costs, first.stages[2].costs
    middle = evaluate_split(SHAPE, WORKLOAD, fleet, devices=["a", "b", "c"], layers=[2, 4, 2])
    b_middle = middle.stages[1].costs
    assert b_then is not None and b_now is not None and b_middle is not None
    assert b_now.memory(4) == b_then.memory(4), "the last stage stays the last"
    moved = b_middle.memory(4) - b_then.memory(4)
    assert b_middle.in_flight > b_then.in_flight and moved > 0
    assert growth_shortfalls(running, middle, {0: 0, 1: 1}, [GIB, moved / 2]) == [
        f"rank 1 (b) needs {_mib(moved)} more for 4 layers and has {_mib(moved / 2)} of room"
    ]
    with pytest.raises(ShardpoolError, match="reported room for 3 ranks, not its 2"):
        growth_shortfalls(running, grown, renumber, [1.0, 2.0, 3.0])


def test_running_ranks_on_one_device_must_grow_within_its_room_together() -> None:
    """Two running stages on host a's CPU, each growing within the room it measured, but not both:
    with c joining last, the first keeps 4 layers with one more micro-batch in flight, and the
    second goes from the last stage (4 layers) to the middle one (3)."""
    fleet = three_hosts([0.1, 0.1, 0.1])
    running = _on_host_a(evaluate_split(SHAPE, WORKLOAD, fleet, devices=["a", "b"], layers=[4, 4]))
    grown = _on_host_a(evaluate_split(SHAPE, WORKLOAD, fleet, devices=["a", "b", "c"], layers=[4, 3, 1]))
    needs = [
        grown.stages[index].costs.memory(count) - running.stages[index].costs.memory(4)  # type: ignore[union-attr]
        for index, count in ((0, 4), (1, 3))
    ]
    assert all(need > 0 for need in needs)
    room = max(needs)
    assert growth_shortfalls(running, grown, {0: 0, 1: 1}, [room, room]) == [
        f"ranks 0 and 1 (a on a) need {_mib(sum(needs))} more together and have {_mib(room)} of room"
    ]
    assert growth_shortfalls(running, grown, {0: 0, 1: 1}, [sum(needs), sum(needs)]) == []


def _on_host_a(plan: Plan) -> Plan:
    """``plan`` with its stages 0 and 1 on host a's CPU (one device: they share its memory)."""
    return replace(
        plan,
        stages=[
            replace(stage, host="a", device="a") if index < 2 else stage
            for index, stage in enumerate(plan.stages)
        ],
    )


def test_a_stages_room_is_the_least_of_its_replicas() -> None:
    # Ranks run stage r % S: ranks 0 and 2 hold stage 0, ranks 1 and 3 stage 1.
    assert stage_rooms([5.0, 7.0, 3.0, 9.0], 2) == [3.0, 7.0]
    with pytest.raises(ShardpoolError, match="room for 3 ranks, not a multiple of the plan's 2 stages"):
        stage_rooms([1.0, 2.0, 3.0], 2)


def test_the_decision_is_deterministic() -> None:
    plan = plan_pipeline(SHAPE, WORKLOAD, two_hosts(0.1, 0.1))
    measured = measured_as(plan, [1.0, 2.0], steps=4, noise=[1.0, 1.02, 0.99, 1.01])
    first = rebalance_decision(plan, measured, CONFIG)
    again = rebalance_decision(plan, list(reversed(measured)), CONFIG)
    assert first is not None and again is not None
    assert json.dumps(first.plan.to_json(), sort_keys=True) == json.dumps(
        again.plan.to_json(), sort_keys=True
    )
    assert (first.predicted_step_s, first.current_step_s) == (again.predicted_step_s, again.current_step_s)


def test_swapped_profiles_get_the_right_split_back() -> None:
    """Planned from profiles that swapped the fast and the slow device; the measured steps give
    the split the true profiles would have given for that device order, and its step."""
    true_fleet = two_hosts(0.05, 0.15)
    swapped = plan_pipeline(SHAPE, WORKLOAD, two_hosts(0.15, 0.05))
    order = [stage.slot for stage in swapped.stages]
    assert swapped.stages[order.index("b")].num_layers > swapped.stages[order.index("a")].num_layers
    truth = {"a": 0.05 / 0.15, "b": 0.15 / 0.05}
    decision = rebalance_decision(swapped, measured_as(swapped, [truth[name] for name in order]), CONFIG)
    assert decision is not None
    best_step, best_counts = brute_force(true_fleet, order)
    assert [stop - start for start, stop in decision.layers] == best_counts
    assert decision.predicted_step_s == pytest.approx(best_step, rel=1e-9)
    assert decision.layers == [(0, 7), (7, 8)] and order == ["a", "b"]


def test_replicas_are_averaged_per_stage() -> None:
    config = config_with(shardpool={"stages": 2, "replicas": 2})
    plan = plan_pipeline(SHAPE, Workload.from_config(config), two_hosts(0.1, 0.1))
    one = measured_as(plan, [1.0, 2.0])[0]
    # Ranks are stage-major per replica: (r0 s0, r0 s1, r1 s0, r1 s1); replica 1 of stage 1 a bit faster.
    s0, s1 = one.stage_compute_s
    step = StepMeasurement(
        step=1, step_seconds=1.0, stage_compute_s=(s0, s1 * 1.1, s0, s1 * 0.9), stage_wait_s=(0.0,) * 4
    )
    assert calibrate(plan, [step], config).speed == pytest.approx((1.0, 2.0))
    with pytest.raises(ShardpoolError, match="not a multiple"):
        calibrate(plan, [StepMeasurement(1, 1.0, (s0, s1, s0), (0.0,) * 3)], config)


def test_plans_without_stage_costs_are_kept() -> None:
    """An older plan.json (no ``costs``) reads back and is never re-sharded."""
    plan = plan_pipeline(SHAPE, WORKLOAD, two_hosts(0.1, 0.1))
    data = plan.to_json()
    for stage in data["stages"]:
        del stage["costs"]
    old = Plan.from_json(data)
    assert old.stages[0].costs is None
    assert rebalance_decision(old, measured_as(plan, [1.0, 2.0]), CONFIG) is None
    assert rebalance_decision(plan, [], CONFIG) is None


def test_plan_json_round_trips_costs_and_calibration() -> None:
    plan = plan_pipeline(SHAPE, WORKLOAD, two_hosts(0.1, 0.1))
    decision = rebalance_decision(plan, measured_as(plan, [1.0, 2.0]), CONFIG)
    assert decision is not None
    back = Plan.from_json(json.loads(json.dumps(decision.plan.to_json())))
    assert [s.costs for s in back.stages] == [s.costs for s in decision.plan.stages]
    assert back.calibration == decision.plan.calibration
    assert back.to_json() == decision.plan.to_json()


def three_hosts(seconds: list[float]) -> Fleet:
    return Fleet(
        devices=tuple(
            Device(name=name, memory_bytes=8 * GIB, seconds_per_layer=s, kind="cpu", host=name)
            for name, s in zip("abc", seconds, strict=True)
        )
    )


def _sharing_host_b(plan: Plan) -> Plan:
    """``plan`` with its stages 1 and 2 on one host's CPU (the order and the costs unchanged)."""
    stages = [
        replace(stage, host="b", device="b") if index in (1, 2) else stage
        for index, stage in enumerate(plan.stages)
    ]
    return replace(plan, stages=stages)


def _each_on_its_own_host(plan: Plan) -> Plan:
    """``plan`` with every stage on a host of its own: no stage shares a device's memory."""
    return replace(plan, stages=[replace(stage, host=f"h{index}") for index, stage in enumerate(plan.stages)])


SHARED_CONFIG = config_with(
    shardpool={"stages": 3, "warmup_lead": 1}
)  # the memory figures below are lead 1's


def _shared_case(
    speeds: list[float], room_layers: float
) -> tuple[Plan, list[StepMeasurement], list[float], float]:
    """A 3-stage plan whose stages 1 and 2 share host b's CPU and whose stages measured ``speeds``;
    the rooms (stage 0 plenty; stages 1 and 2 ``room_layers`` of stage 1's layers); and the best
    calibrated step of all splits whose growths fit each stage's room and host b's together, by
    brute force."""
    workload = Workload.from_config(SHARED_CONFIG)
    plan = _sharing_host_b(plan_pipeline(SHAPE, workload, three_hosts([0.1, 0.1, 0.1])))
    held = [stage.num_layers for stage in plan.stages]
    measured = measured_as(plan, speeds)
    costs = calibrate(plan, measured, SHARED_CONFIG).costs
    middle = plan.stages[1].costs
    assert middle is not None
    room = (middle.memory(held[1] + 1) - middle.memory(held[1])) * room_layers
    rooms = [64 * GIB, room, room]

    def growth(index: int, count: int) -> float:
        return max(0.0, costs[index].memory(count) - costs[index].memory(held[index]))

    problem = SplitProblem(
        costs=costs,
        caps=[c.max_layers() for c in costs],
        layers=SHAPE.num_layers,
        microbatches=plan.microbatches,
        schedule="1f1b",
        lead=plan.warmup_lead,
    )
    steps = [
        problem.simulate(counts)
        for cut in itertools.combinations(range(1, SHAPE.num_layers), 2)
        if (counts := [b - a for a, b in itertools.pairwise([0, *cut, SHAPE.num_layers])])
        and all(n <= c.max_layers() for n, c in zip(counts, costs, strict=True))
        and growth(0, counts[0]) <= rooms[0]
        and growth(1, counts[1]) + growth(2, counts[2]) <= room
    ]
    return plan, measured, rooms, min(steps)


@pytest.mark.parametrize(
    ("speeds", "room_layers"),
    [([3, 1, 1], 0.5), ([3, 1, 1], 1), ([3, 1, 1], 2), ([6, 1, 1], 1), ([4, 1, 2], 1), ([3, 2, 1], 2)],
)
def test_stages_sharing_a_device_get_the_best_split_whose_growth_fits_its_room_together(
    speeds: list[float], room_layers: float
) -> None:
    """Against brute force: stage 0 measures slow and gives layers to stages 1 and 2, which share
    host b's CPU; the decision is the best split of all those whose growths fit its room together."""
    plan, measured, rooms, best = _shared_case(speeds, room_layers)
    decision = rebalance_decision(plan, measured, SHARED_CONFIG, room_bytes=rooms)
    assert decision is not None
    assert decision.predicted_step_s == pytest.approx(best, rel=1e-9)
    assert memory_shortfalls(plan, decision.layers, rooms) == []


@pytest.mark.parametrize(("speeds", "room_layers"), [([3, 1, 1], 1), ([4, 1, 2], 1)])
def test_a_shared_device_gets_a_smaller_growth_instead_of_none(
    speeds: list[float], room_layers: float
) -> None:
    """Here each stage's own room would let both grow, and that split outgrows host b's CPU: the
    decision grows them less (a slower split than the one ruled out, but a re-shard)."""
    plan, measured, rooms, _ = _shared_case(speeds, room_layers)
    apart = _each_on_its_own_host(plan)
    each_alone = rebalance_decision(apart, measured, SHARED_CONFIG, room_bytes=rooms)
    assert each_alone is not None and memory_shortfalls(plan, each_alone.layers, rooms) != []
    decision = rebalance_decision(plan, measured, SHARED_CONFIG, room_bytes=rooms)
    assert decision is not None and decision.layers != plan.layer_ranges()
    assert each_alone.predicted_step_s < decision.predicted_step_s < decision.current_step_s * (1 - MIN_GAIN)


def test_shared_room_caps_are_the_largest_that_fit_together_and_give_up_past_the_limit() -> None:
    plan = _sharing_host_b(
        plan_pipeline(SHAPE, Workload.from_config(SHARED_CONFIG), three_hosts([0.1, 0.1, 0.1]))
    )
    costs = [stage.costs for stage in plan.stages]
    assert all(c is not None for c in costs) and [s.num_layers for s in plan.stages] == [3, 3, 2]
    middle = costs[1]
    assert middle is not None
    two = middle.memory(5) - middle.memory(3)
    # Stages 1 and 2 may grow by two of stage 1's layers together (69.6 MiB each; stage 2, the
    # last, holds one micro-batch: 25.3 MiB a layer): 3+0 / 2+5, 3+1 / 2+2, 3+2 / 2+0.
    choices = shared_room_caps(plan, costs, [8, 8, 8], [64 * GIB, two, two])  # type: ignore[arg-type]
    assert [(c[1], c[2]) for c in choices] == [(3, 7), (4, 4), (5, 2)]
    assert all(c[0] == 8 for c in choices), "a stage on its own device keeps its cap"
    assert shared_room_caps(plan, costs, [8, 8, 8], [64 * GIB, 0.0, 0.0]) == [[8, 3, 2]]  # type: ignore[arg-type]
    # No two stages share a device: the caps as they are.
    apart = _each_on_its_own_host(plan)
    assert shared_room_caps(apart, costs, [8, 8, 8], [1.0, 1.0, 1.0]) == [[8, 8, 8]]  # type: ignore[arg-type]
    # Too many vectors to search: none, and the caller searches under each stage's room alone.
    assert shared_room_caps(plan, costs, [8, 8, 8], [64 * GIB, two, two], limit=2) == []  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(6))
def test_the_decision_is_the_best_split_under_the_measured_speeds(seed: int) -> None:
    """Against brute force: a fleet file with each profile times its measured factor is the
    calibrated model (the ends scale with the layer time there), so its best split of the same
    order is what calibration must find, and the 10% rule is checked against its steps."""
    import random

    rng = random.Random(seed)
    profiled = [0.1, 0.2, 0.15]
    config = config_with(shardpool={"stages": 3})
    workload = Workload.from_config(config)
    plan = plan_pipeline(SHAPE, workload, three_hosts(profiled))
    order = [stage.slot for stage in plan.stages]
    factor = {name: rng.uniform(0.4, 2.5) for name in "abc"}
    truth = three_hosts([s * factor[name] for name, s in zip("abc", profiled, strict=True)])
    decision = rebalance_decision(plan, measured_as(plan, [factor[name] for name in order]), config)

    running = replace(workload, warmup_lead=plan.warmup_lead)  # a re-split keeps the stages' schedule

    def step(counts: list[int]) -> float:
        return evaluate_split(SHAPE, running, truth, devices=order, layers=counts).predicted_step_s

    splits = [
        [b - a for a, b in itertools.pairwise([0, *cut, SHAPE.num_layers])]
        for cut in itertools.combinations(range(1, SHAPE.num_layers), 2)
    ]
    best = min(step(counts) for counts in splits)
    current = step([stage.num_layers for stage in plan.stages])
    if decision is None:
        assert best > current * (1 - MIN_GAIN)
    else:
        assert decision.current_step_s == pytest.approx(current, rel=1e-9)
        assert decision.predicted_step_s == pytest.approx(best, rel=1e-9)
        assert best <= current * (1 - MIN_GAIN)


#: bench_hetero's 16-layer model (scripts/bench_hetero.py FULL; the tokenizer kept 1229 tokens).
BENCH_SHAPE = ModelShape.from_config_json(
    {
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_hidden_layers": 16,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1229,
    },
    name="bench-hetero",
)


def test_the_bench_run_that_did_not_rebalance_gains_under_ten_percent() -> None:
    """docs/performance.md (issue 10, 2026-11-23): the pooled plan put embed + 4 layers on b and
    12 + lm_head on a; b computed 8.81 s per step and waited 4.44 s (32 %), a computed 12.96 s.
    The calibrated model is right about that step (13.52 s predicted, 13.77 s measured), and its
    best split at layer granularity, 5/11, moves 1.08 s of a's compute onto b as 2.2 s: 12.59 s,
    7 % faster, under the 10 % rule. The wait was b waiting for the slower a, which no split of
    16 layers removes: a at 11 layers still computes 11.9 s against b's 11.0 s."""
    fleet = Fleet(
        devices=(
            Device(name="a", memory_bytes=8 * GIB, seconds_per_layer=0.0506, kind="cpu", host="a"),
            Device(name="b", memory_bytes=8 * GIB, seconds_per_layer=0.14307, kind="cpu", host="b"),
        )
    )
    config = config_with(sequence_len=128, micro_batch_size=1, lora_r=8)
    plan = evaluate_split(
        BENCH_SHAPE, Workload.from_config(config), fleet, devices=["b", "a"], layers=[4, 12]
    )
    measured = [
        StepMeasurement(
            step=s, step_seconds=13.77, stage_compute_s=(8.8107, 12.9599), stage_wait_s=(4.4446, 0.3636)
        )
        for s in range(3, 8)
    ]
    calibration = calibrate(plan, measured, config)
    assert [round(ms) for ms in calibration.measured_ms_per_layer] == [138, 66]  # b 2.2 s, a 1.06 s a step
    assert rebalance_decision(plan, measured, config) is None
    below = rebalance_decision(plan, measured, config, min_gain=0.0)
    assert below is not None and below.layers == [(0, 5), (5, 16)]
    assert below.current_step_s == pytest.approx(13.52, abs=0.01)
    assert below.current_step_s / 13.77 == pytest.approx(0.98, abs=0.01), "calibrated: within 2 % of the run"
    assert below.predicted_step_s == pytest.approx(12.59, abs=0.01)
    assert 1 - below.predicted_step_s / below.current_step_s == pytest.approx(0.068, abs=0.002)


def test_the_bench_worked_example_of_the_docs() -> None:
    """docs/planner.md, "Worked example: the bench": the pooled plan of `bench_hetero.py` (stage
    scope, 0.6 + 0.3 CPU, 2026-11-24; its plan.json kept next to this test), predicted from the
    profiles, then calibrated on the run's steps 2 and 3 as the launcher does."""
    data = json.loads((Path(__file__).parent / "bench_hetero_pooled_plan.json").read_text())
    plan = Plan.from_json(data)
    assert [(s.slot, s.start, s.stop) for s in plan.stages] == [("b/cpu", 0, 5), ("a/cpu", 5, 16)]
    costs = [stage.costs for stage in plan.stages]
    assert costs[0] is not None and costs[1] is not None
    assert [round(c.seconds(s.num_layers) * 1e3, 1) for c, s in zip(costs, plan.stages, strict=True)] == [
        557.4,
        600.8,
    ]
    problem = SplitProblem(
        costs=costs, caps=[c.max_layers() for c in costs], layers=16, microbatches=16, schedule="1f1b"
    )
    assert problem.simulate([5, 11]) == pytest.approx(10.207, abs=1e-3)
    assert best_split(problem)[1] == [5, 11], "the profiles' best split"
    config = config_with(sequence_len=128, micro_batch_size=1, lora_r=8)
    measured = [
        StepMeasurement(
            step=2, step_seconds=13.829, stage_compute_s=(11.4163, 12.5594), stage_wait_s=(2.269, 0.751)
        ),
        StepMeasurement(
            step=3, step_seconds=13.739, stage_compute_s=(12.2234, 12.2754), stage_wait_s=(1.326, 0.939)
        ),
    ]
    calibration = calibrate(plan, measured, config)
    assert [round(x, 3) for x in calibration.speed] == [1.325, 1.292]
    assert calibrated_plan(plan, measured, config).predicted_step_s == pytest.approx(13.194, abs=1e-3)
    assert rebalance_decision(plan, measured, config) is None, "5/11 stays the best split"
