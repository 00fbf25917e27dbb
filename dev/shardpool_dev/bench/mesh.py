"""What the lab benchmarks do on a mesh of namespaced hosts: form it, move bytes over it, count its CPU, run finetune on it.

Every function takes a built ``shardpool_dev.lab.Lab``; failures raise :class:`BenchError` with a message that
names the step."""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import shardpool
from mesh.constants import AGENT_PORT
from shardpool_dev.bench.cpu import machine_busy_seconds, own_cpu_seconds
from shardpool_dev.lab import Host, Lab
from shardpool_dev.lab import mesh_address as lab_mesh_address

ROOT = Path(shardpool.__file__).resolve().parents[1]
"""The checkout shardpool runs from: the working directory and PYTHONPATH of what runs in the lab."""
MB = 1e6


MIB = 1 << 20


TCP_PORT = 5201


ONE_GBIT_BYTES_PER_S = 1e9 / 8


MESH_ADDRESSES = {
    label: lab_mesh_address(number) for number, label in enumerate("abc", start=1)
}  # of a, b, c


# Run inside a lab host with ``python -c``: accept one connection, count bytes to EOF, reply with the count.
TCP_RECEIVER = r"""
import socket, sys
host, port, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
with socket.create_server((host, port)) as server:
    server.settimeout(limit)
    print("ready", flush=True)
    conn, _ = server.accept()
    with conn:
        conn.settimeout(limit)
        buffer, total = bytearray(1 << 20), 0
        while True:
            count = conn.recv_into(buffer)
            if not count:
                break
            total += count
        conn.sendall(total.to_bytes(8, "big"))
"""


# Send up to N bytes (or for at most LIMIT seconds), half-close, wait for the receiver's count.
TCP_SENDER = r"""
import json, os, socket, sys, time
host, port, nbytes, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
chunk = memoryview(os.urandom(1 << 20))
sent, started = 0, time.perf_counter()
with socket.create_connection((host, port), timeout=limit) as conn:
    while sent < nbytes and time.perf_counter() - started < limit:
        size = min(len(chunk), nbytes - sent)
        conn.sendall(chunk[:size])
        sent += size
    conn.shutdown(socket.SHUT_WR)
    ack = b""
    while len(ack) < 8:
        part = conn.recv(8 - len(ack))
        if not part:
            break
        ack += part
elapsed = time.perf_counter() - started
print(json.dumps({"bytes_sent": sent, "bytes_received": int.from_bytes(ack, "big"), "seconds": elapsed}))
"""


class BenchError(RuntimeError):
    """A step of the benchmark failed; the message says which and why."""


def parse_ping_rtt(output: str) -> dict[str, float]:
    """``min``/``avg``/``max``/``mdev`` in ms from ping's summary line (``rtt min/avg/max/mdev = ...``)."""
    found = re.search(r"= ([\d.]+)/([\d.]+)/([\d.]+)/([\d.]+) ms", output)
    if found is None:
        raise BenchError(f"no round-trip summary in ping's output: {output.strip()[-200:]!r}")
    return dict(zip(("min", "avg", "max", "mdev"), (float(value) for value in found.groups()), strict=True))


def parse_wg_transfer(output: str) -> dict[str, tuple[int, int]]:
    """``{peer public key: (rx bytes, tx bytes)}`` from ``wg show IFACE transfer``."""
    counters = {}
    for line in output.splitlines():
        fields = line.split()
        if len(fields) == 3:
            counters[fields[0]] = (int(fields[1]), int(fields[2]))
    return counters


