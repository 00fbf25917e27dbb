"""The simulated pipeline step: hand-computed cases, closed forms proven equal, and its properties."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpool.errors import ShardpoolError
from shardpool.plan.pipeline_sim import NO_TRANSFER, StageTimes, Transfer, simulate_step
from shardpool.plan.time_model import ring_allreduce_seconds, step_seconds

SCHEDULES = ("1f1b", "gpipe")


def chain(times: list[tuple[float, float]], link: Transfer = NO_TRANSFER) -> list[StageTimes]:
    """Stages with (forward, backward) times and the same transfer on every boundary."""
    last = len(times) - 1
    return [
        StageTimes(
            f, b, to_next=link if s < last else NO_TRANSFER, to_previous=link if s > 0 else NO_TRANSFER
        )
        for s, (f, b) in enumerate(times)
    ]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_stages_two_microbatches_by_hand(schedule: str) -> None:
    # No links: F0 [0,1] F1 [1,2] on stage 0; stage 1 F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7] (1F1B);
    # stage 0 B0 [4,6] B1 [7,9]. GPipe: stage 1 F0 F1 B0 B1 ends at 7 too, stage 0 at 9.
    stages = chain([(1.0, 2.0), (1.0, 2.0)])
    result = simulate_step(stages, microbatches=2, schedule=schedule)
    assert result.step_s == pytest.approx(9.0)
    assert result.finish_s == pytest.approx((9.0, 7.0))
    # Each transfer holds the link 0.5 s and arrives 0.25 s later (0.75 s in all). 1F1B:
    # stage 0 F0 [0,1] -> arrives 1.75, F1 [1,2] -> link [2,2.5] arrives 2.75;
    # stage 1 F0 [1.75,2.75] B0 [2.75,4.75] -> arrives 5.5, F1 [4.75,5.75] B1 [5.75,7.75] -> 8.5;
    # stage 0 B0 [5.5,7.5] B1 [8.5,10.5]. Without overlap it would be 3 x (3 + 1.5) = 13.5.
    linked = chain([(1.0, 2.0), (1.0, 2.0)], Transfer(busy_s=0.5, latency_s=0.25))
    result = simulate_step(linked, microbatches=2, schedule=schedule)
    assert result.step_s == pytest.approx(10.5)
    assert result.finish_s == pytest.approx((10.5, 8.5))
    # After-step work (all-reduce + optimizer) of the stage that finishes first can decide the step.
    slow_optimizer = [linked[0], replace(linked[1], after_s=3.0)]
    assert simulate_step(slow_optimizer, microbatches=2, schedule=schedule).step_s == pytest.approx(11.5)


def test_worked_example_of_the_docs() -> None:
    """docs/planner.md, "Worked example": the timeline there is this simulation."""
    link = Transfer(busy_s=0.5, latency_s=0.5)
    stages = [
        StageTimes(2.0, 4.0, to_next=link, after_s=0.2),
        StageTimes(3.0, 3.0, to_previous=link, after_s=0.3),
    ]
    # Orders: stage 0 F0 F1 F2 B0 F3 B1 B2 B3 (one warm-up forward more than the textbook 1F1B),
    # stage 1 F0 B0 F1 B1 F2 B2 F3 B3. By hand (each transfer 0.5 s on the link + 0.5 s latency):
    # stage 0 F0 0-2 F1 2-4 F2 4-6 (activations arrive 3, 5, 7); stage 1 F0 3-6 B0 6-9 (gradient 0
    # at 10) F1 9-12 B1 12-15 (16) F2 15-18 B2 18-21 (22); stage 0 B0 10-14 F3 14-16 (arrives 17)
    # B1 16-20 B2 22-26; stage 1 F3 21-24 B3 24-27 (arrives 28); stage 0 B3 28-32.
    # The textbook warm-up (F0 F1 B0 F2 ...) gave 34.0 / 30.0 and a 34.2 s step.
    result = simulate_step(stages, microbatches=4, schedule="1f1b")
    assert result.finish_s == pytest.approx((32.0, 28.0))
    assert result.step_s == pytest.approx(32.2)
    assert result.bubble_fraction == pytest.approx(1 - 24 / 32.2)
    assert step_seconds(7.0, microbatches=4, num_stages=2) == pytest.approx(35.0)  # the old additive model


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 24),
    st.floats(0.01, 5.0),
    st.floats(0.01, 5.0),
    st.sampled_from(SCHEDULES),
)
def test_identical_stages_without_links_match_the_closed_form(
    num_stages: int, microbatches: int, forward: float, backward: float, schedule: str
) -> None:
    stages = chain([(forward, backward)] * num_stages)
    result = simulate_step(stages, microbatches=microbatches, schedule=schedule)
    expected = step_seconds(forward + backward, microbatches=microbatches, num_stages=num_stages)
    assert result.step_s == pytest.approx(expected, rel=1e-12)
    assert result.bubble_fraction == pytest.approx((num_stages - 1) / (microbatches + num_stages - 1))


stage_lists = st.lists(
    st.tuples(
        st.floats(0.01, 3.0),
        st.floats(0.01, 3.0),
        st.floats(0.0, 2.0),
        st.floats(0.0, 0.5),
        st.floats(0.0, 2.0),
        st.floats(0.0, 0.5),
    ),
    min_size=1,
    max_size=5,
)


def build(raw: list[tuple[float, ...]]) -> list[StageTimes]:
    last = len(raw) - 1
    return [
        StageTimes(
            f,
            b,
            to_next=Transfer(nb, nl) if s < last else NO_TRANSFER,
            to_previous=Transfer(pb, pl) if s > 0 else NO_TRANSFER,
        )
        for s, (f, b, nb, nl, pb, pl) in enumerate(raw)
    ]


@settings(max_examples=150, deadline=None)
@given(stage_lists, st.integers(1, 16))
def test_gpipe_equals_its_flow_shop_closed_form(raw: list[tuple[float, ...]], microbatches: int) -> None:
    """GPipe is two flow shops of identical jobs (forwards down, backwards up), each link a machine of
    its busy time and its latency a delay: ``Σ machines + Σ latencies + (M - 1)(max forward machine +
    max backward machine)`` for stage 0, which finishes last."""
    stages = build(raw)
    forward_machines = [s.forward_s for s in stages] + [s.to_next.busy_s for s in stages[:-1]]
    backward_machines = [s.backward_s for s in stages] + [s.to_previous.busy_s for s in stages[1:]]
    latencies = sum(s.to_next.latency_s for s in stages[:-1]) + sum(
        s.to_previous.latency_s for s in stages[1:]
    )
    closed = (
        sum(forward_machines)
        + sum(backward_machines)
        + latencies
        + (microbatches - 1) * (max(forward_machines) + max(backward_machines))
    )
    result = simulate_step(stages, microbatches=microbatches, schedule="gpipe")
    assert result.step_s == pytest.approx(closed, rel=1e-9)


@pytest.mark.parametrize("num_stages", [2, 3, 4])
@pytest.mark.parametrize("link_s", [0.0, 0.1, 0.4, 2.0])
def test_one_f_one_b_steady_state_cycle(num_stages: int, link_s: float) -> None:
    """The steady state of 1F1B on identical stages (forward f, backward b, a transfer of x each
    way), per micro-batch, is the heaviest cycle of its dependency graph per micro-batch it spans.

    Stage s runs F(j) just before B(j - w_s) and B(k) just before F(k + w_s + 1), where w_s is its
    warm-up: S - s forwards (the textbook S - 1 - s plus one), none on the last stage. Stages a..c
    (n of them) close a cycle B_a(k) -> F_a(k + w_a + 1) -> down to c -> B_c(k + w_a + 1 - w_c)
    -> back up to B_a: n (f + b) + 2 (n - 1) x over w_a + 1 - w_c micro-batches. That span is n
    when c is not the last stage (neighbouring warm-ups still differ by one: the round trip stays on
    the cycle), and n + 1 when c is the last (the extra forward gives the last link a whole
    micro-batch of slack). The heaviest: stages 0..S-2, ``f + b + 2 (S - 2) x / (S - 1)``, or the
    whole pipeline, ``(S (f + b) + 2 (S - 1) x) / (S + 1)``. So at S = 2 a link with 2x < f + b
    costs nothing in steady state, where the textbook warm-up paid ``2x`` per micro-batch (and
    ``S (f + b) + 2 (S - 1) x`` per S micro-batches in all). Both cycles repeat over
    (S - 1)(S + 1) micro-batches; from M = 32 on the fill's slack is spent."""
    f, b, x = 1.0, 2.0, link_s
    stages = chain([(f, b)] * num_stages, Transfer(busy_s=x / 2, latency_s=x / 2))
    span = (num_stages - 1) * (num_stages + 1)
    steps = [simulate_step(stages, microbatches=m, schedule="1f1b").step_s for m in (32, 32 + span)]
    per_microbatch = max(
        f + b + 2 * (num_stages - 2) * x / (num_stages - 1),
        (num_stages * (f + b) + 2 * (num_stages - 1) * x) / (num_stages + 1),
    )
    assert steps[1] - steps[0] == pytest.approx(span * per_microbatch)


