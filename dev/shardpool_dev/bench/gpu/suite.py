"""The GPU suite's parts and what each part's outcome means: sizes that travel, CUDA tests, statuses, derived parts, the table."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MIB = 2**20


#: What the device tool sends (tracked and untracked-not-ignored files plus carried paths), at most.
TRAVEL_LIMIT_BYTES = 64 * MIB


#: Files the device tool brings back from $OUT, at most.
MAX_OUT_FILES = 8


#: What every later part imports: the install part fails when one of them does not import.
REQUIRED = ("torch", "bitsandbytes", "transformers", "peft", "pydantic", "cryptography")


#: The exit status of ``timeout`` when it stopped the command (TERM, or KILL after --kill-after).
TIMEOUT_STATUSES = (124, 137)


#: The suite's parts, in the order they run: name and what it shows.
PARTS: tuple[tuple[str, str], ...] = (
    ("install", "wheels installed; torch, CUDA, driver, GPU, bitsandbytes, transformers, peft versions"),
    ("devices", "`shardpool devices --json`: compute capability, bf16, the NF4 probe"),
    ("generate", "generation on one GPU: one stage ÷ peft `generate`; two stages, 8 in flight ÷ one alone"),
    ("cuda_tests", "the tests that skip without CUDA"),
    ("gpu_check", "`scripts/gpu_check.py`: CUDA stages against the CPU fp32 result, memory against the plan"),
    ("s2_one_gpu", "S = 2 as two processes on one GPU (gpu_check's cuda+cuda runs)"),
    ("memory_vs_plan", "planned vs measured memory per CUDA stage, three fp32 layouts (gpu_check)"),
    ("fp16_loss_scaling", "fp16 with the shared loss scale (gpu_check's fp16 runs)"),
    ("torch_nf4_vs_bnb", "one stage on the PyTorch NF4 path against one on bitsandbytes' kernels"),
    ("stage_vs_peft", "one stage against a plain peft + bitsandbytes loop, Llama-3-8B layer shape"),
)


PART_NAMES = tuple(name for name, _ in PARTS)


#: Parts read off gpu_check's report instead of running anything of their own.
DERIVED_PARTS = ("s2_one_gpu", "memory_vs_plan", "fp16_loss_scaling")


#: The three layouts whose per-stage memory ``memory_vs_plan`` reports.
MEMORY_RUNS = ("cuda/fp32", "cuda+cuda/fp32", "cuda+cpu/fp32")


class SuiteError(Exception):
    """An input the suite cannot use (an unknown part, a tree git cannot list); the message says the fix."""


def tree_bytes(repo: Path) -> int:
    """Bytes of the working tree the device tool sends: tracked and untracked-not-ignored files."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=repo,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        raise SuiteError(
            f"cannot list the working tree with git ({error}); run this in a git checkout"
        ) from error
    paths = (repo / os.fsdecode(name) for name in listed.split(b"\0") if name)
    return sum(path.stat().st_size for path in paths if path.is_file() and not path.is_symlink())


def wheel_files(wheels: Path) -> list[Path]:
    """The ``*.whl`` files in ``wheels`` (none when it does not exist), by name."""
    return sorted(wheels.glob("*.whl")) if wheels.is_dir() else []


def duplicate_distributions(names: Iterable[str]) -> list[str]:
    """Distributions with more than one wheel among ``names`` (two versions stop the whole install)."""
    seen: dict[str, int] = {}
    for name in names:
        distribution = name.split("-", 1)[0].lower().replace("_", "-")
        seen[distribution] = seen.get(distribution, 0) + 1
    return sorted(name for name, count in seen.items() if count > 1)


def size_problem(tree: int, wheels: int, limit: int = TRAVEL_LIMIT_BYTES) -> str | None:
    """One line saying the tree plus the wheels are over ``limit`` bytes and what to do, or None."""
    total = tree + wheels
    if total <= limit:
        return None
    return (
        f"working tree {tree / MIB:.1f} MiB + wheels {wheels / MIB:.1f} MiB = {total / MIB:.1f} MiB is over "
        f"the device tool's {limit / MIB:.0f} MiB; carry fewer wheels or git-ignore large files"
    )


def size_check(repo: Path, wheels: Path, limit: int) -> int:
    """Print the sizes of the tree and each wheel; 1 with one line on stderr when over ``limit`` or
    when a distribution has two wheels, else 0."""
    files = wheel_files(wheels)
    for path in files:
        print(f"{path.stat().st_size / MIB:8.2f} MiB  {path.name}")
    tree, carried = tree_bytes(repo), sum(path.stat().st_size for path in files)
    print(f"{carried / MIB:8.2f} MiB  {len(files)} wheels in {wheels}")
    print(f"{tree / MIB:8.2f} MiB  working tree (tracked + untracked, not ignored)")
    print(f"{(tree + carried) / MIB:8.2f} MiB  in all (limit {limit / MIB:g} MiB)")
    doubled = duplicate_distributions(path.name for path in files)
    if doubled:
        print(
            f"gpu_wheels: two versions of {', '.join(doubled)} in {wheels}; delete the old ones",
            file=sys.stderr,
        )
        return 1
    problem = size_problem(tree, carried, limit)
    if problem is not None:
        print(f"gpu_wheels: {problem}", file=sys.stderr)
        return 1
    return 0


