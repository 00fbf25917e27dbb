"""The agent's mesh listener: its routes, and the proof every request and reply carries.

Every request must carry a :mod:`mesh.control.auth` proof from a current member's key. The whole
proof, MAC included, is checked against the body digest the request declares before any body byte
is read (:meth:`MeshRoutes.authenticate`), so a request without a member's key never holds a
handler thread while a body trickles in; the body is then hashed as it streams and must match the
declaration (:meth:`MeshRoutes.proven`). A removed member gets a signed 403, and every reply to a
proven sender is signed, status included. As a second line of defence, the connection's source IP
must be the proven member's mesh address.

The costly routes may hold only some of the listener's handler threads at once
(:class:`RouteLimits`): a probe, an echo, a job start or stop beyond its slots gets a one-line 429
before its body is read, and an event poll beyond its slots is answered at once instead of waiting. Polls are the
launcher's heartbeat, so the threads the costly routes cannot take are what keeps jobs alive.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from mesh.control.auth import AuthError
from mesh.control.directory import Member
from mesh.control.verifier import RequestVerifier
from mesh.http.server import CHUNK, HTTPError, Reply, Request, Route, json_reply, text_reply
from shardpool import __version__
from shardpool.agent.admission import Slots
from shardpool.agent.job_table import on_behalf_of
from shardpool.agent.members import same_ip
from shardpool.contract.job import MAX_JOB_JSON_BYTES

__all__ = ["MAX_ECHO_BYTES", "MeshRoutes", "MeshService", "RouteLimits"]

log = logging.getLogger(__name__)

#: Largest body POST /v1/echo accepts: enough to time a link, small enough to be harmless.
MAX_ECHO_BYTES = 32 * 2**20
_SMALL_BODY = 64 * 1024
_MAX_WAIT_S = 30.0


@dataclass(frozen=True)
class RouteLimits:
    """How many of the mesh listener's handler threads each costly route may hold at once.

    ``probes``: probes running here (each calls other members for up to a minute); ``echoes``:
    echo bodies being received (up to 32 MiB each, sent by other members' probes); ``starts``
    and ``stops``: job starts (up to 256 processes each) and stops (up to 7 s for a stage that
    ignores SIGTERM); ``waiting_polls``: event polls that wait for an event (up to 30 s), of
    which at most ``waiting_polls_per_job`` for one job. The profiler bounds its own waiters
    (:class:`shardpool.agent.profiling.DeviceProfiler`).
    """

    probes: int = 1
    echoes: int = 4
    starts: int = 4
    stops: int = 4
    waiting_polls: int = 28
    waiting_polls_per_job: int = 2

    @classmethod
    def for_threads(cls, threads: int) -> RouteLimits:
        """The limits for a pool of ``threads``: from 16 threads on, with the profiler's waiters
        (``threads // 16``) they leave a fifth of it, or more, to short requests."""
        share = max(1, threads // 16)
        return cls(
            probes=1,
            echoes=share,
            starts=share,
            stops=share,
            waiting_polls=max(1, threads * 7 // 16),
            waiting_polls_per_job=2,
        )


class MeshService(Protocol):
    """What the mesh routes ask of the agent."""

    host: str
    member_name: str

    def devices(self, body: dict[str, Any]) -> dict[str, Any]: ...
    def probe(self, body: dict[str, Any]) -> dict[str, Any]: ...
    def start_job(self, body: dict[str, Any], origin: Member) -> dict[str, Any]: ...
    def poll(
        self, job_id: str, after: int, wait: float, requester: Member, on_behalf: str | None
    ) -> dict[str, Any]: ...
    def log_tail(
        self, job_id: str, rank: int, lines: int, requester: Member, on_behalf: str | None
    ) -> str: ...
    def delete_job(self, job_id: str, requester: Member, on_behalf: str | None) -> dict[str, Any]: ...


@dataclass
class _Sender:
    """The principal of a mesh request: the member its proof names, and how far the proof got.

    ``proven`` once the MAC checked out (over the declared digest of a streamed body); ``removed``
    (with the refusal in ``refusal``) when the sender proved a key that is no longer a member's.
    Only replies to those two are signed.
    """

    member: Member
    proven: bool = False
    removed: bool = False
    refusal: str = ""


class MeshRoutes:
    """The mesh listener's routes over ``service``, and its ``authenticate``/``sign_reply`` hooks.

    ``verifier`` holds this member's private key and answers who signed a request;
    ``check_peer_ip`` also requires the connection to come from the signer's mesh address;
    ``limits`` bounds the handler threads the costly routes hold.
    """

    def __init__(
        self,
        service: MeshService,
        verifier: RequestVerifier,
        *,
        check_peer_ip: bool = True,
        limits: RouteLimits | None = None,
    ) -> None:
        self.service = service
        self.verifier = verifier
        self.check_peer_ip = check_peer_ip
        self.limits = limits or RouteLimits()
        self._probes = Slots(self.limits.probes)
        self._echoes = Slots(self.limits.echoes)
        self._starts = Slots(self.limits.starts)
        self._stops = Slots(self.limits.stops)
        self._waiting_polls = Slots(self.limits.waiting_polls)
        self._job_waits = Slots(self.limits.waiting_polls_per_job)

    def routes(self) -> list[Route]:
        """Every route of the mesh listener, each behind :meth:`proven`, with its body cap."""

        def proven(
            handler: Callable[[Request, Member], Reply],
            cap: int,
            method: str,
            pattern: str,
            slots: tuple[Slots, str] | None = None,
        ) -> Route:
            wrapped = self.proven(handler) if slots is None else self.admitted(self.proven(handler), *slots)
            return Route(method, pattern, wrapped, max_body=cap, stream_body=True)

        busy_probe = "this agent is already running a probe; ask again when it has answered"
        busy_echo = "this agent is receiving as many echoes as it takes at once; try again shortly"
        busy_start = "this agent is starting as many jobs as it takes at once; try again shortly"
        busy_stop = "this agent is stopping as many jobs as it takes at once; try again shortly"
        return [
            proven(self._get_health, 0, "GET", "/v1/health"),
            proven(self._post_devices, 4 * 2**20, "POST", "/v1/devices"),
            proven(self._post_echo, MAX_ECHO_BYTES, "POST", "/v1/echo", (self._echoes, busy_echo)),
            proven(self._post_probe, _SMALL_BODY, "POST", "/v1/probe", (self._probes, busy_probe)),
            proven(self._post_job, MAX_JOB_JSON_BYTES, "POST", "/v1/jobs", (self._starts, busy_start)),
            proven(self._get_events, 0, "GET", "/v1/jobs/{job_id}/events"),
            proven(self._get_log, 0, "GET", "/v1/jobs/{job_id}/log/{rank}"),
            proven(self._delete_job, 0, "DELETE", "/v1/jobs/{job_id}", (self._stops, busy_stop)),
        ]

    def authenticate(self, request: Request) -> _Sender:
        """Check the whole proof before any body byte is read (streamed routes: against the declared digest).

        The sender's key must be a member's whose mesh address the connection comes from (403)
        before its MAC is checked. A removed member that proves its key on an unrouted path gets
        an unsigned 403; on a route it gets a signed one from :meth:`proven`, its body unread.
        """
        try:
            member = self.verifier.precheck(request.headers)
        except AuthError as error:
            raise HTTPError(error.status, str(error)) from None
        if self.check_peer_ip and not same_ip(request.peer.ip, member.address):
            log.warning(
                "refused a request signed by %s from %s, not its mesh address", member.name, request.peer.ip
            )
            raise HTTPError(
                403, f"a request signed by {member.name} came from {request.peer.ip}, not its mesh address"
            )
        refusal = ""
        try:
            if request.body is None:
                member = self.verifier.verify_declared(request.method, request.target, request.headers)
            else:
                member = self.verifier.verify(request.method, request.target, request.headers, request.body)
        except AuthError as error:
            if error.removed is None or request.body is not None:
                raise HTTPError(error.status, str(error)) from None
            member, refusal = error.removed, str(error).splitlines()[0]
        return _Sender(member, proven=not refusal, removed=bool(refusal), refusal=refusal)

    def proven(self, handler: Callable[[Request, Member], Reply]) -> Callable[[Request], Reply]:
        """Wrap a handler: read the body (hashing it), check it against its proven digest, run the handler."""

        def run(request: Request) -> Reply:
            sender: _Sender = request.principal
            if sender.removed:
                return json_reply({"error": sender.refusal, "removed": True}, 403)
            digest, parts, total = hashlib.sha256(), [], 0
            keep = request.path != "/v1/echo"
            while chunk := request.read(CHUNK):
                digest.update(chunk)
                total += len(chunk)
                if keep:
                    parts.append(chunk)
            if total != request.length:
                raise HTTPError(400, "the request body ended early")
            try:
                self.verifier.check_body(request.headers, digest.digest())
            except AuthError as error:
                raise HTTPError(error.status, str(error)) from None
            request.body = b"".join(parts)
            return handler(request, sender.member)

        return run

    def admitted(
        self, run: Callable[[Request], Reply], slots: Slots, busy: str
    ) -> Callable[[Request], Reply]:
        """Wrap a proven route: run it only while one of ``slots`` is free, else a one-line 429 (body unread)."""

        def admit(request: Request) -> Reply:
            with slots.hold() as free:
                if not free:
                    log.debug("refused %s from %s: %s", request.path, request.principal.member.name, busy)
                    return json_reply({"error": busy}, 429)
                return run(request)

        return admit

    def sign_reply(self, request: Request, principal: Any, status: int, body: bytes | None) -> dict[str, str]:
        """The headers that sign a reply to a proven (or proven-but-removed) sender; none otherwise."""
        if isinstance(principal, _Sender) and (principal.proven or principal.removed):
            return self.verifier.reply_headers(
                principal.member.public_key, status, body or b"", request.headers
            )
        return {}

    def _get_health(self, request: Request, member: Member) -> Reply:
        return json_reply(
            {"name": self.service.member_name, "address": self.service.host, "version": __version__}
        )

    def _post_devices(self, request: Request, member: Member) -> Reply:
        return json_reply(self.service.devices(request.json()))

    def _post_echo(self, request: Request, member: Member) -> Reply:
        return json_reply({"bytes": request.length})

    def _post_probe(self, request: Request, member: Member) -> Reply:
        return json_reply(self.service.probe(request.json()))

    def _post_job(self, request: Request, member: Member) -> Reply:
        return json_reply(self.service.start_job(request.json(), member), 201)

    def _get_events(self, request: Request, member: Member) -> Reply:
        after = _number(request.query, "after", 0, int, 0, 2**62)
        wait = _number(request.query, "wait", 1.0, float, 0.0, _MAX_WAIT_S)
        job_id = request.params["job_id"]
        with self._waiting_polls.hold() as some, self._job_waits.hold(job_id) as mine:
            # a poll without a slot is answered at once: still the heartbeat, never a held thread
            return json_reply(
                self.service.poll(
                    job_id, after, wait if some and mine else 0.0, member, on_behalf_of(request.query)
                )
            )

    def _get_log(self, request: Request, member: Member) -> Reply:
        rank = request.params["rank"]
        if not rank.isdigit() or len(rank) > 9:
            raise HTTPError(400, f"rank {rank[:20]!r} is not a number")
        lines = _number(request.query, "tail", 200, int, 1, 100_000)
        return text_reply(
            self.service.log_tail(
                request.params["job_id"], int(rank), lines, member, on_behalf_of(request.query)
            )
        )

    def _delete_job(self, request: Request, member: Member) -> Reply:
        return json_reply(
            self.service.delete_job(request.params["job_id"], member, on_behalf_of(request.query))
        )


def _number(query: dict[str, list[str]], key: str, default: Any, kind: type, low: float, high: float) -> Any:
    values = query.get(key)
    if not values:
        return default
    try:
        value = kind(values[0][:40])
    except ValueError:
        raise HTTPError(400, f"{key}={values[0][:40]!r} is not a number") from None
    if not low <= value <= high:  # NaN fails both comparisons
        raise HTTPError(400, f"{key}={value} is out of range {low}..{high}")
    return value
