"""Keeping a mesh run alive (issue 16): rounds that each kill a random member at a random step, against an uninterrupted reference."""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardpool_dev.bench.mesh import (
    ROOT,
    BenchError,
    checked,
    form_mesh,
    log_tail,
    mesh_address,
    stop_launcher,
    wait_for_agents,
    write_yaml,
)
from shardpool_dev.bench.mesh_bench import versions
from shardpool_dev.bench.workload import completion_rows
from shardpool_dev.lab import Lab

LABELS = "abc"


#: The run every chaos round trains: the tiny model of the mesh tests, a few seconds a step here.
SIZE: dict[str, Any] = {
    "model": {"num_layers": 6, "hidden_size": 64},
    "sequence_len": 32,
    "micro_batch_size": 2,
    "gradient_accumulation_steps": 3,
    "max_steps": 16,
    "rows": 64,
}


#: Kills happen once a step in [1, max_steps - KILL_MARGIN] is logged, so some steps remain after.
KILL_MARGIN = 4


RUN_TIMEOUT_S = 900.0


POLL_S = 0.1


@dataclass
class RoundResult:
    """One chaos round: who was killed when, and how the run ended."""

    victim: str
    kill_after_step: int
    kill_delay_s: float = 0.0
    copy_window_s: float | None = None
    step_s: float | None = None
    exit_code: int | None = None
    steps_lost: list[int] = field(default_factory=list)
    reported_redone: list[int] = field(default_factory=list)
    unreported_redone: list[int] = field(default_factory=list)
    training_again_s: float | None = None
    max_abs_diff: float | None = None
    seconds: float = 0.0
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The round as the report lists it."""
        return {
            "victim": self.victim,
            "kill_after_step": self.kill_after_step,
            "kill_delay_s": round(self.kill_delay_s, 2),
            "copy_window_s": None if self.copy_window_s is None else round(self.copy_window_s, 3),
            "step_s": None if self.step_s is None else round(self.step_s, 3),
            "exit_code": self.exit_code,
            "steps_lost": self.steps_lost,
            "reported_steps_redone": self.reported_redone,
            "unreported_steps_redone": self.unreported_redone,
            "training_again_s": None if self.training_again_s is None else round(self.training_again_s, 1),
            "max_abs_diff": self.max_abs_diff,
            "seconds": round(self.seconds, 1),
            **({"error": self.error} if self.error else {}),
        }


def run_config(model_dir: Path, data: Path, output_dir: Path, shardpool: dict[str, Any]) -> dict[str, Any]:
    """The config of every run (the reference and the chaos rounds differ only in ``shardpool``)."""
    return {
        "base_model": str(model_dir),
        "adapter": "qlora",
        "load_in_4bit": True,
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.0,
        "lora_target_linear": True,
        "datasets": [{"path": str(data), "type": "completion"}],
        "val_set_size": 0,
        "sequence_len": SIZE["sequence_len"],
        "shuffle_merged_datasets": False,
        "micro_batch_size": SIZE["micro_batch_size"],
        "gradient_accumulation_steps": SIZE["gradient_accumulation_steps"],
        "num_epochs": 20,
        "max_steps": SIZE["max_steps"],
        "learning_rate": 0.01,
        "lr_scheduler": "cosine",
        "warmup_steps": 1,
        "max_grad_norm": 0.05,
        "seed": 7,
        "output_dir": str(output_dir),
        "logging_steps": 1,
        "shardpool": {"rebalance": "off", **shardpool},
    }


def build_inputs(work: Path) -> tuple[Path, Path]:
    """The tiny Llama and its completion dataset, readable by the stages' run-as account."""
    from shardpool.model.tinymodel import make_tiny_llama, write_jsonl

    model_dir = make_tiny_llama(work / "model", seed=3, **SIZE["model"])
    data = write_jsonl(completion_rows(SIZE["rows"]), work / "data.jsonl")
    return model_dir, data


def train_reference(work: Path, model_dir: Path, data: Path) -> Path:
    """The uninterrupted run: three local stage processes, 2/2/2 layers; its output directory."""
    out = work / "reference"
    config = write_yaml(
        work / "reference.yaml", run_config(model_dir, data, out, {"placement": "local", "layers": [2, 2, 2]})
    )
    env = dict(os.environ, COLUMNS="200", PYTHONPATH=str(ROOT))
    log = work / "reference.log"
    with open(log, "w") as sink:
        done = subprocess.run(
            [sys.executable, "-m", "shardpool", "finetune", str(config)],
            stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT), timeout=RUN_TIMEOUT_S, check=False,
        )  # fmt: skip
    if done.returncode != 0:
        raise BenchError(f"the reference run failed (exit {done.returncode}):\n{log_tail(log)}")
    return out


