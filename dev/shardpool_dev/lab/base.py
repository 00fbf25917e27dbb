"""A way to try a mesh of several hosts on one machine, used by the tests and the benchmarks.

Each host is a network namespace ``sp<pid>-<label>`` with ``eth0`` on a shared bridge (itself in
a namespace of its own), an address in TEST-NET-1 (192.0.2.0/24), its own ``SHARDPOOL_HOME``, its
own agent socket (``SHARDPOOL_AGENT_SOCKET``) and its own WireGuard interface name. Nothing
touches the machine's own namespace, and :meth:`Lab.close` stops every process the lab started,
by pid, and deletes every namespace and the lab's directory under /tmp. The meshes it forms
take their addresses from :data:`~shardpool_dev.lab.hosts.MESH_CIDR` (198.51.100.0/28), which no
host network of the lab overlaps.

The lab can instead be a *NAT grid* (:meth:`Lab.add_internet`, :meth:`Lab.add_router`): a public
segment 203.0.113.0/24 and routers that masquerade LANs behind it, full cone or symmetric
(:mod:`shardpool_dev.lab.nat` has the addressing and the rules). That needs ``iptables`` too
(:func:`~shardpool_dev.lab.requirements.nat_skip_reason`), and ``conntrack`` for
:meth:`Lab.set_nat` to forget old mappings.

The hosts' homes live in a 0755 directory under /tmp rather than a private temporary tree: an
agent's stages run as the unprivileged run-as account, which must reach the agent's work
directory beside the home, and people on a host must reach its agent socket. Commands in a host
run this source tree (:data:`SOURCE_ROOT` on ``PYTHONPATH``). It needs root, ``ip``,
``wireguard-go``, ``wg``, ``ping`` and ``/dev/net/tun``
(:func:`~shardpool_dev.lab.requirements.netns_skip_reason` says what is missing).
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
from pathlib import Path

import mesh
from mesh.constants import AGENT_PORT, WIREGUARD_PORT
from shardpool_dev.lab.hosts import MESH_CIDR, UNDERLAY, Host, LabError, Router, run_in_netns, run_ip
from shardpool_dev.lab.nat import INTERNET, lan_address, lan_subnet, router_nat_rules, udp_block_rules

__all__ = ["SOURCE_ROOT", "Lab"]

SOURCE_ROOT = Path(mesh.__file__).resolve().parents[1]
"""The directory holding the ``mesh`` package (and ``shardpool`` beside it in a checkout)."""


class Lab:
    """Namespaced hosts on one bridge, or a NAT grid; use as a context manager so cleanup always runs."""

    def __init__(self, workdir: Path) -> None:
        self.tag = f"sp{os.getpid()}"
        self.workdir = workdir
        self.shared = Path(tempfile.mkdtemp(prefix=f"{self.tag}-lab-", dir="/tmp"))
        os.chmod(self.shared, 0o755)
        self.switch = f"{self.tag}-sw"
        self.hosts: dict[str, Host] = {}
        self.routers: dict[str, Router] = {}
        self.internet = False
        self._namespaces: list[str] = []
        self.last_ping = ""

    def __enter__(self) -> Lab:
        self._add_netns(self.switch)
        run_ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        run_ip("-n", self.switch, "link", "set", "br0", "up")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_netns(self, name: str) -> None:
        run_ip("netns", "add", name)
        self._namespaces.append(name)
        run_ip("-n", name, "link", "set", "lo", "up")

    def add_internet(self) -> None:
        """Make this lab a NAT grid: hosts added without a router go on the public 203.0.113.0/24 bridge."""
        if not self.internet:
            self._bridge("inet")
            self.internet = True

    def add_router(self, label: str, kind: str, wan_octet: int) -> Router:
        """Add NAT router ``label`` of ``kind`` (see :mod:`shardpool_dev.lab.nat`) at 203.0.113.``wan_octet``.

        Its LAN is the next free 198.51.100.(16k)/28; hosts join it with ``add_host(..., behind=label)``.
        """
        if not self.internet:
            raise LabError("add_internet() first: a router's wan side sits on the internet")
        router_rules = router_nat_rules(kind, [])  # rejects an unknown kind before anything is made
        index = len(self.routers) + 1
        router = Router(label, f"{self.tag}-{label}", index, f"{INTERNET}.{wan_octet}", kind, f"lan{index}")
        self._add_netns(router.netns)
        self._bridge(router.bridge)
        self._plug(router.netns, "wan", "inet", f"w{label}", f"{router.wan}/24")
        self._plug(router.netns, "lan", router.bridge, f"l{label}", f"{router.gateway}/28")
        run_in_netns(router.netns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for rule in router_rules:
            run_in_netns(router.netns, "iptables", *rule)
        self.routers[label] = router
        return router

    def add_host(
        self, label: str, octet: int, *, behind: str | Router | None = None, listen_port: int | None = None
    ) -> Host:
        """Create host ``label``: 192.0.2.``octet`` on the flat lab, 203.0.113.``octet`` on the internet
        once :meth:`add_internet` ran, or 198.51.100.(16k+``octet``) behind router ``behind`` (number k).

        ``listen_port`` is its WireGuard port; behind a router it defaults to the next port from
        51820 that no other host there uses (a cone router forwards each port to one host).
        """
        router = self.routers[behind if isinstance(behind, str) else behind.label] if behind else None
        netns = f"{self.tag}-{label}"
        if router is None:
            bridge, prefix = ("inet", INTERNET) if self.internet else ("br0", UNDERLAY)
            address, port = f"{prefix}.{octet}", listen_port or WIREGUARD_PORT
        else:
            bridge, address = router.bridge, lan_address(router.index, octet)
            used = {used_port for _, used_port in router.forwards}
            port = listen_port or next(
                p for p in range(WIREGUARD_PORT, WIREGUARD_PORT + 100) if p not in used
            )
            if port in used:
                raise LabError(f"listen port {port} is taken behind router {router.label}")
        self._add_netns(netns)
        self._plug(netns, "eth0", bridge, f"v{label}", f"{address}/{28 if router else 24}")
        socket_path = self.shared / f"{label}-run" / "agent.sock"
        host = Host(label, netns, address, self.shared / label, f"{self.tag}{label}", socket_path, port)
        if router is not None:
            run_ip("-n", netns, "route", "add", "default", "via", router.gateway)
            host.router = router.label
            router.forwards.append((address, port))
            self._apply_nat(router)
        self.hosts[label] = host
        return host

    def set_nat(self, router: str | Router, kind: str) -> None:
        """Switch a router to ``kind`` now: replace its NAT rules and forget its old mappings.

        Old mappings live on in the router's connection tracking; ``conntrack -F`` drops them when
        the tool is installed (without it, flows that already exist keep their old mapping).
        """
        found = self.routers[router if isinstance(router, str) else router.label]
        router_nat_rules(kind, found.forwards)
        found.kind = kind
        self._apply_nat(found)
        if shutil.which("conntrack") is not None:
            subprocess.run(
                ["ip", "netns", "exec", found.netns, "conntrack", "-F"], capture_output=True, timeout=30
            )

    def block_udp_except(self, host: Host, ip: str) -> None:
        """Drop every UDP datagram ``host`` sends except to ``ip`` (the relay), loopback and its WireGuard interface."""
        for rule in udp_block_rules(ip, host.interface):
            run_in_netns(host.netns, "iptables", *rule)

    def _apply_nat(self, router: Router) -> None:
        run_in_netns(router.netns, "iptables", "-t", "nat", "-F")
        for rule in router_nat_rules(router.kind, router.forwards):
            run_in_netns(router.netns, "iptables", *rule)

    def _bridge(self, name: str) -> None:
        run_ip("-n", self.switch, "link", "add", name, "type", "bridge")
        run_ip("-n", self.switch, "link", "set", name, "up")

    def _plug(self, netns: str, inside: str, bridge: str, port: str, address: str) -> None:
        """A veth from ``bridge`` (switch side ``port``) into ``netns`` as ``inside`` with ``address``."""
        run_ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", inside, "netns", netns)
        run_ip("-n", self.switch, "link", "set", port, "master", bridge, "up")
        run_ip("-n", netns, "addr", "add", address, "dev", inside)
        run_ip("-n", netns, "link", "set", inside, "up")

    def lan_subnet(self, router: str) -> str:
        """The CIDR of ``router``'s LAN."""
        return lan_subnet(self.routers[router].index)

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
        token = self.init_mesh(self.hosts[coordinator], uses=uses)
        for label in members:
            self.join_mesh(self.hosts[label], token)
        return token

    def init_mesh(
        self,
        host: Host,
        *,
        uses: int,
        agent: bool = True,
        cidr: str = MESH_CIDR,
        extra: tuple[str, ...] = (),
    ) -> str:
        """``mesh init`` on ``host`` with its endpoint, ``--cidr cidr`` (:data:`MESH_CIDR` unless the
        caller passes its own) and ``extra`` options; returns the join token."""
        init = ["init", "--endpoint", host.endpoint, "--name", host.label, "--interface", host.interface]
        init += ["--cidr", cidr, *self._port_option(host), "--uses", str(uses)]
        init += [*([] if agent else ["--no-agent"]), *extra]
        out = self._checked(self.mesh(host, *init), f"mesh init on {host.label}")
        return out.strip().splitlines()[-1]

    def join_mesh(
        self,
        host: Host,
        token: str,
        *,
        endpoint: bool | None = None,
        agent: bool = True,
        extra: tuple[str, ...] = (),
    ) -> None:
        """``mesh join`` on ``host`` (token on standard input, ``extra`` options appended).

        ``endpoint`` says whether to pass ``--endpoint``; by default only hosts not behind a
        router do, as people behind NAT without a port forward would.
        """
        with_endpoint = host.router is None if endpoint is None else endpoint
        join = ["join", "-", "--name", host.label, "--interface", host.interface, *self._port_option(host)]
        join += [
            *(["--endpoint", host.endpoint] if with_endpoint else []),
            *([] if agent else ["--no-agent"]),
        ]
        self._checked(self.mesh(host, *join, *extra, stdin=token + "\n"), f"mesh join on {host.label}")

    @staticmethod
    def _port_option(host: Host) -> list[str]:
        return [] if host.listen_port == WIREGUARD_PORT else ["--listen-port", str(host.listen_port)]

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

    def host_pids(self, host: Host) -> list[int]:
        """Every process running inside ``host`` (its network namespace) now."""
        return self._namespace_pids(host.netns)

    def kill_host(self, host: Host, timeout: float = 10.0) -> list[int]:
        """``kill -9`` every process of ``host`` (its WireGuard, sync daemon, agent and stages), by pid,
        as a machine that loses power; waits until none is left. Returns the pids killed.

        The namespace, its interfaces and the host's state directory stay: ``mesh up`` inside the
        host starts it again, as the machine's owner would after a reboot.
        """
        killed: list[int] = []
        deadline = time.monotonic() + timeout
        while pids := self._namespace_pids(host.netns):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise LabError(f"processes {pids} of host {host.label} outlived SIGKILL for {timeout:.0f} s")
            time.sleep(0.05)
        return sorted(set(killed))

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
