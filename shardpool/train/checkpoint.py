"""Checkpoints: adapter, optimizer, scheduler position, RNG and data position, saved atomically.

Each stage sends its part into ``checkpoints/checkpoint-N.partial`` on the launching machine;
after a barrier, the launcher merges the adapter and renames the directory to
``checkpoints/checkpoint-N`` (Hugging Face's name) in one step. A crash while saving leaves a
``.partial`` directory that is ignored (and cleared by the next run), and the previous checkpoint
untouched. Checkpoints named ``step-N``, as shardpool named them before, are still resumed from.

Every tensor is keyed by its global adapter key, so a checkpoint written by one split of the
layers can be resumed by another.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from mesh.files import write_json
from shardpool.contract.liveness import rng_file_name, stage_file_name
from shardpool.errors import ShardpoolError
from shardpool.model.lora import LoraSettings, write_adapter

__all__ = [
    "partial_dir",
    "stage_state_tensors",
    "DeviceRng",
    "device_rng",
    "rng_state_tensors",
    "restore_rng_state",
    "stage_file",
    "rng_file",
    "read_stage_lora",
    "merge_stage_lora",
    "finalize_checkpoint",
    "newest_checkpoint",
    "read_lora_and_optimizer",
    "lora_and_optimizer_from",
    "read_rng_state",
    "checkpoint_step",
    "checkpoint_eval_before",
    "clear_partials",
    "resume_point",
    "checkpoints_to_delete",
    "prune_checkpoints",
]

CHECKPOINT_PREFIX = "checkpoint-"
_CHECKPOINT_DIR = re.compile(r"(checkpoint|step)-([0-9]+)")  # step-N: by earlier versions
# torch AdamW's state, then bitsandbytes' (8-bit: uint8 states with their quantization maps).
_OPTIM_FIELDS = ("exp_avg", "exp_avg_sq", "step", "state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2")


def checkpoints_root(output_dir: str | Path) -> Path:
    """``output_dir/checkpoints``."""
    return Path(output_dir) / "checkpoints"


def partial_dir(output_dir: str | Path, step: int) -> Path:
    """The directory a checkpoint is assembled in before it is renamed into place."""
    return checkpoints_root(output_dir) / f"{CHECKPOINT_PREFIX}{step}.partial"


def stage_state_tensors(
    *, named_parameters: list[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """One stage's LoRA tensors and optimizer state (torch or bitsandbytes AdamW), keyed by global adapter key."""
    tensors: dict[str, torch.Tensor] = {}
    for key, param in named_parameters:
        tensors[f"lora.{key}"] = param.detach()
        state = optimizer.state.get(param, {})
        for field in _OPTIM_FIELDS:
            if field in state:
                value = state[field]
                tensors[f"optim.{key}.{field}"] = (
                    value if torch.is_tensor(value) else torch.tensor(float(value))
                )
    return tensors


#: Key of the loss scale (and its finite-step count) in a rank's RNG file, in runs that scale the loss.
LOSS_SCALE_KEY = "loss_scale"


#: Key of the CPU generator's state in a rank's RNG file; a device's is keyed by its kind (``cuda``, ...).
CPU_RNG_KEY = "cpu"


@dataclass(frozen=True)
class DeviceRng:
    """Where a device kind keeps its random state: ``torch.<module>.get_rng_state`` / ``set_rng_state``."""

    module: str
    #: Whether the functions take the device: MPS has one generator, and older torch takes no argument there.
    takes_device: bool


_DEVICE_RNGS = {
    "cuda": DeviceRng("cuda", takes_device=True),
    "xpu": DeviceRng("xpu", takes_device=True),
    "mps": DeviceRng("mps", takes_device=False),
}


def device_rng(device_type: str) -> DeviceRng | None:
    """The RNG state functions of a device kind, or None where it has no generator of its own (CPU).

    Dropout on a CUDA, MPS or XPU stage draws from that device's generator, not the CPU's, so a
    checkpoint holds both for a resumed run to draw the same masks.
    """
    return _DEVICE_RNGS.get(device_type)


