"""The launcher's client of its own member's agent, over the agent's Unix socket.

A launcher never talks to other members' agents itself: it cannot sign (only root reads the
WireGuard key), so it asks its own agent, over a Unix socket (:func:`agent_socket_path`), to
forward signed requests. :class:`LocalAgentClient` is that socket's API; :class:`ForwardedAgent`
keeps :class:`~shardpool.agent.client.AgentClient`'s method names for one member reached that way.
"""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from mesh.constants import AGENT_PORT, AGENT_SOCKET_ENV, DEFAULT_AGENT_SOCKET, ROOT_STATE_DIR
from mesh.http.client import HTTPClient, ReplyTooLarge, Unreachable, error_line
from shardpool.agent.accounts import DEFAULT_LAUNCH_GROUP
from shardpool.agent.client import AgentRefused, AgentUnreachable

__all__ = [
    "ForwardedAgent",
    "LaunchNotAllowed",
    "LocalAgentClient",
    "LocalMember",
    "NoLocalAgent",
    "agent_socket_of_state_dir",
    "agent_socket_path",
    "state_dir_socket",
]


_MAX_LOCAL_REPLY = 64 * 1024 * 1024


def agent_socket_path(explicit: str | None = None, *, state_dir: str | os.PathLike[str] | None = None) -> str:
    """The local agent's socket: ``explicit``, else ``$SHARDPOOL_AGENT_SOCKET``, else the default
    for ``state_dir`` (:func:`state_dir_socket`; the system agent's when none is named).

    One rule for both ends, so a launcher finds the socket its agent listens on.
    """
    chosen = explicit or os.environ.get(AGENT_SOCKET_ENV)
    if chosen:
        return chosen
    return DEFAULT_AGENT_SOCKET if state_dir is None else state_dir_socket(state_dir)


