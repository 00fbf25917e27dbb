"""The per-step gather: named fields in, named fields out, the optional ones where the job has them."""

from __future__ import annotations

import pytest

from shardpool.errors import ShardpoolError
from shardpool.train.step_report import GatheredStep, StepReport, gather_step_reports


def test_a_lone_rank_gathers_its_own_report_by_name() -> None:
    report = StepReport(
        compute_s=1.5, wait_s=0.25, bytes_sent=4096, sync_s=0.125, in_flight=3,
        copy_figures=(0.5, 0.0625, 0.75), room_bytes=2.0**30, grow_due=True,
    )  # fmt: skip
    gathered = gather_step_reports(report, 1)
    assert (gathered.compute_s, gathered.wait_s, gathered.bytes_sent) == ([1.5], [0.25], [4096.0])
    assert (gathered.sync_s, gathered.in_flight) == ([0.125], [3])
    assert gathered.copy_figures == ([0.5], [0.0625], [0.75])
    assert gathered.rooms == [2**30] and gathered.grow_due is True


def test_fields_a_job_does_not_report_stay_absent() -> None:
    gathered = gather_step_reports(StepReport(1.0, 0.0, 0, 0.0, 1), 1)
    assert gathered.copy_figures is None and gathered.rooms is None and gathered.grow_due is None
    with_room = gather_step_reports(StepReport(1.0, 0.0, 0, 0.0, 1, room_bytes=7.0), 1)
    assert with_room.rooms == [7] and with_room.copy_figures is None and with_room.grow_due is None


def test_the_columns_of_three_ranks_read_back_by_rank_and_any_rank_s_grow_flag_counts() -> None:
    like = StepReport(0.0, 0.0, 0, 0.0, 0, copy_figures=(0.0, 0.0, 0.0), room_bytes=0.0, grow_due=False)
    columns = [
        [1.0, 2.0, 3.0],  # compute
        [0.1, 0.2, 0.3],  # wait
        [10.0, 20.0, 30.0],  # bytes
        [0.5, 0.5, 0.5],  # sync
        [2.0, 3.0, 1.0],  # in flight
        [0.4, 0.4, 0.4],  # copy
        [0.01, 0.02, 0.03],  # blocked
        [0.3, 0.3, 0.3],  # copy CPU
        [100.0, 200.0, 300.0],  # room
        [1.0, 0.0, 0.0],  # grow: rank 0 found the decision
    ]
    gathered = GatheredStep.from_columns(columns, like=like)
    assert gathered.in_flight == [2, 3, 1] and gathered.rooms == [100, 200, 300]
    assert gathered.copy_figures == ([0.4] * 3, [0.01, 0.02, 0.03], [0.3] * 3)
    assert gathered.grow_due is True
    assert GatheredStep.from_columns([*columns[:-1], [0.0] * 3], like=like).grow_due is False


def test_columns_that_do_not_match_the_report_s_fields_are_refused() -> None:
    with pytest.raises(ShardpoolError, match="a step report has 5 columns, 6 expected"):
        GatheredStep.from_columns([[0.0]] * 5, like=StepReport(0.0, 0.0, 0, 0.0, 0, room_bytes=1.0))
