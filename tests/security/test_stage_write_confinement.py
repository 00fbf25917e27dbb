"""A stage may write inside its job directory and the fetch cache, and nowhere else (Landlock).

Before, a stage could write wherever its account could: /tmp, /var/tmp, or another job's files.
The agent now fences each stage with Landlock before exec; these tests start real stages through
a real agent and through the fence alone, and try the writes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from shardpool.agent.accounts import DEFAULT_JOB_UIDS
from shardpool.agent.confine import landlock_abi, restrict_writes
from tests.helpers.agents import make_agent, shared_dir, signed, write_worker
from tests.helpers.jobs import job_dict

ABI = landlock_abi()
pytestmark = pytest.mark.skipif(ABI == 0, reason="this kernel has no Landlock")

PROBE = """
import json, os, sys
results = {}
for label, path in json.loads(sys.argv[1]).items():
    try:
        with open(path, "w") as handle:
            handle.write("x")
        results[label] = "written"
    except OSError as error:
        results[label] = error.strerror
print(json.dumps(results), flush=True)
"""

WORKER = """
import json, os, sys
targets = {"job_dir": "own.txt", "tmp": "/tmp/%(tag)s", "var_tmp": "/var/tmp/%(tag)s",
           "dev_null": "/dev/null", "cache": os.path.join(os.environ["SHARDPOOL_CACHE"], "%(tag)s")}
results = {}
for label, path in targets.items():
    try:
        with open(path, "w") as handle:
            handle.write("x")
        results[label] = "written"
    except OSError as error:
        results[label] = error.strerror
with open("probe.json", "w") as handle:
    json.dump(results, handle)
"""


def test_the_fence_forbids_writes_outside_the_given_directories(tmp_path: Path) -> None:
    inside = tmp_path / "inside"
    inside.mkdir()
    tag = uuid.uuid4().hex
    targets = {"inside": str(inside / "f"), "outside": str(tmp_path / "f"), "tmp": f"/tmp/{tag}"}
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(targets)],
        capture_output=True, text=True, check=True,
        preexec_fn=lambda: restrict_writes([str(inside)], ABI),
    )  # fmt: skip
    assert json.loads(result.stdout) == {
        "inside": "written", "outside": "Permission denied", "tmp": "Permission denied"
    }  # fmt: skip
    assert not Path(f"/tmp/{tag}").exists()


def test_an_agent_stage_writes_only_in_its_job_directory_and_the_cache() -> None:
    tag = uuid.uuid4().hex
    with shared_dir() as shared:
        agent = make_agent(shared / "work", write_worker(shared, WORKER % {"tag": tag}))
        with agent:
            status, reply = signed(
                agent.url, "POST", "/v1/jobs", {"job_id": "fenced", "job": job_dict(), "ranks": [0]}
            )
            assert status == 201, reply
            probe = agent.work_dir / "jobs" / "fenced" / "probe.json"
            deadline = time.monotonic() + 30
            while not probe.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            results = json.loads(probe.read_text())
        assert results == {
            "job_dir": "written",
            "tmp": "Permission denied",
            "var_tmp": "Permission denied",
            "dev_null": "written",
            "cache": "written",
        }
        assert probe.stat().st_uid in {0, *DEFAULT_JOB_UIDS}, "written by the job's own uid"
    for leaked in (Path(f"/tmp/{tag}"), Path(f"/var/tmp/{tag}")):
        assert not leaked.exists()
        leaked.unlink(missing_ok=True)
