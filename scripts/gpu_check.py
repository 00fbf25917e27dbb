"""One command for anyone with a GPU: does training on CUDA stages give the CPU's result, and does
the plan's memory prediction hold?

    python scripts/gpu_check.py [--json gpu-check.json] [--keep DIR]

It trains a small random Llama (6 layers, hidden size 256, NF4 + LoRA, 3 optimizer steps) with
``shardpool finetune`` as

  - one CUDA stage                                  (``cuda``),
  - two CUDA stages on one GPU, two processes       (``cuda+cuda``),
  - a CUDA stage and a CPU stage                    (``cuda+cpu``),

each in fp32, bf16 and fp16 (bf16 only where ``torch.cuda.is_bf16_supported()``), and the two
layouts of two stages once more in fp32 with their split moved in place after step 2
(``cuda+cuda/fp32 re-shard``, ``cuda+cpu/fp32 re-shard``: :data:`RESHARDS`; each rank measures
its room on its device first, then the LoRA and AdamW state cross between the devices). It
compares every run with one CPU stage in fp32 (the reference) within the tolerances of
:data:`TOLERANCES`, and a re-shard run must also have re-sharded to its split with every rank
reporting room above 0. For each CUDA stage it also sets ``torch.cuda.max_memory_allocated`` and
``max_memory_reserved`` (from ``run_summary.json``) against the plan's predicted stage memory
(``plan.json``), as ratios, so the planner's reserve constants can be set from measurement.

It prints a table, then the same as JSON (and writes it to ``--json``). It exits 1 when any run
fails or falls outside its tolerance. Without CUDA it prints one line saying it skipped, and
exits 0 (``.ci/run`` calls it on every machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
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
_WORDS = (
    "alpha beta gamma delta stage layer pipeline adapter token gradient loss model tiny fast slow".split()
)


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


def memory_ratios(plan: dict[str, Any], summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Per CUDA stage: the plan's predicted memory and the measured peaks, as ratios measured / predicted."""
    rows = []
    for rank in summary.get("ranks", []):
        stage = plan["stages"][rank["stage"]]
        if not str(stage.get("device", "")).startswith("cuda"):
            continue
        predicted = int(stage.get("memory_bytes") or 0)
        allocated, reserved = rank.get("peak_device_bytes"), rank.get("peak_device_reserved_bytes")
        rows.append(
            {
                "stage": rank["stage"],
                "predicted_bytes": predicted,
                "max_allocated_bytes": allocated,
                "max_reserved_bytes": reserved,
                "allocated_ratio": round(allocated / predicted, 3) if allocated and predicted else None,
                "reserved_ratio": round(reserved / predicted, 3) if reserved and predicted else None,
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The report as a fixed-width table: one line per run, memory ratios per CUDA stage."""
    header = f"{'run':<24} {'ok':<4} {'eval loss':>10} {'eval rel':>9} {'step rel':>9} {'tol':>7}  memory (stage: alloc/pred, reserved/pred)"
    lines = [header, "-" * len(header)]
    for row in rows:
        if row.get("error"):
            lines.append(f"{row['run']:<24} {'FAIL':<4} {row['error']}")
            continue
        memory = ", ".join(
            f"{m['stage']}: {_ratio(m['allocated_ratio'])}/{_ratio(m['reserved_ratio'])}"
            for m in row.get("memory", [])
        )
        lines.append(
            f"{row['run']:<24} {'yes' if row['ok'] else 'NO':<4} {_number(row.get('eval_loss'), '.4f'):>10} "
            f"{_number(row.get('eval_loss_rel'), '.1e'):>9} {_number(row.get('step_loss_rel'), '.1e'):>9} "
            f"{_number(row.get('tolerance'), '.0e'):>7}  {memory or '-'}"
        )
    return "\n".join(lines)


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def skip_reason() -> str | None:
    """Why this machine cannot run the check (no torch with CUDA), or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def _data(path: Path) -> Path:
    rows = [
        {"text": " ".join(_WORDS[(i * 5 + k * 3) % len(_WORDS)] for k in range(4 + i % 23))}
        for i in range(72)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _train(case: Case, work: Path, model: Path, data: Path) -> dict[str, Any]:
    """Run ``shardpool finetune`` for one case; its losses, plan and summary (or the error line)."""
    output_dir = work / case.name.replace("/", "-")
    config = work / f"{output_dir.name}.yaml"
    config.write_text(yaml.safe_dump(run_config(case, model=model, data=data, output_dir=output_dir)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop(FORCE_ENV, None)
    if case.reshard is not None:
        env[FORCE_ENV] = case.reshard
    done = subprocess.run(
        [sys.executable, "-m", "shardpool", "finetune", str(config)],
        capture_output=True, text=True, env=env, timeout=1800, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return {"error": lines[-1] if lines else f"exit status {done.returncode}"}
    summary = json.loads((output_dir / "run_summary.json").read_text())
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((output_dir / "plan.json").read_text())
    return {
        "eval_loss": summary.get("eval_loss_after"),
        "losses": [line["loss"] for line in metrics if "loss" in line],
        "plan": plan,
        "summary": summary,
        "ran": what_ran(plan, metrics),
        "reshard": reshard_outcome(case, metrics),
    }


def main(argv: list[str] | None = None) -> int:
    """Run every case, print the table and the JSON; 0 when all are within tolerance (or skipped)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the JSON report here")
    parser.add_argument(
        "--keep", type=Path, help="work in this directory and keep it (default: a temporary one)"
    )
    args = parser.parse_args(argv)
    reason = skip_reason()
    if reason is not None:
        print(f"gpu_check: skipped: {reason}")
        return 0
    import torch

    sys.path.insert(0, str(REPO_ROOT))
    from shardpool.model.tinymodel import make_tiny_llama

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        work = args.keep or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        model = make_tiny_llama(work / "model", num_layers=6, hidden_size=256, intermediate_size=512, seed=3)
        data = _data(work / "data.jsonl")
        reference = _train(Case("cpu", "fp32"), work, model, data)
        if "error" in reference:
            print(f"gpu_check: the CPU fp32 reference run failed: {reference['error']}")
            return 1
        rows: list[dict[str, Any]] = []
        for case in cases(bf16=torch.cuda.is_bf16_supported(including_emulation=False)):
            result = _train(case, work, model, data)
            row: dict[str, Any] = {"run": case.name, "layout": case.layout, "dtype": case.dtype}
            if "error" in result:
                rows.append(row | {"error": result["error"], "ok": False})
                continue
            compared = compare(result, reference, case.dtype)
            moved = result["reshard"]
            rows.append(
                row
                | {"eval_loss": result["eval_loss"]}
                | result["ran"]
                | compared
                | moved
                | {"ok": compared["ok"] and moved.get("reshard_ok", True)}
                | {"memory": memory_ratios(result["plan"], result["summary"])}
            )
    report = {
        "device": torch.cuda.get_device_name(0),
        "compute_capability": "{}.{}".format(*torch.cuda.get_device_capability(0)),
        "torch": torch.__version__,
        "reference_eval_loss": reference["eval_loss"],
        "tolerances": TOLERANCES,
        "runs": rows,
    }
    print(format_table(rows))
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