@settings(max_examples=150, deadline=None)
@given(stage_lists, st.integers(1, 12), st.sampled_from(SCHEDULES), st.floats(0.0, 1.0), st.integers(0, 4))
def test_adding_time_never_makes_a_step_faster(
    raw: list[tuple[float, ...]], microbatches: int, schedule: str, extra: float, which: int
) -> None:
    stages = build(raw)
    base = simulate_step(stages, microbatches=microbatches, schedule=schedule).step_s
    s = which % len(stages)
    slower = list(stages)
    slower[s] = replace(
        stages[s],
        to_next=Transfer(stages[s].to_next.busy_s + extra, stages[s].to_next.latency_s + extra)
        if s < len(stages) - 1
        else NO_TRANSFER,
        to_previous=Transfer(stages[s].to_previous.busy_s, stages[s].to_previous.latency_s + extra)
        if s > 0
        else NO_TRANSFER,
    )
    assert simulate_step(slower, microbatches=microbatches, schedule=schedule).step_s >= base - 1e-9
    slower[s] = replace(slower[s], forward_s=slower[s].forward_s + extra, after_s=extra)
    assert simulate_step(slower, microbatches=microbatches, schedule=schedule).step_s >= base - 1e-9


@settings(max_examples=150, deadline=None)
@given(stage_lists, st.integers(1, 12), st.sampled_from(SCHEDULES), st.lists(st.floats(0.0, 1.0), min_size=5))
def test_one_device_per_stage_named_explicitly_is_the_same_simulation(
    raw: list[tuple[float, ...]], microbatches: int, schedule: str, after: list[float]
) -> None:
    """The shared-device simulation, given a device per stage, reproduces the proven one exactly."""
    stages = [replace(times, after_s=after[s]) for s, times in enumerate(build(raw))]
    alone = simulate_step(stages, microbatches=microbatches, schedule=schedule)
    named = simulate_step(stages, microbatches=microbatches, schedule=schedule, devices=range(len(stages)))
    assert named.step_s == pytest.approx(alone.step_s, abs=1e-9)
    assert named.finish_s == pytest.approx(alone.finish_s, abs=1e-9)
    assert named.device_compute_s == pytest.approx(alone.compute_s)


