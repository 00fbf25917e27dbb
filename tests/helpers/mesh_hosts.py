"""A lab of hosts made of network namespaces, for the mesh's end-to-end tests.

Each host is a namespace ``sp<pid>-<label>`` with ``eth0`` on a shared bridge (itself in a
namespace of its own), an address in TEST-NET-1 (192.0.2.0/24), its own ``SHARDPOOL_HOME``, its
own agent socket (``SHARDPOOL_AGENT_SOCKET``) and its own WireGuard interface name. Nothing
touches the machine's own namespace, and :meth:`Lab.close` stops every process the lab started, by
pid, and deletes every namespace and the lab's directory under /tmp.

The hosts' homes live in a 0755 directory under /tmp rather than pytest's (0700) temporary tree:
an agent's stages run as the unprivileged run-as account, which must reach the agent's work
directory beside the home, and people on a host must reach its agent socket.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from mesh.constants import AGENT_PORT

REPO = Path(__file__).resolve().parents[2]
UNDERLAY = "192.0.2"


def netns_skip_reason() -> str | None:
    """Why the namespace tests cannot run here, or ``None`` if they can."""
    if sys.platform != "linux":
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root to create network namespaces and interfaces"
    for tool in ("ip", "wireguard-go", "wg", "ping"):
        if shutil.which(tool) is None:
            return f"needs {tool} (apt-get install iproute2 wireguard-go wireguard-tools iputils-ping)"
    if not Path("/dev/net/tun").exists():
        return "needs /dev/net/tun for wireguard-go"
    probe = f"sp{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class LabError(RuntimeError):
    """A lab command failed; the message has its exit code and output."""


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Host:
    """One machine of the lab."""

    label: str
    netns: str
    underlay: str
    home: Path
    interface: str
    agent_socket: Path

    @property
    def endpoint(self) -> str:
        """This host's WireGuard endpoint on the underlay."""
        return f"{self.underlay}:51820"


