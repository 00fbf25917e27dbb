"""A stage's training state, and its share of checkpoints and of the final adapter.

At ``save_steps`` every stage of replica 0 sends its LoRA tensors and AdamW state, and every rank
its RNG state, into ``checkpoints/checkpoint-N.partial`` on the launcher (see
:mod:`shardpool.train.checkpoint` for the files and how the launcher finalizes them). At the end
the same LoRA tensors go to ``checkpoints/final.partial``, which the launcher merges into the
adapter. On ``--resume`` each stage restores the keys it owns from whichever stage file holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from shardpool.contract.job import RESUME_PREFIX, Job
from shardpool.train import checkpoint as ckpt
from shardpool.train.loss_scale import LossScale
from shardpool.train.process_group import world_barrier
from shardpool.train.runfiles import RunFiles

__all__ = [
    "FINAL_DIR",
    "StageState",
    "checkpoint_files",
    "load_lora_and_optimizer",
    "load_optimizer_state",
    "rank_state_tensors",
    "restore_stage_state",
    "state_field_device",
    "send_checkpoint",
    "send_final_lora",
]

FINAL_DIR = "checkpoints/final.partial"


@dataclass
class StageState:
    """What a stage trains: its LoRA parameters (by global adapter key), AdamW and the LR schedule.

    ``device`` is the stage's device, whose random state checkpoints hold beside the CPU's.
    """

    named_params: list[tuple[str, torch.nn.Parameter]]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loss_scale: LossScale | None = None
    device: torch.device = field(kw_only=True)


def send_checkpoint(
    files: RunFiles, state: StageState, step: int, *, rank: int, stage: int, replica: int
) -> str:
    """Send this rank's part of the checkpoint after ``step``, wait for every rank; return its directory."""
    partial = f"checkpoints/{ckpt.partial_dir('', step).name}"
    _send_lora_and_optimizer(files, state, partial, stage=stage, replica=replica)
    files.save_tensors(f"{partial}/{ckpt.rng_file(rank)}", rank_state_tensors(state))
    world_barrier()
    return partial


def rank_state_tensors(state: StageState) -> dict[str, torch.Tensor]:
    """What a rank's RNG file holds: this process's torch RNG states (CPU and device), and the loss scale if it scales."""
    tensors = ckpt.rng_state_tensors(state.device)
    if state.loss_scale is not None:
        tensors[ckpt.LOSS_SCALE_KEY] = state.loss_scale.state_tensor()
    return tensors


def checkpoint_files(
    state: StageState, *, rank: int, stage: int, replica: int
) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's part of a checkpoint as file name → tensors, the same files :func:`send_checkpoint` writes.

    The stage file (LoRA + optimizer state) from replica 0 only, the RNG file from every rank. The
    tensors are the live ones: clone them before the next step if they are to be kept.
    """
    files = {ckpt.rng_file(rank): rank_state_tensors(state)}
    if replica == 0:
        files[ckpt.stage_file(stage)] = ckpt.stage_state_tensors(
            named_parameters=state.named_params, optimizer=state.optimizer
        )
    return files


def send_final_lora(files: RunFiles, state: StageState, *, stage: int, replica: int) -> str:
    """Send this stage's trained LoRA tensors for the adapter, wait for every rank; return their directory."""
    _send_lora_and_optimizer(files, state, FINAL_DIR, stage=stage, replica=replica)
    world_barrier()
    return FINAL_DIR


def _send_lora_and_optimizer(
    files: RunFiles, state: StageState, directory: str, *, stage: int, replica: int
) -> None:
    if replica == 0:
        tensors = ckpt.stage_state_tensors(named_parameters=state.named_params, optimizer=state.optimizer)
        files.save_tensors(f"{directory}/{ckpt.stage_file(stage)}", tensors)


def restore_stage_state(files: RunFiles, job: Job, state: StageState, *, rank: int) -> int:
    """Load the checkpoint the job resumes from into ``state`` (and this rank's RNGs); return its step."""
    step = job.resume_step
    stage_files = [files.path(name) for name in job.inputs if name.startswith(RESUME_PREFIX + "stage-")]
    keys = [key for key, _ in state.named_params]
    load_lora_and_optimizer(state, *ckpt.read_lora_and_optimizer(stage_files, keys))
    for _ in range(step):
        state.scheduler.step()
    rng_input = RESUME_PREFIX + ckpt.rng_file(rank)
    if files.has(rng_input):
        ckpt.restore_rng_state(ckpt.read_rng_state(files.path(rng_input)), state.device)
        saved_scale = ckpt.read_loss_scale(files.path(rng_input))
        if state.loss_scale is not None and saved_scale is not None:
            state.loss_scale.load_state_tensor(saved_scale)
    return step


def load_lora_and_optimizer(
    state: StageState, lora: dict[str, torch.Tensor], optim_state: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Put LoRA tensors and per-parameter optimizer state (by adapter key) into ``state``."""
    with torch.no_grad():
        for key, param in state.named_params:
            param.copy_(lora[key].to(device=param.device, dtype=param.dtype))
    load_optimizer_state(state.optimizer, state.named_params, optim_state)


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    named_params: list[tuple[str, torch.nn.Parameter]],
    optim_state: dict[str, dict[str, torch.Tensor]],
) -> None:
    """Put saved per-parameter state (by adapter key) into ``optimizer``, each field where it belongs.

    torch keeps ``step`` as a tensor (placed by :func:`state_field_device`); bitsandbytes keeps it
    as an int and passes it to its kernels.
    """
    keeps_int_step = type(optimizer).__module__.startswith("bitsandbytes")
    step_on_device = {
        id(param): bool(group.get("fused") or group.get("capturable"))
        for group in optimizer.param_groups
        for param in group["params"]
    }
    optimizer_state = optimizer.state_dict()
    optimizer_state["state"] = {
        index: _placed_fields(
            optim_state[key],
            param.device,
            keeps_int_step=keeps_int_step,
            step_on_device=step_on_device[id(param)],
        )
        for index, (key, param) in enumerate(named_params)
        if optim_state[key]
    }
    optimizer.load_state_dict(optimizer_state)


def _placed_fields(
    fields: dict[str, torch.Tensor], param_device: torch.device, *, keeps_int_step: bool, step_on_device: bool
) -> dict[str, torch.Tensor | int]:
    """One parameter's saved state fields as its optimizer keeps them."""
    placed: dict[str, torch.Tensor | int] = {}
    for name, value in fields.items():
        if name == "step" and keeps_int_step:
            placed[name] = int(value.item())
        else:
            placed[name] = value.to(
                state_field_device(name, param_device=param_device, step_on_device=step_on_device)
            )
    return placed


def state_field_device(name: str, *, param_device: torch.device, step_on_device: bool) -> torch.device:
    """Where a saved AdamW state field goes: the parameter's device, except ``step`` in torch's plain AdamW.

    Plain (neither fused nor capturable) torch AdamW keeps ``step`` as a CPU scalar and reads it
    on the host every step for the bias correction; on a GPU each such read would wait for the
    device. Fused and capturable AdamW (``step_on_device``) keep it on the parameter's device.
    """
    if name == "step" and not step_on_device:
        return torch.device("cpu")
    return param_device
