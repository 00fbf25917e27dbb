"""The pipeline's sends and receives cannot deadlock on a native library (NCCL, RCCL, XCCL).

gloo buffers every send, so the CPU runs of the pipeline cannot show this; the simulator in
``tests/helpers/wire_order.py`` replays each rank's wire operations as a native library runs them
(one queue per communicator, a send done only when the peer's matching receive runs) against the
communicators :func:`~shardpool.train.transport.plan_groups` makes, for every schedule, warm-up
lead and stage count the planner can choose.
"""

from __future__ import annotations

import pytest

from shardpool.contract.schedule import MAX_LEAD
from shardpool.train.transport import GroupPlan, RankDevice, plan_groups
from tests.helpers.wire_order import pipeline_ops, simulate_wire

SCHEDULES = ("1f1b", "gpipe")
MICROBATCHES = (1, 2, 3, 4, 5, 8, 16, 32)


def _gpus(count: int) -> list[RankDevice]:
    """``count`` ranks, each on its own CUDA GPU with NCCL."""
    return [RankDevice("cuda", True, f"h{index}/cuda:0") for index in range(count)]


def _one_communicator_per_pair(plan: GroupPlan):  # noqa: ANN202 - a channel function
    """The wire as it was: both directions of a native boundary in one communicator."""

    def channel(sender: int, receiver: int) -> object:
        key = plan.channel(sender, receiver)
        return None if key is None else (min(sender, receiver), max(sender, receiver))

    return channel


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (3, 8), (4, 16)])
def test_one_communicator_for_both_directions_deadlocks_1f1b(stages: int, microbatches: int) -> None:
    plan = plan_groups(_gpus(stages), num_stages=stages, replicas=1)
    ops = pipeline_ops("1f1b", num_stages=stages, num_microbatches=microbatches, lead=1)
    outcome = simulate_wire(ops, _one_communicator_per_pair(plan))
    assert not outcome.finished
    # stage 0 is stuck on the activation send its neighbour cannot take before its gradient goes
    assert outcome.stuck[0].kind == "recv" and outcome.stuck[0].tag == "B"


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages", range(2, 9))
def test_every_schedule_lead_and_depth_finishes_on_the_planned_communicators(
    schedule: str, stages: int
) -> None:
    plan = plan_groups(_gpus(stages), num_stages=stages, replicas=1)
    for microbatches in MICROBATCHES:
        for lead in range(1, MAX_LEAD + 1):
            ops = pipeline_ops(schedule, num_stages=stages, num_microbatches=microbatches, lead=lead)
            outcome = simulate_wire(ops, plan.channel)
            assert outcome.finished, (schedule, stages, microbatches, lead, str(outcome))


def test_replicas_and_mixed_boundaries_finish_too() -> None:
    # Two replicas of cuda -> cuda (same GPU: gloo) -> cpu -> cuda -> cuda: native and staged
    # boundaries side by side, replica groups beside them.
    devices = [
        RankDevice("cuda", True, "A/cuda:0"),
        RankDevice("cuda", True, "A/cuda:1"),
        RankDevice("cuda", True, "A/cuda:1"),
        RankDevice("cpu", False, "A/cpu"),
        RankDevice("cuda", True, "B/cuda:0"),
        RankDevice("cuda", True, "B/cuda:1"),
    ]
    plan = plan_groups(devices * 2, num_stages=6, replicas=2)
    assert [plan.channel(rank, rank + 1) for rank in range(5)] == [(0, 1), None, None, None, (4, 5)]
    for schedule in SCHEDULES:
        for lead in (1, 2, 5):
            ops = pipeline_ops(schedule, num_stages=6, num_microbatches=12, lead=lead, replicas=2)
            assert simulate_wire(ops, plan.channel).finished, (schedule, lead)


def test_a_native_boundary_has_one_communicator_per_direction() -> None:
    plan = plan_groups(_gpus(3), num_stages=3, replicas=1)
    assert plan.channel(0, 1) == (0, 1) and plan.channel(1, 0) == (1, 0)
    assert plan.channel(1, 2) == (1, 2) and plan.channel(2, 1) == (2, 1)
    assert plan.subgroups == (("nccl", (0, 1)), ("nccl", (1, 0)), ("nccl", (1, 2)), ("nccl", (2, 1)))
    # each communicator carries one direction: only sends on one side, only receives on the other
    for sender, receiver in ((0, 1), (1, 0), (1, 2), (2, 1)):
        ops = pipeline_ops("1f1b", num_stages=3, num_microbatches=6, lead=1)
        kinds = {
            (rank, op.kind)
            for rank, rank_ops in ops.items()
            for op in rank_ops
            if op.kind in ("send", "recv")
            and plan.channel(*((rank, op.peer) if op.kind == "send" else (op.peer, rank)))
            == (sender, receiver)
        }
        assert kinds == {(sender, "send"), (receiver, "recv")}