class Lab:
    """Namespaced hosts on one bridge; use as a context manager so cleanup always runs."""

    def __init__(self, workdir: Path) -> None:
        self.tag = f"sp{os.getpid()}"
        self.workdir = workdir
        self.shared = Path(tempfile.mkdtemp(prefix=f"{self.tag}-lab-", dir="/tmp"))
        os.chmod(self.shared, 0o755)
        self.switch = f"{self.tag}-sw"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self.last_ping = ""

    def __enter__(self) -> Lab:
        self._add_netns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def add_host(self, label: str, octet: int) -> Host:
        """Create host ``label`` with underlay address 192.0.2.``octet``."""
        netns = f"{self.tag}-{label}"
        self._add_netns(netns)
        port = f"v{label}"
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", netns, "addr", "add", f"{UNDERLAY}.{octet}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        socket_path = self.shared / f"{label}-run" / "agent.sock"
        host = Host(
            label, netns, f"{UNDERLAY}.{octet}", self.shared / label, f"{self.tag}{label}", socket_path
        )
        self.hosts[label] = host
        return host

    def run(
        self,
        host: Host,
        *argv: str,
        timeout: float = 60.0,
        stdin: str | None = None,
        user: str | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside ``host`` with its ``SHARDPOOL_HOME`` and agent socket, feeding it ``stdin``.

        ``user`` runs it as that local account instead of root (with its groups from /etc/group and
        ``HOME`` a private directory of its own); ``env`` adds variables.
        """
        return subprocess.run(
            self.command(host, *argv, user=user, env=env),
            capture_output=True,
            text=True,
            timeout=timeout,
            input=stdin,
        )

    def command(
        self, host: Host, *argv: str, user: str | None = None, env: dict[str, str] | None = None
    ) -> list[str]:
        """The argv that runs ``argv`` inside ``host`` as :meth:`run` does (for Popen)."""
        variables = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "SHARDPOOL_HOME": str(host.home),
            "SHARDPOOL_AGENT_SOCKET": str(host.agent_socket),
            "PYTHONPATH": str(REPO),
            "HOME": str(host.home),
        }
        drop: list[str] = []
        if user is not None:
            variables["HOME"] = str(self.user_home(user))
            drop = ["setpriv", f"--reuid={user}", f"--regid={pwd.getpwnam(user).pw_gid}", "--init-groups"]
        variables.update(env or {})
        return [
            "ip",
            "netns",
            "exec",
            host.netns,
            "env",
            "-i",
            *(f"{k}={v}" for k, v in variables.items()),
            *drop,
            *argv,
        ]

    def user_home(self, user: str) -> Path:
        """A private, writable home for ``user`` inside the lab (created on first use)."""
        entry = pwd.getpwnam(user)
        home = self.shared / f"home-{entry.pw_uid}"
        home.mkdir(mode=0o700, exist_ok=True)
        os.chown(home, entry.pw_uid, entry.pw_gid)
        return home

    def processes(self, host: Host, needle: str) -> dict[int, int]:
        """pid -> real uid of every process in ``host`` whose command line contains ``needle``."""
        found: dict[int, int] = {}
        for pid in self._namespace_pids(host.netns):
            try:
                cmdline = (
                    Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            if needle in cmdline:
                uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
                found[pid] = int(uid_line.split()[1])
        return found

    def mesh(
        self, host: Host, *argv: str, timeout: float = 60.0, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``shardpool mesh ARGV`` inside ``host`` through the real CLI."""
        return self.run(host, sys.executable, "-m", "shardpool", "mesh", *argv, timeout=timeout, stdin=stdin)

    def form_mesh(self, coordinator: str, members: str, *, uses: int) -> str:
        """``mesh init`` on ``coordinator``, then ``mesh join`` on each of ``members``, through the real CLI.

        Returns the join token. Hosts are named by their labels; waiting for handshakes and
        agents is left to the caller, which knows what it wants to measure.
        """
        first = self.hosts[coordinator]
        init = ["init", "--endpoint", first.endpoint, "--name", first.label, "--interface", first.interface]
        out = self._checked(self.mesh(first, *init, "--uses", str(uses)), f"mesh init on {coordinator}")
        token = out.strip().splitlines()[-1]
        for label in members:
            host = self.hosts[label]
            join = [
                "join",
                token,
                "--endpoint",
                host.endpoint,
                "--name",
                label,
                "--interface",
                host.interface,
            ]
            self._checked(self.mesh(host, *join), f"mesh join on {label}")
        return token

    def agent_healthy(self, source: Host, address: str, port: int = AGENT_PORT) -> bool:
        """Whether the shardpool agent at ``address`` answers ``/v1/health`` from ``source``.

        The agent answers an unsigned request with 401: that it answers at all is what counts here.
        :meth:`agent_serves` checks a signed request.
        """
        probe = (
            "import sys, urllib.error, urllib.request\n"
            "try:\n"
            f"    urllib.request.urlopen('http://{address}:{port}/v1/health', timeout=2)\n"
            "except urllib.error.HTTPError as error:\n"
            "    sys.exit(0 if error.code == 401 else 1)\n"
        )
        return self.run(source, sys.executable, "-c", probe, timeout=20).returncode == 0

    def agent_serves(self, source: Host, member: str) -> bool:
        """Whether ``member``'s agent answers a signed health request forwarded by ``source``'s agent."""
        probe = (
            "from shardpool.agent.local_client import LocalAgentClient\n"
            f"assert LocalAgentClient().member({member!r}, '').health()['name'] == {member!r}\n"
        )
        return self.run(source, sys.executable, "-c", probe, timeout=30).returncode == 0

    @staticmethod
    def _checked(result: subprocess.CompletedProcess[str], what: str) -> str:
        if result.returncode != 0:
            raise LabError(
                f"{what}: exit {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
            )
        return result.stdout

    def ping(self, source: Host, address: str, timeout: int = 2, count: int = 3) -> bool:
        """Ping ``address`` from ``source`` (``count`` echoes 0.2 s apart); true if any was answered.

        Several echoes, because WireGuard may drop the first packets while two peers that were
        just added to each other both start a handshake at once.
        """
        argv = ["ping", "-c", str(count), "-i", "0.2", "-W", str(timeout), address]
        result = self.run(source, *argv, timeout=timeout + count + 5)
        self.last_ping = f"{source.label} -> {address}: exit {result.returncode} {result.stdout.strip()[-160:]} {result.stderr.strip()}"
        return result.returncode == 0

    def close(self) -> None:
        """Stop every process in the lab's namespaces (by pid) and delete the namespaces."""
        for name in reversed(self._namespaces):
            self._kill_namespace_processes(name)
        for name in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        for host in self.hosts.values():
            Path(f"/var/run/wireguard/{host.interface}.sock").unlink(missing_ok=True)
        self._namespaces.clear()
        shutil.rmtree(self.shared, ignore_errors=True)

    @staticmethod
    def _namespace_pids(name: str) -> list[int]:
        listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        return [int(pid) for pid in listed.stdout.split() if pid.isdigit()]

    def _kill_namespace_processes(self, name: str) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self._namespace_pids(name)
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 3
            while pids and time.monotonic() < deadline:
                time.sleep(0.05)
                pids = self._namespace_pids(name)
            if not pids:
                return


class WireGuardGoInNetns:
    """A wireguard-go interface inside a private namespace, for UAPI tests; stops by pid."""

    def __init__(self, label: str) -> None:
        self.netns = f"sp{os.getpid()}-{label}"
        self.interface = f"sp{os.getpid()}{label}"[:15]
        self.socket = Path(f"/var/run/wireguard/{self.interface}.sock")
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> WireGuardGoInNetns:
        _ip("netns", "add", self.netns)
        try:
            env = dict(os.environ, WG_PROCESS_FOREGROUND="1", LOG_LEVEL="error")
            self.process = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, "wireguard-go", self.interface],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            deadline = time.monotonic() + 10
            while not self.socket.exists():
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"wireguard-go did not start: {self.process.stderr.read() if self.process.stderr else ''}"
                    )
                time.sleep(0.05)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)
        self.socket.unlink(missing_ok=True)

    def wg(self, *argv: str) -> str:
        """Run ``wg`` (which talks to the same UAPI socket) and return its output."""
        return subprocess.run(["wg", *argv], capture_output=True, text=True, check=True, timeout=10).stdout


