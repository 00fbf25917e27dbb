"""The mesh client of ``shardpool agent``: JSON over HTTP to one member's agent.

Every call has a timeout and raises :class:`AgentUnreachable` when the member does not answer,
so the launcher can tell a lost member from a failed stage. An agent's mesh listener answers only
requests signed with a member's key (:mod:`mesh.control.auth`), so the agents call each other with
:class:`SignedAgentClient`; :class:`AgentClient` is the same API over plain HTTP.

A launcher cannot sign: it talks to its own member's agent over a Unix socket instead
(:mod:`shardpool.agent.local_client`).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from mesh.constants import AGENT_PORT
from mesh.control.auth import CONTROL_PURPOSE, AuthError
from mesh.control.client import authenticated_request, http_request
from mesh.http.client import Unreachable, error_line
from shardpool.errors import ShardpoolError

__all__ = ["AgentClient", "AgentRefused", "AgentUnreachable", "SignedAgentClient"]


class AgentUnreachable(ShardpoolError):
    """The agent did not answer (the member is down, cut off, or its agent is not running)."""


class AgentRefused(ShardpoolError):
    """The agent answered with an error status."""


@dataclass(frozen=True)
class AgentClient:
    """A connection-per-call client of one agent, e.g. ``AgentClient("http://10.77.0.2:7710")``."""

    url: str
    timeout: float = 10.0

    def health(self) -> dict[str, Any]:
        """The agent's name, address and version."""
        return self._call("GET", "/v1/health")

    def devices(
        self, model_config: dict[str, Any], workload: dict[str, Any], *, timeout: float = 300.0
    ) -> list[dict[str, Any]]:
        """The member's devices, each profiled for this model shape and workload (cached there)."""
        reply = self._call(
            "POST", "/v1/devices", {"model_config": model_config, "workload": workload}, timeout=timeout
        )
        return list(reply["devices"])

    def echo(self, nbytes: int, *, timeout: float = 60.0) -> float:
        """Send ``nbytes`` to the agent and return the seconds until it confirmed them all."""
        payload = bytes(nbytes)
        started = time.perf_counter()
        reply = self._call("POST", "/v1/echo", raw_body=payload, timeout=timeout)
        elapsed = time.perf_counter() - started
        if int(reply.get("bytes", -1)) != nbytes:
            raise AgentRefused(f"agent at {self.url} confirmed {reply.get('bytes')} of {nbytes} echo bytes")
        return elapsed

    def measure_link(
        self, *, nbytes: int = 4 * 2**20, pings: int = 3, budget_s: float = 150.0
    ) -> dict[str, float]:
        """One-way latency (half the median health round trip) and bandwidth (timed echo) to the agent.

        Every call ends within ``budget_s`` of the first (:class:`AgentUnreachable` once it is spent).
        """
        deadline = time.monotonic() + budget_s
        round_trips = []
        for _ in range(pings):
            started = time.perf_counter()
            self._call("GET", "/v1/health", timeout=self._time_left(deadline, self.timeout))
            round_trips.append(time.perf_counter() - started)
        latency = statistics.median(round_trips) / 2
        transfer = min(self.echo(nbytes, timeout=self._time_left(deadline, 60.0)) for _ in range(2))
        return {"bandwidth": nbytes / max(transfer - 2 * latency, 1e-6), "latency": latency}

    def _time_left(self, deadline: float, most: float) -> float:
        """Seconds the next call may take: at most ``most``, and never past ``deadline``."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise AgentUnreachable(f"agent at {self.url}: the link measurement ran out of time")
        return min(most, left)

    def probe(self, targets: dict[str, str], *, nbytes: int = 4 * 2**20) -> dict[str, dict[str, Any]]:
        """Ask the agent to measure its links to other members' agents (name -> url)."""
        body = {"targets": [{"name": name, "url": url} for name, url in targets.items()], "bytes": nbytes}
        return dict(self._call("POST", "/v1/probe", body, timeout=120.0)["links"])

    def start_job(
        self,
        job_id: str,
        job: dict[str, Any],
        ranks: list[int],
        *,
        files_secret: str | None = None,
        previous: str | None = None,
    ) -> dict[str, Any]:
        """Start the given ranks of a job on the member (the agent sets their environment itself).

        ``files_secret`` is the launcher's file-server secret, handed to the stages in a 0600 file.
        ``previous`` (the job this one continues) is kept only by a launching member's local agent
        (:meth:`LocalAgentClient.forward <shardpool.agent.local_client.LocalAgentClient.forward>`);
        a direct call has no record to keep it in.
        """
        del previous
        body: dict[str, Any] = {"job_id": job_id, "job": job, "ranks": ranks}
        if files_secret is not None:
            body["files_secret"] = files_secret
        return self._call("POST", "/v1/jobs", body, timeout=60.0)

    def events(self, job_id: str, *, after: int, wait: float = 1.0) -> dict[str, Any]:
        """Events after sequence number ``after`` (long-polls up to ``wait`` s); also the heartbeat."""
        return self._call("GET", f"/v1/jobs/{job_id}/events?after={after}&wait={wait}", timeout=wait + 4.0)

    def stop_job(self, job_id: str, *, timeout: float = 15.0) -> dict[str, Any]:
        """Stop every process of the job on the member."""
        return self._call("DELETE", f"/v1/jobs/{job_id}", timeout=timeout)

    def log_tail(self, job_id: str, rank: int, lines: int = 20) -> str:
        """The last lines of one rank's log on the member."""
        return str(self._call("GET", f"/v1/jobs/{job_id}/log/{rank}?tail={lines}", raw=True))

    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float | None = None,
        raw: bool = False,
        raw_body: bytes | None = None,
    ) -> Any:
        if raw_body is not None:
            payload, content_type = raw_body, "application/octet-stream"
        else:
            payload = b"" if body is None else json.dumps(body).encode("utf-8")
            content_type = "application/json"
        try:
            status, data = self.exchange(method, path, payload, content_type, timeout or self.timeout)
        except Unreachable as error:
            raise AgentUnreachable(
                f"agent at {self.url} did not answer {method} {path.split('?')[0]}: {error.reason}"
            ) from None
        if status >= 400:
            raise AgentRefused(
                f"agent at {self.url} refused {method} {path.split('?')[0]}: {status} {error_line(data)}"
            )
        text = data.decode("utf-8", errors="replace")
        if raw:
            return text
        return json.loads(text) if text else {}

    def exchange(
        self, method: str, path: str, payload: bytes, content_type: str, timeout: float
    ) -> tuple[int, bytes]:
        """Send one request and return the reply's status and body (plain HTTP; signed in the subclass).

        Raises :class:`mesh.http.client.Unreachable` when the agent gives no whole reply.
        """
        host, port = self._endpoint()
        headers = {"Content-Type": content_type} if payload else {}
        status, _, data = http_request(host, port, method, path, payload, headers, timeout)
        return status, data

    def _endpoint(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "", parts.port or AGENT_PORT


@dataclass(frozen=True, kw_only=True)
class SignedAgentClient(AgentClient):
    """An :class:`AgentClient` whose requests are signed with this member's WireGuard key.

    Only root on a member can read ``private_key``, so only the agent (and root tools) use this.
    ``peer_public_key`` is the called member's key: the request is signed for it alone, and a
    reply without its valid signature (status included) raises :class:`AgentRefused`.
    """

    private_key: str
    peer_public_key: str
    mesh_id: str

    def exchange(
        self, method: str, path: str, payload: bytes, content_type: str, timeout: float
    ) -> tuple[int, bytes]:
        """Send one signed request; raises :class:`AgentRefused` when the reply's signature fails."""
        host, port = self._endpoint()
        try:
            return authenticated_request(
                host,
                port,
                method,
                path,
                payload,
                private_key=self.private_key,
                peer_public_key=self.peer_public_key,
                mesh_id=self.mesh_id,
                purpose=CONTROL_PURPOSE,
                timeout=timeout,
            )
        except AuthError as error:
            raise AgentRefused(f"agent at {self.url}: {error}") from None