def state_dir_socket(state_dir: str | os.PathLike[str]) -> str:
    """The agent socket of the mesh in ``state_dir``, unless ``--socket`` or the environment names one.

    ``/run/shardpool/agent.sock`` for ``/var/lib/shardpool``; ``/run/shardpool/agent-HASH.sock`` for
    any other directory, HASH naming its absolute path, so several meshes on one machine each have
    their own agent.
    """
    root = os.path.abspath(state_dir)
    if root == os.path.abspath(ROOT_STATE_DIR):
        return DEFAULT_AGENT_SOCKET
    tag = hashlib.sha256(root.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return str(Path(DEFAULT_AGENT_SOCKET).with_name(f"agent-{tag}.sock"))


def agent_socket_of_state_dir(state_dir: str | os.PathLike[str]) -> str:
    """The socket of the agent serving the mesh whose state is in ``state_dir`` (``--state-dir``).

    ``mesh init/join/up --state-dir DIR`` start that agent, which writes its socket into its ready
    file under DIR while it runs; refused in one line when no agent runs there. A caller who may
    not read DIR (it is root's) gets the socket :func:`state_dir_socket` derives from DIR, where
    an agent started by ``mesh init/join/up`` listens.
    """
    from mesh.cli.agent_process import shardpool_agent_files
    from mesh.state import StatePaths

    paths = StatePaths(Path(state_dir))
    ready_file = shardpool_agent_files(paths)[2]
    if not paths.config.exists() and os.access(paths.root, os.R_OK | os.X_OK):
        raise NoLocalAgent(
            f"{paths.root} holds no mesh; pass the --state-dir given to `shardpool mesh init` or `join`"
        )
    try:
        ready = json.loads(ready_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NoLocalAgent(
            f"no shardpool agent runs for the mesh in {paths.root}; start it with "
            f"`shardpool mesh up --state-dir {paths.root}`"
        ) from None
    except PermissionError:
        return state_dir_socket(paths.root)
    except (OSError, ValueError) as error:
        raise NoLocalAgent(
            f"cannot read {ready_file} ({error}); restart the agent with `shardpool mesh up`"
        ) from None
    socket_path = ready.get("socket") if isinstance(ready, dict) else None
    if not isinstance(socket_path, str) or not socket_path:
        raise NoLocalAgent(
            f"the agent for {paths.root} does not say where its socket is (started by an older shardpool); "
            f"restart it with `shardpool mesh down --state-dir {paths.root}` and `mesh up`"
        )
    return socket_path


class NoLocalAgent(AgentUnreachable):
    """Nothing listens on the local agent's socket."""


class LaunchNotAllowed(AgentRefused):
    """The local agent (or the socket's permissions) refused this user."""


def _user_name() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def _socket_group(socket_path: str) -> str:
    """The group that owns the socket (the launch group), or the default when it cannot be read."""
    try:
        return grp.getgrgid(os.stat(socket_path).st_gid).gr_name
    except (OSError, KeyError):
        return DEFAULT_LAUNCH_GROUP


@dataclass(frozen=True)
class LocalMember:
    """A mesh member as the local agent reports it."""

    name: str
    address: str
    online: bool
    is_self: bool


@dataclass(frozen=True)
class LocalAgentClient:
    """The launcher's client of its own member's agent, over the agent's Unix socket.

    The kernel tells the agent who is calling (SO_PEERCRED); the agent allows root and the launch
    group only. Everything aimed at other members goes through :meth:`forward`.
    """

    socket_path: str = field(default_factory=agent_socket_path)
    timeout: float = 10.0

    def members(self) -> list[LocalMember]:
        """Every mesh member, whether it answers now, and which one is this machine."""
        reply = self._call("GET", "/v1/local/members")
        return [
            LocalMember(str(item["name"]), str(item["address"]), bool(item["online"]), bool(item["is_self"]))
            for item in reply.get("members", [])
        ]

    def forward(
        self,
        member: str,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float | None = None,
        previous: str | None = None,
    ) -> Any:
        """Have the local agent send a signed request to ``member``'s agent; return the reply body.

        An error status from that agent raises :class:`AgentRefused` naming the member; a member
        the local agent could not reach raises :class:`AgentUnreachable`. ``previous`` (a job
        start only) is the job this one continues, kept in the local agent's record of the job.
        """
        request: dict[str, Any] = {"member": member, "method": method, "path": path, "body": body}
        if previous is not None:
            request["previous"] = previous
        reply = self._call("POST", "/v1/local/forward", request, timeout=timeout)
        status = int(reply.get("status", 0))
        answer = reply.get("body")
        route = f"{method} {path.split('?')[0]}"
        if status in (503, 504):
            raise AgentUnreachable(f"agent of member {member!r} did not answer {route}: {error_line(answer)}")
        if status >= 400 or status == 0:
            raise AgentRefused(f"agent of member {member!r} refused {route}: {status} {error_line(answer)}")
        return answer

    def jobs(self) -> list[dict[str, Any]]:
        """Jobs started through this agent: the caller's own, or everyone's for root."""
        return list(self._call("GET", "/v1/local/jobs").get("jobs", []))

    def job(self, job_id: str) -> dict[str, Any]:
        """One job started through this agent (the caller's own, or any for root)."""
        return dict(self._call("GET", f"/v1/local/jobs/{quote(job_id, safe='')}"))

    def stop(self, job_id: str) -> dict[str, Any]:
        """Stop a job on every member it runs on (the caller's own, or any for root)."""
        return dict(self._call("DELETE", f"/v1/local/jobs/{quote(job_id, safe='')}", timeout=60.0))

    def member(self, name: str, address: str) -> ForwardedAgent:
        """A client of ``name``'s agent with the old :class:`AgentClient` methods, through this one."""
        return ForwardedAgent(self, name, address)

    def _call(self, method: str, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        payload = b"" if body is None else json.dumps(body).encode("utf-8")
        headers = {"Content-Type": "application/json"} if body is not None else {}
        try:
            with HTTPClient(
                unix_socket=self.socket_path,
                timeout=timeout or self.timeout,
                max_reply_bytes=_MAX_LOCAL_REPLY,
            ) as client:
                # The agent refuses a caller before reading its body; the client still reads that answer.
                reply = client.request(method, path, body=payload, headers=headers)
        except Unreachable as error:
            raise self._unreachable(error, f"{method} {path.split('?')[0]}") from None
        except ReplyTooLarge:
            raise AgentRefused(
                f"the local shardpool agent's reply exceeds {_MAX_LOCAL_REPLY} bytes"
            ) from None
        status, data = reply.status, reply.body
        text = data.decode("utf-8", errors="replace")
        try:
            decoded = json.loads(text) if text else {}
        except json.JSONDecodeError:
            decoded = text
        if status == 403 and "usermod" in error_line(decoded):
            raise LaunchNotAllowed(error_line(decoded))
        if status in (503, 504):
            # The local agent could not reach the member it was to forward to.
            raise AgentUnreachable(error_line(decoded))
        if status >= 400:
            raise AgentRefused(
                f"the local shardpool agent refused {method} {path.split('?')[0]}: {status} {error_line(decoded)}"
            )
        return decoded

    def _unreachable(self, error: Unreachable, route: str) -> AgentUnreachable | LaunchNotAllowed:
        """The one-line error for a local agent that gave no reply: absent, closed to this user, or silent."""
        if isinstance(error.os_error, (FileNotFoundError, ConnectionRefusedError)):
            return NoLocalAgent(
                f"no shardpool agent on this machine (nothing listens at {self.socket_path}); "
                "start it with `shardpool mesh up` or `shardpool agent`"
            )
        if isinstance(error.os_error, PermissionError):
            return self._not_allowed("the socket's permissions refused you")
        return AgentUnreachable(
            f"the local shardpool agent at {self.socket_path} did not answer {route}: {error.reason}"
        )

    def _not_allowed(self, reason: str) -> LaunchNotAllowed:
        user, group = _user_name(), _socket_group(self.socket_path)
        return LaunchNotAllowed(
            f"user {user!r} may not use the shardpool agent at {self.socket_path} ({reason}); "
            f"ask an admin to run `usermod -aG {group} {user}` (then log in again)"
        )


@dataclass(frozen=True)
class ForwardedAgent:
    """One member's agent reached through the local agent, with :class:`AgentClient`'s method names."""

    local: LocalAgentClient
    name: str
    address: str
    port: int = AGENT_PORT

    @property
    def url(self) -> str:
        """The member's agent URL on the mesh (what other agents probe)."""
        return f"http://{self.address}:{self.port}"

    def health(self) -> dict[str, Any]:
        """The agent's name, address and version."""
        return dict(self.local.forward(self.name, "GET", "/v1/health"))

    def devices(
        self, model_config: dict[str, Any], workload: dict[str, Any], *, timeout: float = 300.0
    ) -> list[dict[str, Any]]:
        """The member's devices, each profiled for this model shape and workload (cached there)."""
        body = {"model_config": model_config, "workload": workload}
        return list(self.local.forward(self.name, "POST", "/v1/devices", body, timeout=timeout)["devices"])

    def probe(self, targets: dict[str, str], *, nbytes: int = 4 * 2**20) -> dict[str, dict[str, Any]]:
        """Ask the member's agent to measure its links to other members' agents (name -> url)."""
        body = {"targets": [{"name": name, "url": url} for name, url in targets.items()], "bytes": nbytes}
        return dict(self.local.forward(self.name, "POST", "/v1/probe", body, timeout=130.0)["links"])

    def start_job(
        self,
        job_id: str,
        job: dict[str, Any],
        ranks: list[int],
        *,
        files_secret: str | None = None,
        previous: str | None = None,
    ) -> dict[str, Any]:
        """Start the given ranks of a job on the member; the local agent stamps who submitted it.

        ``previous`` is the job this one continues (a run re-planned after a lost or joined member):
        ``shardpool jobs show`` prints it.
        """
        body: dict[str, Any] = {"job_id": job_id, "job": job, "ranks": ranks}
        if files_secret is not None:
            body["files_secret"] = files_secret
        return dict(self.local.forward(self.name, "POST", "/v1/jobs", body, timeout=70.0, previous=previous))

    def events(self, job_id: str, *, after: int, wait: float = 1.0) -> dict[str, Any]:
        """Events after sequence number ``after`` (long-polls up to ``wait`` s); also the heartbeat."""
        path = f"/v1/jobs/{job_id}/events?after={after}&wait={wait}"
        return dict(self.local.forward(self.name, "GET", path, timeout=wait + 10.0))

    def stop_job(self, job_id: str, *, timeout: float = 15.0) -> dict[str, Any]:
        """Stop every process of the job on the member."""
        return dict(self.local.forward(self.name, "DELETE", f"/v1/jobs/{job_id}", timeout=timeout + 5.0))

    def log_tail(self, job_id: str, rank: int, lines: int = 20) -> str:
        """The last lines of one rank's log on the member."""
        return str(self.local.forward(self.name, "GET", f"/v1/jobs/{job_id}/log/{rank}?tail={lines}"))
