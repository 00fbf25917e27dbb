"""The GPU suite's report file: made at the start, updated after each part, finished with the table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardpool_dev.bench.gpu.suite import (
    FAILING,
    PART_NAMES,
    PARTS,
    SuiteError,
    derived_parts,
    format_table,
    pytest_counts,
    status_of,
    stopped_by_timeout,
)


def versions() -> dict[str, Any]:
    """Python, torch, CUDA, the driver and GPU (``nvidia-smi``), and the ML stack's versions; a
    package that fails to import is recorded with its error (bitsandbytes without its CUDA library)."""
    found: dict[str, Any] = {"python": sys.version.split()[0]}
    for module in ("torch", "bitsandbytes", "transformers", "peft", "accelerate", "pydantic", "cryptography"):
        try:
            found[module] = __import__(module).__version__
        except Exception as error:  # an import error is a finding here, whatever its type
            found[module] = (
                f"error: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            )
    try:
        import torch

        found["torch_cuda"] = torch.version.cuda
        found["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            found["gpu"] = torch.cuda.get_device_name(0)
            found["compute_capability"] = "{}.{}".format(*torch.cuda.get_device_capability(0))
    except ImportError:
        found["cuda_available"] = False
    found["nvidia_smi"] = _nvidia_smi()
    return found


def _nvidia_smi() -> str | None:
    """``name, driver_version, memory.total`` of each GPU as nvidia-smi prints them (None without it)."""
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() or None


def new_report(*, dry_run: bool, budget_s: float, parts: Sequence[str] = PART_NAMES) -> dict[str, Any]:
    """The report before any part ran: every part listed, pending."""
    titles = dict(PARTS)
    rows = [
        {
            "part": name,
            "what": titles[name],
            "status": "pending",
            "seconds": None,
            "limit_s": None,
            "summary": "",
        }
        for name in parts
    ]
    return {
        "suite": "scripts/gpu_suite.sh",
        "dry_run": dry_run,
        "budget_s": budget_s,
        "started_unix": round(time.time(), 1),
        "elapsed_s": 0.0,
        "complete": False,
        "parts": rows,
    }


def write_report(out: Path, report: dict[str, Any]) -> None:
    """Write ``suite.json`` and ``suite.md`` (each through a temporary file and a rename)."""
    report["elapsed_s"] = round(time.time() - report["started_unix"], 1)
    for name, text in (
        ("suite.json", json.dumps(report, indent=2) + "\n"),
        ("suite.md", format_table(report)),
    ):
        staging = out / f".{name}.tmp"
        staging.write_text(text, encoding="utf-8")
        os.replace(staging, out / name)


def read_report(out: Path) -> dict[str, Any]:
    """The ``suite.json`` under ``out``."""
    return json.loads((out / "suite.json").read_text(encoding="utf-8"))


def update_part(report: dict[str, Any], part: str, **fields: Any) -> None:
    """Set ``fields`` on the row of ``part``; SuiteError for a part the report does not list."""
    for row in report["parts"]:
        if row["part"] == part:
            row.update(fields)
            return
    raise SuiteError(f"unknown part {part!r}; pick from: {', '.join(PART_NAMES)}")


def part_details(part: str, out: Path, output: str, work: Path | None) -> dict[str, Any]:
    """What a part left behind, parsed: JSON on its last output line or in its own file."""
    if part in ("install", "devices"):
        found = _last_json(output)
        if part == "devices":
            return {"rows": found} if isinstance(found, list) else {}
        return found if isinstance(found, dict) else {}
    if part == "gpu_check":
        return _read_json(out / "gpu-check.json") or {}
    if part == "stage_vs_peft":
        found = _read_json(out / "bench.json")
        if found is None:  # --plan-only (the dry run) prints the workload alone
            planned = _last_json(output)
            return {"workload": planned} if isinstance(planned, dict) else {}
        return found
    if part == "torch_nf4_vs_bnb":
        return _read_json(out / "nf4-bench.json") or {}
    if part == "generate":
        return _read_json(out / "generate.json") or {}
    if part == "cuda_tests" and work is not None and (work / "cuda-tests.xml").is_file():
        return {"counts": pytest_counts(work / "cuda-tests.xml")}
    return {}


def _last_json(output: str) -> Any:
    """The JSON value the output ends with (one line, or a block starting at a line of ``[``/``{``)."""
    lines = output.rstrip().splitlines()
    for start in range(len(lines) - 1, -1, -1):
        if lines[start][:1] in "[{":
            try:
                return json.loads("\n".join(lines[start:]))
            except json.JSONDecodeError:
                continue
    return None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def record(
    out: Path, part: str, *, rc: int, seconds: float, limit_s: float, log: Path, work: Path | None
) -> str:
    """Record a finished (or stopped) part in the report, rewrite it, and return its status."""
    report = read_report(out)
    output = log.read_text(encoding="utf-8", errors="replace") if log.is_file() else ""
    details = part_details(part, out, output, work)
    timed_out = stopped_by_timeout(rc, seconds, limit_s)
    status, summary = status_of(part, rc, output, details, timed_out=timed_out)
    update_part(
        report, part, status=status, rc=rc, seconds=round(seconds, 1), limit_s=limit_s, summary=summary,
        details=details,
    )  # fmt: skip
    write_report(out, report)
    return status


def skip(out: Path, part: str, reason: str) -> None:
    """Record a part that did not run (budget spent, or not chosen), with why."""
    report = read_report(out)
    update_part(report, part, status="skipped", summary=reason)
    write_report(out, report)


def finish(out: Path, only: Sequence[str] = ()) -> int:
    """Fill the parts read off ``gpu-check.json`` (those ``only`` leaves out: skipped), mark the
    report complete, and return the suite's exit status: 1 when a part failed or timed out."""
    report = read_report(out)
    for part, (status, summary, details) in derived_parts(_read_json(out / "gpu-check.json")).items():
        if only and part not in only:
            update_part(report, part, status="skipped", summary="not chosen (--only)")
        else:
            update_part(report, part, status=status, summary=summary[:300], details=details)
    report["complete"] = True
    write_report(out, report)
    return 1 if any(row["status"] in FAILING for row in report["parts"]) else 0
