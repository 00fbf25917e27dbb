"""The step-boundary copies on the launcher: which are complete, which go, and the one a restart takes.

A run that keeps training across a lost member (``Job.keep_state``) has every rank copy its
checkpoint files after each step into ``checkpoints/live/step-N`` (:mod:`shardpool.contract.liveness`)
and count them on the rendezvous store. A copy is complete when every rank counted it, or when all
of its files are on disk; the newest complete one becomes ``checkpoint-N`` when an attempt ends.
Torch-free.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from shardpool.contract.job import Job
from shardpool.contract.liveness import LIVE_ROOT, live_dir, live_step, rng_file_name, stage_file_name

__all__ = [
    "KEEP_LIVE_COPIES",
    "WorldSize",
    "clear_live_copies",
    "complete_live_steps",
    "copy_files_count",
    "live_steps",
    "prune_live_copies",
    "take_live_copy",
]

#: Complete step-boundary copies kept while the run goes on; older ones are deleted.
KEEP_LIVE_COPIES = 2


def live_steps(output_dir: Path) -> list[int]:
    """Steps of the step-boundary copy directories under ``output_dir``, ascending."""
    root = output_dir / LIVE_ROOT
    if not root.is_dir():
        return []
    steps = (live_step(child.name) for child in root.iterdir() if child.is_dir())
    return sorted(step for step in steps if step is not None)


def copy_files_count(output_dir: Path, step: int, job: Job) -> int:
    """``job.world_size`` when every file of step ``step``'s copy is on disk (each is renamed into
    place whole), else 0.

    The files are the copy; the store counter only says so sooner. A rank stopped between its last
    file and its count (a ``SIGSTOP`` in that instant) leaves a complete copy the counter misses.
    """
    directory = output_dir / live_dir(step)
    names = [stage_file_name(index) for index in range(job.num_stages)]
    names += [rng_file_name(rank) for rank in range(job.world_size)]
    return job.world_size if all((directory / name).is_file() for name in names) else 0


WorldSize = (
    int | Callable[[int], int]
)  # the ranks that copy a step: one number, or by step (a job grown in place)


def _ranks_at(world_size: WorldSize, step: int) -> int:
    return world_size(step) if callable(world_size) else world_size


def complete_live_steps(output_dir: Path, count: Callable[[int], int], world_size: WorldSize) -> list[int]:
    """Steps whose copy every rank finished (``count(step)`` reads ``live_key(step)``), ascending."""
    complete = []
    for step in live_steps(output_dir):
        try:
            if int(count(step)) >= _ranks_at(world_size, step):
                complete.append(step)
        except Exception:  # noqa: BLE001 - an unreadable counter: not known complete
            continue
    return complete


def prune_live_copies(
    output_dir: Path, count: Callable[[int], int], world_size: WorldSize, *, keep: int = KEEP_LIVE_COPIES
) -> list[int]:
    """Delete the copies older than the ``keep`` newest complete ones; return the steps deleted.

    Copies newer than the newest complete one are being written and stay.
    """
    complete = complete_live_steps(output_dir, count, world_size)
    if len(complete) < keep:
        return []
    oldest_kept = complete[-keep]
    deleted = [step for step in live_steps(output_dir) if step < oldest_kept]
    for step in deleted:
        shutil.rmtree(output_dir / live_dir(step), ignore_errors=True)
    return deleted


def take_live_copy(output_dir: Path, step: int, partial: Path) -> Path:
    """Move step ``step``'s copy to ``partial`` (a ``checkpoint-N.partial`` to finalize); return it."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(partial, ignore_errors=True)
    (output_dir / live_dir(step)).rename(partial)
    return partial


def clear_live_copies(output_dir: Path) -> None:
    """Delete every step-boundary copy (a new attempt writes its own)."""
    shutil.rmtree(output_dir / LIVE_ROOT, ignore_errors=True)
