"""The coordinator: the join service on the underlay and the roster service on the mesh.

Both services run on :class:`mesh.http.server.HTTPServer` (aiohttp) and speak JSON:

* The **join service** (``POST /v1/join``, ``GET /v1/membership``) listens on the coordinator's
  underlay endpoint. It is the one service that may bind a wildcard address: when the configured
  endpoint is not an address of this machine (a NAT port forward, a DNS name) it listens on
  ``0.0.0.0``. Joiners are strangers until their token checks out, so its bounds are the tight
  ones in :data:`JOIN_LIMITS`: a join body is a few hundred bytes, capped at
  :data:`JOIN_MAX_BODY` (64 KiB) before any of it is read; the request head must arrive within
  10 s of connecting, the body within 10 s plus 16 KiB/s; at most 64 connections per source
  address (a lab behind one NAT still fits, a single host cannot hold the service) and 4,096 in
  all, so 2,000 idle or trickling connections leave room for honest joiners; 4 handler threads,
  because a join is a short burst of X25519 and one SQLite transaction.
* The **roster service** (``GET /v1/roster``, ``POST /v1/report``, ``POST /v1/leave``) listens on the coordinator's
  mesh address only (never a wildcard), so only WireGuard peers reach it. Its requests carry no
  body, capped at :data:`ROSTER_MAX_BODY` (4 KiB); :data:`ROSTER_LIMITS` allows 32 connections per
  member (one sync loop plus a few CLI calls) and 8 handler threads; its replies (the roster) may
  be large, and the reply allowance grows with their length at 256 KiB/s. A report (a member's
  path candidates and try outcomes, :mod:`mesh.control.report`) may be up to 16 KiB; its strictly
  checked content goes to :attr:`CoordinatorService.board`, and each roster reply carries the
  caller's own ``paths`` instructions from there.

Membership, roster and leave requests are authenticated by the server's ``authenticate`` hook
with :class:`mesh.control.verifier.RequestVerifier` (purpose :data:`mesh.control.auth.ROSTER_PURPOSE`) before their
handler runs, so nothing in their body is parsed for an unproven sender; every reply to a proven
sender (404s and 405s included) is signed by the ``sign_reply`` hook. A removed member that
proves its key gets a signed 403 ``{"removed": true}`` so it can trust that it was removed; every
other refusal is an unsigned 401 that members never act on. Every failure is a 4xx one-line JSON
error, so hostile input cannot crash a service or change the roster.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from mesh.control.auth import ROSTER_PURPOSE, AuthError
from mesh.control.board import PathBoard
from mesh.control.directory import Member, RosterStoreDirectory
from mesh.control.protocol import MAX_CLOCK_SKEW, ProtocolError, open_join_request, seal_join_response
from mesh.control.report import REPORT_MAX_BODY, parse_report
from mesh.control.roster import AdmitRequest, JoinRefused, RosterStore
from mesh.control.verifier import NONCE_CAP, RequestVerifier
from mesh.errors import MeshError
from mesh.http.server import HTTPError, HTTPServer, Limits, Reply, Request, Route, error_reply, json_reply

__all__ = [
    "JOIN_LIMITS",
    "JOIN_MAX_BODY",
    "ROSTER_LIMITS",
    "ROSTER_MAX_BODY",
    "SIGNED_PATHS",
    "CoordinatorService",
    "RemovedCaller",
    "start_join_server",
    "start_roster_server",
]

log = logging.getLogger("shardpool.mesh.coordinator")

JOIN_MAX_BODY = 64 * 1024
"""Largest join request body accepted (a real one is under 1 KiB); larger ones get 413 unread."""
ROSTER_MAX_BODY = 4 * 1024
"""Largest body accepted on the roster service and the membership check (members send none)."""

JOIN_LIMITS = Limits(
    head_timeout_s=10.0,
    keepalive_timeout_s=5.0,
    body_timeout_s=10.0,
    min_rate_bps=16 * 1024,
    max_connections=4096,
    max_connections_per_source=64,
    handler_threads=4,
    max_line_size=4096,
    max_field_size=4096,
    max_headers=32,
)
"""Bounds of the join service on the underlay (see the module docstring for why)."""

ROSTER_LIMITS = replace(
    JOIN_LIMITS, min_rate_bps=256 * 1024, max_connections_per_source=32, handler_threads=8
)
"""Bounds of the roster service on the mesh address (see the module docstring for why)."""

SIGNED_PATHS = frozenset({"/v1/membership", "/v1/roster", "/v1/report", "/v1/leave"})
"""Paths whose every request must carry a member's proof (any method), checked before the body is read."""

