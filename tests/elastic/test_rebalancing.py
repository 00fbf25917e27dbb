"""The launcher's re-balance check: what it measures, what it answers on the store, what it records."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shardpool.config import parse_config
from shardpool.contract.rebalance import FORCE_ENV, FORCE_SHARES_ENV
from shardpool.elastic.messages import decision_key, decode_decision, decode_shares
from shardpool.elastic.rebalance_decision import MIN_GAIN, Rebalance
from shardpool.elastic.rebalancing import RebalanceCheck, carried_plan, replanned_json, resumed_json
from shardpool.plan.calibrate import StepMeasurement
from shardpool.plan.result import Plan, PlannedStage
from shardpool.plan.stage_costs import StageCosts

LAYERS = [(0, 2), (2, 4), (4, 6)]


def _plan(layers: list[tuple[int, int]], predicted: float = 1.0) -> Plan:
    stages = [
        PlannedStage(device="cpu", host="local", start=start, stop=stop, predicted_ms_per_microbatch=1.0,
                     memory_bytes=0, free_bytes=0, slot=f"cpu#{index}")
        for index, (start, stop) in enumerate(layers)
    ]  # fmt: skip
    return Plan(stages=stages, predicted_step_s=predicted, bubble_fraction=0.0, microbatches=3,
                recommended_microbatches=12, num_layers=6)  # fmt: skip


def _step(step: int, seconds: float) -> dict[str, Any]:
    return {
        "event": "step",
        "step": step,
        "step_seconds": seconds,
        "stage_compute_s": [seconds / 2] * 3,
        "stage_wait_s": [0.0] * 3,
    }


def _check(tmp_path: Path, decide: Any, published: dict[str, str], *, first_step: int = 0) -> RebalanceCheck:
    plan = _plan(LAYERS)
    return RebalanceCheck(
        plan=plan,
        plan_json=plan.to_json() | {"replicas": 1, "source": "planner"},
        config=parse_config(
            {
                "base_model": "m",
                "lora_target_linear": True,
                "datasets": [{"path": "d.jsonl", "type": "completion"}],
            }
        ),
        check_at=first_step + 3,
        first_step=first_step,
        publish=published.__setitem__,
        plan_path=tmp_path / "plan.json",
        decide=decide,
    )


def test_the_check_measures_steps_after_the_first_and_answers_keep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(FORCE_ENV, raising=False)
    seen: list[list[StepMeasurement]] = []
    published: dict[str, str] = {}
    check = _check(
        tmp_path, lambda plan, measured, config, **_: seen.append(measured), published, first_step=4
    )
    check.resharded = lambda plan, plan_json: pytest.fail("a kept plan is no re-shard")
    assert [check.on_step(_step(step, 2.0)) for step in (5, 6)] == [None, None]
    assert published == {}, "nothing is published before the check step"
    assert check.on_step(_step(7, 3.0)) is None
    assert [measurement.step for measurement in seen[0]] == [6, 7]  # step 5, the first, is warm-up
    assert seen[0][1] == StepMeasurement(step=7, step_seconds=3.0, stage_compute_s=(1.5,) * 3,
                                         stage_wait_s=(0.0,) * 3)  # fmt: skip
    assert decode_decision(published[decision_key(7)], current=LAYERS) is None
    assert not (tmp_path / "plan.json").exists()


def test_a_decision_is_published_recorded_and_kept_in_plan_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(FORCE_ENV, raising=False)
    new = [(0, 3), (3, 5), (5, 6)]
    decision = Rebalance(
        plan=_plan(new, 0.8), predicted_step_s=0.8, current_step_s=1.1, reason="stage 0 is fast"
    )
    published: dict[str, str] = {}
    check = _check(tmp_path, lambda plan, measured, config, **_: decision, published)
    told: list[tuple[Plan, dict[str, Any]]] = []
    check.resharded = lambda plan, plan_json: told.append((plan, plan_json))
    for step in (1, 2):
        check.on_step(_step(step, 1.1))
    line = check.on_step(_step(3, 1.1))
    assert line == {
        "event": "rebalance",
        "step": 3,
        "from": [[0, 2], [2, 4], [4, 6]],
        "to": [[0, 3], [3, 5], [5, 6]],
        "predicted_step_s": 0.8,
        "current_step_s": 1.1,
        "reason": "stage 0 is fast",
    }
    assert decode_decision(published[decision_key(3)], current=LAYERS) == new
    written = json.loads((tmp_path / "plan.json").read_text())
    assert [stage["layers"] for stage in written["stages"]] == [[0, 3], [3, 5], [5, 6]]
    assert written["source"] == "rebalance" and written["replicas"] == 1
    assert [entry["ended_at_step"] for entry in written["history"]] == [3]
    assert written["history"][0]["source"] == "planner"
    assert check.plan.layer_ranges() == new
    assert len(told) == 1 and told[0][0] is decision.plan, "the supervisor is told the stages' new layers"
    assert told[0][1] == written, "... and the plan.json that records them"


def test_a_failing_check_says_so_and_answers_keep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FORCE_ENV, raising=False)

    def broken(plan: Plan, measured: list[StepMeasurement], config: Any, **_: Any) -> Rebalance | None:
        raise ValueError("calibration bug")

    published: dict[str, str] = {}
    said: list[str] = []
    check = _check(tmp_path, broken, published)
    check.say = said.append
    assert [check.on_step(_step(step, 1.0)) for step in (1, 2, 3)] == [None, None, None]
    assert decode_decision(published[decision_key(3)], current=LAYERS) is None
    assert said == ["re-balance check after step 3 failed, keeping the plan: ValueError: calibration bug"]


def test_the_forced_hook_overrides_the_decision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORCE_ENV, "3:0-1,1-3,3-6")
    published: dict[str, str] = {}
    check = _check(tmp_path, lambda plan, measured, config, **_: None, published)
    for step in (1, 2):
        check.on_step(_step(step, 1.0))
    line = check.on_step(_step(3, 2.0))
    assert line is not None and line["to"] == [[0, 1], [1, 3], [3, 6]]
    assert line["current_step_s"] == 1.5 and line["reason"] == f"forced by {FORCE_ENV}"


def test_a_resumed_run_keeps_the_interrupted_runs_plans_in_its_history() -> None:
    started = _plan(LAYERS).to_json() | {"replicas": 2, "source": "planner"}
    rebalanced = replanned_json(started, _plan([(0, 3), (3, 5), (5, 6)]), ended_at_step=3)
    fresh = _plan(LAYERS).to_json() | {"replicas": 2, "source": "planner"}
    resumed = resumed_json(rebalanced, fresh, resumed_from_step=4)
    assert {key: value for key, value in resumed.items() if key != "history"} == fresh
    assert [entry.get("ended_at_step") for entry in resumed["history"]] == [3, None]
    last = resumed["history"][-1]
    assert last["resumed_from_step"] == 4 and last["source"] == "rebalance"
    assert [stage["layers"] for stage in last["stages"]] == [[0, 3], [3, 5], [5, 6]]
    assert all("history" not in entry for entry in resumed["history"])


@pytest.mark.parametrize("interrupted", [None, [], "garbage", {"stages": "none"}, {"source": "planner"}])
def test_a_resume_without_a_readable_plan_starts_the_history_afresh(interrupted: object) -> None:
    fresh = _plan(LAYERS).to_json() | {"source": "planner"}
    assert resumed_json(interrupted, fresh, resumed_from_step=2) == fresh


def test_history_grows_with_each_replan() -> None:
    first = _plan(LAYERS).to_json() | {"replicas": 2, "source": "manual"}
    second = replanned_json(first, _plan([(0, 3), (3, 5), (5, 6)]), ended_at_step=3)
    third = replanned_json(second, _plan([(0, 1), (1, 5), (5, 6)]), ended_at_step=9)
    assert [entry["ended_at_step"] for entry in third["history"]] == [3, 9]
    assert all("history" not in entry for entry in third["history"])
    assert third["replicas"] == 2


def _stage_costs(capacity: float) -> StageCosts:
    """1 MB a layer on a CPU slot of ``capacity`` bytes."""
    return StageCosts(forward_fixed_s=0.0, forward_per_layer_s=0.01, backward_fixed_s=0.0,
                      backward_per_layer_s=0.02, fixed_bytes=0.0, per_layer_bytes=1e6,
                      capacity_bytes=capacity, kind="cpu", in_flight=1)  # fmt: skip


#: Room for two layers a slot, not three (the framework's reserve included).
TWO_LAYERS = _stage_costs(0.0).memory(2) + 1


def _costed(layers: list[tuple[int, int]], *, capacity: float = 1e12) -> Plan:
    """A fresh plan whose stages carry costs."""
    plan = _plan(layers)
    return replace(plan, stages=[replace(stage, costs=_stage_costs(capacity)) for stage in plan.stages])


def _interrupted(layers: list[tuple[int, int]], **keys: Any) -> dict[str, Any]:
    """``plan.json`` of a run that re-balanced from :data:`LAYERS` to ``layers``."""
    started = _plan(LAYERS).to_json() | {"replicas": 1, "source": "planner"}
    return replanned_json(started, _plan(layers, predicted=0.8), ended_at_step=3) | keys


REBALANCED = [(0, 1), (1, 3), (3, 6)]


def test_a_resumed_run_goes_on_with_the_split_its_interrupted_run_rebalanced_to() -> None:
    interrupted = _interrupted(REBALANCED)  # re-balanced after step 3
    carried = carried_plan(interrupted, _costed(LAYERS), replicas=1, resumed_from_step=4)
    assert carried is not None and carried.layer_ranges() == REBALANCED
    assert carried.predicted_step_s == 0.8, "the re-balanced plan as it was recorded"
    # Resumed from step 4 with that split, then interrupted again: carried again once a newer
    # checkpoint shows it trained on, not from step 4 itself.
    resumed = resumed_json(
        interrupted, carried.to_json() | {"replicas": 1, "source": "resume"}, resumed_from_step=4
    )
    again = carried_plan(resumed, _costed(LAYERS), replicas=1, resumed_from_step=6)
    assert again is not None and again.layer_ranges() == REBALANCED
    assert carried_plan(resumed, _costed(LAYERS), replicas=1, resumed_from_step=4) is None


def _other_slot(plan: dict[str, Any]) -> dict[str, Any]:
    stages = [dict(stage) for stage in plan["stages"]]
    stages[1]["slot"] = "cpu#9"
    return plan | {"stages": stages}


@pytest.mark.parametrize(
    ("interrupted", "fresh", "replicas", "rebalance", "resumed_from_step"),
    [
        pytest.param(_interrupted(REBALANCED), _costed(LAYERS), 1, "auto", 3, id="stopped-in-the-handover"),
        pytest.param(_interrupted(REBALANCED), _costed(LAYERS), 1, "auto", 2, id="checkpoint-before-it"),
        pytest.param(
            {key: value for key, value in _interrupted(REBALANCED).items() if key != "history"},
            _costed(LAYERS),
            1,
            "auto",
            9,
            id="no-history",
        ),
        pytest.param(
            _plan(REBALANCED).to_json() | {"source": "planner"},
            _costed(LAYERS),
            1,
            "auto",
            4,
            id="not-rebalanced",
        ),
        pytest.param(None, _costed(LAYERS), 1, "auto", 4, id="no-plan-json"),
        pytest.param(_interrupted(REBALANCED), _costed(LAYERS), 1, "off", 4, id="rebalance-off"),
        pytest.param(
            {"source": "rebalance", "stages": "none"}, _costed(LAYERS), 1, "auto", 4, id="unreadable"
        ),
        pytest.param(_interrupted(REBALANCED), _costed(LAYERS), 2, "auto", 4, id="other-replicas"),
        pytest.param(
            _interrupted(REBALANCED), _costed([(0, 3), (3, 6)]), 1, "auto", 4, id="other-stage-count"
        ),
        pytest.param(
            _interrupted(REBALANCED, microbatches=6), _costed(LAYERS), 1, "auto", 4, id="other-microbatches"
        ),
        pytest.param(_other_slot(_interrupted(REBALANCED)), _costed(LAYERS), 1, "auto", 4, id="other-slot"),
        pytest.param(
            _interrupted(REBALANCED), _costed(LAYERS, capacity=TWO_LAYERS), 1, "auto", 4, id="does-not-fit"
        ),
        pytest.param(_interrupted(REBALANCED), _plan(LAYERS), 1, "auto", 4, id="fresh-plan-without-costs"),
    ],
)
def test_a_resumed_run_plans_afresh_unless_the_rebalanced_split_still_applies(
    interrupted: Any, fresh: Plan, replicas: int, rebalance: str, resumed_from_step: int
) -> None:
    carried = carried_plan(
        interrupted, fresh, replicas=replicas, resumed_from_step=resumed_from_step, rebalance=rebalance
    )
    assert carried is None


def _check_of(tmp_path: Path, plan: Plan, decide: Any, published: dict[str, str]) -> RebalanceCheck:
    check = _check(tmp_path, decide, published)
    check.plan = plan
    check.plan_json = plan.to_json() | {"replicas": 1, "source": "planner"}
    return check


def _room_step(step: int, room: list[float]) -> dict[str, Any]:
    return _step(step, 1.0) | {"stage_room_bytes": room}


def test_a_forced_split_beyond_a_stages_room_is_held_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FORCE_ENV, "3:0-1,1-3,3-6")
    one_layer = _stage_costs(1e12).memory(3) - _stage_costs(1e12).memory(2)  # stage 2 gains one layer
    published: dict[str, str] = {}
    check = _check_of(tmp_path, _costed(LAYERS), lambda *args, **kwargs: None, published)
    for step in (1, 2):
        check.on_step(_step(step, 1.0))
    line = check.on_step(_room_step(3, [1e9, 1e9, one_layer - 1]))
    assert line == {
        "event": "rebalance_held",
        "step": 3,
        "from": [[0, 2], [2, 4], [4, 6]],
        "to": [[0, 1], [1, 3], [3, 6]],
        "predicted_step_s": 1.0,
        "current_step_s": 1.0,
        "reason": f"stage 2 (cpu#2) needs {one_layer / 2**20:.1f} MiB more for 3 layers and has "
        f"{(one_layer - 1) / 2**20:.1f} MiB of room",
    }
    assert decode_decision(published[decision_key(3)], current=LAYERS) is None, "the stages keep their layers"
    assert not (tmp_path / "plan.json").exists()
    assert check.plan.layer_ranges() == LAYERS

    published.clear()
    check = _check_of(tmp_path, _costed(LAYERS), lambda *args, **kwargs: None, published)
    for step in (1, 2):
        check.on_step(_step(step, 1.0))
    line = check.on_step(_room_step(3, [1e9, 1e9, one_layer]))
    assert line is not None and line["event"] == "rebalance" and line["to"] == [[0, 1], [1, 3], [3, 6]]
    assert decode_decision(published[decision_key(3)], current=LAYERS) == [(0, 1), (1, 3), (3, 6)]


def test_the_check_passes_the_room_on_and_names_the_better_split_it_rules_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(FORCE_ENV, raising=False)
    best = Rebalance(
        plan=_costed([(0, 1), (1, 2), (2, 6)]), predicted_step_s=0.5, current_step_s=1.0, reason="b"
    )
    fitting = Rebalance(
        plan=_costed([(0, 1), (1, 3), (3, 6)]), predicted_step_s=0.8, current_step_s=1.0, reason="f"
    )
    rooms: list[Any] = []

    def decide(plan: Plan, measured: list[StepMeasurement], config: Any, room_bytes: Any = None) -> Rebalance:
        rooms.append(room_bytes)
        return best if room_bytes is None else fitting

    published: dict[str, str] = {}
    check = _check_of(tmp_path, _costed(LAYERS), decide, published)
    for step in (1, 2):
        check.on_step(_step(step, 1.0))
    one_layer = _stage_costs(1e12).memory(3) - _stage_costs(1e12).memory(2)
    line = check.on_step(_room_step(3, [1e9, 1e9, one_layer]))
    assert rooms == [None, [1e9, 1e9, one_layer]], (
        "without the room first, then within it, since the best split does not fit"
    )
    assert line is not None and line["event"] == "rebalance" and line["to"] == [[0, 1], [1, 3], [3, 6]]
    assert line["reason"] == (
        f"f; [0, 1) [1, 2) [2, 6) would predict 0.500 s but stage 2 (cpu#2) needs "
        f"{(_stage_costs(1e12).memory(4) - _stage_costs(1e12).memory(2)) / 2**20:.1f} MiB more for 4 layers "
        f"and has {one_layer / 2**20:.1f} MiB of room"
    )
    written = json.loads((tmp_path / "plan.json").read_text())
    assert [stage["layers"] for stage in written["stages"]] == [[0, 1], [1, 3], [3, 6]]


def test_stages_sharing_a_device_are_held_to_its_room_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stages 1 and 2 each gain a layer on the same host's CPU: each has room for one, not for both."""
    monkeypatch.setenv(FORCE_ENV, "3:0-2,2-4,4-6")
    one_layer = _stage_costs(1e12).memory(2) - _stage_costs(1e12).memory(1)
    published: dict[str, str] = {}
    started = [(0, 4), (4, 5), (5, 6)]
    check = _check_of(tmp_path, _costed(started), lambda *args, **kwargs: None, published)
    for step in (1, 2):
        check.on_step(_step(step, 1.0))
    line = check.on_step(_room_step(3, [one_layer] * 3))
    assert line is not None and line["event"] == "rebalance_held", line
    assert line["reason"] == (
        f"stages 1 and 2 (cpu on local) need {2 * one_layer / 2**20:.1f} MiB more together and have "
        f"{one_layer / 2**20:.1f} MiB of room"
    )
    assert decode_decision(published[decision_key(3)], current=started) is None

    # The same growth on two hosts: each stage has its own memory, and the split is made.
    apart = _costed(started)
    apart = replace(
        apart, stages=[replace(stage, host=f"h{index}") for index, stage in enumerate(apart.stages)]
    )
    published.clear()
    check = _check_of(tmp_path, apart, lambda *args, **kwargs: None, published)
    for step in (1, 2):
        check.on_step(_step(step, 1.0))
    line = check.on_step(_room_step(3, [one_layer] * 3))
    assert line is not None and line["event"] == "rebalance", line
    assert decode_decision(published[decision_key(3)], current=started) == [(0, 2), (2, 4), (4, 6)]