def adapter_difference(first: Path, second: Path) -> float:
    """The largest absolute difference between two adapters' tensors."""
    from safetensors.torch import load_file

    one = load_file(str(first / "adapter_model.safetensors"))
    other = load_file(str(second / "adapter_model.safetensors"))
    if one.keys() != other.keys():
        raise BenchError(f"the adapters hold different tensors: {sorted(set(one) ^ set(other))[:4]}")
    return max(float((one[key] - other[key]).abs().max()) for key in one)


class MetricsPoll:
    """When each line of a run's ``metrics.jsonl`` first appeared (the launcher rewrites the file
    when it restores a copy, so a line counts by its text)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: list[tuple[float, dict[str, Any]]] = []
        self._texts: set[str] = set()

    def poll(self) -> None:
        """Note the lines not seen before, with the time now."""
        try:
            lines = self.path.read_text().splitlines()
        except OSError:
            return
        now = time.monotonic()
        for text in lines:
            if text.strip() and text not in self._texts:
                try:
                    record = json.loads(text)
                except ValueError:
                    continue  # being written
                self._texts.add(text)
                self.seen.append((now, record))

    def newest_step(self) -> int:
        """The highest step logged so far (0 before the first)."""
        return max((int(r["step"]) for _, r in self.seen if _is_step(r)), default=0)

    def training_again(self, since: float) -> float | None:
        """Seconds from ``since`` to the first step line seen after the first ``member_lost`` line."""
        lost = next(
            (index for index, (_, r) in enumerate(self.seen) if r.get("event") == "member_lost"), None
        )
        if lost is None:
            return None
        again = next((t for t, r in self.seen[lost + 1 :] if _is_step(r)), None)
        return None if again is None else again - since

    def reported_redone(self) -> list[int]:
        """Per ``member_lost`` line: the newest step line seen before it minus the step the next
        ``replan`` line goes on from (reported steps trained again; 0 when none)."""
        counts: list[int] = []
        newest = 0
        for index, (_, record) in enumerate(self.seen):
            if _is_step(record):
                newest = max(newest, int(record["step"]))
            elif record.get("event") == "member_lost":
                replan = next((r for _, r in self.seen[index + 1 :] if r.get("event") == "replan"), None)
                if replan is not None:
                    counts.append(max(0, newest - int(replan["step"])))
        return counts

    def unreported_redone(self) -> list[int]:
        """``unreported_steps_redone`` of every ``member_lost`` line (steps whose copy was in flight)."""
        return [
            int(r.get("unreported_steps_redone", 0)) for _, r in self.seen if r.get("event") == "member_lost"
        ]

    def median_step_s(self) -> float:
        """The median ``step_seconds`` logged so far (1 s before any)."""
        seconds = [float(r["step_seconds"]) for _, r in self.seen if _is_step(r) and "step_seconds" in r]
        return statistics.median(seconds) if seconds else 1.0

    def median_copy_window_s(self) -> float | None:
        """The median over logged steps of the slowest rank's step-boundary copy (``stage_copy_s``)."""
        windows = [max(r["stage_copy_s"]) for _, r in self.seen if _is_step(r) and r.get("stage_copy_s")]
        windows = [window for window in windows if window > 0]
        return statistics.median(windows) if windows else None

    def steps_lost(self) -> list[int]:
        """``steps_lost`` of every ``member_lost`` line."""
        return [int(r.get("steps_lost", -1)) for _, r in self.seen if r.get("event") == "member_lost"]


def _is_step(record: dict[str, Any]) -> bool:
    return "event" not in record and "loss" in record


