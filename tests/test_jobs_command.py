"""``shardpool jobs``: list, show and stop through the local agent's socket, errors as one line."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from shardpool.cli import main
from shardpool.jobs_command import format_jobs
from tests.helpers.local_agent import StubLocalAgent, shared_socket_dir

JOBS = {
    "20260101-120000-aa": {
        "id": "20260101-120000-aa",
        "submitter": "alice",
        "members": ["a", "b"],
        "state": "running",
        "started": "2026-01-01T12:00:00Z",
        "ranks": {"a": [0], "b": [1]},
    },
    "20260101-130000-bb": {
        "id": "20260101-130000-bb",
        "submitter": "bob",
        "members": ["a"],
        "state": "finished",
        "started": "2026-01-01T13:00:00Z",
    },
}


@pytest.fixture
def agent() -> Iterator[StubLocalAgent]:
    directory = shared_socket_dir()
    jobs = {key: dict(value) for key, value in JOBS.items()}
    with StubLocalAgent(directory / "agent.sock", jobs=jobs) as stub:
        yield stub
    shutil.rmtree(directory, ignore_errors=True)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_jobs_lists_id_submitter_members_state_and_start(
    agent: StubLocalAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(["jobs", "--socket", str(agent.socket_path)], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "SUBMITTER", "MEMBERS", "STATE", "STARTED"]
    assert lines[1].split() == ["20260101-120000-aa", "alice", "a,b", "running", "2026-01-01T12:00:00Z"]
    assert lines[2].split() == ["20260101-130000-bb", "bob", "a", "finished", "2026-01-01T13:00:00Z"]


def test_jobs_show_prints_every_field_and_stop_stops(
    agent: StubLocalAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(["jobs", "show", "20260101-120000-aa", "--socket", str(agent.socket_path)], capsys)
    assert code == 0
    assert out.splitlines() == [
        "id: 20260101-120000-aa",
        "submitter: alice",
        "members: a,b",
        "state: running",
        "started: 2026-01-01T12:00:00Z",
        'ranks: {"a": [0], "b": [1]}',
    ]
    code, out, _ = _run(["jobs", "stop", "20260101-120000-aa", "--socket", str(agent.socket_path)], capsys)
    assert (code, out) == (0, "stopped job 20260101-120000-aa on a, b\n")
    assert agent.jobs["20260101-120000-aa"]["state"] == "stopped"


def test_jobs_errors_are_one_line(agent: StubLocalAgent, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["jobs", "show", "nope", "--socket", str(agent.socket_path)], capsys)
    assert code == 2
    assert (
        err
        == "shardpool: error: the local shardpool agent refused GET /v1/local/jobs/nope: 404 no job 'nope'\n"
    )
    code, _, err = _run(["jobs", "stop"], capsys)
    assert (code, err) == (
        2,
        "shardpool: error: `shardpool jobs stop` needs a job id: `shardpool jobs stop ID`\n",
    )
    agent.refuse = "user 'eve' may not launch shardpool jobs on this machine; ask an admin to run `usermod -aG shardpool eve`"
    code, _, err = _run(["jobs", "--socket", str(agent.socket_path)], capsys)
    assert (code, err) == (2, f"shardpool: error: {agent.refuse}\n")


def test_an_empty_list_says_whose_jobs_are_listed() -> None:
    assert format_jobs([]).startswith("no jobs (only jobs you started")