# ------------------------------------------------------------------- data-parallel shares


def _replicas(shares: list[int], *, ms: tuple[float, float] = (600.0, 1200.0)) -> Plan:
    """Two whole-model replicas (a, then b) planned at ``ms`` per micro-batch, with ``shares`` of 16."""
    replicas = [
        PlannedStage(device="cpu", host=host, start=0, stop=6, predicted_ms_per_microbatch=per_mb,
                     memory_bytes=0, free_bytes=0, slot=f"{host}/cpu", after_step_ms=50.0)
        for host, per_mb in zip("ab", ms, strict=True)
    ]  # fmt: skip
    slowest = max(n * per_mb / 1e3 + 0.05 for n, per_mb in zip(shares, ms, strict=True))
    return Plan(stages=[replicas[0]], predicted_step_s=slowest + 0.05, bubble_fraction=0.0, microbatches=16,
                recommended_microbatches=16, num_layers=6, data_parallel=replicas, shares=shares)  # fmt: skip


def _replica_step(step: int, compute: list[float]) -> dict[str, Any]:
    return {"event": "step", "step": step, "step_seconds": max(compute) + 0.1,
            "stage_compute_s": compute, "stage_wait_s": [0.0, 0.0]}  # fmt: skip


def test_the_check_of_replicas_moves_their_shares_by_the_measured_speeds(tmp_path: Path) -> None:
    """Planned 2 : 1 (11 / 5), measured 3 : 1: b's 5 micro-batches take 9 s against a's 6.6 s, and
    12 / 4 predicts 7.2 + 0.1 s against 9.05 + 0.05 s: 20 % shorter, so the shares move."""
    published: dict[str, str] = {}
    plan = _replicas([11, 5])
    check = _check_of(tmp_path, plan, lambda *args, **kwargs: None, published)
    for step in (1, 2):
        assert check.on_step(_replica_step(step, [6.6, 9.0])) is None
    line = check.on_step(_replica_step(3, [6.6, 9.0]))
    assert line is not None and line["event"] == "rebalance"
    assert (line["shares_from"], line["shares_to"]) == ([11, 5], [12, 4])
    assert line["current_step_s"] == pytest.approx(9.1) and line["predicted_step_s"] == pytest.approx(7.3)
    assert decode_shares(published[decision_key(3)], current=[11, 5]) == [12, 4]
    written = json.loads((tmp_path / "plan.json").read_text())
    assert written["shares"] == [12, 4] and written["history"][0]["shares"] == [11, 5]
    assert written["data_parallel"][1]["predicted_ms_per_microbatch"] == pytest.approx(1800.0)
    assert check.plan.shares == [12, 4]


