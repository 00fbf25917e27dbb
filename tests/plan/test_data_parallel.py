"""Data parallelism with shares: the share split, the device choice, and when the planner prefers it."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.data_parallel import (
    best_shares,
    data_parallel_candidate,
    ring_seconds,
    shares_step_seconds,
)
from shardpool.plan.fleet import Device, Fleet, LinkSpec
from shardpool.plan.memory_model import lora_params_per_layer
from shardpool.plan.planner import plan_pipeline
from shardpool.plan.result import Plan, plan_table
from shardpool.plan.search_context import SearchContext
from shardpool.plan.time_model import GRADIENT_BYTES

GIB = 2**30
SHAPE = ModelShape.from_config_json(
    {
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_hidden_layers": 16,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1173,
    },
    name="bench-16",
)
WORKLOAD = Workload(micro_batch_size=1, sequence_len=128, gradient_accumulation_steps=16, lora_r=8)
LINK = LinkSpec(bandwidth=100e6, latency=2e-3)


def cpu_host(host: str, seconds_per_layer: float, memory: int = 8 * GIB) -> Device:
    """One mesh host's CPU, profiled at ``seconds_per_layer``."""
    return Device(
        name=f"{host}/cpu",
        host=host,
        kind="cpu",
        torch_device="cpu",
        memory_bytes=memory,
        seconds_per_layer=seconds_per_layer,
    )


def two_hosts(fast_s: float = 0.036, slow_s: float = 0.081, memory: int = 8 * GIB) -> Fleet:
    """The heterogeneity bench's two hosts: one CPU each, the second 2.25 × slower per layer."""
    return Fleet(
        devices=(cpu_host("a", fast_s, memory), cpu_host("b", slow_s, memory)),
        links={frozenset(("a", "b")): LINK},
    )


def brute_force_shares(seconds: list[float], after: list[float], microbatches: int) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, microbatches), len(seconds) - 1):
        bounds = [0, *cuts, microbatches]
        shares = [high - low for low, high in itertools.pairwise(bounds)]
        best = min(best, max(n * s + a for n, s, a in zip(shares, seconds, after, strict=True)))
    return best


@settings(max_examples=200, deadline=None)
@given(
    seconds=st.lists(st.floats(0.01, 5.0), min_size=2, max_size=4),
    after=st.lists(st.floats(0.0, 1.0), min_size=4, max_size=4),
    microbatches=st.integers(4, 24),
)
def test_best_shares_is_the_optimum_of_every_split(
    seconds: list[float], after: list[float], microbatches: int
) -> None:
    after = after[: len(seconds)]
    shares = best_shares(seconds, after, microbatches)
    assert sum(shares) == microbatches and min(shares) >= 1
    found = max(n * s + a for n, s, a in zip(shares, seconds, after, strict=True))
    assert found == pytest.approx(brute_force_shares(seconds, after, microbatches), rel=1e-12)


def test_best_shares_needs_a_micro_batch_for_every_replica() -> None:
    with pytest.raises(ValueError, match="cannot give each of 3 replicas one"):
        best_shares([1.0, 1.0, 1.0], [0.0, 0.0, 0.0], 2)


def test_two_hosts_that_each_hold_the_model_split_the_batch_by_speed() -> None:
    fleet = two_hosts()
    plan = plan_pipeline(SHAPE, replace(WORKLOAD, data_parallel="auto"), fleet)
    pipeline = plan_pipeline(SHAPE, WORKLOAD, fleet)
    assert plan.is_data_parallel and not pipeline.is_data_parallel
    assert [stage.host for stage in plan.data_parallel] == ["a", "b"]  # the fastest first: it evaluates
    assert plan.shares == [11, 5]  # 16 micro-batches at 1 : 2.25 per layer, the ends priced too
    assert all((stage.start, stage.stop) == (0, 16) for stage in plan.data_parallel)
    assert plan.stages == [plan.data_parallel[0]]
    # Without the fill and drain (1/17 of a balanced pipeline's step), the replicas' step is
    # shorter than the best pipeline's by more than 3 %.
    assert plan.predicted_step_s < 0.97 * pipeline.predicted_step_s
    ctx = SearchContext(SHAPE, replace(WORKLOAD, data_parallel="auto"), fleet)
    costs = [ctx.costs((d,), 0) for d in (0, 1)]
    expected = shares_step_seconds(
        [c.seconds(16) for c in costs], [c.after(16) for c in costs], [11, 5], ring_seconds(ctx, (0, 1))
    )
    assert plan.predicted_step_s == pytest.approx(expected)


