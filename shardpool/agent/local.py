"""The agent's local listener: a Unix socket through which people on this member launch and manage jobs.

The kernel names the caller (``SO_PEERCRED``), so nothing the caller says about itself counts.
Root and members of the launch group may use it, except the run-as account (a stage process must
never submit jobs of its own); anyone else gets a one-line 403 on every route and nothing starts.

``POST /v1/local/forward`` is how a launcher talks to any member's agent, this one included: the
local agent signs the request with this member's key (the launcher cannot read it), checks the
signed reply, and hands back its status and body. Only the mesh routes a launcher needs are
forwarded. A job start is stamped with the caller's user name (whatever the body said) and
recorded here, so that its events, logs and stop are allowed only to that user or root, and only
on the members it was started on; each such request is forwarded with ``submitter=USER`` in its
signed path (never from the caller), which the job's agent checks against the job's submitter.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, quote, urlsplit

from mesh.http.client import Unreachable
from mesh.http.server import (
    CHUNK,
    HTTPError,
    HTTPServer,
    Limits,
    Reply,
    Request,
    Route,
    json_object,
    json_reply,
)
from shardpool.agent.accounts import Caller, LaunchPolicy
from shardpool.agent.admission import Slots
from shardpool.agent.client import AgentRefused, SignedAgentClient
from shardpool.agent.job_table import SUBMITTER_PARAMETER
from shardpool.agent.members import MeshPeer
from shardpool.contract.job import MAX_JOB_JSON_BYTES

__all__ = ["PER_CALLER", "LocalService", "MemberGateway", "forward_route"]

#: Requests one user (root aside) may have in progress at once on the socket, a part of the local
#: listener's pool so that one user cannot hold it all: a launcher holds one per member of its
#: run (its event polls) and up to 4 while it profiles.
PER_CALLER = 24

_JOB_ID = r"(?P<job_id>[A-Za-z0-9][A-Za-z0-9._-]{0,63})"
_QUERY = r"(?:\?[A-Za-z0-9=&._-]{0,200})?"
#: (method, path pattern, timeout s): the only mesh requests a local user may have signed.
_FORWARDED = [
    ("GET", re.compile(r"/v1/health"), 15.0),
    ("POST", re.compile(r"/v1/devices"), 600.0),
    ("POST", re.compile(r"/v1/probe"), 180.0),
    ("POST", re.compile(r"/v1/jobs"), 60.0),
    ("GET", re.compile(rf"/v1/jobs/{_JOB_ID}/events{_QUERY}"), 45.0),
    ("GET", re.compile(rf"/v1/jobs/{_JOB_ID}/log/[0-9]{{1,9}}{_QUERY}"), 15.0),
    ("DELETE", re.compile(rf"/v1/jobs/{_JOB_ID}"), 30.0),
]
_FORWARD_MAX_BODY = MAX_JOB_JSON_BYTES + 64 * 1024
_MAX_LOCAL_JOBS = 1024
_FORWARD_FIELDS = {"member", "method", "path", "body", "previous"}
_PREVIOUS_JOB = re.compile(_JOB_ID)  # the job a started one continues


def forward_route(method: object, path: object) -> tuple[str | None, float]:
    """The job id a forwardable request concerns (None for member-wide routes) and its timeout.

    Raises a 403 HTTPError for anything not on the allow-list.
    """
    if isinstance(method, str) and isinstance(path, str) and len(path) <= 512:
        for allowed, pattern, timeout in _FORWARDED:
            match = pattern.fullmatch(path)
            if method == allowed and match is not None:
                return match.groupdict().get("job_id"), timeout
    shown = f"{str(method)[:10]} {str(path)[:80]}"
    raise HTTPError(403, f"{shown!r} is not a request the agent forwards; see docs/agent.md for the routes")


class MemberGateway(Protocol):
    """What the local listener needs of its agent: this member, the current members, and signing."""

    @property
    def member_name(self) -> str: ...
    @property
    def public_key(self) -> str: ...
    def current_peers(self) -> list[MeshPeer]: ...
    def signed_client(self, peer: MeshPeer, *, timeout: float = 10.0) -> SignedAgentClient: ...


@dataclass
class _LocalJob:
    """A job submitted through this agent: who asked, where it runs, and how it stands."""

    job_id: str
    uid: int
    user: str
    started: float
    members: list[str] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
    state: str = "running"
    previous: str | None = None  # the job this one continues (a run re-planned after a member change)

    def to_json(self) -> dict[str, Any]:
        """The job as ``GET /v1/local/jobs`` shows it."""
        shown: dict[str, Any] = {
            "id": self.job_id,
            "submitter": self.user,
            "members": list(self.members),
            "state": self.state,
            "started": self.started,
        }
        if self.previous is not None:
            shown["previous"] = self.previous
        return shown


class LocalService:
    """The Unix-socket listener of one agent (reached through ``gateway``) and its record of local jobs.

    ``run_as_uid`` is the account stages run as: it is refused here even when in ``group``.
    ``per_caller`` bounds the requests one user other than root has in progress at once.
    """

    def __init__(
        self,
        gateway: MemberGateway,
        *,
        socket_path: Path,
        group: str,
        run_as_uid: int,
        limits: Limits,
        per_caller: int = PER_CALLER,
    ) -> None:
        self.gateway = gateway
        self._callers = Slots(per_caller)
        self.socket_path = socket_path
        self.policy = LaunchPolicy(group, frozenset({run_as_uid}))
        self._jobs: dict[str, _LocalJob] = {}
        self._lock = threading.Lock()
        self._server = HTTPServer(
            self._routes(),
            unix_path=socket_path,
            unix_mode=0o660,
            unix_group=group,
            limits=limits,
            authenticate=self._authenticate,
            name="agent-local",
        )

    def start(self) -> None:
        """Listen on the socket (0660, root:group)."""
        self._server.start()

    def stop(self) -> None:
        """Stop listening and remove the socket."""
        self._server.stop()

    def jobs(self) -> list[_LocalJob]:
        """Every job recorded here (for tests and status)."""
        with self._lock:
            return list(self._jobs.values())

    # ------------------------------------------------------------------ routes

    def _routes(self) -> list[Route]:
        def route(method: str, pattern: str, handler: Any, cap: int = 0) -> Route:
            return Route(method, pattern, self._per_caller(handler), max_body=cap, stream_body=True)

        return [
            route("GET", "/v1/local/members", self._members),
            route("POST", "/v1/local/forward", self._forward, _FORWARD_MAX_BODY),
            route("GET", "/v1/local/jobs", self._list_jobs),
            route("GET", "/v1/local/jobs/{job_id}", self._show_job),
            route("DELETE", "/v1/local/jobs/{job_id}", self._stop_job),
        ]

    def _per_caller(self, handler: Callable[[Request], Reply]) -> Callable[[Request], Reply]:
        """Wrap a route: a caller other than root with :data:`PER_CALLER` requests in progress gets a
        one-line 429 at once, its body unread, so no user can hold every handler thread."""

        def run(request: Request) -> Reply:
            caller: Caller = request.principal
            if caller.is_root:
                return handler(request)
            with self._callers.hold(caller.uid) as free:
                if not free:
                    busy = f"user {caller.user} already has {self._callers.limit} requests in progress here"
                    return json_reply({"error": f"{busy}; wait for them"}, 429)
                return handler(request)

        return run

    def _authenticate(self, request: Request) -> Caller:
        """The caller the kernel reports, if the launch policy allows it; else a one-line 403."""
        peer = request.peer
        if peer.uid is None or peer.gid is None:
            raise HTTPError(403, "the agent's local socket needs a Unix peer")
        caller = Caller(peer.uid, peer.gid, peer.pid or 0)
        if not self.policy.allows(caller):
            raise HTTPError(403, self.policy.refusal(caller))
        return caller

    def _members(self, request: Request) -> Reply:
        _read_body(request, 0)
        mine = self.gateway.public_key
        return json_reply(
            {
                "self": self.gateway.member_name,
                "members": [
                    {
                        "name": p.name,
                        "address": p.address,
                        "online": p.online,
                        "is_self": p.public_key == mine,
                    }
                    for p in self.gateway.current_peers()
                ],
            }
        )

    def _list_jobs(self, request: Request) -> Reply:
        _read_body(request, 0)
        caller: Caller = request.principal
        with self._lock:
            shown = [job.to_json() for job in self._jobs.values() if caller.is_root or job.uid == caller.uid]
        return json_reply({"jobs": shown})

    def _show_job(self, request: Request) -> Reply:
        _read_body(request, 0)
        return json_reply(self._owned(request.params["job_id"], request.principal).to_json())

    def _stop_job(self, request: Request) -> Reply:
        _read_body(request, 0)
        job = self._owned(request.params["job_id"], request.principal)
        results: dict[str, Any] = {}
        for name in list(job.members):
            try:
                path = _for_submitter(f"/v1/jobs/{job.job_id}", job, request.principal)
                status, body = self._call(self._peer(name), "DELETE", path, b"", 30.0)
                results[name] = {"status": status, "body": body}
            except HTTPError as error:
                results[name] = {"status": error.status, "body": {"error": error.message}}
        with self._lock:
            job.state = "stopped"
        return json_reply({"id": job.job_id, "members": results})

    def _forward(self, request: Request) -> Reply:
        caller: Caller = request.principal
        payload = json_object(_read_body(request, _FORWARD_MAX_BODY))
        unknown = sorted(set(payload) - _FORWARD_FIELDS)
        if unknown or not {"member", "method", "path"} <= payload.keys():
            raise HTTPError(400, f"forward takes {sorted(_FORWARD_FIELDS)}; got {sorted(payload)[:8]}")
        method, path, inner = payload["method"], payload["path"], payload.get("body")
        job_id, timeout = forward_route(method, path)
        peer = self._peer(payload["member"])
        starting = method == "POST" and path == "/v1/jobs"
        previous = payload.get("previous")
        if previous is not None and (
            not starting or not isinstance(previous, str) or not _PREVIOUS_JOB.fullmatch(previous)
        ):
            raise HTTPError(400, "previous is a job id, and only for a job start")
        if starting:
            if not isinstance(inner, dict):
                raise HTTPError(400, "a job start's body must be a JSON object")
            inner = {**inner, "submitter": caller.user}
            started_id = inner.get("job_id")
            if isinstance(started_id, str):
                self._check_may_start(started_id, caller)
        elif job_id is not None:
            job = self._owned(job_id, caller, allow_unknown_to_root=True)
            if not caller.is_root and peer.name not in job.members:
                raise HTTPError(
                    403, f"job {job_id!r} was not started on member {peer.name!r} through this agent"
                )
            path = _for_submitter(str(path), job, caller)
        data = b"" if inner is None else json.dumps(inner).encode("utf-8")
        status, body = self._call(peer, str(method), str(path), data, timeout)
        if starting and status == 201 and isinstance(inner.get("job_id"), str):
            self._record(inner["job_id"], caller, peer.name, previous=previous)
        elif job_id is not None and status == 200 and isinstance(body, dict):
            self._note_progress(job_id, peer.name, path, body)
        return json_reply({"status": status, "body": body})

    # ------------------------------------------------------------------ helpers

    def _peer(self, name: object) -> MeshPeer:
        for peer in self.gateway.current_peers():
            if peer.name == name:
                return peer
        raise HTTPError(404, f"{str(name)[:64]!r} is not a current mesh member; see `shardpool mesh status`")

    def _call(self, peer: MeshPeer, method: str, path: str, data: bytes, timeout: float) -> tuple[int, Any]:
        client = self.gateway.signed_client(peer, timeout=timeout)
        try:
            status, raw = client.exchange(method, path, data, "application/json", timeout)
        except AgentRefused as error:  # the reply's signature failed: its status and body mean nothing
            raise HTTPError(502, f"member {peer.name}: {error}") from None
        except Unreachable as error:
            raise HTTPError(
                504, f"member {peer.name}'s agent did not answer {method} {path[:80]}: {error.reason}"
            ) from None
        text = raw.decode("utf-8", errors="replace")
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def _check_may_start(self, job_id: str, caller: Caller) -> None:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is not None and job.uid != caller.uid:
            raise HTTPError(403, f"job id {job_id!r} belongs to user {job.user!r}; choose another job id")

    def _owned(self, job_id: str, caller: Caller, *, allow_unknown_to_root: bool = False) -> _LocalJob:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            if allow_unknown_to_root and caller.is_root:
                return _LocalJob(job_id, 0, "root", time.time())
            raise HTTPError(404, f"no job {job_id!r} was submitted through this agent")
        if job.uid != caller.uid and not caller.is_root:
            raise HTTPError(
                403, f"job {job_id!r} belongs to user {job.user!r}; only they or root may manage it"
            )
        return job

    def _record(self, job_id: str, caller: Caller, member: str, *, previous: str | None = None) -> None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.uid != caller.uid or job.state != "running":
                job = self._jobs[job_id] = _LocalJob(job_id, caller.uid, caller.user, time.time())
            if previous is not None:
                job.previous = previous
            if member not in job.members:
                job.members.append(member)
            job.finished.discard(member)
            self._forget_old()

    def _note_progress(self, job_id: str, member: str, path: str, body: dict[str, Any]) -> None:
        """Learn from a forwarded event poll whether the job still runs on that member."""
        if "/events" not in path or body.get("running") is not False:
            return
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or member not in job.members:
                return
            job.finished.add(member)
            if job.state == "running" and job.finished >= set(job.members):
                job.state = "finished"

    def _forget_old(self) -> None:
        if len(self._jobs) <= _MAX_LOCAL_JOBS:
            return
        done = sorted((j for j in self._jobs.values() if j.state != "running"), key=lambda j: j.started)
        for job in done[: len(self._jobs) - _MAX_LOCAL_JOBS]:
            del self._jobs[job.job_id]


def _for_submitter(path: str, job: _LocalJob, caller: Caller) -> str:
    """``path`` as signed for ``caller``: with ``submitter=`` naming the job's user, unless root
    asks (the member itself, which may manage every job it started). The caller may not name it."""
    if SUBMITTER_PARAMETER in parse_qs(urlsplit(path).query, keep_blank_values=True):
        raise HTTPError(400, f"{SUBMITTER_PARAMETER}= is set by the agent, never by the caller")
    if caller.is_root:
        return path
    return f"{path}{'&' if '?' in path else '?'}{SUBMITTER_PARAMETER}={quote(job.user, safe='')}"


def _read_body(request: Request, cap: int) -> bytes:
    """The whole (streamed) body, at most ``cap`` bytes (mesh.http.server already refused a larger declared one)."""
    parts, total = [], 0
    while chunk := request.read(CHUNK):
        total += len(chunk)
        if total > cap:
            raise HTTPError(413, f"a body of more than {cap} bytes is not accepted here")
        parts.append(chunk)
    return b"".join(parts)
