"""The agent's device profiling runs in a child process (shardpool/agent/profiling.py): as the run-as
account, with the agent's environment, fed the shape and workload on stdin. A child that crashes,
hangs, floods stdout or prints garbage costs a one-line 500, never the agent, and leaves no process.

The profiler command is replaced by small scripts; the real ``python -m shardpool.plan.report`` is
exercised by tests/agent/test_service.py::test_devices_profiles_each_device_once.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import pytest

from shardpool.agent.confine import landlock_abi
from shardpool.agent.profiling import ProfileFailed, _report_rows, devices_request
from shardpool.agent.service import Agent
from shardpool.plan.costmodel import Workload
from tests.agent.test_service import _alive
from tests.helpers.agents import PROFILE_CONFIG, PROFILE_WORKLOAD, RUN_AS, make_agent, shared_dir, signed

CONFIG, WORKLOAD = PROFILE_CONFIG, PROFILE_WORKLOAD

#: Reports what it was asked and who it runs as, as the real report's one CPU row would.
ECHO = textwrap.dedent(
    """
    import json, os, sys
    request = json.load(sys.stdin)
    with open("/proc/self/environ", "rb") as initial:
        env = dict(item.decode().split("=", 1) for item in initial.read().split(b"\\0") if item)
    try:
        with open(f"/tmp/shardpool-profile-escape-{os.getpid()}", "w"):
            escaped = True
    except PermissionError:
        escaped = False
    with open("seen.json", "w") as out:
        json.dump({"request": request, "uid": os.getuid(), "env": env, "cwd": os.getcwd(), "escaped": escaped}, out)
    print("torch chatter on stdout would break the report", file=sys.stderr)
    row = {"name": "cpu", "kind": "cpu", "label": "test cpu", "total_bytes": 8, "free_bytes": 4,
           "threads": 2, "seconds_per_layer": 0.5, "activation_bytes": 1024, "extra": "dropped"}
    print(json.dumps({"devices": [row]}))
    """
)


@pytest.fixture
def shared() -> Iterator[Path]:
    with shared_dir() as path:
        yield path


def _devices(agent: Agent, workload: dict[str, Any] = WORKLOAD) -> tuple[int, Any]:
    return signed(agent.url, "POST", "/v1/devices", {"model_config": CONFIG, "workload": workload})


def _profiler(shared: Path, code: str, **options: Any) -> Agent:
    script = shared / "profile.py"
    script.write_text(code)
    script.chmod(0o644)
    return make_agent(shared / "work", None, profile_command=[sys.executable, str(script)], **options)


def test_the_report_runs_as_the_run_as_account_with_the_agents_environment(shared: Path) -> None:
    with _profiler(shared, ECHO) as agent:
        status, reply = _devices(agent)
        assert status == 200, reply
        assert reply == {
            "devices": [
                {"name": "cpu", "kind": "cpu", "label": "test cpu", "total_bytes": 8, "free_bytes": 4,
                 "threads": 2, "seconds_per_layer": 0.5, "activation_bytes": 1024}
            ]
        }  # fmt: skip
        home = agent.work_dir / "profile"
        seen = json.loads((home / "seen.json").read_text())
        assert seen["uid"] == RUN_AS.uid and seen["cwd"] == str(home)
        assert seen["escaped"] is not bool(landlock_abi()), "Landlock fences the report to its directory"
        assert (home.stat().st_uid, home.stat().st_mode & 0o777) == (RUN_AS.uid, 0o700)
        env = seen["env"]
        assert env["HOME"] == env["TMPDIR"] == env["SHARDPOOL_CACHE"] == str(home)
        assert "GLOO_SOCKET_IFNAME" not in env and "SHARDPOOL_AGENT_SOCKET" not in env
        assert seen["request"]["shape"]["hidden_size"] == 64
        assert (
            seen["request"]["workload"]["lora_r"] == 4 and seen["request"]["workload"]["sequence_len"] == 16
        )
        (home / "seen.json").unlink()
        assert _devices(agent, {**WORKLOAD, "stages": 2}) == (200, reply), "cached across planner-only fields"
        assert not (home / "seen.json").exists(), "the cached report started no child"


@pytest.mark.parametrize(
    ("code", "fragment"),
    [
        ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n", "was killed by SIGSEGV"),
        (
            "import sys\nprint('shardpool.plan.report: error: the GPU fell off', file=sys.stderr)\nsys.exit(1)\n",
            "exited with status 1: shardpool.plan.report: error: the GPU fell off",
        ),
        ("print('not a report')\n", "not a JSON object"),
        ("print('{\"devices\": []}')\n", "lists no devices"),
        ('print(\'{"devices": [{"name": "cpu"}]}\')\n', "must have the fields"),
        ("import sys\nsys.stdout.write('x' * (3 << 20))\n", "more than 1048576 bytes"),
    ],
)
def test_a_failing_report_is_a_one_line_500_and_the_agent_carries_on(
    shared: Path, code: str, fragment: str
) -> None:
    with _profiler(shared, code) as agent:
        status, reply = _devices(agent)
        assert status == 500 and fragment in reply["error"] and "\n" not in reply["error"], reply
        assert reply["error"].startswith("profiling this machine's devices failed: ")
        assert signed(agent.url, "GET", "/v1/health")[0] == 200


def test_a_hanging_report_is_stopped_at_the_deadline_with_what_it_started(shared: Path) -> None:
    code = textwrap.dedent(
        """
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open("pids", "w") as out:
            out.write(f"{os.getpid()} {child.pid}")
        time.sleep(600)
        """
    )
    with _profiler(shared, code, profile_timeout_s=2.0) as agent:
        started = time.monotonic()
        status, reply = _devices(agent)
        assert status == 500 and "longer than 2 s" in reply["error"], reply
        assert time.monotonic() - started < 6
        pids = [int(p) for p in (agent.work_dir / "profile" / "pids").read_text().split()]
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids)
        assert signed(agent.url, "GET", "/v1/health")[0] == 200


def test_a_malformed_request_starts_no_child(shared: Path) -> None:
    with _profiler(shared, ECHO) as agent:
        assert signed(agent.url, "POST", "/v1/devices", {"workload": {}})[0] == 400
        status, reply = _devices(agent, {"lora_targets": "q_proj"})
        assert status == 400 and "lora_targets" in reply["error"]
        assert not (agent.work_dir / "profile" / "seen.json").exists()


# ---------------------------------------------------------------------------- the report's rows

OLD_ROW = {"name": "cpu", "kind": "cpu", "label": "test cpu", "total_bytes": 8, "free_bytes": 4,
           "threads": 2, "seconds_per_layer": 0.5, "activation_bytes": 1024}  # fmt: skip
MEASURED = {"forward_seconds": 0.2, "embed_seconds": 0.0, "head_forward_seconds": 0.1,
            "head_backward_seconds": 0.12, "optimizer_seconds": 0.001, "runs": 5,
            "seconds_min": 0.45, "seconds_max": 0.6, "cpu_quota": 0.6, "ci95_rel": 0.02}  # fmt: skip


def _rows(*rows: dict[str, Any]) -> list[dict[str, Any]]:
    return _report_rows(json.dumps({"devices": list(rows)}).encode())


def test_a_row_keeps_the_measured_fields() -> None:
    assert _rows({**OLD_ROW, **MEASURED, "extra": "dropped"}) == [{**OLD_ROW, **MEASURED}]


def test_an_older_members_row_without_the_measured_fields_is_accepted() -> None:
    assert _rows(OLD_ROW) == [OLD_ROW]
    assert _rows({**OLD_ROW, "forward_seconds": None, "cpu_quota": None}) == [OLD_ROW]


@pytest.mark.parametrize(
    ("field", "value"),
    [("forward_seconds", -0.1), ("embed_seconds", "fast"), ("optimizer_seconds", 1e9),
     ("head_forward_seconds", True), ("seconds_max", float("nan")), ("seconds_min", float("inf")),
     ("runs", 0), ("runs", 2.5), ("runs", 10**9), ("cpu_quota", 0), ("cpu_quota", -1.0),
     ("cpu_quota", 1e6), ("ci95_rel", -0.1), ("ci95_rel", 1e9), ("seconds_per_layer", 0.0), ("seconds_per_layer", float("nan"))],
)  # fmt: skip
def test_a_measured_field_out_of_bounds_fails_the_report(field: str, value: Any) -> None:
    with pytest.raises(ProfileFailed, match=f"row's {field} is"):
        _rows({**OLD_ROW, **MEASURED, field: value})


def test_the_launchers_profile_request_validates_here_and_on_an_agent_from_before_replicas() -> None:
    workload = Workload(sequence_len=16, lora_r=4, replicas=2, stages=2)
    request = workload.profile_request()
    _, parsed = devices_request({"model_config": CONFIG, "workload": request})
    assert parsed.profile_key() == workload.profile_key()
    _, full = devices_request({"model_config": CONFIG, "workload": json.loads(json.dumps(asdict(workload)))})
    assert full.replicas == 2, "this version still takes every Workload field"
    known_before_replicas = {field.name for field in fields(Workload)} - {"replicas"}
    assert set(request) <= known_before_replicas, "an older agent rejects unknown workload fields"


FACTS = {"compute_capability": "8.6", "bf16": True}


def test_a_row_keeps_the_device_facts_and_a_refused_device_needs_no_profile() -> None:
    assert _rows({**OLD_ROW, **FACTS}) == [{**OLD_ROW, **FACTS}]
    unprofiled = {
        key: value for key, value in OLD_ROW.items() if key not in ("seconds_per_layer", "activation_bytes")
    }
    refused = {**unprofiled, "compute_capability": "5.2", "bf16": False, "nf4_error": "no kernel image"}
    assert _rows(refused) == [refused]
    with pytest.raises(ProfileFailed, match="must have the fields"):
        _rows(unprofiled)


#: A Maxwell card's row: bitsandbytes' 4-bit probe failed, its NF4 layer was profiled in plain PyTorch.
M40_FACTS = {"compute_capability": "5.2", "bf16": False, "nf4_error": "Error named symbol not found"}


def test_a_profiled_row_with_nf4_error_keeps_its_profile_and_the_error() -> None:
    m40 = {**OLD_ROW, **MEASURED, **M40_FACTS, "name": "cuda:1", "kind": "cuda", "threads": 0}
    assert _rows({**m40, "extra": "dropped"}) == [m40]


@pytest.mark.parametrize(
    ("field", "value"),
    [("seconds_per_layer", 0.0), ("seconds_per_layer", float("inf")), ("seconds_per_layer", "fast"),
     ("activation_bytes", 1.5), ("forward_seconds", -0.1), ("optimizer_seconds", 1e9), ("runs", 0),
     ("cpu_quota", 1e6), ("ci95_rel", float("nan")), ("nf4_error", "e" * 301), ("nf4_error", "two\nlines")],
)  # fmt: skip
def test_a_profiled_row_with_nf4_error_is_held_to_the_same_bounds(field: str, value: Any) -> None:
    with pytest.raises(ProfileFailed, match=f"row's {field} is"):
        _rows({**OLD_ROW, **MEASURED, **M40_FACTS, field: value})


def test_a_row_with_nf4_error_and_half_a_profile_fails_the_report() -> None:
    half = {key: value for key, value in OLD_ROW.items() if key != "activation_bytes"}
    with pytest.raises(ProfileFailed, match="must have the fields"):
        _rows({**half, **M40_FACTS})


@pytest.mark.parametrize(
    ("field", "value"),
    [("compute_capability", 8.6), ("compute_capability", "x" * 41), ("compute_capability", "8.6\n"),
     ("bf16", "yes"), ("bf16", 1), ("nf4_error", ""), ("nf4_error", "e" * 301)],
)  # fmt: skip
def test_a_device_fact_out_of_bounds_fails_the_report(field: str, value: Any) -> None:
    with pytest.raises(ProfileFailed, match=f"row's {field} is"):
        _rows({**OLD_ROW, field: value})


def test_a_host_throttled_anew_is_profiled_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent keeps each report, keyed by the cgroup CPU quota its children run under too."""
    from types import SimpleNamespace

    from shardpool.agent import profiling

    quota: list[float | None] = [None]
    monkeypatch.setattr(profiling, "cpu_quota", lambda: quota[0])
    profiler = profiling.DeviceProfiler(SimpleNamespace(), SimpleNamespace(running=True))  # type: ignore[arg-type]
    measured: list[float | None] = []

    def measure(shape: Any, workload: Any) -> list[dict[str, Any]]:
        measured.append(quota[0])
        return [{"name": "cpu", "seconds_per_layer": 0.1 if quota[0] is None else 0.1 / quota[0]}]

    monkeypatch.setattr(profiler, "_measure", measure)
    body = {"model_config": CONFIG, "workload": WORKLOAD}
    first = profiler.devices(body)
    assert profiler.devices(body) == first and measured == [None]
    quota[0] = 0.25
    assert profiler.devices(body)["devices"][0]["seconds_per_layer"] == pytest.approx(0.4)
    assert measured == [None, 0.25]