def namespace_cpu_seconds(lab: Lab) -> float:
    """CPU-seconds of every live process in the lab's namespaces, with their reaped children."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for name in [lab.switch, *(host.netns for host in lab.hosts.values())]:
        listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in listed.stdout.split():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            total += sum(int(value) for value in fields[11:15]) / ticks  # utime stime cutime cstime
    return total


@dataclass
class CpuMeter:
    """Splits the machine's busy CPU time into this benchmark's (own tree + lab) and everyone else's."""

    lab: Lab | None = None

    def mine(self) -> float:
        """CPU-seconds of this process, its reaped children and (if any) the lab's processes."""
        return own_cpu_seconds() + (namespace_cpu_seconds(self.lab) if self.lab is not None else 0.0)

    @contextlib.contextmanager
    def measure(self, into: dict[str, Any]) -> Iterator[None]:
        """Record load average and the CPU time *other* processes used while the block ran."""
        load, busy, mine, started = os.getloadavg()[0], machine_busy_seconds(), self.mine(), time.monotonic()
        try:
            yield
        finally:
            elapsed = time.monotonic() - started
            own = self.mine() - mine
            into["loadavg_1m_before"] = round(load, 2)
            into["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
            into["elapsed_s"] = round(elapsed, 1)
            into["own_cpu_s"] = round(own, 1)
            into["other_cpu_s"] = round(max(0.0, machine_busy_seconds() - busy - own), 1)
            into["other_cpu_share"] = round(
                into["other_cpu_s"] / max(elapsed * (os.cpu_count() or 1), 1e-9), 3
            )

    def wait_for_idle(self, max_wait_s: float, *, window_s: float = 2.0, busy_fraction: float = 0.1) -> float:
        """Wait until others use under ``busy_fraction`` of one core over ``window_s``; give up after ``max_wait_s``."""
        started = time.monotonic()
        while True:
            busy, mine = machine_busy_seconds(), self.mine()
            time.sleep(window_s)
            other = (machine_busy_seconds() - busy) - (self.mine() - mine)
            waited = time.monotonic() - started
            if other < busy_fraction * window_s or waited >= max_wait_s:
                return round(waited, 1)


def host_argv(host: Host, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside ``host`` with the same clean environment as ``Lab.run``."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "SHARDPOOL_HOME": str(host.home),
        "SHARDPOOL_AGENT_SOCKET": str(host.agent_socket),  # the host's own agent, as Lab.command sets it
        "PYTHONPATH": str(ROOT),
        "HOME": str(host.home),
        "COLUMNS": "200",
    }
    return ["ip", "netns", "exec", host.netns, "env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv]


def checked(result: subprocess.CompletedProcess[str], what: str) -> str:
    """``result.stdout``, or a BenchError naming ``what`` with the tail of its output."""
    if result.returncode != 0:
        raise BenchError(
            f"{what} failed (exit {result.returncode}): {(result.stderr or result.stdout).strip()[-400:]}"
        )
    return result.stdout


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, step_s: float = 0.5) -> float:
    """Poll ``condition`` until true; return the seconds waited or raise BenchError after ``timeout_s``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise BenchError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(step_s)
    return time.monotonic() - started


def mesh_address(index: int) -> str:
    """The mesh address of the ``index``-th host (0-based): the coordinator takes the first, joiners follow."""
    return lab_mesh_address(index + 1)


def form_mesh(lab: Lab, labels: str = "abc") -> float:
    """``mesh init`` on the first host, ``mesh join`` on the rest; wait for all pings and agents.

    Returns the seconds taken.
    """
    started = time.monotonic()
    lab.form_mesh(labels[0], labels[1:], uses=len(labels) - 1)
    for source in labels:
        for index, target in enumerate(labels):
            if target != source:
                address = mesh_address(index)
                wait_until(
                    lambda source=source, address=address: lab.ping(lab.hosts[source], address, timeout=1),
                    30,
                    f"ping {source} -> {address}",
                )
    wait_for_agents(lab, labels)
    return time.monotonic() - started


def wait_for_agents(lab: Lab, labels: str) -> None:
    """Wait until the agent of every host in ``labels`` answers over the mesh, asked from the first."""
    for index, label in enumerate(labels):
        wait_until(
            lambda index=index: lab.agent_healthy(lab.hosts[labels[0]], mesh_address(index), AGENT_PORT),
            60,
            f"agent of {label} healthy",
        )


def tcp_throughput(
    lab: Lab, source: Host, target: Host, address: str, nbytes: int, limit_s: float
) -> dict[str, Any]:
    """Send ``nbytes`` (at most ``limit_s`` seconds) from ``source`` to ``address`` on ``target``; MB/s."""
    receiver = subprocess.Popen(
        host_argv(target, [sys.executable, "-c", TCP_RECEIVER, address, str(TCP_PORT), str(limit_s + 10)]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert receiver.stdout is not None
        if receiver.stdout.readline().strip() != "ready":
            raise BenchError(
                f"TCP receiver on {target.label} did not start: {receiver.communicate()[1].strip()[-300:]}"
            )
        argv = [sys.executable, "-c", TCP_SENDER, address, str(TCP_PORT), str(nbytes), str(limit_s)]
        sent = json.loads(
            checked(lab.run(source, *argv, timeout=limit_s + 30), f"TCP sender {source.label} -> {address}")
        )
        receiver.wait(timeout=15)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    if sent["bytes_received"] != sent["bytes_sent"]:
        raise BenchError(
            f"TCP to {address}: sent {sent['bytes_sent']} bytes but the receiver counted {sent['bytes_received']}"
        )
    return {
        "bytes": sent["bytes_sent"],
        "seconds": round(sent["seconds"], 3),
        "MBps": sent["bytes_sent"] / sent["seconds"] / MB,
    }


def repeated_tcp(lab: Lab, address: str, size: dict[str, Any]) -> dict[str, Any]:
    """Median MB/s of ``tcp_repeats`` transfers a -> b to ``address``, with every run listed."""
    runs = [
        tcp_throughput(lab, lab.hosts["a"], lab.hosts["b"], address, size["tcp_bytes"], limit_s=30.0)
        for _ in range(size["tcp_repeats"])
    ]
    return {"MBps": round(statistics.median(run["MBps"] for run in runs), 1), "runs": runs}


def ping_rtt(lab: Lab, source: Host, address: str, count: int) -> dict[str, float]:
    """Round-trip times in ms of ``count`` pings 0.2 s apart."""
    argv = ["ping", "-q", "-c", str(count), "-i", "0.2", "-W", "2", address]
    return parse_ping_rtt(
        checked(lab.run(source, *argv, timeout=count + 20), f"ping {source.label} -> {address}")
    )


def wg_counters(lab: Lab) -> dict[str, dict[str, tuple[int, int]]]:
    """Every host's per-peer WireGuard transfer counters (``wg show IFACE transfer``)."""
    return {
        label: parse_wg_transfer(
            checked(lab.run(host, "wg", "show", host.interface, "transfer", timeout=10), "wg show")
        )
        for label, host in lab.hosts.items()
    }


def wg_public_keys(lab: Lab) -> dict[str, str]:
    """Every host's WireGuard public key (never the private one)."""
    return {
        label: checked(
            lab.run(host, "wg", "show", host.interface, "public-key", timeout=10), "wg show"
        ).strip()
        for label, host in lab.hosts.items()
    }


def write_yaml(path: Path, config: dict[str, Any]) -> Path:
    """Write ``config`` as YAML to ``path``."""
    import yaml

    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    """The records of ``output_dir/metrics.jsonl``."""
    return [
        json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]


def complete_lines(path: Path) -> int:
    """How many complete lines ``path`` holds (0 if it does not exist yet)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def log_tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a log file, for error messages."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_on_mesh(
    lab: Lab, config_path: Path, output_dir: Path, log: Path, timeout_s: float
) -> dict[int, dict[str, Any]]:
    """Run ``shardpool finetune`` on host a; return WireGuard counter snapshots taken after each logged step.

    The snapshots are keyed by the number of complete lines in ``metrics.jsonl`` when they were
    taken (step ``k`` is logged as line ``k``); key 0 is taken before the launcher starts.
    """
    snapshots = {0: wg_counters(lab)}
    metrics = output_dir / "metrics.jsonl"
    argv = host_argv(lab.hosts["a"], [sys.executable, "-m", "shardpool", "finetune", str(config_path)])
    with open(log, "w") as sink:
        launcher = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout_s
            while launcher.poll() is None:
                if time.monotonic() > deadline:
                    raise BenchError(f"the mesh run took over {timeout_s:.0f} s; log {log}:\n{log_tail(log)}")
                logged = complete_lines(metrics)
                if logged not in snapshots:
                    snapshots[logged] = wg_counters(lab)
                time.sleep(0.05)
        finally:
            stop_launcher(launcher)
    if launcher.returncode != 0:
        raise BenchError(f"the mesh run failed (exit {launcher.returncode}):\n{log_tail(log)}")
    return snapshots


def stop_launcher(launcher: subprocess.Popen[Any]) -> None:
    """Terminate a launcher that is still running (its stages die with it), killing it after 15 s."""
    if launcher.poll() is None:
        launcher.terminate()
        try:
            launcher.wait(timeout=15)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()


def run_on_loopback(config_path: Path, log: Path, env: dict[str, str], timeout_s: float) -> None:
    """Run ``shardpool finetune`` in this namespace (local stage processes over 127.0.0.1)."""
    argv = [sys.executable, "-m", "shardpool", "finetune", str(config_path)]
    with open(log, "w") as sink:
        launcher = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
        try:
            launcher.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as error:
            raise BenchError(
                f"the loopback run took over {timeout_s:.0f} s; log {log}:\n{log_tail(log)}"
            ) from error
        finally:
            stop_launcher(launcher)
    if launcher.returncode != 0:
        raise BenchError(f"the loopback run failed (exit {launcher.returncode}):\n{log_tail(log)}")