def _skips_without_cuda(decorator: ast.expr) -> bool:
    """Whether a decorator is ``pytest.mark.skipif(not torch.cuda.is_available(), ...)``."""
    if not isinstance(decorator, ast.Call) or not ast.unparse(decorator.func).endswith("skipif"):
        return False
    condition = ast.unparse(decorator.args[0]) if decorator.args else ""
    return condition.replace(" ", "") == "nottorch.cuda.is_available()"


def cuda_test_ids(tests: Path, root: Path) -> list[str]:
    """Node ids of the test functions under ``tests`` that skip where CUDA is absent, file by file."""
    ids = []
    for path in sorted(tests.rglob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(map(_skips_without_cuda, node.decorator_list)):
                ids.append(f"{path.relative_to(root).as_posix()}::{node.name}")
    return ids


def pytest_counts(junit_xml: Path) -> dict[str, int]:
    """Passed, failed, errors and skipped test counts of a pytest ``--junitxml`` report."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
        outcome = {child.tag for child in case}
        if "failure" in outcome:
            counts["failed"] += 1
        elif "error" in outcome:
            counts["errors"] += 1
        elif "skipped" in outcome:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def status_of(
    part: str, rc: int, output: str, details: dict[str, Any], *, timed_out: bool
) -> tuple[str, str]:
    """A run part's status and one-line summary from its exit status, output and parsed details.

    ``timed_out``: it ran to its limit and ``timeout`` stopped it (the same exit status before the
    limit is the part's own failure, e.g. killed for memory)."""
    last = output.strip().splitlines()[-1] if output.strip() else ""
    if timed_out:
        found = _summary(part, details)
        return "timeout", "stopped at its time limit" + (f"; so far: {found}" if found else "")
    if part == "gpu_check" and "gpu_check: skipped:" in output:
        return "skipped", last
    broken = [name for name in REQUIRED if str(details.get(name, "")).startswith("error")]
    if part == "install" and broken:
        return "fail", f"cannot import {', '.join(broken)}: " + "; ".join(
            str(details[name]) for name in broken
        )[:250]
    if part == "cuda_tests" and "counts" in details:
        counts = details["counts"]
        summary = ", ".join(f"{count} {kind}" for kind, count in counts.items())
        if rc != 0 or counts["failed"] or counts["errors"]:
            return "fail", summary
        return ("ok" if counts["passed"] else "skipped"), summary
    summary = _summary(part, details) or last
    return ("ok" if rc == 0 else "fail"), summary[:300]


def stopped_by_timeout(rc: int, seconds: float, limit_s: float) -> bool:
    """Whether ``timeout`` stopped a part: its exit status, once the part had run to its limit."""
    return rc in TIMEOUT_STATUSES and seconds >= limit_s - 1


def _summary(part: str, details: dict[str, Any]) -> str:
    """The one line the table shows for a part that finished, from its details."""
    if part == "install" and details:
        keys = ("gpu", "torch", "torch_cuda", "bitsandbytes", "transformers", "peft")
        return ", ".join(f"{key} {details.get(key) or 'none'}" for key in keys)
    if part == "devices" and isinstance(details.get("rows"), list):
        return "; ".join(
            f"{row.get('device')} ({row.get('label')}, {row.get('compute_capability')}) bf16 {row.get('bf16')} nf4 {row.get('nf4')}"
            for row in details["rows"]
        )
    if part == "gpu_check" and isinstance(details.get("runs"), list):
        runs = details["runs"]
        made = [run for run in runs if not run.get("skipped")]
        good = sum(1 for run in made if run.get("ok"))
        return f"{good}/{len(made)} runs within tolerance, {len(runs) - len(made)} skipped"
    if part == "stage_vs_peft" and "runs" not in details and isinstance(details.get("workload"), dict):
        planned = details["workload"]
        return (
            f"workload only: {planned['parameters'] / 1e9:.2f} B parameters, {planned['model']['num_layers']} "
            f"layers of hidden {planned['model']['hidden_size']}, {planned['sequence_len']} tokens, {planned['compute_dtype']}"
        )
    if part == "stage_vs_peft" and details.get("tokens_per_s_ratio_a_over_b") is not None:
        return (
            f"tokens/s stage / plain {details['tokens_per_s_ratio_a_over_b']:.3f} (target >= 0.95), "
            f"peak memory stage / plain {details.get('peak_memory_ratio_a_over_b')} (target <= 1.0)"
        )
    if part == "generate" and isinstance(details.get("one_stage_over_peft"), dict):
        one, two = details["one_stage_over_peft"], details.get("two_stages_concurrent_over_alone") or {}
        first = details.get("time_to_first_token_s") or {}
        return (
            f"one stage ÷ peft generate {one['median']:.3f} (target >= 0.9); two stages on one GPU, "
            f"8 in flight ÷ one alone {two.get('median', float('nan')):.3f} (target >= 1.6); first token "
            f"after {first.get('prompt_tokens')} tokens {first.get('one_stage')} s / {first.get('two_stages')} s"
        )
    if part == "torch_nf4_vs_bnb" and isinstance(details.get("tokens_per_s_ratio_a_over_b"), dict):
        extra = details.get("peak_memory_b_minus_a_median_bytes", 0) / MIB
        bound = details.get("dequantized_linear_bytes", 0) / MIB
        return (
            f"tokens/s bitsandbytes / PyTorch path {details['tokens_per_s_ratio_a_over_b']['median']:.3f}; "
            f"PyTorch path's extra peak {extra:.1f} MiB against one dequantized linear, {bound:.1f} MiB "
            f"(target <= 110 %)"
        )
    return ""


def derived_parts(gpu_check: dict[str, Any] | None) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """Status, summary and details of the parts read off gpu_check's report (None: no report)."""
    runs = (gpu_check or {}).get("runs") or []
    if not runs:
        why = "gpu_check made no run (see its part)"
        return {name: ("no data", why, {}) for name in DERIVED_PARTS}
    made = {run["run"]: run for run in runs if not run.get("skipped")}

    def verdict(names: list[str], what: str) -> tuple[str, str, dict[str, Any]]:
        chosen = [made[name] for name in names]
        if not chosen:
            return "no data", f"no {what} run was made (gpu_check skipped them or ran out of budget)", {}
        good = [run["run"] for run in chosen if run.get("ok")]
        status = "ok" if len(good) == len(chosen) else "fail"
        details = {run["run"]: _run_digest(run) for run in chosen}
        return status, f"{len(good)}/{len(chosen)} {what} runs within tolerance", details

    s2 = verdict([name for name in made if name.startswith("cuda+cuda/")], "cuda+cuda")
    fp16 = verdict([name for name in made if made[name].get("dtype") == "fp16"], "fp16")
    memory_rows = {name: made[name].get("memory") or [] for name in MEMORY_RUNS if name in made}
    ratios = [row.get("allocated_ratio") for rows in memory_rows.values() for row in rows]
    if not memory_rows:
        memory = ("no data", "none of " + ", ".join(MEMORY_RUNS) + " was made", {})
    else:
        above = [ratio for ratio in ratios if ratio is not None and ratio > 1]
        summary = ", ".join(
            f"{name}: " + " ".join(f"{row.get('stage')}:{row.get('allocated_ratio')}" for row in rows)
            for name, rows in memory_rows.items()
        )
        status = "above plan" if above else "ok"
        memory = (status, f"allocated/planned tensors per stage: {summary}", memory_rows)
    return {"s2_one_gpu": s2, "memory_vs_plan": memory, "fp16_loss_scaling": fp16}


def _run_digest(run: dict[str, Any]) -> dict[str, Any]:
    """The figures of one gpu_check run that a part's details keep."""
    keys = (
        "ok",
        "error",
        "eval_loss_rel",
        "step_loss_rel",
        "stage_dtypes",
        "skipped_steps",
        "memory",
        "footprint",
    )
    return {key: run[key] for key in keys if key in run}


def format_table(report: dict[str, Any]) -> str:
    """The report as a markdown table, one line per part, under a line saying what ran where."""
    install = next((row for row in report["parts"] if row["part"] == "install"), {})
    gpu = (install.get("details") or {}).get("gpu") or "no GPU recorded"
    mode = "dry run (CPU plumbing check, no GPU result)" if report["dry_run"] else gpu
    lines = [
        "# GPU suite",
        "",
        f"{mode}; {report['elapsed_s']:.0f} s of a {report['budget_s']:.0f} s budget"
        + ("" if report["complete"] else "; not complete"),
        "",
        "| part | status | seconds | limit s | summary |",
        "|---|---|---|---|---|",
    ]
    for row in report["parts"]:
        seconds = "" if row["seconds"] is None else f"{row['seconds']:.0f}"
        limit = "" if row["limit_s"] is None else f"{row['limit_s']:.0f}"
        summary = str(row["summary"]).replace("|", "/").replace("\n", " ")
        lines.append(f"| {row['part']} | {row['status']} | {seconds} | {limit} | {summary} |")
    return "\n".join(lines) + "\n"


#: Statuses that make the suite exit 1.
FAILING = ("fail", "timeout")
