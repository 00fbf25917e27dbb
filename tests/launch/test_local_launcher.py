"""The local launcher's loop: it relays events, stops the run at once when a stage fails, and
sleeps while the stages compute (it shares their cores) instead of polling."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shardpool.contract.events import EVENT_PREFIX
from shardpool.launch import local_launcher
from shardpool.launch.local_launcher import StageFailed, run_local_job


@dataclass
class FakeJob:
    """What run_local_job reads of a job: its size and each rank's stage."""

    world_size: int

    def stage_index(self, rank: int) -> int:
        return rank


SECRET = "0" * 64


def _stage_script(*, sleep_s: float, event: dict[str, Any] | None, code: int) -> str:
    line = f"print({EVENT_PREFIX + json.dumps(event)!r}, flush=True)" if event else "pass"
    return f"import sys, time\n{line}\ntime.sleep({sleep_s})\nsys.exit({code})"


def _fake_stages(monkeypatch: pytest.MonkeyPatch, scripts: list[str]) -> None:
    """Start ``scripts[rank]`` instead of a stage process (stdout piped, stderr to the rank's log)."""

    def start(job: Any, job_file: Path, rank: int, log_path: Path, **_: Any) -> subprocess.Popen[bytes]:
        with open(log_path, "ab") as log:
            return subprocess.Popen([sys.executable, "-c", scripts[rank]], stdout=subprocess.PIPE, stderr=log)

    monkeypatch.setattr(local_launcher, "_start_rank", start)


def test_events_reach_the_caller_and_the_run_ends_when_every_stage_exits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ready = {"event": "ready", "total_steps": 3, "first_step": 0}
    _fake_stages(
        monkeypatch,
        [_stage_script(sleep_s=0.2, event=ready, code=0), _stage_script(sleep_s=0.0, event=None, code=0)],
    )
    seen: list[dict[str, Any]] = []
    run_local_job(
        FakeJob(2), tmp_path / "job.json", log_dir=tmp_path / "logs", on_event=seen.append, secret=SECRET
    )
    assert seen == [ready]


def test_a_failing_stage_stops_the_run_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    error = {"event": "error", "rank": 1, "message": "boom"}
    _fake_stages(
        monkeypatch,
        [_stage_script(sleep_s=60, event=None, code=0), _stage_script(sleep_s=0.1, event=error, code=1)],
    )
    started = time.monotonic()
    with pytest.raises(StageFailed, match="stage 1 .*boom"):
        run_local_job(
            FakeJob(2), tmp_path / "job.json", log_dir=tmp_path / "logs", on_event=print, secret=SECRET
        )
    # The closing stdout wakes the loop: no waiting for its idle wake-up.
    assert time.monotonic() - started < local_launcher._IDLE_WAKE_S + 3.0


def test_the_loop_sleeps_while_the_stages_compute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_stages(monkeypatch, [_stage_script(sleep_s=3.0, event=None, code=0)])
    dispatches = 0
    dispatch = local_launcher._dispatch

    def counted(*args: Any, **kwargs: Any) -> None:
        nonlocal dispatches
        dispatches += 1
        dispatch(*args, **kwargs)

    monkeypatch.setattr(local_launcher, "_dispatch", counted)
    run_local_job(FakeJob(1), tmp_path / "job.json", log_dir=tmp_path / "logs", on_event=print, secret=SECRET)
    # 3 s of a silent stage: a wake-up every _IDLE_WAKE_S (2 s), one for the exit, the final drain
    # (polling every 0.2 s, as before, made 15).
    assert dispatches <= 5


def test_a_local_run_pins_gloo_and_nccl_to_loopback() -> None:
    from shardpool.launch.local_launcher import loopback_pinning

    assert loopback_pinning(["lo", "eth0", "wg0"]) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert loopback_pinning(["en0", "lo0"]) == {"GLOO_SOCKET_IFNAME": "lo0", "NCCL_SOCKET_IFNAME": "lo0"}
    assert loopback_pinning(["eth0"]) == {}