def rng_state_tensors(device: torch.device) -> dict[str, torch.Tensor]:
    """The torch RNG state of this process (dropout draws depend on it): the CPU's, and ``device``'s.

    The device's state is keyed by its kind (``cuda``, ``mps``, ``xpu``); a CPU stage has none.
    """
    tensors = {CPU_RNG_KEY: torch.get_rng_state()}
    rng = device_rng(device.type)
    if rng is not None:
        functions = getattr(torch, rng.module)
        tensors[rng.module] = functions.get_rng_state(*_device_argument(rng, device))
    return tensors


def restore_rng_state(saved: dict[str, torch.Tensor], device: torch.device) -> None:
    """Set this process's RNG state (the CPU's, and ``device``'s) from a rank's RNG file.

    A device state saved by another kind of device is skipped, as is its absence (checkpoints of
    earlier versions, or from a CPU stage): those draws came from another generator, which no
    state here can repeat.
    """
    torch.set_rng_state(saved[CPU_RNG_KEY])
    rng = device_rng(device.type)
    if rng is not None and rng.module in saved:
        functions = getattr(torch, rng.module)
        functions.set_rng_state(saved[rng.module], *_device_argument(rng, device))


def _device_argument(rng: DeviceRng, device: torch.device) -> tuple[torch.device, ...]:
    return (device,) if rng.takes_device else ()


def stage_file(stage_index: int) -> str:
    """File name of one stage's state inside a checkpoint."""
    return stage_file_name(stage_index)


def rng_file(rank: int) -> str:
    """File name of one rank's RNG state inside a checkpoint."""
    return rng_file_name(rank)


def finalize_checkpoint(
    directory: Path, *, step: int, settings: LoraSettings, base_model: str, extra: dict[str, object]
) -> Path:
    """Merge the stages' LoRA tensors into an adapter, record the step, and rename into place."""
    write_adapter(directory, merge_stage_lora(directory), settings, base_model=base_model)
    write_json(directory / "checkpoint.json", {"step": step, **extra})
    final = directory.parent / f"{CHECKPOINT_PREFIX}{step}"
    if final.exists():
        stale = directory.parent / f"{CHECKPOINT_PREFIX}{step}.stale"
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    directory.rename(final)
    return final


def checkpoints_to_delete(steps: list[int], *, keep: int | None) -> list[int]:
    """Of the complete checkpoints at ``steps``, those ``save_total_limit: keep`` deletes: all but the newest ``keep``.

    The newest is always kept (``keep`` is at least 1): it is the one ``--resume`` starts from.
    """
    if keep is None:
        return []
    newest_first = sorted(set(steps), reverse=True)
    return sorted(newest_first[max(1, keep) :])


def prune_checkpoints(output_dir: str | Path, *, keep: int | None) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints; return those deleted.

    Each is first renamed to ``.stale`` (one atomic step, after which it is no checkpoint; a crash
    leaves the ``.stale`` directory for :func:`clear_partials`), then removed.
    """
    complete = _complete_checkpoints(output_dir)
    doomed = set(checkpoints_to_delete([step for step, _, _ in complete], keep=keep))
    deleted = []
    for step, _, directory in complete:
        if step in doomed:
            stale = directory.with_name(directory.name + ".stale")
            shutil.rmtree(stale, ignore_errors=True)
            directory.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
            deleted.append(directory)
    return deleted


def _complete_checkpoints(output_dir: str | Path) -> list[tuple[int, bool, Path]]:
    """(step, named checkpoint-N, directory) of every complete checkpoint (``checkpoint.json`` written)."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    complete = []
    for child in root.iterdir():
        match = _CHECKPOINT_DIR.fullmatch(child.name)
        if match and (child / "checkpoint.json").is_file():
            complete.append((int(match.group(2)), match.group(1) == "checkpoint", child))
    return complete


def read_stage_lora(path: Path) -> dict[str, torch.Tensor]:
    """The LoRA tensors (global adapter keys) in one stage's state file."""
    return {
        name.removeprefix("lora."): tensor
        for name, tensor in load_file(str(path)).items()
        if name.startswith("lora.")
    }