def chaos_round(
    lab: Lab, work: Path, index: int, rng: random.Random, model_dir: Path, data: Path, reference: Path
) -> RoundResult:
    """One run with one random kill; the victim is started again afterwards."""
    victim = rng.choice(LABELS[1:])
    result = RoundResult(victim=victim, kill_after_step=rng.randint(1, SIZE["max_steps"] - KILL_MARGIN))
    out = work / f"round-{index}"
    config = write_yaml(
        work / f"round-{index}.yaml",
        run_config(model_dir, data, out, {"placement": "mesh", "stages": 3, "on_member_loss": "continue"}),
    )
    log = work / f"round-{index}.log"
    started = time.monotonic()
    watch = MetricsPoll(out / "metrics.jsonl")
    killed_at: float | None = None
    kill_at: float | None = None
    argv = lab.command(
        lab.hosts["a"], sys.executable, "-m", "shardpool", "finetune", str(config), env={"COLUMNS": "200"}
    )
    with open(log, "w") as sink:
        launcher = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
        try:
            while launcher.poll() is None:
                if time.monotonic() - started > RUN_TIMEOUT_S:
                    raise BenchError(
                        f"round {index} took over {RUN_TIMEOUT_S:.0f} s; log {log}:\n{log_tail(log)}"
                    )
                watch.poll()
                if kill_at is None and watch.newest_step() >= result.kill_after_step:
                    result.step_s = watch.median_step_s()
                    result.copy_window_s = watch.median_copy_window_s()
                    result.kill_delay_s = rng.uniform(0.0, result.step_s)
                    kill_at = time.monotonic() + result.kill_delay_s
                if killed_at is None and kill_at is not None and time.monotonic() >= kill_at:
                    lab.kill_host(lab.hosts[victim])
                    killed_at = time.monotonic()
                time.sleep(POLL_S)
        finally:
            stop_launcher(launcher)
    watch.poll()
    result.exit_code = launcher.returncode
    result.seconds = time.monotonic() - started
    result.steps_lost = watch.steps_lost()
    result.reported_redone = watch.reported_redone()
    result.unreported_redone = watch.unreported_redone()
    if killed_at is None:
        result.error = "the run ended before the kill step was logged"
    else:
        result.training_again_s = watch.training_again(killed_at)
    if launcher.returncode == 0:
        result.max_abs_diff = adapter_difference(out, reference)
    else:
        result.error = result.error or log_tail(log, 3)
    restart(lab, victim)
    return result


def restart(lab: Lab, label: str) -> None:
    """``mesh up`` on a host whose processes were killed; wait until every agent answers again."""
    host = lab.hosts[label]
    if not lab.host_pids(host):
        checked(lab.mesh(host, "up", timeout=120), f"mesh up on {label}")
    wait_for_agents(lab, LABELS)


def summary(rounds: list[RoundResult]) -> dict[str, Any]:
    """The report's figures over all rounds."""
    again = [r.training_again_s for r in rounds if r.training_again_s is not None]
    diffs = [r.max_abs_diff for r in rounds if r.max_abs_diff is not None]
    window_share = [r.copy_window_s / r.step_s for r in rounds if r.copy_window_s and r.step_s]
    return {
        "runs": len(rounds),
        "finished_by_themselves": sum(1 for r in rounds if r.exit_code == 0),
        "steps_lost_per_loss": [lost for r in rounds for lost in r.steps_lost],
        "losses_that_lost_a_step": sum(1 for r in rounds for lost in r.steps_lost if lost > 0),
        "reported_steps_redone_per_loss": [count for r in rounds for count in r.reported_redone],
        "losses_in_a_copy_window": sum(1 for r in rounds for count in r.unreported_redone if count > 0),
        "copy_window_over_step_median": round(statistics.median(window_share), 4) if window_share else None,
        "worst_max_abs_diff": max(diffs) if diffs else None,
        "training_again_s": {
            "median": round(statistics.median(again), 1) if again else None,
            "max": round(max(again), 1) if again else None,
        },
    }


def benchmark(*, runs: int, seed: int, keep: Path | None) -> dict[str, Any]:
    """Build the inputs, the reference and the lab; run the rounds; return the report."""
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="shardpool-bench-chaos-")) if keep is None else keep
    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o755)
    rng = random.Random(seed)
    try:
        model_dir, data = build_inputs(work)
        reference = train_reference(work, model_dir, data)
        rounds: list[RoundResult] = []
        (work / "lab").mkdir(exist_ok=True)
        with Lab(work / "lab") as lab:
            for octet, label in enumerate(LABELS, start=1):
                lab.add_host(label, octet)
            mesh_setup_s = form_mesh(lab, LABELS)
            for index in range(runs):
                rounds.append(chaos_round(lab, work, index, rng, model_dir, data, reference))
                print(f"round {index}: {json.dumps(rounds[-1].to_json())}", file=sys.stderr, flush=True)
        return {
            **summary(rounds),
            "rounds": [r.to_json() for r in rounds],
            "size": SIZE,
            "seed": seed,
            "mesh_setup_s": round(mesh_setup_s, 1),
            "mesh_addresses": [mesh_address(i) for i in range(len(LABELS))],
            "versions": versions(),
            "seconds": round(time.monotonic() - started, 1),
        }
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)
