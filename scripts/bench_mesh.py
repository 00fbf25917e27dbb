"""Benchmark pipelined QLoRA over a WireGuard mesh of namespaced hosts and print one JSON object.

    sudo python scripts/bench_mesh.py            # the run recorded in docs/performance.md (Mesh)
    sudo python scripts/bench_mesh.py --quick    # a smaller model, fewer steps, smaller transfers

It needs root, ``ip``, ``wireguard-go``, ``wg``, ``ping`` and ``/dev/net/tun`` (the same as the
mesh tests). Everything happens in a temporary directory and in network namespaces that are
removed at the end, with every process the lab started stopped by pid, also on failure or Ctrl-C:

  1. builds a random tiny Llama (``shardpool.model.tinymodel.make_tiny_llama``) and a completion dataset;
  2. builds three hosts a, b, c (``mesh.lab.Lab``: namespaces + veth + bridge on
     192.0.2.0/24) and forms the mesh with the real CLI (``mesh init`` on a, ``mesh join`` on b, c),
     then waits for pings and for every agent's ``/v1/health``;
  3. measures the raw TCP throughput a -> b over the mesh (198.51.100.1 -> 198.51.100.2, in the
     lab's mesh CIDR ``mesh.lab.MESH_CIDR``) and over the underlay (192.0.2.1 -> 192.0.2.2) with a
     stdlib socket sender/receiver, and the ping RTT;
  4. runs ``shardpool finetune`` on host a with ``shardpool: {placement: mesh, stages: 3}`` (and
     ``threads_per_stage`` = CPUs // 3, since the three hosts share this machine's cores); while
     it trains, snapshots the WireGuard transfer counters of every host after each step, so the
     bytes that cross each hop per step are measured on the wire too;
  5. tears the lab down and runs the same config with the mesh run's split
     (``shardpool: {placement: local, layers: [...]}``) as three local stage processes over loopback;
  6. compares the bytes the pipeline sends per step with what a DDP ring all-reduce of the full
     fp32 gradients (and of the LoRA gradients only) would move for the same model and N = 3.

Step metrics come from each run's ``metrics.jsonl``; the first ``WARMUP_STEPS`` steps are skipped
and medians are reported. MB means 10**6 bytes. See docs/performance.md (Mesh) for a recorded run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mesh.constants import AGENT_PORT  # noqa: E402
from mesh.lab import Host, Lab, LabError, netns_skip_reason  # noqa: E402
from mesh.lab import mesh_address as lab_mesh_address  # noqa: E402
from scripts.bench_pipeline import (  # noqa: E402 - needs ROOT on sys.path
    boundary_bytes_per_step,
    completion_rows,
    count_adapter_parameters,
    count_parameters,
    machine_busy_seconds,
    own_cpu_seconds,
    ring_allreduce_bytes_per_worker,
    training_config,
)
from scripts.report_run import run_and_report  # noqa: E402
from shardpool.plan.device_facts import cpu_model_name  # noqa: E402

FP32_BYTES = 4
MB = 1e6
MIB = 1 << 20
WARMUP_STEPS = 2
WORKERS = 3
TCP_PORT = 5201
ONE_GBIT_BYTES_PER_S = 1e9 / 8
MESH_ADDRESSES = {
    label: lab_mesh_address(number) for number, label in enumerate("abc", start=1)
}  # of a, b, c

FULL: dict[str, Any] = {
    "model": {
        "num_layers": 6,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_heads": 4,
        "num_kv_heads": 2,
        "vocab_size": 1024,
    },
    "sequence_len": 128,
    "micro_batch_size": 4,
    "gradient_accumulation_steps": 4,
    "max_steps": 12,
    "lora_r": 8,
    "tcp_bytes": 128 * MIB,
    "tcp_repeats": 3,
    "pings": 20,
}
QUICK: dict[str, Any] = {
    "model": {
        "num_layers": 6,
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_heads": 4,
        "num_kv_heads": 2,
        "vocab_size": 1024,
    },
    "sequence_len": 64,
    "micro_batch_size": 2,
    "gradient_accumulation_steps": 4,
    "max_steps": 5,
    "lora_r": 4,
    "tcp_bytes": 32 * MIB,
    "tcp_repeats": 1,
    "pings": 10,
}

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


# ---------------------------------------------------------------------------- pure helpers


def summarize_steps(records: Sequence[dict[str, Any]], warmup: int = WARMUP_STEPS) -> dict[str, Any]:
    """Medians over the steps after ``warmup`` of one run's ``metrics.jsonl`` records."""
    records = sorted(records, key=lambda record: record["step"])
    kept = records[warmup:] or records
    stages = len(kept[0]["stage_compute_s"])
    step_s = [float(record["step_seconds"]) for record in kept]
    compute = [statistics.median(float(r["stage_compute_s"][i]) for r in kept) for i in range(stages)]
    return {
        "steps_measured": len(kept),
        "step_s": round(statistics.median(step_s), 4),
        "step_s_min": round(min(step_s), 4),
        "step_s_max": round(max(step_s), 4),
        "tokens_per_s": round(statistics.median(float(record["tokens_per_s"]) for record in kept), 1),
        "bytes_per_step": int(statistics.median(int(record["bytes_sent"]) for record in kept)),
        "stage_compute_s": [round(value, 4) for value in compute],
        "stage_wait_s": [
            round(statistics.median(float(r["stage_wait_s"][i]) for r in kept), 4) for i in range(stages)
        ],
        "bottleneck_compute_s": round(max(compute), 4),
        "final_loss": round(float(records[-1]["loss"]), 6),
    }


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