def test_a_host_capped_anew_is_profiled_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new cgroup memory limit (a container resized, a job given less) is part of the cache key:
    the report's free memory is measured again under it."""
    from types import SimpleNamespace

    from shardpool.agent import profiling
    from shardpool.host.memory_limit import CgroupMemory

    limit: list[CgroupMemory | None] = [None]
    monkeypatch.setattr(profiling, "cgroup_memory", lambda: limit[0])
    profiler = profiling.DeviceProfiler(SimpleNamespace(), SimpleNamespace(running=True))  # type: ignore[arg-type]
    measured: list[CgroupMemory | None] = []

    def measure(shape: Any, workload: Any) -> list[dict[str, Any]]:
        measured.append(limit[0])
        return [{"name": "cpu", "free_bytes": 8 << 30 if limit[0] is None else limit[0].free_bytes}]

    monkeypatch.setattr(profiler, "_measure", measure)
    body = {"model_config": CONFIG, "workload": WORKLOAD}
    assert profiler.devices(body)["devices"][0]["free_bytes"] == 8 << 30
    limit[0] = CgroupMemory(2 << 30, 1 << 30)
    assert profiler.devices(body)["devices"][0]["free_bytes"] == 1 << 30
    limit[0] = CgroupMemory(2 << 30, 1 << 29)  # same limit, other usage: the kept report stands
    assert profiler.devices(body)["devices"][0]["free_bytes"] == 1 << 30
    assert len(measured) == 2
