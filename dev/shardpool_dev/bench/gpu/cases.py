"""The runs of the GPU check: stage layouts, compute dtypes, forced re-shards, their order and their configs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
#: The most ``python -m bitsandbytes`` (and the child that reads the device's facts) may take.
PREFLIGHT_TIMEOUT_S = 90.0


#: The most one training run may take, whatever the budget left.
RUN_TIMEOUT_S = 300.0


WORDS = "alpha beta gamma delta stage layer pipeline adapter token gradient loss model tiny fast slow".split()


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
    """The runs ``--only`` names, once each in the order named (so a rerun can put first what is
    still unmeasured); without ``--only`` all of them, in :data:`PRIORITY` order.

    UsageError for a name that is no run, listing the valid names, so a typo does not silently
    check less than asked."""
    known = {case.name: case for case in runs}
    unknown = [name for name in only or () if name not in known]
    if unknown:
        raise UsageError(
            f"unknown run {', '.join(map(repr, unknown))}; pick from: "
            + ", ".join(case.name for case in by_priority(runs))
        )
    return [known[name] for name in dict.fromkeys(only)] if only else by_priority(runs)


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
