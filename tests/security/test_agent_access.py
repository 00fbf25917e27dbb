"""Who may make the agent start, see and stop jobs: keys on the mesh listener, uids on the Unix socket.

Each test here fails on the agent before issue 9, which trusted the source address alone and ran
stages as root. Real agent, real sockets, real processes; callers on the Unix socket are child
processes running as other uids, so the kernel reports them as those users.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardpool.agent.accounts import DEFAULT_JOB_UIDS
from shardpool.agent.service import Agent
from tests.helpers.agents import (
    AGENT_KEY,
    REMOVED_KEY,
    RUN_AS,
    group_member,
    local_call,
    make_agent,
    outsider,
    shared_dir,
    signed,
    write_worker,
)
from tests.helpers.jobs import job_dict

SLEEPER = """
import json, os, sys, time
print("@shardpool " + json.dumps({"event": "ready", "pid": os.getpid()}), flush=True)
time.sleep(600)
"""


@pytest.fixture
def setup() -> Iterator[tuple[Agent, Path]]:
    with shared_dir() as shared:
        socket_path = shared / "run" / "agent.sock"
        socket_path.parent.mkdir(mode=0o755)
        agent = make_agent(shared / "work", write_worker(shared, SLEEPER), socket_path=socket_path)
        with agent:
            yield agent, socket_path
        for job in agent.jobs():
            for record in job.ranks.values():
                assert record.returncode is not None, "every stage was stopped with the agent"


def _job_body(job_id: str, **extra: Any) -> dict[str, Any]:
    return {"job_id": job_id, "job": job_dict(), "ranks": [0, 1], **extra}


def _forward(member: str, method: str, path: str, body: Any = None) -> dict[str, Any]:
    return {"member": member, "method": method, "path": path, "body": body}


def _uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            real, effective, saved, filesystem = (int(x) for x in line.split()[1:5])
            assert real == effective == saved == filesystem
            return real
    raise AssertionError(f"no Uid line for {pid}")


def _nothing_started(agent: Agent) -> None:
    assert agent.jobs() == []
    assert list((agent.work_dir / "jobs").iterdir()) == []


def test_an_unsigned_request_to_the_mesh_listener_gets_401_and_starts_nothing(setup) -> None:
    agent, _ = setup
    from tests.agent.test_service import _call

    for method, path, body in (
        ("POST", "/v1/jobs", _job_body("unsigned")),
        ("GET", "/v1/health", None),
        ("DELETE", "/v1/jobs/unsigned", None),
    ):
        status, reply = _call(agent.url, method, path, body)
        assert status == 401 and "\n" not in reply["error"] and "X-Shardpool-" in reply["error"], reply
    _nothing_started(agent)


def test_a_request_signed_by_a_removed_member_gets_a_signed_403(setup) -> None:
    agent, _ = setup
    status, reply = signed(agent.url, "POST", "/v1/jobs", _job_body("removed"), key=REMOVED_KEY)
    assert status == 403 and reply["removed"] is True and "removed from the mesh" in reply["error"]
    _nothing_started(agent)


def test_a_caller_outside_the_launch_group_gets_a_one_line_403_and_nothing_starts(setup) -> None:
    agent, socket_path = setup
    for caller in (outsider(65534), {"uid": RUN_AS.uid, "gid": RUN_AS.gid}):
        for method, path, body in (
            ("POST", "/v1/local/forward", _forward("b", "POST", "/v1/jobs", _job_body("sneaky"))),
            ("GET", "/v1/local/members", None),
            ("GET", "/v1/local/jobs", None),
            ("DELETE", "/v1/local/jobs/sneaky", None),
        ):
            status, reply = local_call(socket_path, method, path, body, **caller)
            assert status == 403 and "\n" not in reply["error"], reply
            assert "may not launch" in reply["error"] or "runs job stages" in reply["error"]
    # without even the socket's group, the kernel refuses the connection
    assert local_call(socket_path, "GET", "/v1/local/members", uid=65534, gid=65534)[0] == 0
    assert (socket_path.stat().st_mode & 0o777) == 0o660
    _nothing_started(agent)


def test_a_group_member_starts_a_job_whose_stages_run_under_a_uid_of_its_own(setup) -> None:
    agent, socket_path = setup
    secret = "ab" * 32
    status, reply = local_call(
        socket_path, "POST", "/v1/local/forward",
        _forward("b", "POST", "/v1/jobs", _job_body("mine", files_secret=secret)), **group_member(),
    )  # fmt: skip
    assert (status, reply["status"]) == (200, 201), reply
    pids = [int(pid) for pid in reply["body"]["pids"].values()]
    job_uid = _uid_of(pids[0])
    assert [_uid_of(pid) for pid in pids] == [job_uid, job_uid] and job_uid in DEFAULT_JOB_UIDS
    job_dir = agent.work_dir / "jobs" / "mine"
    info = job_dir.stat()
    assert (info.st_uid, info.st_mode & 0o777) == (job_uid, 0o700)
    secret_file = job_dir / "files.secret"
    assert secret_file.read_text() == secret
    assert (secret_file.stat().st_uid, secret_file.stat().st_mode & 0o777) == (job_uid, 0o600)
    status, listed = local_call(socket_path, "GET", "/v1/local/jobs", **group_member())
    assert [(j["id"], j["submitter"], j["members"]) for j in listed["jobs"]] == [("mine", "nobody", ["b"])]
    status, reply = local_call(socket_path, "DELETE", "/v1/local/jobs/mine", **group_member())
    assert status == 200 and reply["members"]["b"]["status"] == 200
    assert reply["members"]["b"]["body"]["exited"] == {"0": -signal.SIGTERM, "1": -signal.SIGTERM}


def test_a_user_cannot_see_or_stop_another_users_job_but_root_can(setup) -> None:
    agent, socket_path = setup
    alice, bob = group_member(65534), group_member(65533)
    status, reply = local_call(
        socket_path,
        "POST",
        "/v1/local/forward",
        _forward("b", "POST", "/v1/jobs", _job_body("alices")),
        **alice,
    )
    assert (status, reply["status"]) == (200, 201), reply
    pids = [int(pid) for pid in reply["body"]["pids"].values()]
    for method, path, body in (
        ("POST", "/v1/local/forward", _forward("b", "DELETE", "/v1/jobs/alices")),
        ("POST", "/v1/local/forward", _forward("b", "GET", "/v1/jobs/alices/events?after=0&wait=0")),
        ("POST", "/v1/local/forward", _forward("b", "GET", "/v1/jobs/alices/log/0?tail=5")),
        ("POST", "/v1/local/forward", _forward("b", "POST", "/v1/jobs", _job_body("alices"))),
        ("DELETE", "/v1/local/jobs/alices", None),
        ("GET", "/v1/local/jobs/alices", None),
    ):
        status, reply = local_call(socket_path, method, path, body, **bob)
        assert status == 403 and "belongs to user 'nobody'" in reply["error"], (path, reply)
    assert local_call(socket_path, "GET", "/v1/local/jobs", **bob)[1] == {"jobs": []}
    assert all(_uid_of(pid) in DEFAULT_JOB_UIDS for pid in pids), "still running"
    status, reply = local_call(socket_path, "DELETE", "/v1/local/jobs/alices")  # root
    assert status == 200 and reply["members"]["b"]["status"] == 200
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.05)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


def test_a_forged_submitter_is_overwritten_with_the_callers_name(setup) -> None:
    agent, socket_path = setup
    body = _job_body("forged", submitter="root")
    status, reply = local_call(
        socket_path, "POST", "/v1/local/forward", _forward("b", "POST", "/v1/jobs", body), **group_member()
    )
    assert (status, reply["status"]) == (200, 201), reply
    assert [(job.job_id, job.submitter, job.origin.name) for job in agent.jobs()] == [
        ("forged", "nobody", "b")
    ]
    assert [(j.job_id, j.user) for j in agent.local.jobs()] == [("forged", "nobody")]
    local_call(socket_path, "DELETE", "/v1/local/jobs/forged")


def test_a_restarted_job_names_the_job_it_continues_and_nothing_else_takes_previous(setup) -> None:
    agent, socket_path = setup
    forward = _forward("b", "POST", "/v1/jobs", _job_body("second")) | {"previous": "first"}
    status, reply = local_call(socket_path, "POST", "/v1/local/forward", forward, **group_member())
    assert (status, reply["status"]) == (200, 201), reply
    status, listed = local_call(socket_path, "GET", "/v1/local/jobs", **group_member())
    assert [(j["id"], j.get("previous")) for j in listed["jobs"]] == [("second", "first")]
    for bad in (
        _forward("b", "GET", "/v1/jobs/second/events?after=0&wait=0") | {"previous": "first"},
        _forward("b", "POST", "/v1/jobs", _job_body("third")) | {"previous": "../x"},
    ):
        status, reply = local_call(socket_path, "POST", "/v1/local/forward", bad, **group_member())
        assert status == 400 and "previous" in reply["error"], reply
    local_call(socket_path, "DELETE", "/v1/local/jobs/second")


def test_only_the_member_that_started_a_job_may_stop_it(setup) -> None:
    agent, _ = setup
    assert signed(agent.url, "POST", "/v1/jobs", _job_body("from-a"))[0] == 201
    status, reply = signed(agent.url, "DELETE", "/v1/jobs/from-a", key=AGENT_KEY)  # member b
    assert status == 403 and "started by member 'a'" in reply["error"]
    assert agent.job("from-a").running
    assert signed(agent.url, "DELETE", "/v1/jobs/from-a")[0] == 200


def test_the_socket_forwards_only_the_agent_routes(setup) -> None:
    agent, socket_path = setup
    for method, path in (
        ("POST", "/v1/echo"),
        ("GET", "/v1/jobs/../../etc/passwd"),
        ("GET", "/v1/local/members"),
        ("PUT", "/v1/jobs"),
        ("GET", "http://198.51.100.1/v1/health"),
        ("DELETE", "/v1/jobs/x/../y"),
    ):
        status, reply = local_call(
            socket_path, "POST", "/v1/local/forward", _forward("b", method, path, None), **group_member()
        )
        assert status == 403 and "is not a request the agent forwards" in reply["error"], (path, reply)
    status, reply = local_call(
        socket_path, "POST", "/v1/local/forward", _forward("nowhere", "GET", "/v1/health"), **group_member()
    )
    assert status == 404 and "not a current mesh member" in reply["error"]
    status, reply = local_call(
        socket_path, "POST", "/v1/local/forward", _forward("b", "GET", "/v1/health"), **group_member()
    )
    assert (status, reply["status"], reply["body"]["name"]) == (200, 200, "b")
    _nothing_started(agent)
    assert os.path.exists(socket_path)
