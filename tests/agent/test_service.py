"""Tests of the agent (shardpool/agent/service.py and the modules it puts together) with real
processes on loopback, and requests signed by member keys.

The worker command is replaced by a small script (``worker_command``) that prints events, writes
to its log, records its environment, exits with a chosen code or sleeps until killed, so every test
runs in about a second. The script's behaviour rides in the job as one extra input, whose "path"
on the launcher is the JSON of the mode (the agent never opens input paths). Each test checks /proc
that no process it started is left behind. Every request to the mesh listener is signed by member
"a" (tests/helpers/agents.py) unless the test is about unsigned requests; stages run as the
``shardpool`` account, so the script and work directory live in a 0755 directory.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mesh.control.auth import AuthError
from mesh.control.directory import FixedDirectory, Member
from mesh.control.verifier import RequestVerifier
from mesh.wireguard.keys import public_key
from shardpool.agent import jobs as agent_jobs
from shardpool.agent.accounts import DEFAULT_JOB_UIDS
from shardpool.agent.members import MeshPeer
from shardpool.agent.service import Agent
from shardpool.contract.inference import InferenceJob
from shardpool.contract.job import Job
from shardpool.host.cpu_quota import available_cpus
from tests.helpers.agents import (
    AGENT_KEY,
    LAUNCHER_KEY,
    MESH_ID,
    OTHER_KEY,
    RUN_AS,
    make_agent,
    shared_dir,
    signed,
    write_worker,
)
from tests.helpers.jobs import inference_job_dict, job_dict

REPO = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    job = json.load(open(sys.argv[1]))
    rank = int(sys.argv[2])
    extra = json.loads(job["inputs"]["fake-worker.json"])

    def emit(event):
        print("@shardpool " + json.dumps(event), flush=True)

    if extra["mode"] == "events":
        sys.stdout.write(f"plain line from rank {rank}\\n")
        sys.stdout.flush()
        sys.stderr.write(f"stderr line from rank {rank}\\n")
        print("@shardpool {not json", flush=True)
        for i in range(extra["count"]):
            emit({"event": "step", "rank": rank, "i": i})
        with open("/proc/self/environ", "rb") as initial:  # as the agent set it, before Python's own changes
            env = dict(item.decode().split("=", 1) for item in initial.read().split(b"\\0") if item)
        with open(f"env-rank-{rank}.json", "w") as out:
            json.dump({"env": env, "cwd": os.getcwd()}, out)
        sys.exit(extra["codes"][rank])
    child = None if extra.get("no_child") else subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    if extra.get("stubborn"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    emit({"event": "ready", "pid": os.getpid(), "child": child.pid if child else None})
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_dead(pids: list[int], timeout: float = 8.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _call(
    url: str,
    method: str,
    path: str,
    body: Any = None,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """An unsigned request (for what the agent must refuse before any proof is checked)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    payload = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    try:
        connection.request(method, path, body=payload, headers=headers or {})
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    kind = response.headers.get("Content-Type", "")
    return response.status, json.loads(data) if kind.startswith("application/json") else data.decode()


def _job(mode: str, stages: int = 2, **extra: Any) -> dict[str, Any]:
    return job_dict(stages=stages, inputs={"fake-worker.json": json.dumps({"mode": mode, **extra})})


@pytest.fixture
def shared() -> Iterator[Path]:
    with shared_dir() as path:
        yield path


@pytest.fixture
def worker_script(shared: Path) -> list[str]:
    return write_worker(shared, WORKER)


@pytest.fixture
def agent(shared: Path, worker_script: list[str]) -> Iterator[Agent]:
    with make_agent(shared / "work", worker_script, heartbeat_timeout_s=20.0) as running:
        yield running