class InProcessCoordinator:
    """A real coordinator service (SQLite store + HTTP server) on 127.0.0.1, for protocol tests.

    By default one server on :attr:`port` carries the join and the roster routes, so a member can
    use one port for everything. With ``split=True`` it runs the two production servers instead
    (as `mesh.node.syncd` does): joins and membership checks on :attr:`port` (:attr:`server`), rosters
    and leaves on :attr:`roster_port` (:attr:`roster_server`).
    """

    def __init__(
        self, directory: Path, cidr: str = "10.77.0.0/24", nonce_cap: int | None = None, split: bool = False
    ) -> None:
        from mesh.addresses import first_address, parse_cidr
        from mesh.control.coordinator import (
            JOIN_LIMITS,
            CoordinatorService,
            start_join_server,
            start_roster_server,
        )
        from mesh.control.model import RosterEntry
        from mesh.control.roster import RosterStore
        from mesh.wireguard.keys import generate_private_key, public_key

        self.private_key = generate_private_key()
        self.public_key = public_key(self.private_key)
        self.address = first_address(parse_cidr(cidr))
        self.store = RosterStore.create(
            directory / "coordinator.db",
            "testmesh",
            cidr,
            RosterEntry("coord", self.address, self.public_key, "127.0.0.1:9", True),
        )
        options = {} if nonce_cap is None else {"nonce_cap": nonce_cap}
        self.service = CoordinatorService(
            self.store, self.private_key, {"mtu": 1420, "keepalive": 25, "api_port": 9}, **options
        )
        if split:
            self.server = start_join_server(self.service, "127.0.0.1", 0)
            self.roster_server = start_roster_server(self.service, "127.0.0.1", 0)
        else:
            routes = self.service.join_routes() + self.service.roster_routes()
            self.server = self.service.server(routes, "127.0.0.1", 0, limits=JOIN_LIMITS).start()
            self.roster_server = self.server
        self.port = int(self.server.url.rsplit(":", 1)[1])
        self.roster_port = int(self.roster_server.url.rsplit(":", 1)[1])
        self.endpoint = f"127.0.0.1:{self.port}"

    def invite(self, ttl: int = 3600, uses: int = 1):  # noqa: ANN201 - returns mesh.control.token.JoinToken
        """Issue a token the way `mesh invite` does."""
        from mesh.control.token import new_token, secret_hash

        token = new_token(self.public_key, self.endpoint, ttl)
        self.store.add_token(token.token_id, secret_hash(token.secret), token.expires_at, uses)
        return token

    def signed_request(
        self, private_key: str, method: str, path: str, time_text: str | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        """Send one request signed by ``private_key`` the way members do, optionally with a hostile time text.

        The reply is returned as it came, unverified, so tests can look at refusals too.
        """
        from mesh.control.auth import (
            MAC_HEADER,
            NONCE_HEADER,
            ROSTER_PURPOSE,
            TIME_HEADER,
            pair_key,
            sign_request,
        )
        from mesh.control.auth import _request_mac as request_mac
        from mesh.control.client import http_request
        from mesh.wireguard.keys import public_key

        key = pair_key(private_key, self.public_key, "testmesh", ROSTER_PURPOSE)
        sender = public_key(private_key)
        headers = sign_request(
            key, sender_public=sender, receiver_public=self.public_key, method=method, path=path, body=b""
        )
        if time_text is not None:
            headers[TIME_HEADER] = time_text
            headers[MAC_HEADER] = request_mac(
                key, method, path, b"", time_text, headers[NONCE_HEADER], sender, self.public_key
            )
        port = self.roster_port if path.startswith(("/v1/roster", "/v1/leave")) else self.port
        return http_request("127.0.0.1", port, method, path, b"", headers)

    def close(self) -> None:
        """Stop the HTTP server(s) and join their threads."""
        self.server.stop()
        self.roster_server.stop()


class FakeDevice:
    """Keeps peers in a dict, like a WireGuard device would (for sync tests without a real interface)."""

    name = "fake"

    def __init__(self) -> None:
        self.peers: dict[str, object] = {}

    def show(self, ifname: str):  # noqa: ANN201 - returns mesh.wireguard.backend.DeviceStatus
        """Report the peers as a device would."""
        from mesh.wireguard.backend import DeviceStatus, PeerStatus

        return DeviceStatus(
            None,
            51820,
            tuple(
                PeerStatus(k, p.endpoint, p.allowed_ips, None, 0, 0, p.persistent_keepalive or 0)
                for k, p in self.peers.items()
            ),
        )

    def update_peers(self, ifname: str, peers: list) -> None:
        """Add, change or remove peers."""
        for peer in peers:
            if peer.remove:
                self.peers.pop(peer.public_key, None)
            else:
                self.peers[peer.public_key] = peer


def member_daemon(
    state_dir: Path,
    coordinator: InProcessCoordinator,
    monkeypatch,  # noqa: ANN001 - pytest's MonkeyPatch
    api_port: int | None = None,
    coordinator_endpoint: str | None = None,
):  # noqa: ANN201 - returns (mesh.node.syncd.SyncDaemon, FakeDevice)
    """Join ``coordinator`` as member "b" and return its sync daemon, driving a :class:`FakeDevice`.

    ``api_port`` is where it syncs over the "mesh" (127.0.0.1 here) and ``coordinator_endpoint``
    where it asks whether it is still a member; both default to the coordinator itself.
    """
    from mesh.control.client import request_join
    from mesh.node import syncd as syncd_module
    from mesh.node.config import MeshConfig, save_config
    from mesh.node.member import save_cached_roster
    from mesh.state import StatePaths
    from mesh.wireguard.keys import generate_private_key, public_key, write_private_key

    private = generate_private_key()
    result = request_join(coordinator.invite(), "b", public_key(private), None)
    paths = StatePaths(state_dir)
    paths.ensure()
    write_private_key(paths.private_key, private)
    save_config(
        paths,
        MeshConfig(
            role="member", mesh_id="testmesh", name="b", interface="fake0", backend="userspace", cidr=result.roster.cidr,
            address=result.member.address, public_key=public_key(private), endpoint=None, listen_port=51820, mtu=1420,
            keepalive=25, coordinator_key=coordinator.public_key,
            coordinator_endpoint=coordinator_endpoint or coordinator.endpoint,
            coordinator_address="127.0.0.1", api_port=api_port or coordinator.port,
        ),
    )  # fmt: skip
    save_cached_roster(paths, result.roster)
    device = FakeDevice()
    monkeypatch.setattr(syncd_module, "backend_for", lambda paths, config: device)
    return syncd_module.SyncDaemon(paths), device


def write_coordinator_state(coordinator: InProcessCoordinator) -> Path:
    """Write ``mesh.json`` beside the in-process coordinator's database and return that state dir.

    Then `mesh invite`, `mesh invite --list/--revoke` and `mesh remove` run through the real CLI
    against the live coordinator, and the tokens they print point at its HTTP endpoint.
    """
    from mesh.node.config import MeshConfig, save_config
    from mesh.state import StatePaths

    directory = coordinator.store.path.parent
    roster = coordinator.store.roster()
    config = MeshConfig(
        role="coordinator",
        mesh_id=roster.mesh_id,
        name="coord",
        interface="spnever0",
        backend="userspace",
        cidr=roster.cidr,
        address=coordinator.address,
        public_key=coordinator.public_key,
        endpoint=coordinator.endpoint,
        listen_port=coordinator.port,
        mtu=1420,
        keepalive=25,
        coordinator_key=coordinator.public_key,
        coordinator_endpoint=coordinator.endpoint,
        coordinator_address=coordinator.address,
        api_port=coordinator.port,
    )
    save_config(StatePaths(directory), config)
    return directory
