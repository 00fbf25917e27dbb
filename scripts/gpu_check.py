"""One command for anyone with a GPU: does training on CUDA stages give the CPU's result, and does
the plan's memory prediction hold?

    python scripts/gpu_check.py [--json gpu-check.json] [--keep DIR] [--budget SECONDS]
                                [--only NAME ...] [--list]

It trains a small random Llama (6 layers, hidden size 256, NF4 + LoRA, 3 optimizer steps) with
``shardpool finetune`` as

  - one CUDA stage                                  (``cuda``),
  - two CUDA stages on one GPU, two processes       (``cuda+cuda``),
  - a CUDA stage and a CPU stage                    (``cuda+cpu``),

each in fp32, bf16 and fp16 (bf16 only where ``torch.cuda.is_bf16_supported()``), and the two
layouts of two stages once more in fp32 with their split moved in place after step 2
(``cuda+cuda/fp32 re-shard``, ``cuda+cpu/fp32 re-shard``: :data:`RESHARDS`; each rank measures
its room on its device first, then the LoRA and AdamW state cross between the devices). It
compares every run with one CPU stage in fp32 (the reference, always run first) within the
tolerances of :data:`TOLERANCES`, and a re-shard run must also have re-sharded to its split with
every rank reporting room above 0. ``--list`` prints the runs' names; ``--only`` picks some.

First a pre-flight: ``python -m bitsandbytes`` (its own diagnostic; every run is NF4, so when it
fails no run starts and the check says why in one line) and the GPU's compute mode
(``Exclusive_Process`` lets one process use the GPU, so the ``cuda+cuda`` runs are skipped with
that reason). The runs then go in :data:`PRIORITY` order (most informative first) within
``--budget`` seconds: each run's timeout is the budget left (at most :data:`RUN_TIMEOUT_S`), and
a run is not started once the longest run so far would not fit (it is reported ``skip budget``).

Memory, against the plan (``plan.json``), whose stage memory is planned tensors plus a reserve
(0.75 GiB per CUDA stage plus 5% of the tensors) for the CUDA context, cuBLAS workspaces, NCCL
buffers and the allocator's fragmentation:

  - per CUDA stage, ``torch.cuda.max_memory_allocated`` (from ``run_summary.json``) against the
    planned tensors, the stage memory without its reserve;
  - per run, the GPU's whole footprint (the peak of its used memory while the run goes, less what
    was used before, read through NVML or ``nvidia-smi``, so this process holds no CUDA context)
    less the stages' allocated peaks, against the CUDA stages' reserves.

A ratio above 1 is marked ``!``: the plan undercounts that part.

It prints the pre-flight and a table, then the same as JSON; ``--json`` is rewritten (atomically)
after every run, so a killed check leaves what finished. It exits 1 when any run fails or falls
outside its tolerance, or when no run was made (the pre-flight or the reference ruled them out, or
every run was skipped); 2 for an unknown run name. Without CUDA it prints one line saying it
skipped, and exits 0 (``.ci/run`` calls it on every machine).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
#: The test hook that forces a re-shard (``shardpool.contract.rebalance.FORCE_ENV``; this script
#: imports nothing of shardpool before it knows there is a GPU).
FORCE_ENV = "SHARDPOOL_TEST_RESHARD"

#: Largest relative difference from the CPU fp32 reference, per compute dtype, of the eval loss
#: after training and of each logged step's train loss. fp32 differs only by kernel order (cuBLAS
#: vs. the CPU's GEMMs, NF4 dequantization on the GPU); bf16 keeps 8 bits of mantissa (about 2
#: significant digits, so losses within 2%); fp16 keeps 11 bits but trains its LoRA updates in
#: fp16 activations (within 1%). These are set from reasoning, not yet from a run (docs/gpu.md).
TOLERANCES: dict[str, float] = {"fp32": 1e-3, "bf16": 2e-2, "fp16": 1e-2}
#: The config keys that select each compute dtype (axolotl's).
DTYPE_KEYS: dict[str, dict[str, bool]] = {
    "fp32": {"bf16": False, "fp16": False},
    "bf16": {"bf16": True, "fp16": False},
    "fp16": {"bf16": False, "fp16": True},
}
#: Stage layouts: the devices of each stage and the manual split of the model's 6 layers.
LAYOUTS: dict[str, tuple[list[str], list[int]]] = {
    "cpu": (["cpu"], [6]),
    "cuda": (["cuda:0"], [6]),
    "cuda+cuda": (["cuda:0", "cuda:0"], [3, 3]),
    "cuda+cpu": (["cuda:0", "cpu"], [3, 3]),
}
#: Layouts run once more in fp32 with a forced in-place re-shard after step 2 (the test hook
#: ``SHARDPOOL_TEST_RESHARD``, :mod:`shardpool.contract.rebalance`): stage 1 takes two layers from
#: stage 0 on one GPU; the CUDA stage takes one from the CPU stage.
RESHARDS: dict[str, str] = {"cuda+cuda": "2:0-1,1-6", "cuda+cpu": "2:0-4,4-6"}
#: The order the runs go in, most informative first, so a short budget still covers each mechanism
#: once: fp32 on each layout (kernels, the NCCL pair on one GPU, the CUDA-CPU boundary; fp32 has the
#: tightest tolerance), bf16 on one stage (the dtype a current card trains in), the two re-shards
#: (state crossing devices), then the remaining dtypes.
PRIORITY: tuple[str, ...] = (
    "cuda/fp32",
    "cuda+cuda/fp32",
    "cuda+cpu/fp32",
    "cuda/bf16",
    "cuda+cuda/fp32 re-shard",
    "cuda+cpu/fp32 re-shard",
    "cuda+cuda/bf16",
    "cuda+cpu/bf16",
    "cuda/fp16",
    "cuda+cuda/fp16",
    "cuda+cpu/fp16",
)
#: Default ``--budget``: fits a 15-minute device lease with room for the machine's start and a rerun.
DEFAULT_BUDGET_S = 420.0
#: The most one training run may take, whatever the budget left.
RUN_TIMEOUT_S = 300.0
#: The most ``python -m bitsandbytes`` (and the child that reads the device's facts) may take.
PREFLIGHT_TIMEOUT_S = 90.0
#: Compute modes under which only one process may use the GPU (nvidia-smi's names).
EXCLUSIVE_MODES = ("Exclusive_Process", "Exclusive_Thread")
#: NVML's compute mode numbers (``nvmlComputeMode_t``), by nvidia-smi's names.
NVML_COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}
_WORDS = (
    "alpha beta gamma delta stage layer pipeline adapter token gradient loss model tiny fast slow".split()
)


class UsageError(Exception):
    """A command line the check cannot run (an unknown run name); the message names the fix."""


@dataclass(frozen=True)
class Case:
    """One run: a stage layout (a key of :data:`LAYOUTS`) in one compute dtype."""

    layout: str
    dtype: str
    reshard: str | None = None  # STEP:START-STOP,... of a forced re-shard (:data:`RESHARDS`)

    @property
    def name(self) -> str:
        """How the table names it: ``cuda+cpu/bf16``, ``cuda+cpu/fp32 re-shard``."""
        return f"{self.layout}/{self.dtype}" + (" re-shard" if self.reshard else "")


def cases(*, bf16: bool, fp16: bool = True) -> list[Case]:
    """The runs to make on a device with (or without) bf16 and fp16: every CUDA layout in every
    dtype it has, then the re-shard runs in fp32."""
    dtypes = ["fp32"] + (["bf16"] if bf16 else []) + (["fp16"] if fp16 else [])
    plain = [Case(layout, dtype) for layout in ("cuda", "cuda+cuda", "cuda+cpu") for dtype in dtypes]
    return plain + [Case(layout, "fp32", split) for layout, split in RESHARDS.items()]


def by_priority(runs: Iterable[Case]) -> list[Case]:
    """``runs`` in :data:`PRIORITY` order (most informative first)."""
    return sorted(runs, key=lambda case: PRIORITY.index(case.name))


def select(runs: Sequence[Case], only: Sequence[str] | None) -> list[Case]:
    """The runs ``--only`` names (all of them without ``--only``), in :data:`PRIORITY` order.

    UsageError for a name that is no run, listing the valid names, so a typo does not silently
    check less than asked."""
    known = {case.name: case for case in runs}
    unknown = [name for name in only or () if name not in known]
    if unknown:
        raise UsageError(
            f"unknown run {', '.join(map(repr, unknown))}; pick from: "
            + ", ".join(case.name for case in by_priority(runs))
        )
    return by_priority(runs if not only else [known[name] for name in dict.fromkeys(only)])


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


def run_config(case: Case, *, model: Path, data: Path, output_dir: Path) -> dict[str, Any]:
    """The ``shardpool finetune`` config of one case: deterministic (fp32 LoRA, file order, no dropout)."""
    devices, layers = LAYOUTS[case.layout]
    return {
        "base_model": str(model),
        "adapter": "qlora",
        "load_in_4bit": True,
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "lora_target_linear": True,
        "datasets": [{"path": str(data), "type": "completion"}],
        "val_set_size": 8,
        "sequence_len": 64,
        "shuffle_merged_datasets": False,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "max_steps": 3,
        "learning_rate": 0.002,
        "lr_scheduler": "constant",
        "max_grad_norm": 1.0,
        "seed": 7,
        "output_dir": str(output_dir),
        "logging_steps": 1,
        **DTYPE_KEYS[case.dtype],
        "shardpool": {"devices": devices, "layers": layers, "rebalance": "auto" if case.reshard else "off"},
    }


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


# ----- memory against the plan ----------------------------------------------------------------
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


# ----- pre-flight -----------------------------------------------------------------------------
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


# ----- budget ---------------------------------------------------------------------------------
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
    """One run's timeout: the budget left, at most :data:`RUN_TIMEOUT_S` (at least 1 s)."""
    return max(1.0, min(RUN_TIMEOUT_S, budget_s - elapsed_s))


