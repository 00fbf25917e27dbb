"""The GPU check's table and JSON report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardpool_dev.bench.gpu.verdicts import above_plan


def format_preflight(preflight: dict[str, Any]) -> str:
    """The pre-flight in one line: bitsandbytes, the compute mode, how the GPU's memory is read."""
    bnb = preflight.get("bitsandbytes", {})
    mode = preflight.get("compute_mode", {})
    return (
        f"pre-flight: bitsandbytes {bnb.get('version') or '?'}: {'ok' if bnb.get('ok') else bnb.get('detail')}"
        f" | compute mode: {mode.get('mode') or 'unknown'} ({mode.get('source') or 'not readable'})"
        f" | GPU memory read by: {preflight.get('device_memory') or 'nothing (no footprint)'}"
    )


def format_table(rows: list[dict[str, Any]]) -> str:
    """The report as a fixed-width table: one line per run; memory as allocated/planned tensors per
    CUDA stage and, for the run, the footprint beyond tensors/reserve (``!``: above 1)."""
    header = (
        f"{'run':<24} {'ok':<4} {'eval loss':>10} {'eval rel':>9} {'step rel':>9} {'tol':>7}  "
        "memory (stage: allocated/tensors; gpu: beyond tensors/reserve)"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        if row.get("skipped"):
            lines.append(f"{row['run']:<24} {'skip':<4} {row['skipped']}")
            continue
        if row.get("error"):
            lines.append(f"{row['run']:<24} {'FAIL':<4} {row['error']}")
            continue
        memory = ", ".join(f"{m['stage']}: {_ratio(m['allocated_ratio'])}" for m in row.get("memory", []))
        footprint = row.get("footprint") or {}
        if memory:
            memory += f"; gpu: {_ratio(footprint.get('reserve_ratio'))}"
        lines.append(
            f"{row['run']:<24} {'yes' if row['ok'] else 'NO':<4} {_number(row.get('eval_loss'), '.4f'):>10} "
            f"{_number(row.get('eval_loss_rel'), '.1e'):>9} {_number(row.get('step_loss_rel'), '.1e'):>9} "
            f"{_number(row.get('tolerance'), '.0e'):>7}  {memory or '-'}"
        )
    return "\n".join(lines)


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}" + ("!" if above_plan(value) else "")


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Replace ``path`` with the JSON report atomically: a check killed mid-write leaves the last one."""
    from mesh.files import atomic_write

    atomic_write(path, (json.dumps(report, indent=2) + "\n").encode("utf-8"))


def verdict_word(row: dict[str, Any]) -> str:
    """One word (or a short phrase) for a run's outcome, for the progress lines."""
    return "ok" if row["ok"] else f"FAIL ({row['error']})" if row.get("error") else "outside tolerance"
