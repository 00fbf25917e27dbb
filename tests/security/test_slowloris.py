"""Slowloris regression: 2,000 idle and trickling connections must not starve an honest client.

The old servers spent one thread per connection and had no deadline on the request head, so a
few thousand connections that never finish their headers stopped every other client. Everything
here talks to 127.0.0.1 only (from several 127.0.0.x source addresses, so the per-source cap
does not refuse the attack before it can be measured).
"""

from __future__ import annotations

import threading
import time

import pytest

from mesh.http.server import HTTPServer, Limits, Route, json_reply
from tests.helpers.http_client import fetch
from tests.helpers.slowloris import SlowlorisAttack, loopback_sources, raise_fd_limit

pytestmark = pytest.mark.slow

ATTACKERS = 2000
SOURCES = loopback_sources(20)  # 100 connections from each
HEAD_TIMEOUT_S = 8.0
HANDLER_THREADS = 4


def _server_threads(name: str) -> int:
    return sum(1 for thread in threading.enumerate() if thread.name.startswith(name))


def test_two_thousand_slowloris_connections_do_not_starve_an_honest_client() -> None:
    raise_fd_limit(2 * ATTACKERS + 200)
    threads_before = set(threading.enumerate())
    limits = Limits(
        head_timeout_s=HEAD_TIMEOUT_S, keepalive_timeout_s=HEAD_TIMEOUT_S, handler_threads=HANDLER_THREADS
    )
    route = Route("GET", "/v1/who", lambda request: json_reply({"ip": request.peer.ip}))
    server = HTTPServer([route], host="127.0.0.1", limits=limits, name="slowloris").start()
    try:
        with SlowlorisAttack(
            server.url, ATTACKERS, SOURCES, b"GET /v1/who HTTP/1.1\r\nHost: x\r\nX-Slow: "
        ) as attack:
            attack_opened = time.monotonic()
            deadline = time.monotonic() + 5.0
            while server.open_connections < ATTACKERS and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server.open_connections >= ATTACKERS, "the attack connections must be held open"

            for _ in range(5):
                started = time.monotonic()
                status, _, body = fetch(server.url, path="/v1/who")
                elapsed = time.monotonic() - started
                assert status == 200 and b"127.0.0.1" in body
                assert elapsed < 10.0, f"an honest request took {elapsed:.1f} s under attack"
            assert server.open_connections >= ATTACKERS, "the attack was still under way"
            assert _server_threads("slowloris") <= 1 + HANDLER_THREADS

            cut_by = attack_opened + HEAD_TIMEOUT_S + 3.0
            while attack.still_open() and time.monotonic() < cut_by:
                time.sleep(0.25)
            still_open = attack.still_open()
            assert still_open == 0, (
                f"{still_open} slowloris connections outlived the {HEAD_TIMEOUT_S} s head deadline"
            )
            assert server.open_connections == 0
    finally:
        server.stop()
    left_running = set(threading.enumerate()) - threads_before  # earlier tests' threads may end meanwhile
    assert not left_running, f"the server left threads running: {left_running}"