def test_the_ring_all_reduce_moves_the_whole_models_lora_gradients_over_the_slowest_link() -> None:
    slow = LinkSpec(bandwidth=10e6, latency=5e-3)
    third = cpu_host("c", 0.05)
    base = two_hosts()
    fleet = replace(
        base,
        devices=(*base.devices, third),
        links={frozenset("ab"): LINK, frozenset("bc"): slow, frozenset("ac"): LINK},
    )
    ctx = SearchContext(SHAPE, WORKLOAD, fleet)
    nbytes = lora_params_per_layer(SHAPE, WORKLOAD) * 16 * GRADIENT_BYTES
    assert ring_seconds(ctx, (0, 1)) == pytest.approx(nbytes / 100e6 + 2 * 2e-3)
    # a -> b -> c -> a: 2 (N - 1) / N of the bytes at b-c's 10 MB/s, 2 (N - 1) latencies of its 5 ms
    assert ring_seconds(ctx, (0, 1, 2)) == pytest.approx(4 / 3 * nbytes / 10e6 + 4 * 5e-3)
    assert ring_seconds(ctx, (0,)) == 0.0


def test_a_device_that_cannot_hold_the_whole_model_keeps_the_pipeline() -> None:
    roomy = two_hosts()
    need = plan_pipeline(SHAPE, replace(WORKLOAD, data_parallel="auto"), roomy).data_parallel[0].memory_bytes
    small = cpu_host("b", 0.081, memory=int(need * 0.95))  # 11 layers, not 16
    fleet = replace(roomy, devices=(roomy.devices[0], small))
    plan = plan_pipeline(SHAPE, replace(WORKLOAD, data_parallel="auto"), fleet)
    assert not plan.is_data_parallel
    assert len(plan.stages) == 2  # the pipeline still pools both hosts


def test_what_fixes_the_pipeline_keeps_it() -> None:
    fleet = two_hosts()
    for workload in (
        replace(WORKLOAD, data_parallel="off"),
        replace(WORKLOAD, data_parallel="auto", stages=2),
        replace(WORKLOAD, data_parallel="auto", layers=(11, 5)),
        replace(WORKLOAD, data_parallel="auto", replicas=2),
    ):
        assert not plan_pipeline(SHAPE, workload, fleet).is_data_parallel, workload


def test_data_parallel_on_takes_replicas_even_where_the_pipeline_is_predicted_faster() -> None:
    fleet = two_hosts(fast_s=0.05, slow_s=0.1)  # 2 : 1, as profiled in the bench: 11 / 5 leaves a 3 % long
    pipeline = plan_pipeline(SHAPE, replace(WORKLOAD, data_parallel="auto"), fleet)
    forced = plan_pipeline(SHAPE, replace(WORKLOAD, data_parallel="on"), fleet)
    assert not pipeline.is_data_parallel and forced.shares == [11, 5]
    assert pipeline.predicted_step_s < forced.predicted_step_s
    one = Fleet(devices=fleet.devices[:1])
    with pytest.raises(ShardpoolError, match="data_parallel is on but fewer than two devices"):
        plan_pipeline(SHAPE, replace(WORKLOAD, data_parallel="on"), one)