def _drain(url: str, job_id: str, timeout: float = 15.0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    events: list[dict[str, Any]] = []
    after = 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, reply = signed(url, "GET", f"/v1/jobs/{job_id}/events?after={after}&wait=1")
        assert status == 200, reply
        events += reply["events"]
        after = events[-1]["seq"] if events else after
        if not reply["running"]:
            return events, reply
    raise AssertionError(f"job {job_id} did not finish")


def test_health(agent: Agent) -> None:
    assert signed(agent.url, "GET", "/v1/health") == (
        200,
        {"name": "b", "address": "127.0.0.1", "version": "0.1.0"},
    )


def test_events_stream_with_seqs_and_exit_codes(agent: Agent) -> None:
    body = {"job_id": "run-1", "job": _job("events", count=5, codes=[0, 3]), "ranks": [0, 1]}
    status, reply = signed(agent.url, "POST", "/v1/jobs", body)
    assert status == 201 and reply["job_id"] == "run-1" and sorted(reply["pids"]) == ["0", "1"]
    events, final = _drain(agent.url, "run-1")
    assert [e["seq"] for e in events] == list(range(1, 11))
    for rank in (0, 1):
        mine = [e["event"] for e in events if e["rank"] == rank]
        assert [e["i"] for e in mine if e["event"] == "step"] == [0, 1, 2, 3, 4]
    assert final["exited"] == {"0": 0, "1": 3}
    job_dir = agent.work_dir / "jobs" / "run-1"
    assert json.loads((job_dir / "job.json").read_text()) == Job.model_validate(body["job"]).model_dump(
        mode="json"
    )
    assert (job_dir.stat().st_mode & 0o777, (job_dir / "job.json").stat().st_mode & 0o777) == (0o700, 0o600)
    # the job's own uid while it runs; root's once it ended and the uid went back
    assert {job_dir.stat().st_uid, (job_dir / "job.json").stat().st_uid} <= {0, *DEFAULT_JOB_UIDS}
    status, log = signed(agent.url, "GET", "/v1/jobs/run-1/log/1?tail=10")
    assert status == 200
    assert "plain line from rank 1" in log and "stderr line from rank 1" in log and "{not json" in log
    assert "step" not in log, "events go to the event list, not the log"
    assert signed(agent.url, "GET", "/v1/jobs/run-1/log/1?tail=1")[1].count("\n") == 1
    # polling from the middle returns only newer events
    status, reply = signed(agent.url, "GET", "/v1/jobs/run-1/events?after=8&wait=0")
    assert [e["seq"] for e in reply["events"]] == [9, 10] and reply["lost"] == 0


def test_stage_environment_is_set_by_the_agent_alone(agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_ONLY_SECRET", "s3cret")
    monkeypatch.setenv("LANG", "C.UTF-8")
    monkeypatch.setenv("SHARDPOOL_CACHE", "/root/.cache/shardpool")
    body = {"job_id": "env", "job": _job("events", stages=3, count=0, codes=[0, 0, 0]), "ranks": [0, 2]}
    assert signed(agent.url, "POST", "/v1/jobs", body)[0] == 201
    _drain(agent.url, "env")
    job_dir = agent.work_dir / "jobs" / "env"
    threads = str(max(1, available_cpus() // 2))
    expected = {
        "PATH": os.environ["PATH"],
        "LANG": "C.UTF-8",
        "SHARDPOOL_CACHE": str(agent.work_dir / "cache"),
        "HOME": str(job_dir),
        "TMPDIR": str(job_dir),
        "PYTHONUNBUFFERED": "1",
        "GLOO_SOCKET_IFNAME": "sptest0",
        "NCCL_SOCKET_IFNAME": "sptest0",
        "NCCL_IB_DISABLE": "1",
        "SHARDPOOL_LOCAL_RANKS": "2",
        "SHARDPOOL_THREADS": threads,
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
    }
    if os.environ.get("PYTHONPATH"):
        expected["PYTHONPATH"] = os.environ["PYTHONPATH"]
    for rank in (0, 2):
        seen = json.loads((job_dir / f"env-rank-{rank}.json").read_text())
        # the job's uid has no passwd entry: the agent names it
        user = seen["env"].get("USER", "")
        assert user.startswith("shardpool-") and int(user.removeprefix("shardpool-")) in DEFAULT_JOB_UIDS
        assert seen == {"env": {**expected, "USER": user, "LOGNAME": user}, "cwd": str(job_dir)}
    cache = agent.work_dir / "cache"
    assert (cache.stat().st_uid, cache.stat().st_gid, cache.stat().st_mode & 0o7777) == (
        RUN_AS.uid,
        RUN_AS.gid,
        0o2770,
    ), "one cache for every job, through the run-as group"


def test_bad_job_requests_are_refused_with_400_and_one_line(agent: Agent) -> None:
    cases = [
        (
            {"job_id": "x", "job": _job("events"), "ranks": [0], "env": {"PATH": "/tmp"}},
            "unknown field `env`",
        ),
        ({"job_id": "../x", "job": _job("events"), "ranks": [0]}, "job_id"),
        ({"job_id": "x", "job": _job("events"), "ranks": [2]}, "0..1"),
        ({"job_id": "x", "job": _job("events"), "ranks": [0, 0]}, "distinct"),
        ({"job_id": "x", "job": _job("events"), "ranks": ["0"]}, "integer"),
        ({"job_id": "x", "job": "not a job", "ranks": [0]}, "`job`"),
        ({"job_id": "x", "job": {**_job("events"), "extra": 1}, "ranks": [0]}, "unknown field `job.extra`"),
        ({"job_id": "x", "job": {**_job("events"), "files_url": None}, "ranks": [0]}, "needs files_url"),
        ({"job_id": "x", "job": _job("events"), "ranks": [0], "files_secret": "AB" * 32}, "files_secret"),
        ({"job_id": "x", "job": _job("events"), "ranks": [0], "submitter": "a b"}, "submitter"),
    ]
    for body, fragment in cases:
        status, reply = signed(agent.url, "POST", "/v1/jobs", body)
        assert status == 400 and fragment in reply["error"] and "\n" not in reply["error"], (body, reply)
    assert signed(agent.url, "POST", "/v1/jobs", raw=b"{nope")[0] == 400
    assert (
        _call(agent.url, "POST", "/v1/jobs", raw=b"", headers={"Content-Length": str(17 * 2**20)})[0] == 413
    )
    assert signed(agent.url, "GET", "/v1/jobs/nope/events")[0] == 404
    assert signed(agent.url, "GET", "/v1/jobs/x/events?after=abc")[0] in (400, 404)
    assert signed(agent.url, "GET", "/v1/other")[0] == 404
    assert signed(agent.url, "PUT", "/v1/jobs")[0] == 405
    assert not (agent.work_dir / "jobs" / "x").exists()


def test_an_inference_job_runs_the_inference_stage_command_not_the_training_rank(
    shared: Path, worker_script: list[str]
) -> None:
    inference = shared / "inference.py"
    inference.write_text(
        "import sys\nprint('inference stage', sys.argv[2], sys.argv[1].endswith('job.json'))\n"
    )
    inference.chmod(0o644)
    job = inference_job_dict(inputs={"model/config.json": "/m/config.json"})
    agent_ = make_agent(shared / "work", worker_script, inference_command=[sys.executable, str(inference)])
    with agent_ as agent:
        status, reply = signed(agent.url, "POST", "/v1/jobs", {"job_id": "ring", "job": job, "ranks": [0, 1]})
        assert status == 201, reply
        _, final = _drain(agent.url, "ring")
        assert final["exited"] == {"0": 0, "1": 0}
        for rank in (0, 1):
            assert (
                f"inference stage {rank} True"
                in signed(agent.url, "GET", f"/v1/jobs/ring/log/{rank}?tail=5")[1]
            )
        written = json.loads((agent.work_dir / "jobs" / "ring" / "job.json").read_text())
        assert written == InferenceJob.model_validate(job, strict=False).model_dump(mode="json")
        status, reply = signed(agent.url, "POST", "/v1/jobs", {"job_id": "ring2", "job": job, "ranks": [2]})
        assert status == 400 and "0..1" in reply["error"], reply


def _started_events(url: str, job_id: str, count: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + 10
    while len(events) < count and time.monotonic() < deadline:
        reply = signed(url, "GET", f"/v1/jobs/{job_id}/events?after={len(events)}&wait=1")[1]
        events += [e["event"] for e in reply["events"]]
    assert len(events) == count, f"only {len(events)} of {count} ranks started"
    return events


def test_delete_stops_the_job_and_its_children_and_a_running_id_is_409(agent: Agent) -> None:
    body = {"job_id": "sleepy", "job": _job("sleep"), "ranks": [0, 1]}
    status, reply = signed(agent.url, "POST", "/v1/jobs", body)
    assert status == 201
    pids = [int(p) for p in reply["pids"].values()]
    time.sleep(0.5)  # the request's connection and its server thread are gone by now
    assert all(_alive(p) for p in pids), "workers outlive the request thread that started them"
    started = _started_events(agent.url, "sleepy", 2)
    children = [e["child"] for e in started]
    assert all(_alive(p) for p in pids + children)
    assert signed(agent.url, "POST", "/v1/jobs", body)[0] == 409
    t0 = time.monotonic()
    status, reply = signed(agent.url, "DELETE", "/v1/jobs/sleepy")
    assert status == 200 and reply["exited"] == {"0": -signal.SIGTERM, "1": -signal.SIGTERM}
    assert time.monotonic() - t0 < 3
    assert _wait_dead(pids + children) == []
    status, reply = signed(agent.url, "GET", "/v1/jobs/sleepy/events?after=2&wait=0")
    assert reply["running"] is False and reply["stopped_by"] == "request"
    assert (
        signed(agent.url, "POST", "/v1/jobs", {**body, "job": _job("events", count=0, codes=[0, 0])})[0]
        == 201
    ), "a finished id can be reused"
    _drain(agent.url, "sleepy")


def test_a_job_ignoring_sigterm_is_killed_after_the_grace_period(agent: Agent, monkeypatch) -> None:
    monkeypatch.setattr(agent_jobs, "_TERMINATE_GRACE_S", 0.5)
    status, reply = signed(
        agent.url,
        "POST",
        "/v1/jobs",
        {"job_id": "stubborn", "job": _job("sleep", stubborn=True), "ranks": [0]},
    )
    pid = int(reply["pids"]["0"])
    child = _started_events(agent.url, "stubborn", 1)[0]["child"]
    status, reply = signed(agent.url, "DELETE", "/v1/jobs/stubborn")
    assert reply["exited"] == {"0": -signal.SIGKILL}
    assert _wait_dead([pid, child]) == []


def test_heartbeat_timeout_stops_a_job_nobody_polls(shared: Path, worker_script: list[str]) -> None:
    with make_agent(shared / "w", worker_script, interface=None, heartbeat_timeout_s=1.0) as agent:
        status, reply = signed(
            agent.url, "POST", "/v1/jobs", {"job_id": "orphan", "job": _job("sleep"), "ranks": [1]}
        )
        pid = int(reply["pids"]["1"])
        # polling keeps it alive past the timeout ...
        for _ in range(4):
            assert signed(agent.url, "GET", "/v1/jobs/orphan/events?after=9&wait=0.4")[1]["running"]
        assert _alive(pid)
        # ... and silence stops it
        t0 = time.monotonic()
        assert _wait_dead([pid], timeout=5) == []
        assert time.monotonic() - t0 < 3
        status, reply = signed(agent.url, "GET", "/v1/jobs/orphan/events?after=0&wait=0")
        assert reply["stopped_by"] == "heartbeat timeout" and reply["exited"] == {"1": -signal.SIGTERM}


def test_long_poll_waits_for_events_but_not_longer(agent: Agent) -> None:
    signed(agent.url, "POST", "/v1/jobs", {"job_id": "wait", "job": _job("sleep"), "ranks": [0]})
    status, reply = signed(agent.url, "GET", "/v1/jobs/wait/events?after=0&wait=10")
    assert len(reply["events"]) == 1, "returns as soon as an event exists"
    t0 = time.monotonic()
    status, reply = signed(agent.url, "GET", "/v1/jobs/wait/events?after=1&wait=0.6")
    assert reply["events"] == [] and reply["running"] is True
    assert 0.5 < time.monotonic() - t0 < 2.0
    assert signed(agent.url, "GET", "/v1/jobs/wait/events?after=1&wait=999")[0] == 400


def test_agent_stop_stops_every_job(shared: Path, worker_script: list[str]) -> None:
    agent = make_agent(shared / "w", worker_script, interface=None)
    agent.start()
    pids = []
    for job_id in ("one", "two"):
        pids += [
            int(p)
            for p in signed(
                agent.url, "POST", "/v1/jobs", {"job_id": job_id, "job": _job("sleep"), "ranks": [0, 1]}
            )[1]["pids"].values()
        ]
    agent.stop()
    assert _wait_dead(pids, timeout=2) == []


def test_workers_die_when_the_agent_is_killed(shared: Path, worker_script: list[str]) -> None:
    code = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from tests.helpers import agents
        agent = agents.make_agent(Path({str(shared / "w")!r}), {worker_script!r}, interface=None).start()
        print(agent.url, agents.AGENT_KEY, agents.LAUNCHER_KEY, flush=True)
        time.sleep(600)
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    pids: list[int] = []
    try:
        url, agent_key, launcher_key = (process.stdout.readline() if process.stdout else "").split()
        reply = signed(
            url, "POST", "/v1/jobs", {"job_id": "j", "job": _job("sleep", no_child=True), "ranks": [0, 1]},
            key=launcher_key, to=agent_key,
        )[1]  # fmt: skip
        pids = [int(p) for p in reply["pids"].values()]
        time.sleep(0.3)
        assert all(_alive(p) for p in pids)
    finally:
        process.kill()
        process.wait()
    survivors = _wait_dead(pids, timeout=3)
    for pid in pids:  # never leak, even when the assertion below fails
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert survivors == [], "PR_SET_PDEATHSIG kills workers with the agent"


def test_unsigned_strangers_and_misplaced_members_are_refused(shared: Path, worker_script: list[str]) -> None:
    """Replaces the IP allowlist: no proof or a stranger's key is 401; a member's key from another
    address than its own mesh address is 403; none of them starts anything."""
    elsewhere = RequestVerifier(
        AGENT_KEY,
        MESH_ID,
        FixedDirectory(
            [
                Member("a", "198.51.100.1", public_key(LAUNCHER_KEY), True),
                Member("b", "127.0.0.1", public_key(AGENT_KEY), True),
            ]
        ),
    )
    with Agent(
        "127.0.0.1", 0, verifier=elsewhere, peers=lambda: [MeshPeer("b", "127.0.0.1", public_key(AGENT_KEY))],
        work_dir=shared / "w", interface=None, member_name="f", run_as=RUN_AS, worker_command=worker_script,
    ) as agent:  # fmt: skip
        for method, path, body in (
            ("GET", "/v1/health", None),
            ("POST", "/v1/jobs", {"job_id": "x", "job": _job("sleep"), "ranks": [0]}),
            ("DELETE", "/v1/jobs/x", None),
        ):
            status, reply = _call(agent.url, method, path, body)
            assert status == 401 and "X-Shardpool" in reply["error"], reply
            with pytest.raises(AuthError, match="403"):  # the refusal is not signed: never trusted
                signed(agent.url, method, path, body)
            with pytest.raises(AuthError, match="401"):
                signed(agent.url, method, path, body, key=OTHER_KEY)
        assert not (shared / "w" / "jobs" / "x").exists() and agent.jobs() == []


@pytest.mark.slow
def test_devices_profiles_each_device_once(agent: Agent, tiny_model: Path) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    workload = {
        "micro_batch_size": 1,
        "sequence_len": 16,
        "gradient_accumulation_steps": 2,
        "lora_r": 4,
        "lora_targets": ["q_proj", "v_proj"],
    }
    status, reply = signed(agent.url, "POST", "/v1/devices", {"model_config": config, "workload": workload})
    assert status == 200, reply
    cpu = reply["devices"][-1]
    assert cpu["name"] == "cpu" and cpu["kind"] == "cpu" and cpu["threads"] >= 1
    assert (
        cpu["seconds_per_layer"] > 0
        and cpu["activation_bytes"] > 0
        and 0 < cpu["free_bytes"] <= cpu["total_bytes"]
    )
    t0 = time.monotonic()
    planner_only = {**workload, "stages": 3, "max_stages": None, "schedule": "gpipe", "wire_bytes": 2}
    again = signed(agent.url, "POST", "/v1/devices", {"model_config": config, "workload": planner_only})
    assert again == (200, reply)
    assert time.monotonic() - t0 < 0.5, "cached: planner-only fields do not change a layer profile"
    status, reply = signed(
        agent.url, "POST", "/v1/devices", {"model_config": config, "workload": {"bogus": 1}}
    )
    assert status == 400 and "bogus" in reply["error"]
    status, reply = signed(
        agent.url, "POST", "/v1/devices", {"model_config": {"model_type": "gpt2"}, "workload": {}}
    )
    assert status == 400 and "unsupported architecture 'gpt2'" in reply["error"]


def test_agent_command_without_mesh_state_is_one_line_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shardpool", "agent", "--state-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=30, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    assert result.returncode == 2
    assert (
        result.stderr.strip().startswith("shardpool: error: no mesh state")
        and "\n" not in result.stderr.strip()
    )


def test_agent_module_does_not_import_torch() -> None:
    code = (
        "import importlib, pkgutil, sys, shardpool.agent, shardpool.cli\n"
        "for module in pkgutil.iter_modules(shardpool.agent.__path__, 'shardpool.agent.'):\n"
        "    importlib.import_module(module.name)\n"
        "print([m for m in sys.modules if m.split('.')[0] == 'torch'])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert result.stdout.strip() == "[]"


def test_echo_and_probe_measure_links_between_members(agent: Agent, shared: Path) -> None:
    from shardpool.agent.client import AgentRefused, SignedAgentClient

    client = SignedAgentClient(
        agent.url, private_key=LAUNCHER_KEY, peer_public_key=public_key(AGENT_KEY), mesh_id=MESH_ID
    )
    assert client.echo(1 << 20) > 0
    link = client.measure_link(nbytes=1 << 20)
    assert link["bandwidth"] > 1e6 and 0 < link["latency"] < 1.0
    port = int(agent.url.rsplit(":", 1)[1])
    with make_agent(shared / "other", None, key=OTHER_KEY, name="c", host="127.0.0.2", port=port):
        measured = client.probe({"c": f"http://127.0.0.2:{port}"}, nbytes=1 << 20)
    assert set(measured) == {"c"} and measured["c"]["bandwidth"] > 1e6, measured
    with pytest.raises(AgentRefused, match="403"):
        client.probe({"outside": "http://192.0.2.99:7710"})
    status, reply = _call(
        agent.url, "POST", "/v1/echo", raw=b"x" * 10, headers={"Content-Length": str(64 * 2**20)}
    )
    assert status == 413, reply