def hop_bytes(
    before: dict[str, dict[str, tuple[int, int]]],
    after: dict[str, dict[str, tuple[int, int]]],
    keys: dict[str, str],
) -> dict[str, int]:
    """Bytes that crossed each hop ``"x-y"`` (both directions) between two counter snapshots.

    ``before``/``after`` map a host label to its ``wg show transfer`` counters; ``keys`` maps a
    host label to its public key. Each direction is counted once, from the sender's tx counter.
    """
    labels = sorted(keys)
    crossed = {}
    for index, first in enumerate(labels):
        for second in labels[index + 1 :]:
            total = 0
            for sender, receiver in ((first, second), (second, first)):
                key = keys[receiver]
                total += after[sender].get(key, (0, 0))[1] - before[sender].get(key, (0, 0))[1]
            crossed[f"{first}-{second}"] = total
    return crossed


def stage_hops(plan: dict[str, Any]) -> list[str]:
    """The hops ``"x-y"`` (labels sorted) between the hosts of neighbouring stages in ``plan.json``."""
    hosts = [stage["host"] for stage in plan["stages"]]
    return ["-".join(sorted(pair)) for pair in zip(hosts, hosts[1:], strict=False)]


def layer_counts(plan: dict[str, Any]) -> list[int]:
    """Layers per stage of a ``plan.json``, as ``shardpool: {layers: [...]}`` takes them."""
    return [int(stop) - int(start) for start, stop in (stage["layers"] for stage in plan["stages"])]


# ---------------------------------------------------------------------------- CPU accounting


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


# ---------------------------------------------------------------------------- the lab


def host_argv(host: Host, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside ``host`` with the same clean environment as ``Lab.run``."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "SHARDPOOL_HOME": str(host.home),
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


# ---------------------------------------------------------------------------- training runs


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


def wire_bytes_per_step(
    snapshots: dict[int, dict[str, dict[str, tuple[int, int]]]], keys: dict[str, str], warmup: int
) -> dict[str, Any]:
    """Bytes per step on each hop from the counter snapshots after step ``warmup`` and after the last step."""
    last = max(snapshots)
    first = min((key for key in snapshots if key >= warmup), default=last)
    if last <= first:
        raise BenchError(f"too few counter snapshots to measure per-step wire bytes: {sorted(snapshots)}")
    crossed = hop_bytes(snapshots[first], snapshots[last], keys)
    return {
        "from_step": first,
        "to_step": last,
        "per_hop": {hop: int(total / (last - first)) for hop, total in crossed.items()},
    }


# ---------------------------------------------------------------------------- main


def versions() -> dict[str, str]:
    """Versions of everything that shapes the numbers."""
    import bitsandbytes
    import peft
    import torch
    import transformers

    wireguard_go = subprocess.run(
        ["wireguard-go", "--version"], capture_output=True, text=True
    ).stdout.split()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "bitsandbytes": bitsandbytes.__version__,
        "wireguard_go": wireguard_go[1] if len(wireguard_go) > 1 else "unknown",
        "kernel": platform.release(),
    }


