"""The coordinator: the join service on the underlay and the roster service on the mesh.

Both are small HTTP/1.0 services (stdlib ``http.server``) that speak JSON. Requests larger than
:data:`MAX_REQUEST_BYTES` are refused before their body is read, sockets time out after a few
seconds, and every failure becomes a 4xx JSON error, so hostile input cannot crash the service
or change the roster.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from mesh.errors import MeshError
from mesh.protocol import (
    MAX_CLOCK_SKEW,
    NonceCache,
    ProtocolError,
    open_join_request,
    seal_join_response,
    sign_sync_response,
    sync_key,
    verify_sync_request,
)
from mesh.roster import AdmitRequest, JoinRefused, RosterStore

__all__ = ["MAX_REQUEST_BYTES", "CoordinatorService", "MeshHTTPServer", "start_server"]

MAX_REQUEST_BYTES = 16 * 1024
log = logging.getLogger("shardpool.mesh.coordinator")

Reply = tuple[int, bytes, dict[str, str]]
Headers = Mapping[str, str]
Route = Callable[[Headers, bytes], Reply]


def _json_reply(status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> Reply:
    return status, json.dumps(payload).encode("utf-8"), headers or {}


def _error(status: int, message: str) -> Reply:
    return _json_reply(status, {"error": message})


class CoordinatorService:
    """Handles join, roster and leave requests against the SQLite roster."""

    def __init__(
        self,
        store: RosterStore,
        private_key: str,
        settings: dict[str, Any],
        clock: Callable[[], float] = time.time,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.on_change = on_change
        self.private_key = private_key
        self.settings = settings
        self.clock = clock
        self.nonces = NonceCache()
        self._mesh_id = store.roster().mesh_id
        self._keys: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def join(self, headers: Headers, body: bytes) -> Reply:
        """Admit a joiner: decrypt and check its request, admit it atomically, seal the reply."""
        try:
            envelope = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return _error(400, "join request is not JSON: use `shardpool mesh join`")
        now = self.clock()
        try:
            request, context = open_join_request(envelope, self.private_key, self.store.token_hash, now)
            member = self.store.admit(
                AdmitRequest(
                    token_id=request.token_id,
                    secret=request.secret,
                    nonce=request.nonce,
                    nonce_expires_at=now + 2 * MAX_CLOCK_SKEW,
                    name=request.name,
                    public_key=request.public_key,
                    endpoint=request.endpoint,
                ),
                now,
            )
        except (ProtocolError, JoinRefused) as error:
            return _error(error.status, str(error))
        except MeshError as error:
            return _error(400, str(error))
        log.info("admitted %s at %s", member.name, member.address)
        if self.on_change is not None:
            self.on_change()
        payload = {"member": member.to_json(), "roster": self.store.roster().to_json(), "mesh": self.settings}
        return _json_reply(200, seal_join_response(context, payload))

    def _authenticate(self, method: str, path: str, headers: Headers, body: bytes) -> tuple[str, bytes, bool]:
        member_key = headers.get("X-Shardpool-Key")
        found = (
            self.store.lookup_key(member_key)
            if isinstance(member_key, str) and len(member_key) == 44
            else None
        )
        if found is None or member_key is None:
            raise ProtocolError("sync request from a key that is not in this mesh", 401)
        with self._lock:
            key = self._keys.get(member_key)
            if key is None:
                key = self._keys[member_key] = sync_key(self.private_key, member_key, self._mesh_id)
        verify_sync_request(key, headers, method, path, body, self.nonces, self.clock())
        return member_key, key, found[1]

    def _signed(self, status: int, payload: dict[str, Any], key: bytes, headers: Headers) -> Reply:
        body = json.dumps(payload).encode("utf-8")
        return status, body, {"X-Shardpool-Mac": sign_sync_response(key, headers["X-Shardpool-Nonce"], body)}

    def roster(self, headers: Headers, body: bytes) -> Reply:
        """Send the current roster to an authenticated member (or tell a revoked one it was removed)."""
        try:
            _, key, revoked = self._authenticate("GET", "/v1/roster", headers, body)
        except MeshError as error:
            return _error(getattr(error, "status", 401), str(error))
        if revoked:
            return self._signed(
                403, {"error": "revoked", "message": "this machine was removed from the mesh"}, key, headers
            )
        return self._signed(200, {"roster": self.store.roster().to_json()}, key, headers)

    def membership(self, headers: Headers, body: bytes) -> Reply:
        """Tell an authenticated key whether it is still a member, and nothing else.

        Served on the underlay, so a member cut off from the mesh learns that it was removed;
        it carries no roster, so nothing about the mesh is exposed there.
        """
        try:
            _, key, revoked = self._authenticate("GET", "/v1/membership", headers, body)
        except MeshError as error:
            return _error(getattr(error, "status", 401), str(error))
        if revoked:
            return self._signed(
                403, {"error": "revoked", "message": "this machine was removed from the mesh"}, key, headers
            )
        return self._signed(200, {"member": True}, key, headers)

    def leave(self, headers: Headers, body: bytes) -> Reply:
        """Revoke the authenticated member that asks to leave."""
        try:
            member_key, key, revoked = self._authenticate("POST", "/v1/leave", headers, body)
            if not revoked:
                found = self.store.lookup_key(member_key)
                if found is not None:
                    self.store.revoke(found[0].name, self.clock())
                    if self.on_change is not None:
                        self.on_change()
        except MeshError as error:
            return _error(getattr(error, "status", 400), str(error))
        return self._signed(200, {"left": True}, key, headers)


class _Handler(BaseHTTPRequestHandler):
    server_version = "shardpool-mesh/1"
    sys_version = ""
    protocol_version = "HTTP/1.0"
    timeout = 5.0
    server: MeshHTTPServer

    def parse_request(self) -> bool:
        """Parse the request line and headers, answering 405 to methods other than GET and POST."""
        if not super().parse_request():
            return False
        if self.command not in ("GET", "POST"):
            self._send(*_error(405, f"method {self.command[:20]} is not allowed: use GET or POST"))
            return False
        return True

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802 - http.server naming
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        route = self.server.routes.get((method, self.path))
        if route is None:
            self._send(*_error(404, f"no such endpoint {method} {self.path[:100]}"))
            return
        length_text = self.headers.get("Content-Length", "0" if method == "GET" else "")
        if not length_text.isdigit():
            self._send(*_error(411, "request needs a Content-Length"))
            return
        length = int(length_text)
        if length > MAX_REQUEST_BYTES:
            self._send(
                *_error(413, f"request of {length} bytes is larger than the {MAX_REQUEST_BYTES}-byte limit")
            )
            return
        body = self.rfile.read(length)
        if len(body) != length:
            self._send(*_error(400, "request body is shorter than its Content-Length"))
            return
        try:
            reply = route(self.headers, body)
        except Exception:  # noqa: BLE001 - the service must survive any bug triggered by input
            log.exception("internal error on %s %s", method, self.path)
            reply = _error(500, "internal error in the coordinator: see its log")
        self._send(*reply)

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - signature fixed by http.server
        log.debug("%s " + format, self.address_string(), *args)


class MeshHTTPServer(ThreadingHTTPServer):
    """A threaded HTTP server with a fixed route table."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], routes: dict[tuple[str, str], Route]) -> None:
        self.routes = routes
        super().__init__(address, _Handler)


def start_server(host: str, port: int, routes: dict[tuple[str, str], Route]) -> MeshHTTPServer:
    """Bind ``host:port`` and serve ``routes`` in a daemon thread; call ``shutdown()`` to stop."""
    try:
        server = MeshHTTPServer((host, port), routes)
    except OSError as error:
        raise MeshError(
            f"cannot listen on {host}:{port} ({error.strerror}): free the TCP port or choose another --listen-port"
        ) from None
    thread = threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": 0.1},
        name=f"mesh-http-{host}:{port}",
        daemon=True,
    )
    thread.start()
    return server
