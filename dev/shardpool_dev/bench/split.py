"""The same model whole and split, as local stage processes under the hosts' CPU quotas: what splitting costs without the mesh."""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardpool_dev.bench.cgroups import PERIOD_US, HostCgroups, detect_cgroup
from shardpool_dev.bench.hetero.modes import FULL, LABELS, QUICK
from shardpool_dev.bench.hetero.summary import read_jsonl
from shardpool_dev.bench.mesh import ROOT, write_yaml
from shardpool_dev.bench.mesh_bench import build_inputs
from shardpool_dev.bench.procfs import STAGE_MODULE, parent_pids
from shardpool_dev.bench.workload import training_config

FIRST_STEP = 2
"""The window starts when this many steps have ended (the first ones warm up)."""


SAMPLE_EVERY_S = 0.1


DEFAULT_SPLITS = ("16@a", "11,5@a,b", "6,5,5@a,b,a")


QUICK_SPLITS = ("4@a", "3,1@a,b")


class SplitError(Exception):
    """A run that failed; the message says which and how."""


@dataclass(frozen=True)
class Split:
    """Decoder layers per stage, in order, and the host (cgroup label) each stage runs under."""

    layers: tuple[int, ...]
    hosts: tuple[str, ...]

    @property
    def name(self) -> str:
        """How the split was written: ``11,5@a,b``."""
        return ",".join(map(str, self.layers)) + "@" + ",".join(self.hosts)


def parse_split(text: str, hosts: int, num_layers: int) -> Split:
    """A ``LAYERS@HOSTS`` split (see the module docstring), checked against the hosts and the model."""
    layers_text, _, hosts_text = text.partition("@")
    try:
        layers = tuple(int(count) for count in layers_text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"split {text!r}: layers must be whole numbers, as in 11,5@a,b"
        ) from None
    labels = tuple(hosts_text.split(",")) if hosts_text else ("a",) * len(layers)
    known = LABELS[:hosts]
    if len(labels) != len(layers):
        raise argparse.ArgumentTypeError(f"split {text!r}: give one host per stage, as in 11,5@a,b")
    if any(label not in known for label in labels):
        raise argparse.ArgumentTypeError(
            f"split {text!r}: hosts are {', '.join(known)} (one per --hosts quota)"
        )
    if any(count < 1 for count in layers) or sum(layers) != num_layers:
        raise argparse.ArgumentTypeError(
            f"split {text!r}: needs at least 1 layer a stage, {num_layers} in all"
        )
    return Split(layers, labels)


def abba(names: Sequence[str], repeats: int) -> list[str]:
    """The runs in order: the splits, then reversed, and so on, ``repeats`` times each."""
    order: list[str] = []
    for round_index in range(repeats):
        order += list(names) if round_index % 2 == 0 else list(reversed(names))
    return order


def stage_rank(cmdline: Sequence[str]) -> int | None:
    """The rank of a stage process from its command line (``python -m shardpool.elastic.rank JOB RANK``)."""
    if STAGE_MODULE not in cmdline:
        return None
    try:
        return int(cmdline[-1])
    except (ValueError, IndexError):
        return None


def proc_cpu(pid: int) -> tuple[float, float, int] | None:
    """User and system CPU seconds and minor page faults of process ``pid`` (its threads together),
    or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks, int(fields[7])


def window_figures(
    before: Mapping[int, tuple[float, float, int]],
    after: Mapping[int, tuple[float, float, int]],
    ranks: Mapping[int, int],
    hosts: Sequence[str],
    steps: int,
) -> dict[str, Any]:
    """Per stage and per host, CPU seconds a step between two samples of the stage processes;
    per stage also its minor page faults a step."""
    stages = []
    for pid, rank in sorted(ranks.items(), key=lambda item: item[1]):
        user0, system0, faults0 = before.get(pid, (0.0, 0.0, 0))
        user1, system1, faults1 = after[pid]
        stages.append(
            {
                "rank": rank,
                "host": hosts[rank],
                "cpu_s_per_step": round((user1 + system1 - user0 - system0) / steps, 4),
                "system_s_per_step": round((system1 - system0) / steps, 4),
                "minor_faults_per_step": round((faults1 - faults0) / steps),
            }
        )
    by_host: dict[str, float] = {}
    for stage in stages:
        by_host[stage["host"]] = round(by_host.get(stage["host"], 0.0) + stage["cpu_s_per_step"], 4)
    return {
        "stages": stages,
        "host_cpu_s_per_step": by_host,
        "cpu_s_per_step": round(sum(by_host.values()), 4),
    }


def started_by(parent: int) -> list[int]:
    """The processes ``parent`` started itself (the launcher's are its stage processes; a process
    a stage forks carries the stage's command line until it execs, so none deeper is looked at)."""
    return [pid for pid, its_parent in parent_pids().items() if its_parent == parent]


def cmdline(pid: int) -> list[str]:
    """The command line of ``pid`` (empty once it is gone)."""
    try:
        return [part.decode() for part in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if part]
    except OSError:
        return []


def steps_done(metrics: Path) -> int:
    """Steps ``metrics.jsonl`` has reported so far."""
    if not metrics.exists():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if '"step_seconds"' in line)


