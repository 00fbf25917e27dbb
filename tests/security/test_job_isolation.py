"""Jobs on one member are kept from each other (issue 39, finding 6), and a job id is never re-used.

Each job's stages run under a uid of their own, so one job's stage cannot read another's secret,
model or output; ``jobs/`` cannot be listed by other users; a job id, once used on an agent, is
refused to every other member and user for good, and its own launcher starting it again gets a
fresh directory, the old log left as it was; and a run's uploads to the launcher's file
server are bounded in number and total size. Real agent, real stage processes, real uids.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardpool.agent.service import Agent
from shardpool.files.server import FileServer
from tests.helpers.agents import AGENT_KEY, LAUNCHER_KEY, RUN_AS, make_agent, shared_dir, signed, write_worker
from tests.helpers.jobs import job_dict

#: A stage that tries to read another job's secret, then says what it got in its log and exits
#: (the victim sleeps).
PRYING = """
import os, sys, time
from pathlib import Path
job_dir = Path(sys.argv[1]).parent
target = job_dir.parent / "victim" / "files.secret"
try:
    print("READ " + target.read_text(), file=sys.stderr, flush=True)
except OSError as error:
    print(f"REFUSED {type(error).__name__}", file=sys.stderr, flush=True)
print(f"UID {os.getuid()}", file=sys.stderr, flush=True)
if job_dir.name == "victim":
    time.sleep(600)
