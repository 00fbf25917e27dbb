"""The coordinator: the join service on the underlay and the roster service on the mesh.

Both are small HTTP/1.0 services (stdlib ``http.server``) that speak JSON. Requests larger than
:data:`MAX_REQUEST_BYTES` are refused before their body is read, sockets time out after a few
seconds, and every failure becomes a 4xx JSON error, so hostile input cannot crash the service
or change the roster. Roster, membership and leave requests are authenticated by
:mod:`mesh.auth` before anything else, and their replies are signed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from mesh.auth import NONCE_CAP, ROSTER_PURPOSE, AuthError, Member, RequestVerifier, RosterStoreDirectory
from mesh.errors import MeshError
from mesh.protocol import MAX_CLOCK_SKEW, ProtocolError, open_join_request, seal_join_response
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
        nonce_cap: int = NONCE_CAP,
    ) -> None:
        self.store = store
        self.on_change = on_change
        self.private_key = private_key
        self.settings = settings
        self.clock = clock
        self.verifier = RequestVerifier(
            private_key,
            store.roster().mesh_id,
            RosterStoreDirectory(store),
            purpose=ROSTER_PURPOSE,
            nonce_cap=nonce_cap,
            clock=clock,
        )

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

    def _authenticated(
        self, method: str, path: str, headers: Headers, body: bytes, handle: Callable[[Member], Reply]
    ) -> Reply:
        """Verify the request, run ``handle`` for its current member, and sign whatever it answers.

        A removed member that proves its key gets a signed 403, so it can trust that it was
        removed; every other refusal is an unsigned 401 that the member never acts on.
        """
        try:
            member = self.verifier.verify(method, path, headers, body)
        except AuthError as error:
            if error.removed is None:
                return _error(error.status, str(error))
            status, reply, _ = _json_reply(error.status, {"error": str(error), "removed": True})
            return (
                status,
                reply,
                self.verifier.reply_headers(error.removed.public_key, status, reply, headers),
            )
        status, reply, extra = handle(member)
        return (
            status,
            reply,
            {**extra, **self.verifier.reply_headers(member.public_key, status, reply, headers)},
        )

    def roster(self, headers: Headers, body: bytes) -> Reply:
        """Send the current roster to an authenticated member (or tell a removed one it was removed)."""
        return self._authenticated(
            "GET",
            "/v1/roster",
            headers,
            body,
            lambda member: _json_reply(200, {"roster": self.store.roster().to_json()}),
        )

    def membership(self, headers: Headers, body: bytes) -> Reply:
        """Tell an authenticated key whether it is still a member, and nothing else.

        Served on the underlay, so a member cut off from the mesh learns that it was removed;
        it carries no roster, so nothing about the mesh is exposed there.
        """
        return self._authenticated(
            "GET", "/v1/membership", headers, body, lambda member: _json_reply(200, {"member": True})
        )

    def leave(self, headers: Headers, body: bytes) -> Reply:
        """Revoke the authenticated member that asks to leave."""
        return self._authenticated("POST", "/v1/leave", headers, body, self._revoke)

    def _revoke(self, member: Member) -> Reply:
        try:
            self.store.revoke(member.name, self.clock())
        except MeshError as error:
            return _error(400, str(error))
        if self.on_change is not None:
            self.on_change()
        return _json_reply(200, {"left": True})


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