def test_the_check_of_replicas_moves_shares_for_a_gain_a_reshard_would_not_make(tmp_path: Path) -> None:
    """The bench's run (docs/planner.md): 12 / 4 measured 9.31 s and 6.39 s of compute; at those
    speeds 11 / 5 predicts a step 8 % shorter, under a layer re-shard's 10 % but worth a free move."""
    published: dict[str, str] = {}
    check = _check_of(
        tmp_path, _replicas([12, 4], ms=(741.0, 2000.0)), lambda *args, **kwargs: None, published
    )
    for step in (1, 2, 3):
        line = check.on_step(_replica_step(step, [9.31, 6.39]))
    assert line is not None and (line["shares_from"], line["shares_to"]) == ([12, 4], [11, 5])
    assert 0.02 < 1 - line["predicted_step_s"] / line["current_step_s"] < MIN_GAIN


def test_the_check_of_replicas_keeps_shares_that_the_measured_speeds_confirm(tmp_path: Path) -> None:
    published: dict[str, str] = {}
    check = _check_of(tmp_path, _replicas([11, 5]), lambda *args, **kwargs: None, published)
    for step in (1, 2, 3):
        line = check.on_step(_replica_step(step, [6.6, 6.3]))
    assert line is None
    assert decode_shares(published[decision_key(3)], current=[11, 5]) is None
    assert not (tmp_path / "plan.json").exists()


