"""Which line a failed ring is reported with: the root cause (a stage killed, a member lost), not a
neighbour that only lost its peer, with the stage's own ``error:`` line where it wrote one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from shardpool.contract.inference import InferenceJob
from shardpool.infer.rings import LocalRing, MeshRing, last_error_line
from shardpool.launch.mesh_follow import Follow
from shardpool.launch.mesh_members import MeshMember


def test_the_last_error_line_is_what_the_stage_said_when_it_failed() -> None:
    log = "loading\nerror: first\nTraceback...\nerror: CUDA out of memory\nexiting\n"
    assert last_error_line(log) == "CUDA out of memory"
    assert last_error_line("one\ntwo\n\n") == "two"
    assert last_error_line("") == ""


def test_a_local_ring_names_the_killed_stage_before_the_one_that_lost_its_peer(tmp_path: Path) -> None:
    said = "import sys; print('error: peer closed the connection', file=sys.stderr); sys.exit(1)"
    lost_peer = subprocess.Popen(
        [sys.executable, "-c", said],
        stderr=open(tmp_path / "infer-rank-0.log", "wb"),  # noqa: SIM115
    )
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ring = LocalRing([lost_peer, killed], tmp_path)
    lost_peer.wait()
    assert (
        ring.failure() == f"stage 0 failed: peer closed the connection (log: {tmp_path / 'infer-rank-0.log'})"
    )
    killed.kill()
    killed.wait()
    assert ring.failure() is not None and ring.failure().startswith("stage 1 failed: killed by signal 9")


class _Agent:
    """What a MeshRing asks a member's agent when a stage failed: its log's tail."""

    def __init__(self, log: str) -> None:
        self.log = log

    def log_tail(self, job_id: str, rank: int, lines: int = 20) -> str:
        return self.log


def _job() -> InferenceJob:
    return InferenceJob.model_validate(
        {
            "kind": "inference",
            "inputs": {"model/config.json": "/m/config.json"},
            "stages": [{"start": 0, "stop": 1, "device": "cpu", "host": name} for name in "abc"],
            "master_addr": "198.51.100.1",
            "master_port": 29500,
            "threads_per_process": 1,
        },
        strict=False,
    )


def _follow(name: str, rank: int, log: str = "", **state: Any) -> Follow:
    member = MeshMember(name, "198.51.100.1", False, _Agent(log))  # type: ignore[arg-type]
    follow = Follow(member, [rank])
    for key, value in state.items():
        setattr(follow, key, value)
    return follow


def test_a_mesh_ring_reports_a_lost_member_first_then_a_killed_stage_then_a_stage_error() -> None:
    running = MeshRing("job", _job(), follows={"a": _follow("a", 0), "b": _follow("b", 1)})
    assert running.failure() is None

    errored = _follow("a", 0, "Traceback\nerror: the inference job is broken\n", exited={0: 1})
    killed = _follow("b", 1, exited={1: -9})
    lost = _follow("c", 2, lost="its agent stopped answering for 11 s")
    assert MeshRing("job", _job(), follows={"a": errored, "b": killed, "c": lost}).failure() == (
        "member 'c' was lost while serving: its agent stopped answering for 11 s"
    )
    assert MeshRing("job", _job(), follows={"a": errored, "b": killed}).failure() == (
        "stage 1 on member 'b' failed: killed by signal 9"
    )
    assert MeshRing("job", _job(), follows={"a": errored}).failure() == (
        "stage 0 on member 'a' failed: the inference job is broken"
    )
