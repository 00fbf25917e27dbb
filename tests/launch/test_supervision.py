"""A supervised mesh launcher asks the supervisor it was given, and nothing set on it from outside."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shardpool.contract.job import Job
from shardpool.launch import mesh_launcher
from shardpool.launch.mesh_launcher import LOST_AFTER_S, MeshLauncher
from shardpool.launch.mesh_members import MeshMember
from tests.helpers.jobs import job_dict


class _Supervision:
    lost_after_s = 4.0

    def __init__(self) -> None:
        self.watched: list[Job] = []

    def watch(self, job: Job) -> str:
        self.watched.append(job)
        return "the watch"

    def interrupt(self) -> bool:
        return False

    def tick(self) -> None:
        return None

    def grow(self) -> None:
        return None


def _launcher(**kwargs: Any) -> MeshLauncher:
    members = [MeshMember(name, f"198.51.100.{i + 1}", i == 0, object()) for i, name in enumerate("ab")]
    return MeshLauncher(members, say=print, **kwargs)  # type: ignore[arg-type]


def _job() -> Job:
    job = job_dict(stages=2)
    for index, stage in enumerate(job["stages"]):
        stage["host"] = "ab"[index]
    return Job.model_validate(job)


def _started(monkeypatch: pytest.MonkeyPatch, launcher: MeshLauncher) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(mesh_launcher, "run_mesh_job", lambda *args, **kwargs: seen.update(kwargs))
    launcher.start(_job(), Path("job.json"), lambda event: None)
    return seen


def test_the_event_loop_gets_the_supervisors_watch_bound_interrupt_tick_and_growth(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    supervision = _Supervision()
    seen = _started(monkeypatch, _launcher().supervised_by(supervision))  # type: ignore[arg-type]
    assert seen["lost_after_s"] == 4.0 and seen["watch"] == "the watch"
    assert seen["interrupt"] == supervision.interrupt and seen["tick"] == supervision.tick
    assert seen["grow"] == supervision.grow
    assert [job.world_size for job in supervision.watched] == [2]


def test_an_unsupervised_launcher_stops_at_the_first_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _started(monkeypatch, _launcher())
    assert "watch" not in seen and "grow" not in seen and "interrupt" not in seen
    assert seen.get("lost_after_s", LOST_AFTER_S) == LOST_AFTER_S


def test_the_next_attempts_launcher_keeps_the_supervisor_listing_and_history() -> None:
    supervision = _Supervision()
    listing = list
    launcher = _launcher(supervision=supervision, list_members=listing)
    launcher.job_id = "first"
    successor = launcher.over(launcher.members[:1], say=print)
    assert successor.supervision is supervision and successor.list_members is listing
    assert successor.previous_job_ids == ["first"] and [m.name for m in successor.members] == ["a"]
    for hook in ("watch", "interrupt", "tick", "grow", "lost_after_s"):
        assert not hasattr(successor, hook), f"{hook} is the supervisor's, asked through launcher.supervision"