def test_a_shared_device_runs_one_action_at_a_time_and_its_after_step_work_in_turn() -> None:
    # Three stages, the first and the last on device 0, one micro-batch, no links: F0 on s0 [0,1],
    # on s1 [1,3], on s2 [3,4]; B0 on s2 [4,6], s1 [6,10], s0 [10,12]; then device 0's two
    # optimizer steps one after the other (0.5 + 0.25), device 1's (2.0) from 10.
    stages = [
        StageTimes(1.0, 2.0, after_s=0.5),
        StageTimes(2.0, 4.0, after_s=2.0),
        StageTimes(1.0, 2.0, after_s=0.25),
    ]
    shared = simulate_step(stages, microbatches=1, schedule="1f1b", devices=[0, 1, 0])
    assert shared.finish_s == pytest.approx((12.0, 10.0, 6.0))
    assert shared.step_s == pytest.approx(12.75)
    assert shared.device_compute_s == pytest.approx((6.0, 6.0))
    # Two micro-batches: device 0 can never be in two places, so its 12 s of compute plus the
    # wait for device 1's first forward bound the step from below.
    two = simulate_step(stages, microbatches=2, schedule="1f1b", devices=[0, 1, 0])
    assert two.step_s >= 2 * 6.0 + 2.0 + 0.75
    with pytest.raises(ShardpoolError, match="one per stage"):
        simulate_step(stages, microbatches=1, schedule="1f1b", devices=[0, 1])


