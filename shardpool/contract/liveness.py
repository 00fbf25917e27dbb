"""Keeping a run alive across a lost member: the files the stages and the launcher share.

A mesh run with ``shardpool.on_member_loss: continue`` sets :attr:`Job.keep_state
<shardpool.contract.job.Job.keep_state>`. Its stage processes then do two things for the launcher:

* **beat**: from the moment the process starts, a thread raises the sealed number its rank keeps
  at :func:`~shardpool.elastic.messages.beat_key` every :data:`BEAT_INTERVAL_S` seconds.
  A stage whose number stops rising (a suspended laptop, a ``SIGSTOP``) is found by the launcher even though its process and
  its agent are still there.
* **copy its step-boundary state**: after every optimizer step ``N`` each rank writes its part of
  a checkpoint (the same files: :func:`~shardpool.train.checkpoint.stage_file` from replica 0,
  :func:`~shardpool.train.checkpoint.rng_file` from every rank) into :func:`live_dir` ``(N)`` under
  ``output_dir`` on the launcher, in the background while step ``N + 1`` computes, then adds 1 to
  :func:`~shardpool.elastic.messages.live_key` ``(N)``. Step ``N``'s copy is complete when that
  counter equals the world size.

When a member is lost the launcher turns the newest complete copy into ``checkpoints/checkpoint-N``
and starts the stages again over the remaining members from it: no completed step is lost. The
store keys are :mod:`shardpool.elastic.messages`'; this module names the directories and files.
Pure and torch-free.
"""

from __future__ import annotations

import re

__all__ = [
    "BEAT_INTERVAL_S",
    "LIVE_ROOT",
    "live_dir",
    "live_step",
    "rng_file_name",
    "stage_file_name",
]

#: Seconds between two beats of a stage process.
BEAT_INTERVAL_S = 1.0
#: Where the step-boundary copies go, relative to ``output_dir``. Not under ``.shardpool``: the
#: stages write through :class:`~shardpool.train.runfiles.RunFiles` and the file server's uploads,
#: and both refuse path segments that start with a dot (:func:`shardpool.contract.names.safe_relative_name`).
#: Beside the checkpoints, so a complete copy becomes ``checkpoints/checkpoint-N.partial`` by one
#: rename on the same file system; the checkpoint scans (``checkpoint-N`` / ``step-N`` names) skip it.
LIVE_ROOT = "checkpoints/live"

_LIVE_DIR = re.compile(r"step-([0-9]+)")


def live_dir(step: int) -> str:
    """The directory (relative to ``output_dir``) that holds the step-boundary copy after ``step``."""
    return f"{LIVE_ROOT}/step-{step}"


def live_step(name: str) -> int | None:
    """The step of a :func:`live_dir` directory name (``step-N``), or None for any other name."""
    match = _LIVE_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def stage_file_name(stage_index: int) -> str:
    """The file of one stage's LoRA and optimizer state, in a checkpoint and in a copy."""
    return f"stage-{stage_index}.safetensors"


def rng_file_name(rank: int) -> str:
    """The file of one rank's RNG state (and loss scale), in a checkpoint and in a copy."""
    return f"rng-rank-{rank}.safetensors"
