"""A stand-in for the local agent's Unix-socket API (AGENT_API.md section B) on a real mesh.http.server server.

It answers from canned data and records what it was asked, so the launcher's client can be tested
over a real Unix socket without WireGuard keys or stage processes.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mesh.http.server import HTTPError, HTTPServer, Request, Route, error_reply, json_reply

__all__ = ["StubLocalAgent", "shared_socket_dir"]


def shared_socket_dir() -> Path:
    """A fresh 0755 directory under /tmp, so another uid can reach a socket in it (pytest's is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="sp-sock-", dir="/tmp"))
    os.chmod(path, 0o755)
    return path


@dataclass
class StubLocalAgent:
    """Serves members, forward, and local jobs from ``members``, ``forward_replies`` and ``jobs``.

    ``refuse`` answers every request 403 with that text; a forward to a member in ``unreachable``
    is answered 504, as the agent does when the member's agent does not answer.
    """

    socket_path: Path
    members: list[dict[str, Any]] = field(default_factory=list)
    forward_replies: dict[str, tuple[int, Any]] = field(default_factory=dict)
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    refuse: str | None = None
    unreachable: set[str] = field(default_factory=set)
    unix_mode: int = 0o660
    unix_group: str | None = None
    forwarded: list[dict[str, Any]] = field(default_factory=list)
    server: HTTPServer | None = None

    def __enter__(self) -> StubLocalAgent:
        routes = [
            Route("GET", "/v1/local/members", self._members),
            # streamed, as the agent does, so a refused caller's body is never read
            Route("POST", "/v1/local/forward", self._forward, max_body=64 * 2**20, stream_body=True),
            Route("GET", "/v1/local/jobs", self._jobs),
            Route("GET", "/v1/local/jobs/{job_id}", self._job),
            Route("DELETE", "/v1/local/jobs/{job_id}", self._stop),
        ]
        self.server = HTTPServer(
            routes,
            unix_path=self.socket_path,
            unix_mode=self.unix_mode,
            unix_group=self.unix_group,
            authenticate=self._authenticate,
            name="stub-agent",
        ).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.stop()

    def _authenticate(self, request: Request) -> None:
        if self.refuse is not None:
            raise HTTPError(403, self.refuse)

    def _members(self, request: Request) -> Any:
        return json_reply(
            {"self": next((m["name"] for m in self.members if m["is_self"]), None), "members": self.members}
        )

    def _forward(self, request: Request) -> Any:
        body = b"".join(iter(request.read, b""))
        asked = json.loads(body)
        self.forwarded.append(asked)
        if asked["member"] in self.unreachable:
            return error_reply(504, f"member {asked['member']}'s agent did not answer {asked['method']}")
        status, body = self.forward_replies.get(
            asked["path"].split("?")[0], (404, {"error": "no such route"})
        )
        return json_reply({"status": status, "body": body})

    def _jobs(self, request: Request) -> Any:
        return json_reply({"jobs": list(self.jobs.values())})

    def _job(self, request: Request) -> Any:
        job = self.jobs.get(request.params["job_id"])
        return json_reply(job) if job else error_reply(404, f"no job {request.params['job_id']!r}")

    def _stop(self, request: Request) -> Any:
        job = self.jobs.get(request.params["job_id"])
        if job is None:
            return error_reply(404, f"no job {request.params['job_id']!r}")
        job["state"] = "stopped"
        return json_reply({"id": job["id"], "members": job["members"], "state": "stopped"})
