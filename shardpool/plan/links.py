"""Measure a link's latency and bandwidth with a tiny TCP probe.

One side runs :class:`ProbeServer` (on a mesh member it listens on its mesh address); the
other calls :func:`probe_link`. Latency is half the median round trip of 1-byte pings;
bandwidth is a bulk transfer's bytes over its time (minus one latency). On one machine,
:func:`measure_loopback` does both over ``127.0.0.1``, which is how stages on one host talk.
Plain sockets and threads only: no torch, so the mesh package may use it too.
"""

from __future__ import annotations

import socket
import socketserver
import statistics
import struct
import threading
import time
from dataclasses import dataclass

__all__ = ["LinkMeasurement", "ProbeServer", "measure_loopback", "probe_link"]

_PING = b"P"
_BULK = b"B"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class LinkMeasurement:
    """Measured one-way ``bandwidth`` (bytes/s) and ``latency`` (seconds)."""

    bandwidth: float
    latency: float


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        conn: socket.socket = self.request
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            op = conn.recv(1)
            if not op:
                return
            if op == _PING:
                conn.sendall(_PING)
            elif op == _BULK:
                (size,) = struct.unpack("!Q", _recv_exact(conn, 8))
                remaining = size
                while remaining:
                    chunk = conn.recv(min(_CHUNK, remaining))
                    if not chunk:
                        return
                    remaining -= len(chunk)
                conn.sendall(_BULK)
            else:
                return


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class ProbeServer:
    """Answers probes on ``(host, port)`` in a background thread; port 0 picks a free port.

    Use as a context manager; ``address`` is the bound address to give to :func:`probe_link`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = _Server((host, port), _Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="shardpool-link-probe",
            daemon=True,
        )

    @property
    def address(self) -> tuple[str, int]:
        """The ``(host, port)`` the server listens on."""
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def __enter__(self) -> ProbeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()


def probe_link(
    address: tuple[str, int], *, payload_bytes: int = 16 << 20, pings: int = 20, timeout: float = 10.0
) -> LinkMeasurement:
    """Measure latency and bandwidth to a :class:`ProbeServer` at ``address``."""
    with socket.create_connection(address, timeout=timeout) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        round_trips = []
        for _ in range(max(1, pings)):
            start = time.perf_counter()
            conn.sendall(_PING)
            _recv_exact(conn, 1)
            round_trips.append(time.perf_counter() - start)
        latency = statistics.median(round_trips) / 2
        payload = memoryview(bytes(min(payload_bytes, _CHUNK)))
        start = time.perf_counter()
        conn.sendall(_BULK + struct.pack("!Q", payload_bytes))
        remaining = payload_bytes
        while remaining:
            piece = payload[: min(len(payload), remaining)]
            conn.sendall(piece)
            remaining -= len(piece)
        _recv_exact(conn, 1)
        elapsed = time.perf_counter() - start
    transfer = max(elapsed - 2 * latency, elapsed / 2)
    return LinkMeasurement(bandwidth=payload_bytes / transfer, latency=latency)


_loopback_cache: LinkMeasurement | None = None


def measure_loopback(*, payload_bytes: int = 16 << 20) -> LinkMeasurement:
    """Latency and bandwidth over ``127.0.0.1`` (measured once per process)."""
    global _loopback_cache
    if _loopback_cache is None:
        with ProbeServer() as server:
            _loopback_cache = probe_link(server.address, payload_bytes=payload_bytes)
    return _loopback_cache


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the probe peer closed the connection")
        data += chunk
    return bytes(data)