def test_a_v_shaped_placement_of_the_bench_beats_its_two_stages_but_not_by_the_margin_it_needs() -> None:
    """docs/performance.md, "A V-shaped placement, simulated": bench_hetero's measured costs per
    micro-batch (a 0.536 s, b 1.164 s a layer per step of 16; lm_head 0.35 s on b, 0.16 s on a;
    forward a third of forward + backward; 5 ms links; 0.05 s after-step work)."""
    microbatches, fastest_alone_s = 16, 8.26
    a_layer, b_layer, b_head = 0.536 / 16, 1.164 / 16, 0.35 / 16
    a_head = b_head * a_layer / b_layer
    link = Transfer(latency_s=0.005)

    def stage(seconds: float, *, first: bool = False, last: bool = False) -> StageTimes:
        return StageTimes(
            seconds / 3, 2 * seconds / 3, to_next=NO_TRANSFER if last else link,
            to_previous=NO_TRANSFER if first else link, after_s=0.05,
        )  # fmt: skip

    two = simulate_step(
        [stage(11 * a_layer, first=True), stage(5 * b_layer + b_head, last=True)],
        microbatches=microbatches, schedule="1f1b",
    )  # fmt: skip
    assert fastest_alone_s / two.step_s == pytest.approx(1.252, abs=0.001)  # measured: 1.248
    v_shaped = {
        first: simulate_step(
            [
                stage(first * a_layer, first=True),
                stage(5 * b_layer),
                stage((11 - first) * a_layer + a_head, last=True),
            ],
            microbatches=microbatches,
            schedule="1f1b",
            devices=[0, 1, 0],
        ).step_s  # fmt: skip
        for first in range(2, 11)
    }
    best = min(v_shaped, key=v_shaped.__getitem__)
    assert best == 8
    assert fastest_alone_s / v_shaped[best] == pytest.approx(1.293, abs=0.001)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_fast_links_are_hidden_by_overlap(schedule: str) -> None:
    """Under GPipe a transfer that is short next to the compute costs its time once per boundary
    and direction (fill and drain), not once per micro-batch as when it was added to compute;
    1F1B hides part of it (see the cycle above), and both beat the additive model."""
    compute = chain([(1.0, 2.0)] * 4)
    link = Transfer(busy_s=0.01, latency_s=0.0)
    no_links = simulate_step(compute, microbatches=32, schedule=schedule).step_s
    linked = simulate_step(chain([(1.0, 2.0)] * 4, link), microbatches=32, schedule=schedule).step_s
    if schedule == "gpipe":
        assert linked == pytest.approx(no_links + 2 * 3 * link.seconds)
    assert linked - no_links < 0.8 * (32 + 3) * 2 * link.seconds  # the additive model's cost


def test_ring_allreduce() -> None:
    assert ring_allreduce_seconds(1e6, replicas=1, bandwidth=1e9, latency=1e-3) == 0.0
    # 2 (N-1)/N x bytes / bandwidth + 2 (N-1) x latency
    assert ring_allreduce_seconds(4e6, replicas=4, bandwidth=1e9, latency=1e-3) == pytest.approx(
        1.5 * 4e-3 + 6e-3
    )


@pytest.mark.parametrize(("latency_s", "lead_needed"), [(0.5, 1), (2.0, 2), (5.0, 4)])
def test_a_lead_deep_enough_for_the_round_trip_reaches_the_path_bound(
    latency_s: float, lead_needed: int
) -> None:
    """Two identical stages (forward 1 s, backward 2 s) over a link of ``latency_s`` each way, M = 16.
    No schedule beats the path from stage 0's first forward through all of stage 1's actions and
    back to stage 0's last backward: 16 x 3 + 1 + 2 + 2x. At lead 1 stage 0 stalls for every
    gradient that a slow round trip holds back (60 s at x = 2, 96 s at x = 5); a deeper lead keeps
    it computing until the bound is reached, and deeper still changes nothing here."""
    link = Transfer(busy_s=0.0, latency_s=latency_s)
    stages = chain([(1.0, 2.0), (1.0, 2.0)], link)
    bound = 16 * 3.0 + 1.0 + 2.0 + 2 * latency_s
    steps = [
        simulate_step(stages, microbatches=16, schedule="1f1b", lead=lead).step_s for lead in range(1, 9)
    ]
    assert min(steps) == pytest.approx(bound)
    assert steps.index(min(steps)) + 1 == lead_needed
    assert all(step == pytest.approx(bound) for step in steps[lead_needed - 1 :])
    if lead_needed > 1:
        assert steps[0] > bound + latency_s
    # GPipe has no warm-up to deepen: the lead changes nothing.
    assert simulate_step(stages, microbatches=16, schedule="gpipe", lead=4).step_s == pytest.approx(
        simulate_step(stages, microbatches=16, schedule="gpipe").step_s
    )