def newest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None.

    Both ``checkpoint-N`` and the older ``step-N`` count; at equal steps ``checkpoint-N`` wins.
    """
    complete = _complete_checkpoints(output_dir)
    return max(complete)[2] if complete else None


def checkpoint_step(directory: Path) -> int:
    """The optimizer step a checkpoint was taken after."""
    return int(_record(directory)["step"])


def checkpoint_eval_before(directory: Path) -> float | None:
    """The eval loss measured before training, as the run that took the checkpoint recorded it."""
    return _record(directory).get("eval_before")


def _record(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "checkpoint.json").read_text(encoding="utf-8"))


def resume_point(
    output_dir: str | Path, *, resume: bool, explicit: str | Path | None = None, auto: bool = False
) -> Path | None:
    """The checkpoint a run starts from, or None for a fresh run.

    ``explicit`` (axolotl's ``resume_from_checkpoint``) names one; ``resume`` (``--resume``) takes
    the newest in ``output_dir``, and ``auto`` (``auto_resume_from_checkpoints``) does the same
    when there is one. ``--resume`` without a checkpoint is refused, and so is a fresh run into an
    ``output_dir`` that already holds checkpoints (it would mix two runs), or an explicit
    checkpoint older than the newest there (the newer ones would be overwritten out of order).
    """
    newest = newest_checkpoint(output_dir)
    if explicit is not None:
        return _explicit_checkpoint(Path(explicit), newest)
    if resume or (auto and newest is not None):
        if newest is None:
            raise ShardpoolError(
                f"--resume: no checkpoint in {checkpoints_root(output_dir)}; run without --resume"
            )
        return newest
    if newest is not None:
        raise ShardpoolError(
            f"{output_dir} already holds checkpoints; pass --resume to continue, or choose a new output_dir"
        )
    return None


def _explicit_checkpoint(path: Path, newest: Path | None) -> Path:
    if not (path / "checkpoint.json").is_file():
        raise ShardpoolError(
            f"resume_from_checkpoint {str(path)!r} is not a complete shardpool checkpoint (no checkpoint.json); "
            "point it at OUTPUT_DIR/checkpoints/checkpoint-N"
        )
    if (
        newest is not None
        and newest.resolve() != path.resolve()
        and checkpoint_step(newest) > checkpoint_step(path)
    ):
        raise ShardpoolError(
            f"resume_from_checkpoint {path} (step {checkpoint_step(path)}) is older than {newest} in output_dir; "
            "resume from the newest (--resume) or use a new output_dir"
        )
    return path


def read_lora_and_optimizer(
    stage_files: list[Path], keys: list[str]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The LoRA tensors and AdamW state of the given adapter keys, from whichever stage saved them."""
    found: dict[str, torch.Tensor] = {}
    for path in stage_files:
        found.update(load_file(str(path)))
    return lora_and_optimizer_from(found, keys)


def lora_and_optimizer_from(
    found: dict[str, torch.Tensor], keys: list[str]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The LoRA tensors and AdamW state of ``keys`` in stage-state tensors (:func:`stage_state_tensors`' names)."""
    lora: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for key in keys:
        if f"lora.{key}" not in found:
            raise ShardpoolError(f"the checkpoint lacks {key}; it belongs to a different model or LoRA setup")
        lora[key] = found[f"lora.{key}"]
        optim[key] = {
            field: found[f"optim.{key}.{field}"] for field in _OPTIM_FIELDS if f"optim.{key}.{field}" in found
        }
    return lora, optim


def read_rng_state(path: Path) -> dict[str, torch.Tensor]:
    """A rank's saved RNG states by generator (``cpu``, and ``cuda``, ``mps`` or ``xpu``), for :func:`restore_rng_state`."""
    return {
        name: tensor
        for name, tensor in load_file(str(path)).items()
        if name == CPU_RNG_KEY or name in _DEVICE_RNGS
    }


def read_loss_scale(path: Path) -> torch.Tensor | None:
    """The loss scale saved beside a rank's RNG state (fp16 runs), or None."""
    return load_file(str(path)).get(LOSS_SCALE_KEY)


def merge_stage_lora(directory: Path) -> dict[str, torch.Tensor]:
    """The LoRA tensors of every stage file in ``directory``, keyed as peft saves them."""
    lora: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("stage-*.safetensors")):
        lora.update(read_stage_lora(path))
    return lora


def clear_partials(output_dir: str | Path) -> None:
    """Remove checkpoints that were being assembled when a run stopped."""
    root = checkpoints_root(output_dir)
    if root.is_dir():
        for child in root.iterdir():
            if child.name.endswith((".partial", ".stale")):
                shutil.rmtree(child, ignore_errors=True)
