"""Slowloris against the agent and the launcher's file server: job starts and file reads still go through.

With 2,000 idle or trickling connections held open against each server (40 loopback source
addresses, 50 each, under the per-source cap, so the attack is held and not simply refused), a
member's signed job start and a stage's read of the manifest must each complete within 10 s,
and the servers' threads stay bounded. Only 127.0.0.x addresses are used.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from pathlib import Path

import pytest

from shardpool.files.client import RemoteFiles
from shardpool.files.server import FileServer
from tests.helpers.agents import make_agent, shared_dir, signed, write_worker
from tests.helpers.jobs import job_dict
from tests.helpers.slowloris import SlowlorisAttack, loopback_sources, raise_fd_limit

pytestmark = pytest.mark.slow

ATTACKERS = 2000
SOURCES = loopback_sources(40)
HONEST_LIMIT_S = 10.0
HEAD_START = b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\nX-Slow: "

QUIET_WORKER = """
import json, os, time
print("@shardpool " + json.dumps({"event": "ready", "total_steps": 1, "first_step": 0}), flush=True)
time.sleep(600)
"""


def _wait_held(server_connections, count: int) -> None:  # noqa: ANN001 - a callable returning an int
    deadline = time.monotonic() + 10.0
    while server_connections() < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server_connections() >= count, "the attack connections must be held open"


def _timed(what: str, action):  # noqa: ANN001, ANN202 - any callable, its result
    started = time.monotonic()
    result = action()
    elapsed = time.monotonic() - started
    assert elapsed < HONEST_LIMIT_S, f"{what} took {elapsed:.1f} s under attack"
    return result


def test_a_signed_job_start_completes_while_two_thousand_connections_hold_the_agent() -> None:
    raise_fd_limit(2 * ATTACKERS + 200)
    threads_before = set(threading.enumerate())
    with shared_dir() as shared:
        agent = make_agent(shared / "work", write_worker(shared, QUIET_WORKER))
        with agent:
            with SlowlorisAttack(agent.url, ATTACKERS, SOURCES, HEAD_START):
                _wait_held(lambda: agent._server.open_connections, ATTACKERS)
                body = {"job_id": "under-attack", "job": job_dict(), "ranks": [0]}
                status, reply = _timed(
                    "a signed job start", lambda: signed(agent.url, "POST", "/v1/jobs", body)
                )
                assert status == 201, reply
                status, reply = _timed(
                    "an event poll", lambda: signed(agent.url, "GET", "/v1/jobs/under-attack/events?wait=5")
                )
                assert status == 200 and reply["events"][0]["event"]["event"] == "ready"
                assert agent._server.open_connections >= ATTACKERS, "the attack was still under way"
                assert threading.active_count() < len(threads_before) + 64
    assert set(threading.enumerate()) == threads_before


def test_a_manifest_read_completes_while_two_thousand_connections_hold_the_file_server(
    tmp_path: Path,
) -> None:
    raise_fd_limit(2 * ATTACKERS + 200)
    data = tmp_path / "data.bin"
    data.write_bytes(b"x" * 4096)
    secret = secrets.token_hex(32)
    threads_before = set(threading.enumerate())
    with FileServer(
        "127.0.0.1", 0, files={"data.bin": data}, upload_root=tmp_path / "out", secret=secret
    ) as server:
        with SlowlorisAttack(server.url, ATTACKERS, SOURCES, HEAD_START):
            _wait_held(lambda: server._server.open_connections, ATTACKERS)
            with RemoteFiles(server.url, secret=secret, cache_dir=tmp_path / "cache") as files:
                manifest = _timed("a manifest read", lambda: files.manifest(refresh=True))
                assert json.loads(json.dumps(manifest))["data.bin"]["size"] == 4096
                chunk = _timed("a ranged read", lambda: files.read_range("data.bin", 0, 100, use_cache=False))
                assert chunk == b"x" * 100
            assert server._server.open_connections >= ATTACKERS, "the attack was still under way"
    assert set(threading.enumerate()) == threads_before
