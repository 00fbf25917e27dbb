"""A way to try a mesh of several hosts on one machine, used by the tests and the benchmarks.

Each host is a network namespace ``sp<pid>-<label>`` with ``eth0`` on a shared bridge (itself in
a namespace of its own), an address in TEST-NET-1 (192.0.2.0/24), its own ``SHARDPOOL_HOME``, its
own agent socket (``SHARDPOOL_AGENT_SOCKET``) and its own WireGuard interface name. Nothing
touches the machine's own namespace, and :meth:`Lab.close` stops every process the lab started,
by pid, and deletes every namespace and the lab's directory under /tmp. :class:`WireGuardGoInNetns`
is one wireguard-go interface in a namespace of its own, for tests of the UAPI.

The hosts' homes live in a 0755 directory under /tmp rather than a private temporary tree: an
agent's stages run as the unprivileged run-as account, which must reach the agent's work
directory beside the home, and people on a host must reach its agent socket. Commands in a host
run this source tree (:data:`SOURCE_ROOT` on ``PYTHONPATH``). It needs root, ``ip``,
``wireguard-go``, ``wg``, ``ping`` and ``/dev/net/tun`` (:func:`netns_skip_reason` says what is missing).
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

__all__ = ["SOURCE_ROOT", "UNDERLAY", "Host", "Lab", "LabError", "WireGuardGoInNetns", "netns_skip_reason"]

SOURCE_ROOT = Path(__file__).resolve().parents[1]
"""The directory holding the ``mesh`` package (and ``shardpool`` beside it in a checkout)."""
UNDERLAY = "192.0.2"
"""The first three octets of every host's underlay address (TEST-NET-1)."""


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
            "PYTHONPATH": str(SOURCE_ROOT),
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
        ``tests.helpers.mesh_hosts.agent_serves`` checks a signed request.
        """
        probe = (
            "import sys, urllib.error, urllib.request\n"
            "try:\n"
            f"    urllib.request.urlopen('http://{address}:{port}/v1/health', timeout=2)\n"
            "except urllib.error.HTTPError as error:\n"
            "    sys.exit(0 if error.code == 401 else 1)\n"
        )
        return self.run(source, sys.executable, "-c", probe, timeout=20).returncode == 0

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
