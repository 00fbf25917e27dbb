"""What a run leaves in ``output_dir`` on the launcher: its checkpoints and its adapter.

The stages send their parts (each stage's LoRA and optimizer state, every rank's RNG state) into
a ``checkpoint-N.partial`` directory, or their final LoRA tensors into the final directory; the
launcher then finalizes the checkpoint (:meth:`RunOutputs.finalize_checkpoint`: the adapter merged,
the step recorded, the oldest deleted past ``save_total_limit``) or writes the adapter and the
tokenizer (:meth:`RunOutputs.write_adapter`). The same object answers the supervisor's questions
about the run's checkpoints (:class:`shardpool.elastic.supervisor.Checkpoints`).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shardpool.data.tokenizing import save_tokenizer
from shardpool.model.lora import LoraSettings, write_adapter
from shardpool.train import checkpoint as ckpt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["RunOutputs"]


@dataclass(frozen=True)
class RunOutputs:
    """Where one run's checkpoints and adapter go, and what they record.

    ``base_model`` is what the adapter names as its base (a hub id or an absolute path);
    ``keep`` is ``save_total_limit`` (None: keep every checkpoint); ``scratch`` is where the
    tokenizer is written before it is moved into place.
    """

    output_dir: Path
    lora: LoraSettings
    base_model: str
    total_steps: int
    keep: int | None
    scratch: Path
    tokenizer: PreTrainedTokenizerBase | None = None

    def finalize_checkpoint(
        self, partial: Path, step: int, eval_before: float | None
    ) -> tuple[Path, list[Path]]:
        """Turn an assembled ``partial`` into ``checkpoint-N``; return it and the checkpoints deleted."""
        final = ckpt.finalize_checkpoint(
            partial,
            step=step,
            settings=self.lora,
            base_model=self.base_model,
            extra={"eval_before": eval_before, "total_steps": self.total_steps},
        )
        return final, ckpt.prune_checkpoints(self.output_dir, keep=self.keep)

    def write_adapter(self, final_dir: Path) -> None:
        """Merge the stages' final LoRA tensors in ``final_dir`` into one PEFT adapter in
        ``output_dir`` (with the tokenizer), then delete ``final_dir``."""
        lora = ckpt.merge_stage_lora(final_dir)
        write_adapter(self.output_dir, lora, self.lora, base_model=self.base_model)
        if self.tokenizer is not None:
            save_tokenizer(self.tokenizer, self.output_dir, scratch_parent=self.scratch)
        shutil.rmtree(final_dir, ignore_errors=True)

    # ----- the run's checkpoints, as the supervisor asks for them --------------------------------
    def partial(self, step: int) -> Path:
        """The ``checkpoint-N.partial`` directory a checkpoint of ``step`` is assembled in."""
        return ckpt.partial_dir(self.output_dir, step)

    def finalize(self, partial: Path, step: int, eval_before: float | None) -> Path:
        """:meth:`finalize_checkpoint`, returning only the checkpoint."""
        return self.finalize_checkpoint(partial, step, eval_before)[0]

    def newest(self) -> Path | None:
        """The newest complete checkpoint in ``output_dir``, or None."""
        return ckpt.newest_checkpoint(self.output_dir)

    def step_of(self, checkpoint: Path) -> int:
        """The step a checkpoint was taken after."""
        return ckpt.checkpoint_step(checkpoint)

    def eval_before_of(self, checkpoint: Path) -> float | None:
        """The eval loss before training that a checkpoint recorded."""
        return ckpt.checkpoint_eval_before(checkpoint)