def test_slots_of_one_shared_device_are_no_replicas_unless_shares_ask() -> None:
    shared = Fleet(
        devices=tuple(
            Device(
                name=f"cpu#{i}",
                host="vm",
                kind="cpu",
                torch_device="cpu",
                memory_bytes=4 * GIB,
                seconds_per_layer=0.07,
                shared_by=2,
            )
            for i in range(2)
        )
    )
    assert data_parallel_candidate(SearchContext(SHAPE, WORKLOAD, shared)) is None
    assert not plan_pipeline(SHAPE, replace(WORKLOAD, data_parallel="auto"), shared).is_data_parallel
    forced = plan_pipeline(SHAPE, replace(WORKLOAD, shares=(12, 4)), shared)
    assert forced.shares == [12, 4] and forced.search == "given"
    assert [stage.slot for stage in forced.data_parallel] == ["cpu#0", "cpu#1"]


def test_given_shares_go_to_the_fastest_devices_first() -> None:
    plan = plan_pipeline(SHAPE, replace(WORKLOAD, shares=(4, 12)), two_hosts())
    assert [stage.host for stage in plan.data_parallel] == ["a", "b"] and plan.shares == [4, 12]
    with pytest.raises(ShardpoolError, match="shardpool.shares names 3 replicas but fewer devices"):
        plan_pipeline(SHAPE, replace(WORKLOAD, shares=(6, 5, 5)), two_hosts())


def test_shares_must_cover_the_step() -> None:
    with pytest.raises(ShardpoolError, match="adding up to the step's 16"):
        replace(WORKLOAD, shares=(10, 5))


def test_a_third_host_joins_only_where_it_shortens_the_step() -> None:
    fleet = two_hosts()
    snail = cpu_host("c", 5.0)
    quick = cpu_host("c", 0.072)
    slow_plan = plan_pipeline(
        SHAPE, replace(WORKLOAD, data_parallel="auto"), replace(fleet, devices=(*fleet.devices, snail))
    )
    assert slow_plan.shares == [11, 5] and slow_plan.left_out == ["c/cpu"]
    three = plan_pipeline(
        SHAPE, replace(WORKLOAD, data_parallel="auto"), replace(fleet, devices=(*fleet.devices, quick))
    )
    assert len(three.shares) == 3 and sum(three.shares) == 16


def test_plan_json_keeps_the_replicas_and_shares() -> None:
    plan = plan_pipeline(SHAPE, replace(WORKLOAD, data_parallel="auto"), two_hosts())
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again.shares == plan.shares
    assert [(s.host, s.start, s.stop) for s in again.data_parallel] == [
        (s.host, s.start, s.stop) for s in plan.data_parallel
    ]
    broken = plan.to_json() | {"shares": [16]}
    with pytest.raises(ShardpoolError, match="data_parallel replicas and shares do not match"):
        Plan.from_json(broken)


def test_the_plan_table_shows_each_replica_and_its_share() -> None:
    from rich.console import Console

    plan = plan_pipeline(SHAPE, replace(WORKLOAD, data_parallel="auto"), two_hosts())
    console = Console(width=160, record=True)
    console.print(plan_table(plan))
    text = console.export_text()
    assert "r0" in text and "r1" in text
    assert "[0, 16) × 11 mb" in text and "[0, 16) × 5 mb" in text
    assert "Data parallel: 2 replicas" in text and "11 / 5" in text


def test_worked_example_of_data_parallelism() -> None:
    """docs/planner.md, "Data parallelism with shares": 11 / 5, a 6.90 s step, 1.40 × a alone."""
    seconds, after, allreduce = [0.6, 1.35], [0.05, 0.1], 0.05
    assert best_shares(seconds, after, 16) == [11, 5]
    assert shares_step_seconds(seconds, after, [11, 5], allreduce) == pytest.approx(6.90)
    assert shares_step_seconds(seconds, after, [12, 4], allreduce) == pytest.approx(7.30)
    assert shares_step_seconds(seconds, after, [10, 6], allreduce) == pytest.approx(8.25)
    alone = 16 * 0.6 + 0.05
    assert alone == pytest.approx(9.65) and alone / 6.90 == pytest.approx(1.40, abs=0.005)
