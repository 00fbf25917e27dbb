"""Who may talk to shardpool's HTTP services: current mesh members only, checked on every request.

The agent and the file server listen on this machine's mesh address. WireGuard's cryptokey routing
guarantees that a packet arriving over the mesh interface with source address ``10.77.0.X`` was sent
by the holder of that member's private key, so the peer IP of a connection *is* the member's
identity. :class:`MemberAllowlist` keeps the set of current member addresses, re-reading the roster
at most every ``refresh_s`` seconds, so a member removed from the mesh is refused within a few
seconds. Anything else (an underlay address, a stale member, a misconfigured route) gets 403.

:class:`GuardedHTTPServer` and :class:`GuardedHandler` are the small stdlib HTTP base both services
share: the allowlist check before any handler runs, JSON errors, bounded request bodies.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from shardpool.errors import ShardpoolError

__all__ = [
    "GuardedHTTPServer",
    "GuardedHandler",
    "HTTPError",
    "MemberAllowlist",
    "mesh_member_addresses",
    "normalize_ip",
    "start_in_thread",
]

log = logging.getLogger("shardpool.access")

_MAX_JSON_BODY = 16 * 2**20


def normalize_ip(address: str) -> str:
    """Canonical text of an IP address; IPv4-mapped IPv6 (``::ffff:10.0.0.1``) becomes plain IPv4.

    Returns the input unchanged when it is not an IP address, so it simply matches nothing.
    """
    try:
        parsed = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped)
    return str(parsed)


class MemberAllowlist:
    """The set of addresses allowed to connect, refreshed from ``fetch`` at most every ``refresh_s``.

    ``fetch`` returns the current member addresses. When it raises, the allowlist *fails closed*:
    nobody is allowed until a later refresh succeeds, because a roster that cannot be read might
    be one from which a member was just removed. Thread-safe.
    """

    def __init__(
        self,
        fetch: Callable[[], set[str]],
        refresh_s: float = 2.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch = fetch
        self._refresh_s = refresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._addresses: frozenset[str] = frozenset()
        self._fetched_at: float | None = None
        self.last_error: str | None = None

    @classmethod
    def fixed(cls, addresses: Iterable[str]) -> MemberAllowlist:
        """An allowlist that never changes, e.g. ``{"127.0.0.1"}`` for tests and loopback runs."""
        frozen = {normalize_ip(a) for a in addresses}
        return cls(lambda: set(frozen), refresh_s=float("inf"))

    def addresses(self) -> frozenset[str]:
        """The current allowed addresses (refreshing first if they are older than ``refresh_s``)."""
        with self._lock:
            now = self._clock()
            if self._fetched_at is None or now - self._fetched_at >= self._refresh_s:
                self._fetched_at = now
                try:
                    self._addresses = frozenset(normalize_ip(a) for a in self._fetch())
                    self.last_error = None
                except Exception as error:  # noqa: BLE001 - any failure to read the roster fails closed
                    self._addresses = frozenset()
                    self.last_error = f"{type(error).__name__}: {error}"
                    log.warning(
                        "cannot read the mesh roster, refusing everyone until it can: %s", self.last_error
                    )
            return self._addresses

    def allows(self, ip: str) -> bool:
        """Whether a connection from ``ip`` comes from a current member."""
        return normalize_ip(ip) in self.addresses()


def mesh_member_addresses(state_dir: str | os.PathLike[str] | None) -> Callable[[], set[str]]:
    """A ``fetch`` for :class:`MemberAllowlist` reading this machine's mesh roster (no probing).

    Imported lazily so that this module stays usable without mesh state (tests, loopback runs).
    """

    def fetch() -> set[str]:
        from mesh.api import members

        return {member.address for member in members(state_dir, probe=False)}

    return fetch


class HTTPError(Exception):
    """Raised inside a handler to answer with ``status`` and a one-line JSON error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class GuardedHTTPServer(ThreadingHTTPServer):
    """A threaded HTTP server bound to one address that serves only allowlisted peers.

    IPv6 addresses are supported; binding to a wildcard address is refused, because the whole
    point is to listen on the mesh address only.
    """

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(
        self, host: str, port: int, handler: type[GuardedHandler], allowlist: MemberAllowlist
    ) -> None:
        try:
            parsed = ipaddress.ip_address(host)
        except ValueError:
            raise ShardpoolError(
                f"listen address {host!r} is not an IP address; give the mesh address"
            ) from None
        if parsed.is_unspecified:
            raise ShardpoolError(f"refusing to listen on {host}: listen on this member's mesh address only")
        self.address_family = socket.AF_INET6 if parsed.version == 6 else socket.AF_INET
        self.allowlist = allowlist
        try:
            super().__init__((host, port), handler)
        except OSError as error:
            raise ShardpoolError(
                f"cannot listen on {host}:{port} ({error.strerror or error}); is the mesh up and the port free?"
            ) from None

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. ``http://10.77.0.1:7710``."""
        host, port = self.server_address[:2]
        shown = f"[{host}]" if ":" in str(host) else str(host)
        return f"http://{shown}:{port}"