def stage_threads() -> int:
    """Torch threads per stage: this machine's CPUs shared by the three stages (at least 1 each)."""
    return max(1, len(os.sched_getaffinity(0)) // WORKERS)


def build_inputs(work: Path, size: dict[str, Any]) -> tuple[Path, Path]:
    """The random tiny Llama and a dataset with exactly enough rows for ``max_steps`` steps."""
    from shardpool.model.tinymodel import DEFAULT_CORPUS, make_tiny_llama, write_jsonl

    rows = completion_rows(size["max_steps"] * size["micro_batch_size"] * size["gradient_accumulation_steps"])
    data = write_jsonl(rows, work / "data.jsonl")
    model_dir = make_tiny_llama(
        work / "model",
        seed=0,
        initializer_range=0.1,
        corpus=[row["text"] for row in rows] + list(DEFAULT_CORPUS),
        **size["model"],
    )
    return model_dir, data


def measure_network(lab: Lab, size: dict[str, Any]) -> dict[str, Any]:
    """Raw TCP a -> b over the mesh and over the underlay, and ping RTTs."""
    a = lab.hosts["a"]
    return {
        "wireguard_tcp": repeated_tcp(lab, MESH_ADDRESSES["b"], size),
        "underlay_tcp": repeated_tcp(lab, lab.hosts["b"].underlay, size),
        "mesh_ping_ms": ping_rtt(lab, a, MESH_ADDRESSES["b"], size["pings"]),
        "underlay_ping_ms": ping_rtt(lab, a, lab.hosts["b"].underlay, size["pings"]),
    }


def benchmark(*, quick: bool, keep: Path | None, max_wait_idle_s: float) -> dict[str, Any]:
    """Build the model, the lab and the mesh; measure the link; run mesh and loopback; return the report."""
    size = QUICK if quick else FULL
    threads = stage_threads()
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="shardpool-bench-mesh-")) if keep is None else keep
    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o755)
    try:
        model_dir, data = build_inputs(work, size)
        hf_config = json.loads((model_dir / "config.json").read_text())
        parameters = count_parameters(model_dir)
        mesh_out, loop_out = work / "out-mesh", work / "out-loopback"
        mesh_config = write_yaml(
            work / "mesh.yaml",
            training_config(
                model_dir,
                data,
                mesh_out,
                size,
                {"placement": "mesh", "stages": WORKERS, "threads_per_stage": threads, "rebalance": "off"},
            ),
        )
        load: dict[str, dict[str, Any]] = {}
        (work / "lab").mkdir(exist_ok=True)
        with Lab(work / "lab") as lab:
            for octet, label in enumerate("abc", start=1):
                lab.add_host(label, octet)
            mesh_setup_s = form_mesh(lab)
            meter = CpuMeter(lab)
            network: dict[str, Any] = {"idle_wait_s": meter.wait_for_idle(max_wait_idle_s)}
            with meter.measure(load.setdefault("network", {})):
                network.update(measure_network(lab, size))
            keys = wg_public_keys(lab)
            idle_wait_mesh = meter.wait_for_idle(max_wait_idle_s)
            with meter.measure(load.setdefault("mesh_run", {})):
                snapshots = run_on_mesh(lab, mesh_config, mesh_out, work / "mesh-run.log", timeout_s=1800)
        plan = json.loads((mesh_out / "plan.json").read_text())
        loop_config = write_yaml(
            work / "loopback.yaml",
            training_config(
                model_dir,
                data,
                loop_out,
                size,
                {
                    "placement": "local",
                    "layers": layer_counts(plan),
                    "threads_per_stage": threads,
                    "rebalance": "off",
                },
            ),
        )
        env = dict(os.environ, SHARDPOOL_CACHE=str(work / "cache"), COLUMNS="200", PYTHONPATH=str(ROOT))
        meter = CpuMeter()
        idle_wait_loop = meter.wait_for_idle(max_wait_idle_s)
        with meter.measure(load.setdefault("loopback_run", {})):
            run_on_loopback(loop_config, work / "loopback-run.log", env, timeout_s=1800)
        return report(
            quick=quick,
            size=size,
            hf_config=hf_config,
            parameters=parameters,
            lora_parameters=count_adapter_parameters(mesh_out),
            network=network,
            mesh_out=mesh_out,
            loop_out=loop_out,
            plan=plan,
            wire=wire_bytes_per_step(snapshots, keys, WARMUP_STEPS),
            load=load,
            idle_waits={
                "network": network.pop("idle_wait_s"),
                "mesh_run": idle_wait_mesh,
                "loopback_run": idle_wait_loop,
            },
            mesh_setup_s=mesh_setup_s,
            seconds=time.monotonic() - started,
        )
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)


