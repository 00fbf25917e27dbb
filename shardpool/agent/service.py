"""The shardpool agent: runs on every mesh member and starts stage processes for a remote launcher.

``shardpool agent`` (root, because it signs with the member's WireGuard key) serves two listeners on
:mod:`mesh.http.server`:

- the **mesh listener**, TCP on this member's mesh address (:data:`AGENT_PORT`), for other members'
  agents; every request and reply is signed (:mod:`shardpool.agent.mesh_routes`).
- the **local listener** (:mod:`shardpool.agent.local`), a Unix socket for people on this member:
  the kernel names the caller's uid, and only root or the launch group may use it.

A launcher asks an agent for this machine's devices (``POST /v1/devices``, measured in a child
process: :mod:`shardpool.agent.profiling`), starts stage processes (``POST /v1/jobs``), long-polls
their JSON events (``GET /v1/jobs/ID/events``), reads their logs and stops them (``DELETE
/v1/jobs/ID``, only the member that started the job): :mod:`shardpool.agent.job_table`. Stage
processes run as the unprivileged run-as account, never root, in a 0700 job directory it owns,
with an environment the agent sets itself (:mod:`shardpool.agent.processes`).

Stage processes die with the agent (``PR_SET_PDEATHSIG``), and the agent stops every job on
SIGTERM/SIGINT. The agent never imports torch, so it starts in well under a second and stays
small while idle. :class:`Agent` puts these pieces together; ``shardpool agent`` itself is
:mod:`shardpool.agent.command`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mesh.constants import AGENT_PORT
from mesh.control.directory import Member
from mesh.control.verifier import RequestVerifier
from mesh.http.server import HTTPError, HTTPServer, Limits
from shardpool.agent.accounts import DEFAULT_LAUNCH_GROUP, RunAs, make_directory, make_tree
from shardpool.agent.client import AgentRefused, AgentUnreachable, SignedAgentClient
from shardpool.agent.confine import landlock_abi
from shardpool.agent.job_table import JobTable
from shardpool.agent.jobs import Job
from shardpool.agent.local import LocalService
from shardpool.agent.members import MeshPeer, same_ip
from shardpool.agent.mesh_routes import MeshRoutes, RouteLimits
from shardpool.agent.processes import Spawner, StageSettings, check_reachable
from shardpool.agent.profiling import PROFILE_TIMEOUT_S, DeviceProfiler
from shardpool.errors import ShardpoolError

__all__ = ["AGENT_LIMITS", "LOCAL_LIMITS", "MAX_PROBE_ECHO_BYTES", "PROBE_DEADLINE_S", "Agent"]

log = logging.getLogger(__name__)

#: Long polls hold a handler thread for up to 30 s: room for many launchers at once. The costly
#: routes may hold only part of the pool (:class:`shardpool.agent.mesh_routes.RouteLimits`).
AGENT_LIMITS = Limits(handler_threads=64)
#: The local socket's pool: a user other than root holds at most :data:`shardpool.agent.local.PER_CALLER` of it.
LOCAL_LIMITS = Limits(handler_threads=64)
#: Largest echo a probe sends to each target (twice): the launcher sends 4 MiB.
MAX_PROBE_ECHO_BYTES = 16 * 2**20
#: How long one probe may measure, all targets together: under the launcher's 130 s wait for it.
PROBE_DEADLINE_S = 60.0


class Agent:
    """The agent's two listeners, its job table and its device profiler (``shardpool agent`` runs one).

    ``verifier`` holds this member's private key and answers who signed a request; ``peers`` lists
    the current members (name, mesh address, key, online), which the agent uses to check the
    addresses in a job, to aim probes and to forward requests. ``run_as`` is the account stage
    processes (and the device profiler) run as; ``group`` and ``socket_path`` configure the local
    listener (none when ``socket_path`` is None). ``worker_command`` replaces ``[python, -m,
    shardpool.elastic.rank]`` (tests run small scripts; it must be runnable by ``run_as``); the job
    file and the rank are appended to it. ``inference_command`` likewise replaces ``[python, -m,
    shardpool.infer.stage_process]``, which runs an inference job's stages. ``profile_command`` likewise replaces ``[python, -m,
    shardpool.plan.report]``, which must answer within ``profile_timeout_s``. ``interface`` is the
    mesh interface, given to gloo and NCCL. Other members' agents are called on ``peer_port``
    (default: the port this agent listens on). ``limits`` bound the mesh listener, and the share
    of its handler threads each costly route may hold; ``local_limits`` bound the local listener.
    """

    def __init__(
        self,
        host: str,
        port: int = AGENT_PORT,
        *,
        verifier: RequestVerifier,
        peers: Callable[[], list[MeshPeer]],
        work_dir: Path,
        interface: str | None,
        member_name: str,
        run_as: RunAs,
        group: str = DEFAULT_LAUNCH_GROUP,
        socket_path: str | os.PathLike[str] | None = None,
        worker_command: list[str] | None = None,
        inference_command: list[str] | None = None,
        profile_command: list[str] | None = None,
        profile_timeout_s: float = PROFILE_TIMEOUT_S,
        heartbeat_timeout_s: float = 20.0,
        max_events: int = 10_000,
        peer_port: int | None = None,
        check_peer_ip: bool = True,
        limits: Limits = AGENT_LIMITS,
        local_limits: Limits = LOCAL_LIMITS,
    ) -> None:
        self.host = host
        self.verifier = verifier
        self.peers = peers
        self.member_name = member_name
        self.run_as = run_as
        self.settings = StageSettings(
            run_as=run_as,
            worker_command=list(worker_command or [sys.executable, "-m", "shardpool.elastic.rank"]),
            inference_command=tuple(inference_command or [sys.executable, "-m", "shardpool.infer.stage_process"]),
            interface=interface,
            work_dir=Path(work_dir),
            landlock_abi=landlock_abi(),
        )
        if not self.settings.landlock_abi:
            log.warning(
                "this kernel has no Landlock: stages run as %r in 0700 job directories, but may write "
                "wherever that account can (see docs/security.md)",
                run_as.user,
            )
        self._peer_port = peer_port
        self._spawner = Spawner()
        self.job_table = JobTable(
            self.settings,
            self._spawner,
            is_member_address=self.is_member_address,
            heartbeat_timeout_s=heartbeat_timeout_s,
            max_events=max_events,
        )
        self.profiler = DeviceProfiler(
            self.settings,
            self._spawner,
            command=profile_command,
            timeout_s=profile_timeout_s,
            max_waiters=max(1, limits.handler_threads // 16),
        )
        mesh_routes = MeshRoutes(
            self,
            verifier,
            check_peer_ip=check_peer_ip,
            limits=RouteLimits.for_threads(limits.handler_threads),
        )
        self._server = HTTPServer(
            mesh_routes.routes(),
            host=host,
            port=port,
            limits=limits,
            authenticate=mesh_routes.authenticate,
            sign_reply=mesh_routes.sign_reply,
            client_errors=(ShardpoolError,),
            name="agent",
        )
        self.local = (
            LocalService(
                self, socket_path=Path(socket_path), group=group, run_as_uid=run_as.uid, limits=local_limits
            )
            if socket_path is not None
            else None
        )

    @property
    def url(self) -> str:
        """Base URL of the mesh listener, e.g. ``http://10.77.0.2:7710``."""
        return self._server.url

    @property
    def peer_port(self) -> int:
        """The port other members' agents listen on (this agent's own unless told otherwise)."""
        return self._peer_port or int(self.url.rsplit(":", 1)[1])

    @property
    def work_dir(self) -> Path:
        """Where job directories (``jobs/ID``), the shared cache and the profiler's directory live."""
        return self.settings.work_dir

    @property
    def public_key(self) -> str:
        """This member's WireGuard public key."""
        return self.verifier.public_key

    def start(self) -> Agent:
        """Prepare the work directory, start both listeners, the spawner and the watchdog; returns self."""
        if self._spawner.running:
            return self
        check_reachable(self.run_as, self.work_dir)
        make_tree(self.work_dir)
        make_directory(self.work_dir / "jobs", mode=0o755)
        self.run_as.make_private_dir(self.settings.cache_dir)
        self._spawner.start()
        self.job_table.open()
        try:
            self._server.start()
            if self.local is not None:
                self.local.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every job (SIGTERM, SIGKILL after 5 s), then the listeners and helper threads."""
        self.job_table.close()
        if self.local is not None:
            self.local.stop()
        self._server.stop()
        self._spawner.close()
        self.job_table.close_finished_logs()

    def __enter__(self) -> Agent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ members

    def current_peers(self) -> list[MeshPeer]:
        """The current members, or none when the roster cannot be read (fails closed)."""
        try:
            return list(self.peers())
        except Exception as error:  # noqa: BLE001 - an unreadable roster must refuse, not crash
            log.warning("cannot list the mesh members, refusing every address until I can: %s", error)
            return []

    def is_member_address(self, address: str) -> bool:
        """Whether ``address`` is a current member's mesh address."""
        return any(same_ip(address, peer.address) for peer in self.current_peers())

    def signed_client(self, peer: MeshPeer, *, timeout: float = 10.0) -> SignedAgentClient:
        """A client of ``peer``'s agent whose requests this agent signs with its own key."""
        shown = f"[{peer.address}]" if ":" in peer.address else peer.address
        return SignedAgentClient(
            f"http://{shown}:{self.peer_port}",
            timeout=timeout,
            private_key=self.verifier.private_key,
            peer_public_key=peer.public_key,
            mesh_id=self.verifier.mesh_id,
        )

    # ------------------------------------------------------------------ what the mesh routes serve

    def start_job(self, body: dict[str, Any], origin: Member) -> dict[str, Any]:
        """Start a job's ranks here (``POST /v1/jobs``); see :meth:`JobTable.start`."""
        return self.job_table.start(body, origin)

    def poll(
        self, job_id: str, after: int, wait: float, requester: Member, on_behalf: str | None
    ) -> dict[str, Any]:
        """A job's events after ``after``, waiting up to ``wait`` s; also the launcher's heartbeat.
        Only for the member that started it, on behalf of its submitter (see :meth:`JobTable.owned`)."""
        return self.job_table.poll(job_id, after, wait, requester, on_behalf)

    def delete_job(self, job_id: str, requester: Member, on_behalf: str | None) -> dict[str, Any]:
        """Stop a job (only the member that started it may, for its submitter) and return its exit codes."""
        return self.job_table.delete(job_id, requester, on_behalf)

    def log_tail(self, job_id: str, rank: int, lines: int, requester: Member, on_behalf: str | None) -> str:
        """The last ``lines`` lines of a rank's log (only for the job's origin member and submitter)."""
        return self.job_table.log_tail(job_id, rank, lines, requester, on_behalf)

    def job(self, job_id: str) -> Job:
        """The job called ``job_id``, or a 404."""
        return self.job_table.job(job_id)

    def jobs(self) -> list[Job]:
        """Every job the agent remembers (running, and the most recent finished ones)."""
        return self.job_table.jobs()

    def devices(self, body: dict[str, Any]) -> dict[str, Any]:
        """This machine's devices with one profiled layer each (``POST /v1/devices``, cached)."""
        return self.profiler.devices(body)

    def probe(self, body: dict[str, Any]) -> dict[str, Any]:
        """Measure latency and bandwidth from this member to other members' agents, signing each call.

        Targets must be current mesh members other than this one, each named once (their key is
        what the request is signed for), so a probe can never be aimed outside the mesh nor made
        to measure a link twice. Each target gets three health calls and two echoes of ``bytes``
        (at most :data:`MAX_PROBE_ECHO_BYTES`); all of them end within :data:`PROBE_DEADLINE_S`,
        whether or not the caller still waits, and a target not reached by then gets an error.
        """
        targets, nbytes = self._probe_targets(body)
        deadline = time.monotonic() + PROBE_DEADLINE_S
        links: dict[str, Any] = {}
        for name, peer in targets:
            left = deadline - time.monotonic()
            if left <= 0:
                links[name] = {"error": f"not measured: the probe's {PROBE_DEADLINE_S:.0f} s were up"}
                continue
            try:
                links[name] = self.signed_client(peer).measure_link(nbytes=nbytes, budget_s=left)
            except (AgentUnreachable, AgentRefused) as error:
                links[name] = {"error": str(error)}
        return {"links": links}

    def _probe_targets(self, body: dict[str, Any]) -> tuple[list[tuple[str, MeshPeer]], int]:
        """The (name, member) pairs a probe body names and its echo size; a one-line 400/403 when
        a target is not a current member, is this member, or is named twice."""
        targets = body.get("targets")
        nbytes = body.get("bytes", 4 * 2**20)
        if not isinstance(targets, list) or not all(
            isinstance(t, dict) and {"name", "url"} <= t.keys() for t in targets
        ):
            raise HTTPError(400, "targets must be a list of {name, url}")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 1 <= nbytes <= MAX_PROBE_ECHO_BYTES:
            raise HTTPError(400, f"bytes must be an integer from 1 to {MAX_PROBE_ECHO_BYTES}")
        peers = self.current_peers()
        chosen: list[tuple[str, MeshPeer]] = []
        for target in targets:
            try:
                host = urlsplit(str(target["url"])).hostname or ""
            except ValueError:
                host = ""
            peer = next((p for p in peers if same_ip(host, p.address)), None)
            if peer is None:
                raise HTTPError(403, f"probe target {host[:64]!r} is not a mesh member")
            if same_ip(host, self.host) or peer.public_key == self.public_key:
                raise HTTPError(
                    400, f"probe target {host[:64]!r} is this member; a probe measures links to others"
                )
            if any(peer.public_key == seen.public_key for _, seen in chosen):
                raise HTTPError(400, f"probe target {host[:64]!r} is named twice; name each member once")
            chosen.append((str(target["name"])[:64], peer))
        return chosen, nbytes