class GuardedHandler(BaseHTTPRequestHandler):
    """Request handler base: refuses non-members with 403 before any ``do_*`` method runs.

    Subclasses raise :class:`HTTPError` for client errors; anything unexpected becomes a 500 with
    a one-line message (and a logged traceback), never a dropped connection.
    """

    server: GuardedHTTPServer
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"  # a garbled request line still gets a status line back
    timeout = 120
    server_version = "shardpool"
    sys_version = ""

    def parse_request(self) -> bool:
        """Parse the request line and headers, then check the peer against the allowlist."""
        if not super().parse_request():
            return False
        peer = str(self.client_address[0])
        if not self.server.allowlist.allows(peer):
            log.warning("refused %s %s from %s: not a current mesh member", self.command, self.path, peer)
            self.close_connection = True
            self.send_json(HTTPStatus.FORBIDDEN, {"error": f"{peer} is not a current member of this mesh"})
            return False
        return True

    def send_json(self, status: int, value: Any, headers: dict[str, str] | None = None) -> None:
        """Send a complete JSON response."""
        body = (json.dumps(value) + "\n").encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for key, value_ in (headers or {}).items():
            self.send_header(key, value_)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_text(self, status: int, text: str) -> None:
        """Send a complete plain-text response."""
        body = text.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Errors raised by the stdlib parser (bad request line, huge headers) as JSON too."""
        self.close_connection = True
        try:
            self.send_json(code, {"error": message or HTTPStatus(code).phrase})
        except OSError:
            pass

    def content_length(self, limit: int) -> int:
        """The request's Content-Length, required and at most ``limit`` bytes."""
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise HTTPError(
                HTTPStatus.LENGTH_REQUIRED, "chunked bodies are not accepted; send Content-Length"
            )
        raw = self.headers.get("Content-Length")
        if raw is None:
            self.close_connection = True
            raise HTTPError(HTTPStatus.LENGTH_REQUIRED, "the request needs a Content-Length header")
        try:
            length = int(raw)
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            raise HTTPError(HTTPStatus.BAD_REQUEST, f"bad Content-Length {raw!r}")
        if length > limit:
            self.close_connection = True
            raise HTTPError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {length} bytes exceeds the {limit}-byte limit"
            )
        return length

    def read_json_body(self, limit: int = _MAX_JSON_BODY) -> dict[str, Any]:
        """Read and parse a JSON object body (bounded), or raise a 400/411/413 HTTPError."""
        length = self.content_length(limit)
        raw = self.rfile.read(length)
        if len(raw) != length:
            self.close_connection = True
            raise HTTPError(HTTPStatus.BAD_REQUEST, "the request body ended early")
        try:
            value = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise HTTPError(HTTPStatus.BAD_REQUEST, f"the body is not JSON ({error})") from None
        if not isinstance(value, dict):
            raise HTTPError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
        return value

    def dispatch(self, route: Callable[[], None]) -> None:
        """Run one route, turning HTTPError/ShardpoolError into JSON errors and anything else into 500."""
        try:
            route()
        except HTTPError as error:
            self.send_json(error.status, {"error": error.message})
        except ShardpoolError as error:
            self.send_json(HTTPStatus.BAD_REQUEST, {"error": str(error).splitlines()[0]})
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as error:  # noqa: BLE001 - a server must answer, never drop the connection
            log.exception("%s %s failed", self.command, self.path)
            self.close_connection = True
            try:
                self.send_json(
                    HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(error).__name__}: {error}"}
                )
            except OSError:
                pass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        """Route the stdlib's access log to ``logging`` at debug level."""
        log.debug("%s - %s", self.client_address[0], format % args)


def start_in_thread(server: GuardedHTTPServer, name: str) -> threading.Thread:
    """Serve ``server`` from a daemon thread (stopped with ``server.shutdown()``)."""
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, name=name, daemon=True
    )
    thread.start()
    return thread