def report(
    *,
    quick: bool,
    size: dict[str, Any],
    hf_config: dict[str, Any],
    parameters: int,
    lora_parameters: int,
    network: dict[str, Any],
    mesh_out: Path,
    loop_out: Path,
    plan: dict[str, Any],
    wire: dict[str, Any],
    load: dict[str, dict[str, Any]],
    idle_waits: dict[str, float],
    mesh_setup_s: float,
    seconds: float,
) -> dict[str, Any]:
    """Assemble the JSON report from the measurements."""
    mesh = summarize_steps(read_metrics(mesh_out))
    loopback = summarize_steps(read_metrics(loop_out))
    mesh_config = json.loads((mesh_out / ".shardpool" / "job.json").read_text())["config"]
    hops = stage_hops(plan)
    microbatches = size["gradient_accumulation_steps"]
    expected = boundary_bytes_per_step(
        stages=WORKERS,
        microbatches=microbatches,
        micro_batch_size=size["micro_batch_size"],
        sequence_len=size["sequence_len"],
        hidden_size=hf_config["hidden_size"],
        wire_bytes=FP32_BYTES,
    )
    ddp_full = ring_allreduce_bytes_per_worker(parameters * FP32_BYTES, WORKERS)
    ddp_lora = ring_allreduce_bytes_per_worker(lora_parameters * FP32_BYTES, WORKERS)
    per_hop = wire["per_hop"]
    busiest = max(per_hop[hop] for hop in hops)
    wireguard_MBps = network["wireguard_tcp"]["MBps"]
    needed_MBps = mesh["bytes_per_step"] / mesh["step_s"] / MB
    mesh.update(
        {
            "bytes_per_step_expected": expected,
            "bytes_per_boundary_per_step": mesh["bytes_per_step"] // (WORKERS - 1),
            "stage_hops": hops,
            "wireguard_bytes_per_step_per_hop": per_hop,
            "wireguard_counters_steps": [wire["from_step"], wire["to_step"]],
            "wireguard_bytes_vs_payload_busiest_hop": round(
                busiest / (mesh["bytes_per_step"] / (WORKERS - 1)), 3
            ),
            "run_seconds": json.loads((mesh_out / "run_summary.json").read_text())["seconds"],
        }
    )
    loopback["run_seconds"] = json.loads((loop_out / "run_summary.json").read_text())["seconds"]
    return {
        "benchmark": "mesh",
        "quick": quick,
        "command": "sudo python scripts/bench_mesh.py" + (" --quick" if quick else ""),
        "wireguard_tcp_MBps": wireguard_MBps,
        "underlay_tcp_MBps": network["underlay_tcp"]["MBps"],
        "mesh_ping_ms": network["mesh_ping_ms"]["avg"],
        "underlay_ping_ms": network["underlay_ping_ms"]["avg"],
        "mesh": mesh,
        "loopback": loopback,
        "ddp_workers": WORKERS,
        "ddp_full_grad_bytes_per_step": int(ddp_full),
        "ddp_lora_bytes_per_step": int(ddp_lora),
        "ddp_bytes_note": "per worker (= per ring hop, one direction) per step: 2 (N-1)/N x params x 4 bytes",
        "mesh_bytes_per_worker_per_step": mesh["bytes_per_step"] // WORKERS,
        "ddp_full_vs_mesh_busiest_hop": round(ddp_full / busiest, 2),
        "slowdown_mesh_vs_loopback": round(mesh["step_s"] / loopback["step_s"], 3),
        "slowdown_bottleneck_compute_mesh_vs_loopback": round(
            mesh["bottleneck_compute_s"] / loopback["bottleneck_compute_s"], 3
        ),
        "mesh_bytes_per_step_MBps_needed": round(needed_MBps, 3),
        "link_utilisation": round(needed_MBps / wireguard_MBps, 4),
        "busiest_hop_MBps_needed": round(busiest / mesh["step_s"] / MB, 3),
        "busiest_hop_utilisation": round(busiest / mesh["step_s"] / MB / wireguard_MBps, 4),
        "seconds_per_step_at_1_gbit": {
            "mesh_busiest_hop": round(busiest / ONE_GBIT_BYTES_PER_S, 4),
            "ddp_full_grad": round(ddp_full / ONE_GBIT_BYTES_PER_S, 4),
            "ddp_lora": round(ddp_lora / ONE_GBIT_BYTES_PER_S, 4),
        },
        "network": network,
        "plan": [{"host": s["host"], "layers": s["layers"], "device": s["device"]} for s in plan["stages"]],
        "threads_per_stage": mesh_config["shardpool"]["threads_per_stage"],
        "threads_note": (
            "set explicitly in both runs: the three lab hosts share this machine's cores, and by default a "
            "mesh stage alone on its host would take all of them (oversubscribing the cores 3x here)"
        ),
        "model": {
            "type": hf_config["model_type"],
            "num_layers": hf_config["num_hidden_layers"],
            "hidden_size": hf_config["hidden_size"],
            "intermediate_size": hf_config["intermediate_size"],
            "num_heads": hf_config["num_attention_heads"],
            "num_kv_heads": hf_config["num_key_value_heads"],
            "vocab_size": hf_config["vocab_size"],
            "parameters": parameters,
            "lora_parameters": lora_parameters,
        },
        "config": {
            key: size[key]
            for key in (
                "sequence_len",
                "micro_batch_size",
                "gradient_accumulation_steps",
                "max_steps",
                "lora_r",
            )
        }
        | {
            "val_set_size": 0,
            "wire_dtype": "fp32",
            "schedule": "1f1b",
            "warmup_steps_skipped": WARMUP_STEPS,
            "tcp_bytes": size["tcp_bytes"],
            "tcp_repeats": size["tcp_repeats"],
        },
        "machine": {
            "cpu": cpu_model_name(),
            "logical_cpus": os.cpu_count(),
            "load": load,
            "idle_wait_s": idle_waits,
        },
        "versions": versions(),
        "mesh_setup_s": round(mesh_setup_s, 1),
        "seconds": round(seconds, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, check for root and the tools, run the benchmark, print its JSON report."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="a smaller model, fewer steps and smaller transfers"
    )
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (model, outputs, logs)")
    parser.add_argument(
        "--max-wait-idle",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="before each measurement, wait up to this long for other processes to leave the CPUs (default 60)",
    )
    args = parser.parse_args(argv)
    reason = netns_skip_reason()
    if reason is not None:
        hint = "; run it as `sudo python scripts/bench_mesh.py`" if os.geteuid() != 0 else ""
        print(f"bench_mesh: error: {reason}{hint}", file=sys.stderr)
        return 2
    return run_and_report(
        "bench_mesh",
        lambda: benchmark(quick=args.quick, keep=args.keep, max_wait_idle_s=args.max_wait_idle),
        errors=(BenchError, LabError),
        cleaned="the lab was removed",
    )


if __name__ == "__main__":
    sys.exit(main())
