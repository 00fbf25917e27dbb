"""A job stays its submitter's on every member (issue 39, finding 4).

A job's events, logs and stop are answered only to the member whose key signed its start, and,
when that member's agent asks on behalf of one of its users, only for the user it started the
job for; the local agent forwards such requests only to the members it started the job on, with
the caller's user name it got from the kernel. Real agents (two members on one machine), real
sockets, real callers of other uids.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from shardpool.agent.service import Agent
from tests.helpers.agents import (
    AGENT_KEY,
    OTHER_KEY,
    group_member,
    local_call,
    make_agent,
    shared_dir,
    signed,
    write_worker,
)
from tests.helpers.jobs import job_dict

SLEEPER = """
import sys, time
print("alice's private log line", file=sys.stderr, flush=True)
time.sleep(600)
"""

ALICE, BOB = group_member(65534), group_member(65533)


def _forward(member: str, method: str, path: str, body: Any = None) -> dict[str, Any]:
    return {"member": member, "method": method, "path": path, "body": body}


def _start_body(job_id: str, *, launcher: str = "127.0.0.1", **extra: Any) -> dict[str, Any]:
    """A start of ``job_id`` whose rendezvous and files are at ``launcher``, the sender's mesh address."""
    return {"job_id": job_id, "job": job_dict(launcher=launcher), "ranks": [0], **extra}


@contextmanager
def _member_b(**options: Any) -> Iterator[Agent]:
    """Member b's agent with its local socket."""
    with shared_dir() as shared:
        socket_path = shared / "run" / "agent.sock"
        socket_path.parent.mkdir(mode=0o755)
        with make_agent(
            shared / "work", write_worker(shared, SLEEPER), socket_path=socket_path, **options
        ) as b:
            yield b


@pytest.fixture
def agent() -> Iterator[Agent]:
    with _member_b() as started:
        yield started


@pytest.fixture
def two_members() -> Iterator[tuple[Agent, Agent]]:
    """Members b (127.0.0.1) and c (127.0.0.2), on one port, each with its own local socket."""
    with shared_dir() as shared:
        worker = write_worker(shared, SLEEPER)
        sockets = {name: shared / f"run-{name}" / "agent.sock" for name in ("b", "c")}
        for path in sockets.values():
            path.parent.mkdir(mode=0o755)
        with make_agent(shared / "b", worker, socket_path=sockets["b"], check_peer_ip=False) as b:
            port = int(b.url.rsplit(":", 1)[1])
            with make_agent(
                shared / "c", worker, key=OTHER_KEY, name="c", host="127.0.0.2", port=port,
                socket_path=sockets["c"], check_peer_ip=False,
            ) as c:  # fmt: skip
                yield b, c


def _socket(agent: Agent) -> Path:
    assert agent.local is not None
    return agent.local.socket_path


def _wait_for_log(agent: Agent, job_id: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        entry = agent.job(job_id)
        if entry.ranks and "private" in _tail(entry):
            return
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} never logged")


def _tail(entry: Any) -> str:
    from shardpool.agent.jobs import tail

    return tail(entry.ranks[0].log_fd, 5)


def test_a_group_user_cannot_read_another_users_log_or_events_on_another_member(two_members) -> None:
    b, c = two_members
    # alice, on member b, runs job "shared-id" on member c
    status, reply = local_call(
        _socket(b), "POST", "/v1/local/forward", _forward("c", "POST", "/v1/jobs", _start_body("shared-id")), **ALICE
    )  # fmt: skip
    assert (status, reply["status"]) == (200, 201), reply
    _wait_for_log(c, "shared-id")
    # bob, on member c, makes the id his own there (a job of that id on member b) ...
    status, reply = local_call(
        _socket(c), "POST", "/v1/local/forward", _forward("b", "POST", "/v1/jobs", _start_body("shared-id", launcher="127.0.0.2")), **BOB
    )  # fmt: skip
    assert (status, reply["status"]) == (200, 201), reply
    # ... and asks member c, where alice's job runs, for its log, events and stop
    for method, path in (
        ("GET", "/v1/jobs/shared-id/log/0?tail=5"),
        ("GET", "/v1/jobs/shared-id/events?after=0&wait=0"),
        ("DELETE", "/v1/jobs/shared-id"),
    ):
        status, reply = local_call(
            _socket(c), "POST", "/v1/local/forward", _forward("c", method, path), **BOB
        )
        refused = reply.get("status", status) if status == 200 else status
        assert refused == 403, (path, reply)
        assert "private" not in str(reply)
    assert c.job("shared-id").running and c.job("shared-id").submitter == "nobody"
    # alice still reads her own log through her member
    status, reply = local_call(
        _socket(b), "POST", "/v1/local/forward", _forward("c", "GET", "/v1/jobs/shared-id/log/0?tail=5"), **ALICE
    )  # fmt: skip
    assert (status, reply["status"]) == (200, 200) and "private" in reply["body"], reply


