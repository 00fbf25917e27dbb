"""End to end, on three network-namespace hosts over real wireguard-go: who may launch a mesh job.

A local account that is neither root nor in the launch group (uid 65534) is refused on every path
to a stage process, each with one line, and nothing starts on any member: an unsigned request
straight to another member's agent over the mesh, its own member's agent socket, and
``shardpool finetune`` with mesh placement. That a user in the group trains across the mesh with
stages as the unprivileged run-as account is tested with the mesh exactness run, in
tests/launch/test_mesh_launcher.py, so that the suite trains across the mesh once.
"""

from __future__ import annotations

import pwd
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from shardpool_dev.lab import Lab, netns_skip_reason

from tests.helpers.mesh_training import (
    AGENT_PORT,
    launch,
    mesh_of_three,
    ok,
    training_config,
    training_lab,
)
from tests.helpers.training import write_config

pytestmark = [pytest.mark.netns, pytest.mark.slow]

SKIP = netns_skip_reason()
if SKIP:
    pytest.skip(SKIP, allow_module_level=True)

OUTSIDER = "nobody"  # uid 65534
WORKER = "shardpool.elastic.rank"
RUN_AS = "shardpool"
LAUNCH_GROUP = "shardpool"


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    yield from training_lab(tmp_path_factory, "launch-access")


@pytest.fixture(scope="module")
def mesh3(lab: Lab) -> dict[str, str]:
    return mesh_of_three(lab)


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
