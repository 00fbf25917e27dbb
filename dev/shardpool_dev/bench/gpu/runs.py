"""The GPU check's training runs: the CPU fp32 reference, then each chosen run within the budget."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from shardpool_dev.bench.gpu.cases import FORCE_ENV, WORDS, Case, run_config
from shardpool_dev.bench.gpu.device import GpuMemory
from shardpool_dev.bench.gpu.report import verdict_word, write_report
from shardpool_dev.bench.gpu.verdicts import (
    compare,
    device_footprint,
    memory_ratios,
    reshard_outcome,
    run_timeout_s,
    what_ran,
    why_skipped,
)


def _data(path: Path) -> Path:
    rows = [
        {"text": " ".join(WORDS[(i * 5 + k * 3) % len(WORDS)] for k in range(4 + i % 23))} for i in range(72)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _finetune(
    config: Path, env: dict[str, str], gpu: GpuMemory, timeout_s: float
) -> tuple[int | None, int | None]:
    """Run ``shardpool finetune config`` (its output to ``config``'s ``.out``/``.err``), sampling
    the GPU's used memory; its exit status (None: stopped at ``timeout_s``) and the footprint."""
    before = gpu.used_bytes()
    peak = before
    interval = 0.1 if gpu.source == "nvml" else 0.5
    with open(config.with_suffix(".out"), "w") as out, open(config.with_suffix(".err"), "w") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "shardpool", "finetune", str(config)],
            stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while process.poll() is None:
            if time.monotonic() > deadline:
                _stop(process)
                return None, None
            used = gpu.used_bytes()
            if used is not None and peak is not None:
                peak = max(peak, used)
            time.sleep(interval)
    footprint = peak - before if peak is not None and before is not None else None
    return process.returncode, footprint


def _stop(process: subprocess.Popen[bytes]) -> None:
    """End a run that overran: its launcher's process group (its stages die with the launcher)."""
    for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0)):
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def _train(
    case: Case, work: Path, model: Path, data: Path, gpu: GpuMemory, timeout_s: float
) -> dict[str, Any]:
    """Run ``shardpool finetune`` for one case; its losses, plan, summary and GPU footprint (or the error line)."""
    output_dir = work / case.name.replace("/", "-").replace(" ", "-")
    config = work / f"{output_dir.name}.yaml"
    config.write_text(yaml.safe_dump(run_config(case, model=model, data=data, output_dir=output_dir)))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(_source_root()), os.environ.get("PYTHONPATH", "")])
    )
    env.pop(FORCE_ENV, None)
    if case.reshard is not None:
        env[FORCE_ENV] = case.reshard
    code, footprint = _finetune(config, env, gpu, timeout_s)
    if code is None:
        return {"error": f"did not finish within its {timeout_s:.0f} s timeout (stopped)"}
    if code != 0:
        lines = [line for line in config.with_suffix(".err").read_text().splitlines() if line.strip()]
        return {"error": lines[-1] if lines else f"exit status {code}"}
    summary = json.loads((output_dir / "run_summary.json").read_text())
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((output_dir / "plan.json").read_text())
    return {
        "eval_loss": summary.get("eval_loss_after"),
        "losses": [line["loss"] for line in metrics if "loss" in line],
        "plan": plan,
        "summary": summary,
        "footprint_bytes": footprint,
        "ran": what_ran(plan, metrics),
        "reshard": reshard_outcome(case, metrics),
    }


def _row(case: Case, result: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """One run's report row: against the reference, its re-shard, its memory against the plan."""
    row: dict[str, Any] = {"run": case.name, "layout": case.layout, "dtype": case.dtype}
    if "error" in result:
        return row | {"error": result["error"], "ok": False}
    compared = compare(result, reference, case.dtype)
    moved = result["reshard"]
    memory = memory_ratios(result["plan"], result["summary"])
    return (
        row
        | {"eval_loss": result["eval_loss"]}
        | result["ran"]
        | compared
        | moved
        | {"ok": compared["ok"] and moved.get("reshard_ok", True)}
        | {"memory": memory, "footprint": device_footprint(memory, result["footprint_bytes"])}
    )


def run_all(
    chosen: list[Case],
    report: dict[str, Any],
    *,
    work: Path,
    gpu: GpuMemory,
    started: float,
    budget_s: float,
    json_path: Path | None,
) -> str | None:
    """The reference, then each chosen run or why it was skipped, into ``report["runs"]``, saving
    the report after each; why no run could be made (bitsandbytes, the reference), or None."""
    from shardpool.model.tinymodel import make_tiny_llama

    rows: list[dict[str, Any]] = []
    preflight = report["preflight"]

    def save(*, complete: bool) -> None:
        pending = [case.name for case in chosen[len(rows) :]]
        report.update(
            elapsed_s=round(time.monotonic() - started, 1), complete=complete, runs=rows, pending=pending
        )
        if json_path is not None:
            write_report(json_path, report)

    ruled_out = (
        None if preflight["bitsandbytes"]["ok"] else f"bitsandbytes: {preflight['bitsandbytes']['detail']}"
    )
    model = make_tiny_llama(work / "model", num_layers=6, hidden_size=256, intermediate_size=512, seed=3)
    data = _data(work / "data.jsonl")
    durations: list[float] = []
    reference: dict[str, Any] = {}
    if ruled_out is None:
        begun = time.monotonic()
        reference = _train(
            Case("cpu", "fp32"), work, model, data, gpu, run_timeout_s(begun - started, budget_s)
        )
        durations.append(time.monotonic() - begun)
        report["reference_eval_loss"] = reference.get("eval_loss")
        if "error" in reference:
            ruled_out = f"the CPU fp32 reference run failed: {reference['error']}"
    for case in chosen:
        elapsed = time.monotonic() - started
        skipped = ruled_out or why_skipped(
            case, bf16=bool(report["bf16"]), blocked=preflight["compute_mode"]["blocked"],
            elapsed_s=elapsed, durations_s=durations, budget_s=budget_s,
        )  # fmt: skip
        if skipped is not None:
            rows.append(
                {"run": case.name, "layout": case.layout, "dtype": case.dtype, "skipped": skipped, "ok": None}
            )
        else:
            begun = time.monotonic()
            result = _train(case, work, model, data, gpu, run_timeout_s(elapsed, budget_s))
            durations.append(time.monotonic() - begun)
            rows.append(_row(case, result, reference))
            print(
                f"gpu_check: {case.name}: {verdict_word(rows[-1])} in {durations[-1]:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        save(complete=False)
    save(complete=True)
    return ruled_out


def _source_root() -> Path:
    """The checkout shardpool is imported from (the stages' PYTHONPATH); shardpool is imported only now."""
    import shardpool

    return Path(shardpool.__file__).resolve().parents[1]