def test_only_the_origin_member_may_poll_read_or_stop_a_job_and_others_keep_nothing_alive() -> None:
    with _member_b(heartbeat_timeout_s=1.0) as agent:
        assert signed(agent.url, "POST", "/v1/jobs", _start_body("from-a"))[0] == 201  # signed by member a
        deadline = time.monotonic() + 2.0  # past the 1 s heartbeat: only the origin's polls count
        while time.monotonic() < deadline:
            for method, path in (
                ("GET", "/v1/jobs/from-a/events?after=0&wait=0"),
                ("GET", "/v1/jobs/from-a/log/0?tail=5"),
                ("DELETE", "/v1/jobs/from-a"),
            ):
                status, reply = signed(agent.url, method, path, key=AGENT_KEY)  # member b, not the origin
                assert status == 403 and "started by member 'a'" in reply["error"], (path, reply)
            time.sleep(0.2)
        assert agent.job("from-a").stopped_by == "heartbeat timeout"


def test_the_origin_is_answered_only_for_the_jobs_submitter(agent) -> None:
    assert signed(agent.url, "POST", "/v1/jobs", _start_body("alices", submitter="nobody"))[0] == 201
    _wait_for_log(agent, "alices")
    for method, path in (
        ("GET", "/v1/jobs/alices/events?after=0&wait=0&submitter=bob"),
        ("GET", "/v1/jobs/alices/log/0?tail=5&submitter=bob"),
        ("DELETE", "/v1/jobs/alices?submitter=bob"),
    ):
        status, reply = signed(agent.url, method, path)
        assert status == 403 and "not 'bob'" in reply["error"], (path, reply)
    assert agent.job("alices").running
    status, reply = signed(agent.url, "GET", "/v1/jobs/alices/log/0?tail=5&submitter=nobody")
    assert status == 200 and "private" in reply
    assert signed(agent.url, "DELETE", "/v1/jobs/alices")[0] == 200  # the origin's root


def test_a_caller_cannot_name_the_submitter_the_agent_signs_for(agent) -> None:
    socket_path = _socket(agent)
    body = _forward("b", "POST", "/v1/jobs", _start_body("bobs"))
    assert local_call(socket_path, "POST", "/v1/local/forward", body, **BOB)[1]["status"] == 201
    status, reply = local_call(
        socket_path, "POST", "/v1/local/forward",
        _forward("b", "GET", "/v1/jobs/bobs/events?after=0&wait=0&submitter=nobody"), **BOB,
    )  # fmt: skip
    assert status == 400 and "set by the agent" in reply["error"], reply
    status, reply = local_call(
        socket_path, "POST", "/v1/local/forward", _forward("b", "GET", "/v1/jobs/bobs/log/0?tail=5"), **BOB
    )
    assert (status, reply["status"]) == (200, 200), reply
    local_call(socket_path, "DELETE", "/v1/local/jobs/bobs")


def test_a_stage_under_its_job_uid_cannot_submit_jobs(agent) -> None:
    job_uid = 61184  # the first of the job uids (DEFAULT_JOB_UIDS), with the run-as group as stages have
    for method, path, body in (
        ("POST", "/v1/local/forward", _forward("b", "POST", "/v1/jobs", _start_body("from-a-stage"))),
        ("GET", "/v1/local/jobs", None),
    ):
        status, reply = local_call(_socket(agent), method, path, body, **group_member(job_uid))
        assert status == 403 and "runs job stages" in reply["error"], reply
    assert agent.jobs() == []