def run_split(
    split: Split, cgroups: HostCgroups, config_path: Path, out: Path, steps: int, timeout_s: float
) -> dict[str, Any]:
    """One local ``finetune`` of ``split``, its stages moved into their hosts' cgroups; its figures."""
    log = out.with_suffix(".log")
    with open(log, "w") as sink:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "shardpool", "finetune", str(config_path)],
            stdout=sink, stderr=subprocess.STDOUT, cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )  # fmt: skip
    ranks: dict[int, int] = {}
    window: dict[str, tuple[float, dict[int, tuple[float, float]]]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while launcher.poll() is None:
            if time.monotonic() > deadline:
                raise SplitError(f"{split.name} took over {timeout_s:.0f} s; log {log}")
            for pid in started_by(launcher.pid):
                rank = None if pid in ranks else stage_rank(cmdline(pid))
                if rank is not None:
                    cgroups.add(split.hosts[rank], pid)
                    ranks[pid] = rank
            done = steps_done(out / "metrics.jsonl")
            for mark, reached in (("first", done >= FIRST_STEP), ("last", done >= steps)):
                if reached and mark not in window:
                    sample = {pid: cpu for pid in ranks if (cpu := proc_cpu(pid)) is not None}
                    window[mark] = (time.monotonic(), sample)
            time.sleep(SAMPLE_EVERY_S)
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)
            try:
                launcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()
    failed = launcher.returncode != 0 or "last" not in window or set(window["last"][1]) != set(ranks)
    if failed or len(ranks) != len(split.layers):
        if launcher.returncode == 0:
            raise SplitError(
                f"{split.name}: saw {len(ranks)} of {len(split.layers)} stages, and"
                f" {sorted(window)} of the window's ends with {sorted(window.get('last', (0, {}))[1])} of {sorted(ranks)}"
            )
        tail = log.read_text().splitlines()[-5:]
        raise SplitError(f"{split.name} failed (exit {launcher.returncode}): " + " | ".join(tail))
    (started, before), (ended, after) = window["first"], window["last"]
    counted = steps - FIRST_STEP
    records = [record for record in read_jsonl(out / "metrics.jsonl") if "step_seconds" in record]
    tail_records = records[FIRST_STEP:steps]
    return {
        "split": split.name,
        "wall_s_per_step": round((ended - started) / counted, 3),
        **window_figures(before, after, ranks, split.hosts, counted),
        "stage_compute_s": [round(statistics.median(r["stage_compute_s"][i] for r in tail_records), 3) for i in range(len(split.layers))],
        "stage_wait_s": [round(statistics.median(r["stage_wait_s"][i] for r in tail_records), 3) for i in range(len(split.layers))],
    }  # fmt: skip


def summarize(runs: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per split: the median wall step and CPU over its runs, and both as ratios to the first split's."""
    medians = {}
    for name in names:
        mine = [run for run in runs if run["split"] == name]
        medians[name] = {
            "runs": len(mine),
            "wall_s_per_step": round(statistics.median(run["wall_s_per_step"] for run in mine), 3),
            "cpu_s_per_step": round(statistics.median(run["cpu_s_per_step"] for run in mine), 4),
        }
    first = medians[names[0]]
    for figures in medians.values():
        figures["step_over_first"] = round(figures["wall_s_per_step"] / first["wall_s_per_step"], 3)
        figures["cpu_over_first"] = round(figures["cpu_s_per_step"] / first["cpu_s_per_step"], 3)
    return medians


def measure(
    splits: Sequence[Split],
    quotas: tuple[float, ...],
    *,
    quick: bool,
    repeats: int,
    steps: int,
    period_us: int = PERIOD_US,
) -> dict[str, Any]:
    """Build the model, run every split ``repeats`` times in ABBA order, and assemble the report."""
    # One step more than the window: every stage is still training when the window closes.
    size = dict(QUICK if quick else FULL, max_steps=steps + 1)
    choice = detect_cgroup()
    assert choice is not None  # cgroup_skip_reason checked it
    work = Path(tempfile.mkdtemp(prefix="shardpool-split-cpu-"))
    work.chmod(0o755)
    by_name = {split.name: split for split in splits}
    runs = []
    try:
        model_dir, data = build_inputs(work, size)
        host_quotas = dict(zip(LABELS, quotas, strict=False))
        with HostCgroups(choice, host_quotas, period_us=period_us) as cgroups:
            for index, name in enumerate(abba(list(by_name), repeats)):
                split = by_name[name]
                out = work / f"out-{index}"
                settings = {"placement": "local", "layers": list(split.layers), "threads_per_stage": 1}
                config_path = write_yaml(
                    work / f"run-{index}.yaml", training_config(model_dir, data, out, size, settings)
                )
                runs.append(run_split(split, cgroups, config_path, out, steps, size["run_timeout_s"]))
                print(
                    f"split_cpu: {name}: {runs[-1]['wall_s_per_step']} s a step", file=sys.stderr, flush=True
                )
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return {
        "benchmark": "split_cpu",
        "quick": quick,
        "hosts_cpu_quota": dict(zip(LABELS, quotas, strict=False)),
        "cgroup": choice.version,
        "cfs_period_ms": period_us / 1000,
        "steps": steps,
        "window_steps": steps - FIRST_STEP,
        "splits": summarize(runs, list(by_name)),
        "runs": runs,
        "loadavg_1m_end": round(os.getloadavg()[0], 2),
    }
