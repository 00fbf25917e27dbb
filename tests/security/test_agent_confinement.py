"""The agent starts only jobs that fit the contract, gives stages its own minimal environment, and
the mesh launcher passes on only events that fit the contract. Real agent, real sockets, real processes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from mesh.wireguard.keys import public_key
from shardpool.agent.client import SignedAgentClient
from shardpool.agent.service import Agent
from shardpool.contract.job import Job
from shardpool.errors import ShardpoolError
from shardpool.host.cpu_quota import available_cpus
from shardpool.launch.mesh_launcher import run_mesh_job
from shardpool.launch.mesh_members import MeshMember
from tests.helpers.agents import (
    AGENT_KEY,
    LAUNCHER_KEY,
    MESH_ID,
    make_agent,
    shared_dir,
    signed,
    write_worker,
)
from tests.helpers.jobs import RECORDING_WORKER, job_dict


@pytest.fixture
def agent() -> Iterator[Agent]:
    with shared_dir() as shared:
        with make_agent(shared / "work", write_worker(shared, RECORDING_WORKER)) as running:
            yield running


def _client(agent: Agent) -> SignedAgentClient:
    return SignedAgentClient(
        agent.url, private_key=LAUNCHER_KEY, peer_public_key=public_key(AGENT_KEY), mesh_id=MESH_ID
    )


def _post(agent: Agent, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return signed(agent.url, "POST", "/v1/jobs", body)


def _wait_finished(agent: Agent, job_id: str) -> None:
    client = _client(agent)
    for _ in range(60):
        if not client.events(job_id, after=0, wait=1.0)["running"]:
            return
    raise AssertionError(f"job {job_id} did not finish")


def test_a_job_naming_a_non_member_address_is_refused_with_403(agent: Agent) -> None:
    for job in (job_dict(master_addr="192.0.2.99"), job_dict(files_url="http://192.0.2.99:8000")):
        status, reply = _post(agent, {"job_id": "outside", "job": job, "ranks": [0]})
        assert status == 403 and "192.0.2.99 is not a current mesh member" in reply["error"]
        assert "\n" not in reply["error"]
    assert not (agent.work_dir / "jobs" / "outside").exists()


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"env": {"NCCL_NET_PLUGIN": "/tmp/evil.so"}}, "unknown field `env`"),
        ({"job": job_dict(inputs={"../../etc/passwd": "/x"})}, "input name"),
        ({"job": job_dict(files_url=None)}, "needs files_url"),
    ],
)
def test_requests_outside_the_contract_are_refused_with_400(
    agent: Agent, change: dict[str, Any], fragment: str
) -> None:
    status, reply = _post(agent, {"job_id": "bad", "job": job_dict(), "ranks": [0], **change})
    assert status == 400 and fragment in reply["error"], reply
    assert not (agent.work_dir / "jobs" / "bad").exists()


def test_stage_processes_get_the_agents_minimal_environment_not_its_own(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENT_ONLY_SECRET", "s3cret")
    monkeypatch.setenv("LD_PRELOAD", "")
    monkeypatch.delenv("SHARDPOOL_CACHE", raising=False)
    status, reply = _post(agent, {"job_id": "env", "job": job_dict(), "ranks": [0, 1]})
    assert status == 201, reply
    _wait_finished(agent, "env")
    job_dir = agent.work_dir / "jobs" / "env"
    env = json.loads((job_dir / "env-rank-1.json").read_text())
    assert "AGENT_ONLY_SECRET" not in env and "LD_PRELOAD" not in env
    assert {key: env.get(key) for key in ("HOME", "TMPDIR", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")} == {
        "HOME": str(job_dir),
        "TMPDIR": str(job_dir),
        "GLOO_SOCKET_IFNAME": "sptest0",
        "NCCL_SOCKET_IFNAME": "sptest0",
    }
    assert (env["NCCL_IB_DISABLE"], env["SHARDPOOL_LOCAL_RANKS"]) == ("1", "2")
    assert env["SHARDPOOL_CACHE"] == str(agent.work_dir / "cache"), "one cache for every job"
    assert int(env["OMP_NUM_THREADS"]) == int(env["SHARDPOOL_THREADS"]) == max(1, available_cpus() // 2)


def test_the_mesh_launcher_refuses_an_event_that_points_outside_the_output_dir(agent: Agent) -> None:
    escape = {"event": "checkpoint_written", "step": 1, "partial": "../../../etc", "eval_before": None}
    job = Job.model_validate(job_dict(stages=1, inputs={"events.json": json.dumps([escape])}))
    member = MeshMember("b", "127.0.0.1", True, _client(agent))
    seen: list[dict[str, Any]] = []
    with pytest.raises(ShardpoolError, match="breaks the contract"):
        run_mesh_job(job, "escape", {"b": (member, [0])}, on_event=seen.append)
    assert seen == []
