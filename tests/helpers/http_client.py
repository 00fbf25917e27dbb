"""Small HTTP clients for tests of mesh.http.server servers (http.client over TCP or a Unix socket, raw sockets), and a stdlib server."""

from __future__ import annotations

import hashlib
import http.client
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A stdlib HTTP server on loopback answering with ``handler``; yields its ``http://127.0.0.1:PORT``."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a Unix socket at ``path``."""

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.unix_path)
        self.sock = sock


def connect(url: str, timeout: float = 10.0) -> http.client.HTTPConnection:
    """An http.client connection to the server at ``url`` (``http://host:port``)."""
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)


def call(
    connection: http.client.HTTPConnection,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One request on ``connection``: (status, headers, body)."""
    connection.request(method, path, body=body, headers=headers or {})
    response = connection.getresponse()
    return response.status, response.headers, response.read()


def fetch(url: str, method: str = "GET", path: str = "/", **kwargs: Any) -> tuple[int, Any, bytes]:
    """One request on a fresh connection to ``url``."""
    connection = connect(url)
    try:
        return call(connection, method, path, **kwargs)
    finally:
        connection.close()


def error_of(body: bytes) -> str:
    """The message of a one-line JSON error body (and check it is one line)."""
    text = body.decode("utf-8")
    assert text.count("\n") == 1 and text.endswith("\n"), text
    return json.loads(text)["error"]


def open_socket(url: str, source_ip: str | None = None, timeout: float = 10.0) -> socket.socket:
    """A raw TCP connection to the server at ``url``, optionally from a given loopback source address."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    if source_ip is not None:
        sock.bind((source_ip, 0))
    sock.connect((parts.hostname, parts.port))
    return sock


def closed_by_peer(sock: socket.socket, wait_s: float) -> bool:
    """Whether the server closes ``sock`` within ``wait_s`` seconds (anything it sends first is read)."""
    end = time.monotonic() + wait_s
    while (left := end - time.monotonic()) > 0:
        readable, _, _ = select.select([sock], [], [], left)
        if not readable:
            return False
        try:
            if not sock.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
    return False


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP response with a Content-Length from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a whole response head: {data!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed inside the response body")
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:length]


def read_hashed(response: http.client.HTTPResponse, chunk_size: int = 256 * 1024) -> tuple[str, int]:
    """Read a response body chunk by chunk, never whole: its SHA-256 hex digest and its length."""
    digest, received = hashlib.sha256(), 0
    while chunk := response.read(chunk_size):
        digest.update(chunk)
        received += len(chunk)
    return digest.hexdigest(), received
