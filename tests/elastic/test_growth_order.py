"""A growth order's progress is the run's state: its flags read it, and a move out of order is refused."""

from __future__ import annotations

import pytest

from shardpool.contract.job import Job
from shardpool.elastic.growth import GrowOrder
from shardpool.elastic.states import IllegalTransition, RunMachine, RunState
from tests.helpers.jobs import job_dict


def _order(machine: RunMachine | None = None) -> GrowOrder:
    job = Job.model_validate(job_dict(stages=2))
    return GrowOrder(job, {}, {0: 0, 1: 1}) if machine is None else GrowOrder(job, {}, {0: 0, 1: 1}, machine)


def test_an_order_goes_growing_joining_grown_and_back_to_training() -> None:
    machine = RunMachine(RunState.GROWING)
    order = _order(machine)
    assert (order.started, order.grown, order.applied, order.failed) == (False, False, False, None)
    order.joiners_started()
    assert machine.state is RunState.JOINING and order.started and not order.grown
    order.stages_moved()
    assert machine.state is RunState.GROWN and order.grown and not order.applied
    order.followed()
    assert machine.state is RunState.TRAINING and order.applied and order.started and order.grown


def test_a_failed_order_says_why_and_leaves_the_run_training() -> None:
    order = _order()
    order.joiners_started()
    order.abandon("member 'c' did not start its stages")
    assert order.machine.state is RunState.TRAINING
    assert order.failed == "member 'c' did not start its stages"
    assert not order.grown and not order.applied


def test_a_move_out_of_order_is_refused_and_setting_a_flag_twice_changes_nothing() -> None:
    order = _order()
    with pytest.raises(IllegalTransition, match="stages_moved cannot happen while growing"):
        order.stages_moved()
    order.started = True
    order.started = True
    assert order.machine.state is RunState.JOINING
    with pytest.raises(IllegalTransition, match="grown_followed cannot happen while joining"):
        order.followed()