"""

#: A stage that writes one line to its log and exits.
TALKER = """
import sys
print("first run wrote this", file=sys.stderr, flush=True)
"""


@pytest.fixture
def shared() -> Iterator[Path]:
    with shared_dir() as path:
        yield path


def _start(agent: Agent, job_id: str, *, key: str = LAUNCHER_KEY, **extra: Any) -> tuple[int, Any]:
    body = {"job_id": job_id, "job": job_dict(), "ranks": [0], **extra}
    return signed(agent.url, "POST", "/v1/jobs", body, key=key)


def _log(agent: Agent, job_id: str, until: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = signed(agent.url, "GET", f"/v1/jobs/{job_id}/log/0?tail=50")[1]
        if until in text:
            return text
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} never logged {until!r}: {text!r}")


def _wait_finished(agent: Agent, job_id: str) -> None:
    deadline = time.monotonic() + 30
    while agent.job(job_id).running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not agent.job(job_id).running


def test_one_jobs_stage_cannot_read_another_jobs_secret(shared: Path) -> None:
    secret = secrets.token_hex(32)
    with make_agent(shared / "work", write_worker(shared, PRYING)) as agent:
        assert _start(agent, "victim", files_secret=secret)[0] == 201
        assert _start(agent, "prying")[0] == 201
        victim_log, prying_log = _log(agent, "victim", "UID"), _log(agent, "prying", "UID")
        assert "REFUSED PermissionError" in prying_log and secret not in prying_log, prying_log
        from shardpool.agent.accounts import DEFAULT_JOB_UIDS  # here, so that older code fails above

        uids = {int(text.split("UID ")[1].split()[0]) for text in (victim_log, prying_log)}
        assert len(uids) == 2 and RUN_AS.uid not in uids and uids <= set(DEFAULT_JOB_UIDS), uids
        victim = agent.work_dir / "jobs" / "victim"
        assert (victim / "files.secret").stat().st_uid in uids
        assert signed(agent.url, "DELETE", "/v1/jobs/victim")[0] == 200
        # once its stages are gone, the job's uid is taken back and its directory handed to root
        deadline = time.monotonic() + 10
        while victim.stat().st_uid != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (victim.stat().st_uid, (victim / "files.secret").stat().st_uid) == (0, 0)


def test_jobs_directory_cannot_be_listed_by_another_user(shared: Path) -> None:
    with make_agent(shared / "work", write_worker(shared, TALKER)) as agent:
        assert _start(agent, "listed")[0] == 201
        jobs = agent.work_dir / "jobs"
        listing = subprocess.run(
            [sys.executable, "-I", "-c", f"import os; print(os.listdir({str(jobs)!r}))"],
            capture_output=True, text=True, user=65534, group=65534, extra_groups=[], cwd="/", timeout=60,
        )  # fmt: skip
        assert listing.returncode != 0 and "PermissionError" in listing.stderr, listing.stdout
        assert jobs.stat().st_mode & 0o777 == 0o711


def test_a_job_id_is_never_taken_by_another_and_its_old_directory_and_log_are_never_reused(
    shared: Path,
) -> None:
    worker = write_worker(shared, TALKER)
    jobs = shared / "work" / "jobs"
    with make_agent(shared / "work", worker) as agent:
        assert _start(agent, "once")[0] == 201  # signed by member a
        _wait_finished(agent, "once")
        log = jobs / "once" / "rank-0.log"
        before = log.read_bytes()
        assert b"first run wrote this" in before
        status, reply = _start(agent, "once", key=AGENT_KEY)  # member b takes the id a used
        assert status == 403 and "another member or user" in reply["error"], reply
        status, reply = _start(agent, "once", submitter="mallory")  # a, for another of its users
        assert status == 403 and "another member or user" in reply["error"], reply
        assert _start(agent, "once")[0] == 201  # a's own run takes this member back: a fresh directory
        _wait_finished(agent, "once")
        assert (jobs / "once~2" / "rank-0.log").read_bytes() == before
    with make_agent(shared / "work", worker) as agent:  # a restarted agent still knows whose id it was
        status, reply = _start(agent, "once", key=AGENT_KEY)
        assert status == 403 and "another member or user" in reply["error"], reply
    assert log.read_bytes() == before
    assert sorted(p.name for p in jobs.iterdir()) == ["once", "once~2", "once~owner"]


def _put(server: FileServer, relative: str, data: bytes, secret: str) -> tuple[int, bytes]:
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        headers = {"Authorization": f"Bearer {secret}", "X-Content-SHA256": hashlib.sha256(data).hexdigest()}
        connection.request("PUT", f"/v1/upload/{relative}", body=data, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_uploads_are_bounded_in_count_and_total_size(tmp_path: Path) -> None:
    secret = secrets.token_hex(32)
    out = tmp_path / "out"
    with FileServer(
        "127.0.0.1", files={}, upload_root=out, secret=secret, max_upload_files=3, max_upload_total_bytes=1000
    ) as server:
        assert _put(server, "a", b"x" * 400, secret)[0] == 201
        assert _put(server, "a", b"y" * 400, secret)[0] == 201  # the same path again counts once
        assert _put(server, "b", b"z" * 400, secret)[0] == 201
        status, body = _put(server, "c", b"w" * 300, secret)  # 1100 bytes in all
        assert status == 413 and b"over its bound of 1000" in body, body
        assert not (out / "c").exists()
        assert _put(server, "c", b"w" * 100, secret)[0] == 201
        status, body = _put(server, "d", b"v", secret)  # a fourth file
        assert status == 429 and b"most files it may (3)" in body, body
        assert sorted(os.listdir(out)) == ["a", "b", "c"]


ESCAPING = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(f"CHILD {child.pid}", file=sys.stderr, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_process_a_stage_hid_in_a_session_of_its_own_dies_with_the_job(shared: Path) -> None:
    with make_agent(shared / "work", write_worker(shared, ESCAPING)) as agent:
        assert _start(agent, "escaping")[0] == 201
        child = int(_log(agent, "escaping", "CHILD").split("CHILD ")[1].split()[0])
        assert signed(agent.url, "DELETE", "/v1/jobs/escaping")[0] == 200
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = Path(f"/proc/{child}").exists()
        if alive:
            os.kill(child, 9)
        assert not alive, "the hidden process outlived its job"
