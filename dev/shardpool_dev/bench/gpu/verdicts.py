"""How the GPU check judges a run: against the CPU reference, against its plan's memory, and whether it may run at all."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from shardpool_dev.bench.gpu.cases import PREFLIGHT_TIMEOUT_S, RUN_TIMEOUT_S, TOLERANCES, Case

#: Compute modes under which only one process may use the GPU (nvidia-smi's names).
EXCLUSIVE_MODES = ("Exclusive_Process", "Exclusive_Thread")


#: NVML's compute mode numbers (``nvmlComputeMode_t``), by nvidia-smi's names.
NVML_COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}


def reshard_outcome(case: Case, metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """For a re-shard case: the split the run moved to, each rank's room at the check, and whether
    it moved to the forced split with every rank reporting room above 0 (empty for other cases)."""
    if case.reshard is None:
        return {}
    from shardpool.contract.rebalance import parse_forced_reshard

    expected = [list(pair) for pair in parse_forced_reshard(case.reshard)[1]]
    moved = [line["to"] for line in metrics if line.get("event") == "rebalance"]
    rooms = [line["stage_room_bytes"] for line in metrics if line.get("stage_room_bytes") is not None]
    to, room = (moved[0] if moved else None), (rooms[0] if rooms else None)
    ok = to == expected and room is not None and min(room) > 0
    return {"resharded_to": to, "room_bytes": room, "reshard_ok": ok}


def relative_difference(value: float | None, reference: float | None) -> float | None:
    """``|value - reference| / |reference|`` (None when either is missing)."""
    if value is None or reference is None:
        return None
    return abs(value - reference) / max(abs(reference), 1e-12)


def compare(result: dict[str, Any], reference: dict[str, Any], dtype: str) -> dict[str, Any]:
    """How far a run's eval loss and step losses are from the reference's, and whether within tolerance."""
    eval_diff = relative_difference(result.get("eval_loss"), reference.get("eval_loss"))
    step_diffs = [
        relative_difference(loss, ref)
        for loss, ref in zip(result.get("losses", []), reference.get("losses", []), strict=False)
    ]
    step_diff = max((diff for diff in step_diffs if diff is not None), default=None)
    limit = TOLERANCES[dtype]
    complete = eval_diff is not None and len(step_diffs) == len(reference.get("losses", [])) > 0
    within = complete and eval_diff <= limit and step_diff is not None and step_diff <= limit  # type: ignore[operator]
    return {"eval_loss_rel": eval_diff, "step_loss_rel": step_diff, "tolerance": limit, "ok": bool(within)}


def what_ran(plan: dict[str, Any], metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """The dtype each stage really computed in (the planner chooses it from the device under the
    config's cap: an fp16 case on a card below 7.0 runs fp32) and the steps the fp16 loss scale
    skipped (a skipped step trains less than the reference, so later losses may leave tolerance)."""
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    return {
        "stage_dtypes": [short.get(stage.get("dtype") or "", "config") for stage in plan.get("stages", [])],
        "skipped_steps": [line["step"] for line in metrics if line.get("skipped_step")],
    }


def ratio(measured: float | None, planned: float | None) -> float | None:
    """``measured / planned`` to 3 decimals (None when either is missing or nothing was planned)."""
    if measured is None or not planned or planned <= 0:
        return None
    return round(measured / planned, 3)


def above_plan(value: float | None) -> bool:
    """Whether a measured/planned ratio says the plan undercounts (above 1)."""
    return value is not None and value > 1


def planned_reserve_bytes(stage: dict[str, Any]) -> int:
    """The reserve part of a ``plan.json`` stage's memory: its ``memory_breakdown["reserve"]``, or
    for a plan without the breakdown, the planner's own formula (memory = tensors + base + 5% of
    tensors, :func:`shardpool.plan.memory_model.reserve_bytes`) solved for the reserve."""
    breakdown = stage.get("memory_breakdown") or {}
    if "reserve" in breakdown:
        return int(breakdown["reserve"])
    from shardpool.plan.memory_model import FRAGMENTATION, reserve_base_bytes

    memory = int(stage.get("memory_bytes") or 0)
    base = reserve_base_bytes(str(stage.get("device", "cuda")).split(":")[0])
    tensors = max(0.0, (memory - base) / (1 + FRAGMENTATION))
    return int(round(min(float(memory), base + FRAGMENTATION * tensors)))


def memory_ratios(plan: dict[str, Any], summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Per CUDA stage: the planned memory split into tensors and reserve, the measured peaks, and
    ``max_memory_allocated`` against the planned tensors (the reserve is not for tensors, so it is
    left out of the denominator; above 1: the plan undercounts the stage's tensors).

    A re-sharded run's peak spans its plans (``plan.json``'s ``history``), so each stage is set
    against the plan that gave it the most tensors."""
    plans = [plan, *(plan.get("history") or [])]
    rows = []
    for rank in summary.get("ranks", []):
        index = rank["stage"]
        if not str(plan["stages"][index].get("device", "")).startswith("cuda"):
            continue
        planned = [
            _planned_parts(each["stages"][index]) for each in plans if index < len(each.get("stages", []))
        ]
        predicted, reserve = max(planned, key=lambda parts: parts[0] - parts[1])
        allocated = rank.get("peak_device_bytes")
        allocated_ratio = ratio(allocated, predicted - reserve)
        rows.append(
            {
                "stage": index,
                "predicted_bytes": predicted,
                "reserve_bytes": reserve,
                "predicted_tensor_bytes": predicted - reserve,
                "max_allocated_bytes": allocated,
                "max_reserved_bytes": rank.get("peak_device_reserved_bytes"),
                "allocated_ratio": allocated_ratio,
                "above_plan": above_plan(allocated_ratio),
            }
        )
    return rows