def test_a_forced_move_of_shares_is_answered_as_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FORCE_SHARES_ENV, "3:10,6")
    published: dict[str, str] = {}
    check = _check_of(tmp_path, _replicas([11, 5]), lambda *args, **kwargs: None, published)
    for step in (1, 2, 3):
        line = check.on_step(_replica_step(step, [6.6, 6.3]))
    assert line is not None and line["shares_to"] == [10, 6]
    assert json.loads(published[decision_key(3)]) == {"shares": [10, 6]}


def test_a_resumed_run_goes_on_with_its_rebalanced_shares_only_on_the_same_replicas() -> None:
    started = _replicas([11, 5]).to_json() | {"replicas": 1, "source": "planner"}
    interrupted = replanned_json(started, _replicas([12, 4]), ended_at_step=3)
    carried = carried_plan(interrupted, _replicas([11, 5]), replicas=1, resumed_from_step=4)
    assert carried is not None and carried.shares == [12, 4]
    other = replace(
        _replicas([11, 5]), data_parallel=[replace(r, host="c") for r in _replicas([11, 5]).data_parallel]
    )
    assert carried_plan(interrupted, other, replicas=1, resumed_from_step=4) is None
    assert carried_plan(interrupted, _costed([(0, 6)]), replicas=1, resumed_from_step=4) is None
