"""The launcher's client of its own agent's Unix socket: members, forwarding, refusals as one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mesh.constants import AGENT_SOCKET_ENV, DEFAULT_AGENT_SOCKET
from shardpool.agent.client import AgentRefused, AgentUnreachable
from shardpool.agent.local_client import LaunchNotAllowed, LocalAgentClient, NoLocalAgent, agent_socket_path
from shardpool.launch.mesh_members import online_members
from tests.helpers.local_agent import StubLocalAgent, shared_socket_dir

REPO = Path(__file__).resolve().parents[2]
MEMBERS = [
    {"name": "a", "address": "198.51.100.1", "online": True, "is_self": True},
    {"name": "b", "address": "198.51.100.2", "online": True, "is_self": False},
    {"name": "c", "address": "198.51.100.3", "online": False, "is_self": False},
]


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    path = shared_socket_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_socket_path_comes_from_the_argument_then_the_environment_then_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(AGENT_SOCKET_ENV, raising=False)
    assert agent_socket_path() == DEFAULT_AGENT_SOCKET == "/run/shardpool/agent.sock"
    monkeypatch.setenv(AGENT_SOCKET_ENV, "/tmp/x/agent.sock")
    assert agent_socket_path() == "/tmp/x/agent.sock"
    assert LocalAgentClient().socket_path == "/tmp/x/agent.sock"
    assert agent_socket_path("/elsewhere.sock") == "/elsewhere.sock"


def test_a_missing_agent_is_one_line_that_says_how_to_start_it(socket_dir: Path) -> None:
    client = LocalAgentClient(str(socket_dir / "agent.sock"))
    with pytest.raises(NoLocalAgent) as caught:
        client.members()
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("no shardpool agent on this machine")
    assert str(socket_dir / "agent.sock") in message
    assert "`shardpool mesh up`" in message and "`shardpool agent`" in message


def test_online_members_lists_only_those_that_answer_with_clients_forwarding_to_them(
    socket_dir: Path,
) -> None:
    path = socket_dir / "agent.sock"
    replies = {"/v1/jobs": (201, {"job_id": "j1", "pids": {"1": 4242}})}
    with StubLocalAgent(path, members=MEMBERS, forward_replies=replies) as agent:
        members = online_members(LocalAgentClient(str(path)))
        assert [(m.name, m.address, m.is_self) for m in members] == [
            ("a", "198.51.100.1", True),
            ("b", "198.51.100.2", False),
        ]
        assert members[1].agent.url == "http://198.51.100.2:7710"
        secret = "ab" * 32
        reply = members[1].agent.start_job("j1", {"world": 2}, [1], files_secret=secret)
    assert reply == {"job_id": "j1", "pids": {"1": 4242}}
    assert agent.forwarded == [
        {
            "member": "b",
            "method": "POST",
            "path": "/v1/jobs",
            "body": {"job_id": "j1", "job": {"world": 2}, "ranks": [1], "files_secret": secret},
        }
    ]


def test_a_restart_forwards_the_job_it_continues_beside_the_start_body(socket_dir: Path) -> None:
    path = socket_dir / "agent.sock"
    replies = {"/v1/jobs": (201, {"job_id": "j2", "pids": {"0": 1}})}
    with StubLocalAgent(path, members=MEMBERS, forward_replies=replies) as agent:
        LocalAgentClient(str(path)).member("b", "198.51.100.2").start_job(
            "j2", {"world": 1}, [0], previous="j1"
        )
    assert agent.forwarded[0]["previous"] == "j1"
    assert "previous" not in agent.forwarded[0]["body"], "the member's agent never sees it"


def test_a_member_agents_refusal_names_the_member_and_an_unreachable_member_is_told_apart(
    socket_dir: Path,
) -> None:
    path = socket_dir / "agent.sock"
    replies = {"/v1/jobs/j1": (403, {"error": "only the member that started job j1 may stop it"})}
    with StubLocalAgent(path, members=MEMBERS, forward_replies=replies, unreachable={"c"}):
        local = LocalAgentClient(str(path))
        with pytest.raises(AgentRefused) as refused:
            local.member("b", "198.51.100.2").stop_job("j1")
        with pytest.raises(AgentUnreachable) as unreachable:
            local.member("c", "198.51.100.3").events("j1", after=0)
    assert not isinstance(refused.value, (AgentUnreachable, LaunchNotAllowed))
    assert str(refused.value) == (
        "agent of member 'b' refused DELETE /v1/jobs/j1: 403 only the member that started job j1 may stop it"
    )
    assert str(unreachable.value) == "member c's agent did not answer GET"


def test_a_refusal_by_the_local_agent_keeps_its_one_line_fix(socket_dir: Path) -> None:
    path = socket_dir / "agent.sock"
    reason = "user 'eve' may not launch shardpool jobs on this machine; ask an admin to run `usermod -aG shardpool eve`"
    with StubLocalAgent(path, members=MEMBERS, refuse=reason):
        with pytest.raises(LaunchNotAllowed) as caught:
            LocalAgentClient(str(path)).members()
    assert str(caught.value) == reason


def test_a_refusal_sent_before_a_large_body_was_read_is_still_the_answer(socket_dir: Path) -> None:
    path = socket_dir / "agent.sock"
    reason = "user 'shardpool' runs job stages and may not launch jobs itself"
    big_job = {"inputs": {f"model/shard-{index:05d}": "x" * 200 for index in range(40_000)}}
    with StubLocalAgent(path, members=MEMBERS, refuse=reason):
        agent = LocalAgentClient(str(path)).member("b", "198.51.100.2")
        with pytest.raises(AgentRefused) as caught:
            agent.start_job("j1", big_job, [0])
    assert not isinstance(caught.value, AgentUnreachable)
    assert str(caught.value) == f"the local shardpool agent refused POST /v1/local/forward: 403 {reason}"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the client as another uid")
def test_a_user_the_socket_mode_keeps_out_gets_the_usermod_fix_naming_the_socket_group(
    socket_dir: Path,
) -> None:
    path = socket_dir / "agent.sock"
    with StubLocalAgent(path, members=MEMBERS, unix_group="shardpool"):
        result = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "shardpool", "jobs",
             "--socket", str(path)],
            capture_output=True, text=True, timeout=60, cwd="/", env={"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO)},
        )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0] == (
        f"shardpool: error: user 'nobody' may not use the shardpool agent at {path} "
        "(the socket's permissions refused you); ask an admin to run `usermod -aG shardpool nobody` "
        "(then log in again)"
    )


def test_a_refused_user_gets_the_fix_from_finetune_before_anything_is_prepared(
    socket_dir: Path,
    tiny_model: Path,
    completion_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rich.console import Console

    from shardpool.config import parse_config
    from shardpool.finetune import finetune
    from tests.helpers.training import base_config

    path = socket_dir / "agent.sock"
    monkeypatch.setenv(AGENT_SOCKET_ENV, str(path))
    out = tmp_path / "out"
    config = parse_config(base_config(tiny_model, completion_data, out, shardpool={"placement": "mesh"}))
    reason = "user 'eve' may not launch shardpool jobs on this machine; ask an admin to run `usermod -aG shardpool eve`"
    with StubLocalAgent(path, members=MEMBERS, refuse=reason) as agent:
        with pytest.raises(LaunchNotAllowed, match="usermod -aG shardpool eve"):
            finetune(config, console=Console(quiet=True))
    assert agent.forwarded == []
    assert not out.exists()
