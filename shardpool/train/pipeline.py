"""One stage's part of a pipelined step: its schedule of forward and backward micro-batches.

Per micro-batch a stage receives activations from the previous stage (stage 0 embeds the tokens),
runs its layers and sends the activations on; the last stage computes the loss instead. Backward
runs the other way: the gradient of its output arrives from the next stage, backward runs, the
gradient of its input goes back. The order of these actions is the schedule (1F1B or GPipe, see
:mod:`shardpool.contract.schedule`); backward passes run in micro-batch order on every stage, so
gradients accumulate exactly as in a single-device loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shardpool.contract.schedule import schedule_for
from shardpool.data.rows import TokenRows
from shardpool.model.stage import PipelineStage, StageSpec
from shardpool.train.loss import StepTotals, token_loss_sum
from shardpool.train.process_group import Wire

__all__ = ["BACKWARD_TAG", "FORWARD_TAG", "StagePipe"]

FORWARD_TAG, BACKWARD_TAG = 1, 2


@dataclass
class StagePipe:
    """A stage in its pipeline: its layers, the wire to its neighbours, the shape of what crosses it."""

    stage: PipelineStage
    spec: StageSpec
    wire: Wire
    device: torch.device
    hidden_size: int
    packed: bool

    def run_schedule(
        self, schedule: str, microbatches: list[TokenRows], step_label_tokens: int
    ) -> StepTotals:
        """Run this stage's actions of ``schedule`` over ``microbatches``; return its loss and compute time."""
        totals = StepTotals()
        saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        actions = schedule_for(
            schedule,
            stage=self.spec.index,
            num_stages=self.spec.num_stages,
            num_microbatches=len(microbatches),
        )
        for kind, index in actions:
            if kind == "F":
                saved[index] = self.forward(microbatches[index], step_label_tokens, totals)
            else:
                self.backward(*saved.pop(index), totals)
        return totals

    def forward(
        self, rows: TokenRows, step_label_tokens: int, totals: StepTotals
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward one micro-batch; return (inputs, output), the output being the loss on the last stage."""
        inputs = self.inputs(rows, tag=FORWARD_TAG)
        if not self.spec.is_first:
            inputs.requires_grad_(True)
        started = time.perf_counter()
        output = self.stage(inputs, **self.positions(rows))
        if self.spec.is_last:
            output = token_loss_sum(output, rows.labels) / step_label_tokens
            totals.add_loss(output)
        totals.compute_seconds += time.perf_counter() - started
        if not self.spec.is_last:
            self.wire.send(output, self.wire.next, tag=FORWARD_TAG)
        return inputs, output

    def backward(self, inputs: torch.Tensor, output: torch.Tensor, totals: StepTotals) -> None:
        """Backward one micro-batch from its output's gradient (or its loss); send its input's gradient back."""
        gradient = None
        if not self.spec.is_last:
            gradient = self.wire.recv(tuple(output.shape), self.wire.next, tag=BACKWARD_TAG)
        started = time.perf_counter()
        output.backward(gradient)
        totals.compute_seconds += time.perf_counter() - started
        if not self.spec.is_first:
            self.wire.send(inputs.grad, self.wire.previous, tag=BACKWARD_TAG)

    def inputs(self, rows: TokenRows, *, tag: int) -> torch.Tensor:
        """The stage's input for ``rows``: the token ids on stage 0, else the previous stage's activations."""
        if self.spec.is_first:
            return rows.input_ids.to(self.device)
        shape = (rows.input_ids.shape[0], rows.input_ids.shape[1], self.hidden_size)
        return self.wire.recv(shape, self.wire.previous, tag=tag)

    def positions(self, rows: TokenRows) -> dict[str, torch.Tensor | None]:
        """Position ids, and the attention mask unless the rows are packed (then the positions say it all)."""
        attention_mask = None if self.packed else rows.attention_mask.to(self.device)
        return {"attention_mask": attention_mask, "position_ids": rows.position_ids.to(self.device)}
