"""Slowloris regression: 2,000 idle and trickling connections must not starve an honest client.

The old servers spent one thread per connection and had no deadline on the request head, so a
few thousand connections that never finish their headers stopped every other client. Everything
here talks to 127.0.0.1 only (from several 127.0.0.x source addresses, so the per-source cap
does not refuse the attack before it can be measured).
"""

from __future__ import annotations

import resource
import socket
import threading
import time
from urllib.parse import urlsplit

import pytest

from mesh.http import HTTPServer, Limits, Route, json_reply
from tests.helpers.http_client import fetch

pytestmark = pytest.mark.slow

ATTACKERS = 2000
SOURCES = [f"127.0.0.{i}" for i in range(2, 22)]  # 100 connections from each
HEAD_TIMEOUT_S = 8.0
HANDLER_THREADS = 4


def _raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"needs {needed} open files, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _open_attack(url: str) -> list[socket.socket]:
    parts = urlsplit(url)
    sockets = []
    for index in range(ATTACKERS):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((SOURCES[index % len(SOURCES)], 0))
        sock.settimeout(5.0)
        sock.connect((parts.hostname, parts.port))
        sock.setblocking(False)
        if index % 2:  # half start a request head and then trickle it; half stay silent
            sock.send(b"GET /v1/who HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        sockets.append(sock)
    return sockets


def _trickle(sockets: list[socket.socket], stop: threading.Event) -> None:
    while not stop.wait(1.0):
        for sock in sockets[1::2]:
            try:
                sock.send(b"a")
            except OSError:
                pass  # already cut by the server


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _server_threads(name: str) -> int:
    return sum(1 for thread in threading.enumerate() if thread.name.startswith(name))


def test_two_thousand_slowloris_connections_do_not_starve_an_honest_client() -> None:
    _raise_fd_limit(2 * ATTACKERS + 200)
    threads_before = set(threading.enumerate())
    limits = Limits(
        head_timeout_s=HEAD_TIMEOUT_S, keepalive_timeout_s=HEAD_TIMEOUT_S, handler_threads=HANDLER_THREADS
    )
    route = Route("GET", "/v1/who", lambda request: json_reply({"ip": request.peer.ip}))
    server = HTTPServer([route], host="127.0.0.1", limits=limits, name="slowloris").start()
    stop_trickling = threading.Event()
    attack: list[socket.socket] = []
    try:
        attack = _open_attack(server.url)
        attack_opened = time.monotonic()
        trickler = threading.Thread(target=_trickle, args=(attack, stop_trickling), name="test-trickler")
        trickler.start()
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
        while not all(_closed_by_server(sock) for sock in attack) and time.monotonic() < cut_by:
            time.sleep(0.25)
        still_open = sum(1 for sock in attack if not _closed_by_server(sock))
        assert still_open == 0, (
            f"{still_open} slowloris connections outlived the {HEAD_TIMEOUT_S} s head deadline"
        )
        assert server.open_connections == 0
    finally:
        stop_trickling.set()
        for sock in attack:
            sock.close()
        server.stop()
    trickler.join()
    assert set(threading.enumerate()) == threads_before
