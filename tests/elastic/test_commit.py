"""The commit gate: a supervised run reports a step only once every rank's copy of it is complete."""

from __future__ import annotations

from shardpool.elastic.commit import CommitGate, passing


def _gate(complete: set[int]) -> tuple[CommitGate, list[str]]:
    reported: list[str] = []
    return CommitGate(lambda step: step in complete), reported


def test_a_step_is_reported_once_its_copy_is_complete_and_what_follows_waits_for_it() -> None:
    complete: set[int] = set()
    gate, reported = _gate(complete)

    gate.step(1, lambda: reported.append("step 1"))
    gate.then(lambda: reported.append("checkpoint 1"))
    gate.step(2, lambda: reported.append("step 2"))
    assert reported == [] and gate.held_steps == 2 and gate.newest_step == 2 and gate.reported_step == 0

    complete.add(2)  # a newer copy alone does not release the older step
    gate.release()
    assert reported == []

    complete.add(1)
    gate.release()
    assert reported == ["step 1", "checkpoint 1", "step 2"]
    assert gate.held_steps == 0 and gate.reported_step == 2


def test_release_all_reports_everything_held_in_order() -> None:
    gate, reported = _gate(set())
    gate.step(3, lambda: reported.append("step 3"))
    gate.then(lambda: reported.append("done"))
    gate.release_all()
    assert reported == ["step 3", "done"] and gate.reported_step == 3


def test_a_step_at_or_before_the_reported_one_is_not_asked_about() -> None:
    asked: list[int] = []
    gate = CommitGate(lambda step: asked.append(step) or False)
    gate.reported_step = gate.newest_step = 4  # an attempt that resumed after step 4
    reported: list[int] = []
    gate.step(4, lambda: reported.append(4))
    assert reported == [4] and asked == []
    gate.step(5, lambda: reported.append(5))
    assert reported == [4] and asked == [5]


def test_a_passing_gate_holds_nothing() -> None:
    gate, reported = passing(), []
    gate.step(1, lambda: reported.append(1))
    gate.then(lambda: reported.append(2))
    assert reported == [1, 2]