def _planned_parts(stage: dict[str, Any]) -> tuple[int, int]:
    """A ``plan.json`` stage's planned memory and the reserve part of it."""
    return int(stage.get("memory_bytes") or 0), planned_reserve_bytes(stage)


def device_footprint(memory: list[dict[str, Any]], footprint_bytes: int | None) -> dict[str, Any]:
    """The run's whole footprint on the GPU against what the plan reserved for it.

    ``footprint_bytes`` is the peak of the GPU's used memory during the run less what was used
    before (every stage process on it: tensors, the caching allocator's spare blocks, the CUDA
    context, cuBLAS workspaces, NCCL buffers). Less the stages' allocated peaks, it is what the
    reserve is for; ``reserve_ratio`` sets it against the CUDA stages' planned reserves (above 1:
    the reserve is too small). ``beyond_allocator_bytes`` is the part torch's allocator does not
    hold at all (the footprint less the stages' reserved peaks)."""
    allocated = sum(row["max_allocated_bytes"] or 0 for row in memory)
    reserved = sum(row["max_reserved_bytes"] or 0 for row in memory)
    reserve = sum(row["reserve_bytes"] for row in memory)
    if footprint_bytes is None or not memory:
        return {"footprint_bytes": footprint_bytes, "reserve_bytes": reserve, "reserve_ratio": None}
    reserve_ratio = ratio(footprint_bytes - allocated, reserve)
    return {
        "footprint_bytes": footprint_bytes,
        "allocated_bytes": allocated,
        "reserved_bytes": reserved,
        "beyond_allocator_bytes": footprint_bytes - reserved,
        "beyond_tensors_bytes": footprint_bytes - allocated,
        "reserve_bytes": reserve,
        "reserve_ratio": reserve_ratio,
        "above_plan": above_plan(reserve_ratio),
    }


def bitsandbytes_verdict(returncode: int | None, output: str) -> dict[str, Any]:
    """What ``python -m bitsandbytes`` said, in one line: ok only when it exited 0 having printed
    ``SUCCESS!`` (its CUDA sanity check passed). ``returncode`` None means it timed out."""
    version = re.search(r"bitsandbytes v(\S+)", output)
    found = {"version": version.group(1) if version else None}
    if returncode is None:
        return found | {
            "ok": False,
            "detail": f"python -m bitsandbytes did not finish in {PREFLIGHT_TIMEOUT_S:g} s",
        }
    if re.search(r"No module named '?bitsandbytes'?(\s|$)", output):
        return found | {"ok": False, "detail": "bitsandbytes is not installed (pip install bitsandbytes)"}
    if returncode == 0 and "SUCCESS!" in output:
        return found | {"ok": True, "detail": "python -m bitsandbytes: SUCCESS"}
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    telling = (
        r"library load error",
        r"^[\w.]*(Error|Exception)\b",
        r"CPU-only",
        r"failed to load",
        r"^PyTorch says",
        r"^No CUDA",
    )
    why = next(
        (line for pattern in telling for line in reversed(lines) if re.search(pattern, line)),
        lines[-1] if lines else "no output",
    )
    return found | {"ok": False, "detail": f"python -m bitsandbytes failed (exit {returncode}): {why[:300]}"}


def parse_compute_mode(text: str) -> str | None:
    """The compute mode in ``nvidia-smi --query-gpu=compute_mode --format=csv,noheader`` output
    (None when it names none, e.g. ``[N/A]``)."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return first if first in NVML_COMPUTE_MODES.values() else None


def blocked_layouts(mode: str | None) -> dict[str, str]:
    """The layouts the GPU's compute mode rules out, each with why: an exclusive mode lets one
    process use the GPU, so two stage processes on it cannot both start; ``Prohibited`` lets none."""
    fix = "(nvidia-smi -c DEFAULT, as root)"
    if mode == "Prohibited":
        return {
            layout: f"compute mode Prohibited lets no process use the GPU {fix}"
            for layout in ("cuda", "cuda+cuda", "cuda+cpu")
        }
    if mode in EXCLUSIVE_MODES:
        return {
            "cuda+cuda": f"compute mode {mode} lets one process use the GPU; two stages on it need Default {fix}"
        }
    return {}


def parse_smi_mib(text: str) -> int | None:
    """Bytes from ``nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits`` (MiB)."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return int(float(first) * 2**20) if re.fullmatch(r"\d+(\.\d+)?", first) else None


def why_skipped(
    case: Case,
    *,
    bf16: bool,
    blocked: dict[str, str],
    elapsed_s: float,
    durations_s: Sequence[float],
    budget_s: float,
) -> str | None:
    """Why ``case`` is not started (None: start it): the device has no bf16, the compute mode
    rules its layout out, or the budget left is shorter than the longest run so far."""
    if case.dtype == "bf16" and not bf16:
        return "this device has no bf16"
    if case.layout in blocked:
        return blocked[case.layout]
    if elapsed_s + max(durations_s, default=0.0) > budget_s:
        return "budget"
    return None


def run_timeout_s(elapsed_s: float, budget_s: float) -> float:
    """One run's timeout: the budget left, at most :data:`shardpool_dev.bench.gpu.cases.RUN_TIMEOUT_S` (at least 1 s)."""
    return max(1.0, min(RUN_TIMEOUT_S, budget_s - elapsed_s))


def exit_status(rows: Sequence[dict[str, Any]]) -> int:
    """0 when every run that ran is within tolerance (skipped runs do not count), else 1; also 1
    when none ran (every one skipped: nothing was checked)."""
    ran = [row["ok"] for row in rows if row["ok"] is not None]
    return 0 if ran and all(ran) else 1