_WILDCARD_V4 = "0.0.0.0"


@dataclass(frozen=True)
class RemovedCaller:
    """The principal of a request whose sender proved a key that was removed from the mesh."""

    member: Member
    status: int
    message: str


def _require_length(request: Request) -> None:
    if "Content-Length" not in request.headers:
        raise HTTPError(411, "request needs a Content-Length")


class CoordinatorService:
    """Handles join, membership, roster and leave requests against the SQLite roster."""

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
        self.board = PathBoard()
        self.verifier = RequestVerifier(
            private_key,
            store.roster().mesh_id,
            RosterStoreDirectory(store),
            purpose=ROSTER_PURPOSE,
            nonce_cap=nonce_cap,
            clock=clock,
        )

    # ------------------------------------------------------------------ routes

    def join_routes(self) -> list[Route]:
        """The routes of the join service on the underlay: joins, and the membership check."""
        return [
            Route("POST", "/v1/join", self.join, max_body=JOIN_MAX_BODY),
            Route("GET", "/v1/membership", self.membership, max_body=ROSTER_MAX_BODY),
        ]

    def roster_routes(self) -> list[Route]:
        """The routes of the roster service on the mesh address: roster sync, reports and leave."""
        return [
            Route("GET", "/v1/roster", self.roster, max_body=ROSTER_MAX_BODY),
            Route("POST", "/v1/report", self.report, max_body=REPORT_MAX_BODY),
            Route("POST", "/v1/leave", self.leave, max_body=ROSTER_MAX_BODY),
        ]

    def server(
        self,
        routes: Iterable[Route],
        host: str,
        port: int,
        *,
        limits: Limits,
        allow_wildcard: bool = False,
        name: str = "coordinator",
    ) -> HTTPServer:
        """An unstarted HTTP server for ``routes``; its routes on :data:`SIGNED_PATHS` need a proof.

        Paths it does not route get a plain 404, proof or not, so each service shows only its own.
        """
        routes = list(routes)
        signed = frozenset(route.pattern for route in routes) & SIGNED_PATHS
        return HTTPServer(
            routes,
            host=host,
            port=port,
            allow_wildcard=allow_wildcard,
            limits=limits,
            authenticate=functools.partial(self.authenticate, signed_paths=signed),
            sign_reply=self.sign_reply,
            name=name,
        )

    # ------------------------------------------------------------------ hooks

    def authenticate(
        self, request: Request, signed_paths: frozenset[str] = SIGNED_PATHS
    ) -> Member | RemovedCaller | None:
        """Check the proof of a request to one of ``signed_paths`` before anything in its body is parsed.

        Returns the current member, a :class:`RemovedCaller` for a removed member that proved its
        key (its handler answers a signed 403), or ``None`` on other paths (the join, unknown paths).
        """
        if request.path not in signed_paths:
            return None
        try:
            return self.verifier.verify(request.method, request.target, request.headers, request.body or b"")
        except AuthError as error:
            if error.removed is None:
                raise HTTPError(error.status, str(error)) from None
            return RemovedCaller(error.removed, error.status, str(error))

    def sign_reply(
        self, request: Request, principal: Member | RemovedCaller | None, status: int, body: bytes | None
    ) -> Mapping[str, str]:
        """Sign every reply to a proven sender (status and body), so a flipped status is detected."""
        if principal is None:
            return {}
        member = principal.member if isinstance(principal, RemovedCaller) else principal
        return self.verifier.reply_headers(member.public_key, status, body or b"", request.headers)

    # ------------------------------------------------------------------ handlers

    def join(self, request: Request) -> Reply:
        """Admit a joiner: decrypt and check its request, admit it atomically, seal the reply."""
        _require_length(request)
        try:
            envelope = json.loads(request.body or b"")
        except (ValueError, UnicodeDecodeError):
            return error_reply(400, "join request is not JSON: use `shardpool mesh join`")
        now = self.clock()
        try:
            joiner, context = open_join_request(envelope, self.private_key, self.store.token_hash, now)
            member = self.store.admit(
                AdmitRequest(
                    token_id=joiner.token_id,
                    secret=joiner.secret,
                    nonce=joiner.nonce,
                    nonce_expires_at=now + 2 * MAX_CLOCK_SKEW,
                    name=joiner.name,
                    public_key=joiner.public_key,
                    endpoint=joiner.endpoint,
                ),
                now,
            )
        except (ProtocolError, JoinRefused) as error:
            return error_reply(error.status, str(error))
        except MeshError as error:
            return error_reply(400, str(error))
        log.info("admitted %s at %s", member.name, member.address)
        if self.on_change is not None:
            self.on_change()
        payload = {"member": member.to_json(), "roster": self.store.roster().to_json(), "mesh": self.settings}
        return json_reply(seal_join_response(context, payload))

    def membership(self, request: Request) -> Reply:
        """Tell an authenticated key whether it is still a member, and nothing else.

        Served on the underlay, so a member cut off from the mesh learns that it was removed;
        it carries no roster, so nothing about the mesh is exposed there.
        """
        return self._for_member(request, lambda member: json_reply({"member": True}))

    def roster(self, request: Request) -> Reply:
        """Send the current roster, and the caller's path instructions, to an authenticated member.

        A removed member is told that it was removed. ``paths`` is left out when there are none,
        so the reply is byte-for-byte what members before path planning got.
        """
        return self._for_member(request, self._roster_reply)

    def _roster_reply(self, member: Member) -> Reply:
        payload: dict[str, Any] = {"roster": self.store.roster().to_json()}
        paths = self.board.paths_json(member.public_key)
        if paths:
            payload["paths"] = paths
        relaying = self.board.relay_json(member.public_key)
        if relaying:
            payload["relay_allocations"] = relaying
        return json_reply(payload)

    def report(self, request: Request) -> Reply:
        """Take an authenticated member's report (candidates, peer view, try outcomes) for the path planner."""
        _require_length(request)
        return self._for_member(request, functools.partial(self._record_report, request))

    def _record_report(self, request: Request, member: Member) -> Reply:
        try:
            report = parse_report(json.loads(request.body or b""))
        except (ValueError, UnicodeDecodeError, RecursionError):
            return error_reply(400, "report is not JSON")
        except MeshError as error:
            return error_reply(400, f"report refused: {error}")
        self.board.record(member.public_key, report)
        return json_reply({"recorded": True})

    def leave(self, request: Request) -> Reply:
        """Revoke the authenticated member that asks to leave."""
        _require_length(request)
        return self._for_member(request, self._revoke)

    def _for_member(self, request: Request, handle: Callable[[Member], Reply]) -> Reply:
        """Run ``handle`` for the proven current member; answer a removed one with its 403."""
        caller = request.principal
        if isinstance(caller, RemovedCaller):
            return json_reply({"error": caller.message, "removed": True}, caller.status)
        if not isinstance(caller, Member):  # served without the authenticate hook: never answer unproven
            return error_reply(401, "this route needs a signed request, and this server checks none")
        return handle(caller)

    def _revoke(self, member: Member) -> Reply:
        try:
            self.store.revoke(member.name, self.clock())
        except MeshError as error:
            return error_reply(400, str(error))
        if self.on_change is not None:
            self.on_change()
        return json_reply({"left": True})


def start_join_server(service: CoordinatorService, host: str, port: int) -> HTTPServer:
    """Serve joins and membership checks on the underlay endpoint ``host:port``; returns the started server.

    The configured endpoint may be a wildcard, or may not be an address of this machine (a NAT
    port forward, or a DNS name): then the service listens on every IPv4 address. This is the one
    service allowed a wildcard.
    """
    try:
        return service.server(
            service.join_routes(),
            host,
            port,
            limits=JOIN_LIMITS,
            allow_wildcard=True,
            name="coordinator-join",
        ).start()
    except MeshError:
        if host == _WILDCARD_V4:
            raise
        log.info("endpoint host %s is not an address of this machine; serving joins on all addresses", host)
    return service.server(
        service.join_routes(),
        _WILDCARD_V4,
        port,
        limits=JOIN_LIMITS,
        allow_wildcard=True,
        name="coordinator-join",
    ).start()


def start_roster_server(service: CoordinatorService, mesh_address: str, port: int) -> HTTPServer:
    """Serve roster syncs and leaves on the coordinator's mesh address only; returns the started server."""
    return service.server(
        service.roster_routes(), mesh_address, port, limits=ROSTER_LIMITS, name="coordinator-roster"
    ).start()
