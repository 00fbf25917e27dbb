"""End to end, on three network-namespace hosts over real wireguard-go: who may launch a mesh job.

A local account that is neither root nor in the launch group (uid 65534) is refused on every path
to a stage process, each with one line, and nothing starts on any member: an unsigned request
straight to another member's agent over the mesh, its own member's agent socket, and
``shardpool finetune`` with mesh placement. A user in the group (made for the test) trains across
the mesh; the stage processes on the members run as the unprivileged run-as account, and the
adapter equals a local run of the same split.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import write_config
from tests.helpers.mesh_training import (
    AGENT_PORT,
    launch,
    local_twin,
    mesh_of_three,
    ok,
    training_config,
    training_lab,
)
from tests.mesh_hosts import Lab, netns_skip_reason

pytestmark = [pytest.mark.netns, pytest.mark.slow]

SKIP = netns_skip_reason()
if SKIP:
    pytest.skip(SKIP, allow_module_level=True)

OUTSIDER = "nobody"  # uid 65534
WORKER = "shardpool.worker"
RUN_AS = "shardpool"
LAUNCH_GROUP = "shardpool"


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    yield from training_lab(tmp_path_factory, "launch-access")


@pytest.fixture(scope="module")
def mesh3(lab: Lab) -> dict[str, str]:
    return mesh_of_three(lab)


@pytest.fixture(scope="module")
def student() -> Iterator[str]:
    """A fresh local user in the launch group, removed afterwards."""
    name = f"spstu{os.getpid() % 100000}"
    subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "--groups", LAUNCH_GROUP, name],
        check=True,
        capture_output=True,
    )
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def _workers(lab: Lab) -> dict[str, dict[int, int]]:
    return {label: lab.processes(lab.hosts[label], WORKER) for label in "abc"}


def _no_jobs_anywhere(lab: Lab) -> None:
    for label in "abc":
        listed = ok(lab.run(lab.hosts[label], sys.executable, "-m", "shardpool", "jobs"))
        assert listed.startswith("no jobs"), (label, listed)
    assert _workers(lab) == {"a": {}, "b": {}, "c": {}}


_UNSIGNED_JOB_POST = """
import json, sys, urllib.request, urllib.error
body = json.dumps({"job_id": "evil", "job": {}, "ranks": [0]}).encode()
request = urllib.request.Request(sys.argv[1], data=body, method="POST", headers={"Content-Type": "application/json"})
try:
    urllib.request.urlopen(request, timeout=10)
    print("accepted")
except urllib.error.HTTPError as error:
    print(error.code, json.loads(error.read())["error"])
"""


def test_an_outsider_is_refused_on_every_path_and_nothing_starts(
    lab: Lab, mesh3: dict[str, str], tmp_path: Path
) -> None:
    a, b = lab.hosts["a"], lab.hosts["b"]
    assert pwd.getpwnam(OUTSIDER).pw_uid == 65534

    # (a) straight to another member's agent over the mesh, unsigned
    url = f"http://{mesh3['a']}:{AGENT_PORT}/v1/jobs"
    answer = ok(lab.run(b, sys.executable, "-c", _UNSIGNED_JOB_POST, url, user=OUTSIDER)).strip()
    status, _, reason = answer.partition(" ")
    assert status == "401", answer
    assert reason and "\n" not in reason

    # (b) its own member's agent socket
    refused = lab.run(b, sys.executable, "-m", "shardpool", "jobs", user=OUTSIDER)
    assert refused.returncode == 2, refused
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert f"usermod -aG {LAUNCH_GROUP} {OUTSIDER}" in lines[0], lines[0]

    # (c) shardpool finetune with mesh placement
    workspace = lab.user_home(OUTSIDER)
    private = workspace / "private"
    private.mkdir(exist_ok=True)
    out = workspace / "out"
    config_path = write_config(workspace / "mesh.yaml", training_config(out, private))
    launched = launch(lab, a, private, config_path, user=OUTSIDER)
    assert launched.returncode == 2, launched
    lines = launched.stderr.strip().splitlines()
    assert len(lines) == 1, launched.stderr
    assert lines[0].startswith("shardpool: error: user 'nobody' may not use the shardpool agent"), lines[0]
    assert f"`usermod -aG {LAUNCH_GROUP} {OUTSIDER}`" in lines[0]
    assert not out.exists(), "nothing may be prepared for a refused launch"

    _no_jobs_anywhere(lab)


def test_a_group_member_trains_on_the_mesh_with_stages_as_the_run_as_account(
    lab: Lab, mesh3: dict[str, str], student: str, tmp_path: Path
) -> None:
    a = lab.hosts["a"]
    run_as_uid = pwd.getpwnam(RUN_AS).pw_uid
    workspace = lab.user_home(student)
    private = workspace / "private"
    private.mkdir()
    out = workspace / "out"
    config_path = write_config(workspace / "mesh.yaml", training_config(out, private))
    launcher = launch(lab, a, private, config_path, background=True, user=student)
    seen: dict[str, set[int]] = {"a": set(), "b": set(), "c": set()}
    try:
        deadline = time.monotonic() + 600
        while launcher.poll() is None and time.monotonic() < deadline:
            for label, workers in _workers(lab).items():
                seen[label].update(workers.values())
            time.sleep(0.1)
        stdout, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, f"stdout: {stdout}\nstderr: {stderr}"
    plan = json.loads((out / "plan.json").read_text())
    hosts = sorted(stage["host"] for stage in plan["stages"])
    assert hosts == ["a", "b", "c"], plan["stages"]
    assert seen == {"a": {run_as_uid}, "b": {run_as_uid}, "c": {run_as_uid}}, seen
    assert os.stat(out / "adapter_model.safetensors").st_uid == pwd.getpwnam(student).pw_uid

    from safetensors.torch import load_file

    twin = local_twin(tmp_path / "twin", out)
    mesh_adapter = load_file(str(out / "adapter_model.safetensors"))
    local_adapter = load_file(str(twin / "adapter_model.safetensors"))
    assert mesh_adapter.keys() == local_adapter.keys()
    difference = max(float((mesh_adapter[key] - local_adapter[key]).abs().max()) for key in local_adapter)
    assert difference < 1e-4

    mine = ok(lab.run(a, sys.executable, "-m", "shardpool", "jobs", user=student)).splitlines()
    assert len(mine) == 2, mine
    job_id, submitter, members = mine[1].split()[:3]
    assert submitter == student and sorted(members.split(",")) == ["a", "b", "c"], mine
    everyone = ok(lab.run(a, sys.executable, "-m", "shardpool", "jobs")).splitlines()
    assert any(line.split()[:2] == [job_id, student] for line in everyone[1:]), everyone