def exit_status(rows: Sequence[dict[str, Any]]) -> int:
    """0 when every run that ran is within tolerance (skipped runs do not count), else 1; also 1
    when none ran (every one skipped: nothing was checked)."""
    ran = [row["ok"] for row in rows if row["ok"] is not None]
    return 0 if ran and all(ran) else 1


# ----- report ---------------------------------------------------------------------------------
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


# ----- the device -----------------------------------------------------------------------------
def skip_reason() -> str | None:
    """Why this machine cannot run the check (no torch with CUDA), or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


class GpuMemory:
    """The used memory and compute mode of one GPU, read without a CUDA context in this process (a
    context here would count as the stages' footprint and, under an exclusive compute mode, keep
    them off the GPU): NVML through the driver's ``libnvidia-ml.so.1`` (as torch reads device
    counts), else ``nvidia-smi``. ``source`` is None where neither answers."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.source: str | None = None
        self._nvml: Any = None
        self._handle = ctypes.c_void_p()
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            if (
                nvml.nvmlInit_v2() == 0
                and nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self._handle)) == 0
            ):
                self._nvml, self.source = nvml, "nvml"
        except (OSError, AttributeError):
            pass
        if self.source is None and shutil.which("nvidia-smi"):
            self.source = "nvidia-smi"

    def used_bytes(self) -> int | None:
        """The GPU's used memory now (every process's, the driver's own included)."""
        if self._nvml is not None:
            info = _NvmlMemory()
            return (
                int(info.used)
                if self._nvml.nvmlDeviceGetMemoryInfo(self._handle, ctypes.byref(info)) == 0
                else None
            )
        if self.source == "nvidia-smi":
            return parse_smi_mib(self._smi("memory.used", "--format=csv,noheader,nounits"))
        return None

    def compute_mode(self) -> tuple[str | None, str | None]:
        """The compute mode and where it was read (nvidia-smi first, else NVML)."""
        if shutil.which("nvidia-smi"):
            mode = parse_compute_mode(self._smi("compute_mode", "--format=csv,noheader"))
            if mode is not None:
                return mode, "nvidia-smi"
        if self._nvml is not None:
            value = ctypes.c_int(-1)
            if self._nvml.nvmlDeviceGetComputeMode(self._handle, ctypes.byref(value)) == 0:
                return NVML_COMPUTE_MODES.get(value.value), "nvml"
        return None, None

    def _smi(self, query: str, fmt: str) -> str:
        try:
            done = subprocess.run(
                ["nvidia-smi", f"--query-gpu={query}", fmt, "-i", str(self.index)],
                capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout if done.returncode == 0 else ""


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _nvml_index() -> int:
    """NVML's index of ``cuda:0`` (CUDA_VISIBLE_DEVICES taken into account), 0 where torch cannot say."""
    import torch

    try:
        return int(torch.cuda._get_nvml_device_index(0))
    except Exception:  # a private helper: any failure means "assume the first GPU"
        return 0


def _child(code: list[str], timeout_s: float) -> tuple[int | None, str, str]:
    """Run a Python child; its exit status (None: timed out), stdout and stderr."""
    try:
        done = subprocess.run(
            [sys.executable, *code], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return None, "", ""
    return done.returncode, done.stdout, done.stderr


_FACTS = (
    "import json, torch; p = torch.cuda.get_device_properties(0); print(json.dumps({"
    "'device': p.name, 'compute_capability': f'{p.major}.{p.minor}', 'torch': torch.__version__, "
    "'bf16': torch.cuda.is_bf16_supported(including_emulation=False)}))"
)


def _device_facts() -> dict[str, Any] | str:
    """The GPU's name, capability and bf16 support, read in a child (so no context stays here); or
    the one line saying why they could not be read."""
    code, out, err = _child(["-c", _FACTS], PREFLIGHT_TIMEOUT_S)
    facts = [line for line in out.splitlines() if line.startswith("{")]
    if code != 0 or not facts:
        errors = [line for line in err.splitlines() if line.strip()]
        return f"the GPU's facts could not be read (exit {code}): {errors[-1] if errors else 'no output'}"
    return dict(json.loads(facts[-1]))


def _preflight(gpu: GpuMemory) -> dict[str, Any]:
    """bitsandbytes' own diagnostic, the compute mode and what it rules out, and the memory reader."""
    code, out, err = _child(["-m", "bitsandbytes"], PREFLIGHT_TIMEOUT_S)
    mode, source = gpu.compute_mode()
    return {
        "bitsandbytes": bitsandbytes_verdict(code, out + err),
        "compute_mode": {"mode": mode, "source": source, "blocked": blocked_layouts(mode)},
        "device_memory": gpu.source,
    }


# ----- the runs -------------------------------------------------------------------------------
def _data(path: Path) -> Path:
    rows = [
        {"text": " ".join(_WORDS[(i * 5 + k * 3) % len(_WORDS)] for k in range(4 + i % 23))}
        for i in range(72)
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
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", type=Path, help="also write the JSON report here (rewritten after every run)"
    )
    parser.add_argument(
        "--keep", type=Path, help="work in this directory and keep it (default: a temporary one)"
    )
    parser.add_argument(
        "--budget", type=float, default=DEFAULT_BUDGET_S,
        help=f"seconds for the whole check; runs that no longer fit are skipped (default {DEFAULT_BUDGET_S:g})",
    )  # fmt: skip
    parser.add_argument("--only", nargs="+", metavar="NAME", help="make only these runs (see --list)")
    parser.add_argument(
        "--list", action="store_true", help="print the runs' names, in the order they go, and exit"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Pre-flight, the reference, then the chosen runs within the budget; print the table and the
    JSON. 0 when all that ran are within tolerance (or the machine has no CUDA)."""
    args = _parser().parse_args(argv)
    every = cases(bf16=True)
    if args.list:
        print("\n".join(case.name for case in by_priority(every)))
        return 0
    try:
        chosen = select(every, args.only)
    except UsageError as error:
        print(f"gpu_check: {error}", file=sys.stderr)
        return 2
    reason = skip_reason()
    if reason is not None:
        print(f"gpu_check: skipped: {reason}")
        return 0
    sys.path.insert(0, str(REPO_ROOT))
    started = time.monotonic()
    gpu = GpuMemory(_nvml_index())
    preflight = _preflight(gpu)
    print(format_preflight(preflight), file=sys.stderr, flush=True)
    facts = _device_facts()
    if isinstance(facts, str):
        print(f"gpu_check: {facts}")
        return 1
    report: dict[str, Any] = facts | {
        "preflight": preflight,
        "budget_s": args.budget,
        "tolerances": TOLERANCES,
    }
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        work = args.keep or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        ruled_out = _run_all(
            chosen, report, work=work, gpu=gpu, started=started, budget_s=args.budget, json_path=args.json
        )
    print(format_preflight(preflight))
    print(format_table(report["runs"]))
    print(json.dumps(report, indent=2))
    if ruled_out is not None:
        print(f"gpu_check: no run made: {ruled_out}")
        return 1
    return exit_status(report["runs"])


def _run_all(
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
                f"gpu_check: {case.name}: {_verdict(rows[-1])} in {durations[-1]:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        save(complete=False)
    save(complete=True)
    return ruled_out


def _verdict(row: dict[str, Any]) -> str:
    return "ok" if row["ok"] else f"FAIL ({row['error']})" if row.get("error") else "outside tolerance"


if __name__ == "__main__":
    sys.exit(main())
