"""One stage's part of a pipelined step: its schedule of forward and backward micro-batches.

Per micro-batch a stage receives activations from the previous stage (stage 0 embeds the tokens),
runs its layers and sends the activations on; the last stage computes the loss instead. Backward
runs the other way: the gradient of its output arrives from the next stage, backward runs, the
gradient of its input goes back. The order of these actions is the schedule (1F1B or GPipe, see
:mod:`shardpool.contract.schedule`); backward passes run in micro-batch order on every stage, so
gradients accumulate exactly as in a single-device loop.

Receives are posted one ahead (:class:`Inbox`): as soon as a stage has the tensor it waits for,
it posts the receive for its next one in the same direction, then computes. The neighbour's send
can then land while this stage computes instead of while it waits. Sends never hold the stage up
(on a native boundary each direction has its own communicator, so a send waiting for its
receiver never stands in front of a receive: :mod:`shardpool.train.transport`). An
activation's buffer is let go when its gradient comes back (the neighbour has it). A gradient's
buffer goes when an activation arrives that the previous stage sent after running that gradient's
backward (:func:`~shardpool.contract.schedule.gradients_delivered_by_forwards`). The rest go at
the step's end.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from shardpool.contract.schedule import gradient_sends_proven, schedule_for
from shardpool.data.rows import TokenRows
from shardpool.model.stage import PipelineStage, StageSpec
from shardpool.train.clock import StageClock, stage_clock
from shardpool.train.loss import StepTotals, token_loss_sum
from shardpool.train.preference import (
    PairLogps,
    PreferenceObjective,
    completion_positions,
    micro_batch_losses,
)
from shardpool.train.process_group import Link, PostedRecv, Wire

__all__ = ["BACKWARD_TAG", "FORWARD_TAG", "REFERENCE_TAG", "Inbox", "StagePipe"]

#: The wire's channels: activations, their gradients, and the reference policy's activations of a
#: preference step (a channel of their own, so a forward's place on its channel stays its micro-batch).
FORWARD_TAG, BACKWARD_TAG, REFERENCE_TAG = 1, 2, 3


@dataclass
class Inbox:
    """The receives one direction of a schedule needs, in order, with the next one always posted ahead."""

    wire: Wire
    link: Link
    tag: int
    shapes: deque[tuple[int, tuple[int, ...]]]  # (micro-batch, shape) still to receive, in schedule order
    posted: tuple[int, PostedRecv] | None = field(default=None)

    def take(self, index: int) -> torch.Tensor:
        """Micro-batch ``index``'s tensor (the next one due), then post the receive after it."""
        if self.posted is None:
            self._post_next()
        assert self.posted is not None and self.posted[0] == index, (self.posted, index)
        tensor = self.posted[1].wait()
        self.posted = None
        self._post_next()
        return tensor

    def _post_next(self) -> None:
        if self.shapes:
            index, shape = self.shapes.popleft()
            self.posted = (index, self.wire.post_recv(shape, self.link, tag=self.tag))


@dataclass
class StagePipe:
    """A stage in its pipeline: its layers, the wire to its neighbours, the shape of what crosses it."""

    stage: PipelineStage
    spec: StageSpec
    wire: Wire
    device: torch.device
    hidden_size: int
    packed: bool
    #: The last stage multiplies each loss by this before backward (fp16 runs); None: no scaling.
    loss_scale: float | None = None
    #: A preference run's loss (DPO, IPO, ORPO, SimPO) on the last stage; None: next-token loss (SFT).
    objective: PreferenceObjective | None = None
    #: The reference policy's LoRA tensors of this stage (global keys) when the run started from an
    #: adapter (``lora_model_dir``): TRL's reference is then that starting adapter. None: the
    #: reference is the base alone (the adapter disabled), which a fresh adapter starts equal to.
    reference_adapter: dict[str, torch.Tensor] | None = None
    #: Times the forward and backward passes on the stage's device (:func:`~shardpool.train.clock.stage_clock`).
    clock: StageClock = field(init=False)
    #: The last stage's reference log-probabilities of this step's micro-batches, by index
    #: (:meth:`reference_pass`).
    reference: dict[int, PairLogps] = field(init=False, default_factory=dict)
    #: ``precompute_ref_log_probs``: every training pair's reference log-probabilities by pair index
    #: (chosen, rejected, chosen tokens, rejected tokens), kept by the last stage; empty on the
    #: others, None until :meth:`precompute_reference` ran.
    reference_table: dict[int, torch.Tensor] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.clock = stage_clock(self.device)

    def run_schedule(
        self,
        schedule: str,
        microbatches: list[TokenRows],
        step_label_tokens: int,
        *,
        lead: int = 1,
        pairs: list[list[int]] | None = None,
    ) -> StepTotals:
        """Run this stage's actions of ``schedule`` (at warm-up ``lead``) over ``microbatches``; return
        its loss and compute time. ``pairs``: each micro-batch's pair indices, to look up
        precomputed reference log-probabilities (:meth:`precompute_reference`)."""
        totals = StepTotals()
        folded = False
        if self.objective is not None and self.objective.needs_reference:
            if self.reference_table is not None and pairs is not None:
                self._reference_from_table(pairs)
            elif self.reference_adapter is None:
                folded = True  # each micro-batch's reference forward runs just before its forward
            else:
                self.reference_pass(microbatches)
        saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        actions = schedule_for(
            schedule,
            stage=self.spec.index,
            num_stages=self.spec.num_stages,
            num_microbatches=len(microbatches),
            lead=lead,
        )
        lora_layers = self._lora_layers() if folded else []
        activations = self._inbox(actions, microbatches, "F", self.wire.previous, FORWARD_TAG)
        references = (
            self._inbox(actions, microbatches, "F", self.wire.previous, REFERENCE_TAG) if folded else None
        )
        gradients = self._inbox(actions, microbatches, "B", self.wire.next, BACKWARD_TAG)
        gradients_delivered = gradient_sends_proven(
            schedule,
            stage=self.spec.index,
            num_stages=self.spec.num_stages,
            num_microbatches=len(microbatches),
            lead=lead,
        )
        for kind, index in actions:
            if kind == "F":
                if folded:
                    self._reference_forward(microbatches[index], index, references, lora_layers)
                received = activations.take(index) if activations else None
                if index in gradients_delivered:  # the previous stage ran the backwards before it
                    self.wire.delivered(self.wire.previous, BACKWARD_TAG, through=gradients_delivered[index])
                saved[index] = self.forward(
                    microbatches[index], step_label_tokens, totals, received=received, index=index
                )
                totals.peak_in_flight = max(totals.peak_in_flight, len(saved))
            else:
                gradient = gradients.take(index) if gradients else None
                if gradient is not None:  # the next stage ran this backward on our activation
                    self.wire.delivered(self.wire.next, FORWARD_TAG, through=index)
                    if folded:  # and took the reference activation sent before it
                        self.wire.delivered(self.wire.next, REFERENCE_TAG, through=index)
                self.backward(*saved.pop(index), totals, gradient=gradient)
        totals.compute_seconds += self.clock.collect()
        self.reference.clear()
        return totals

    def reference_pass(self, microbatches: list[TokenRows], *, timed: bool = True) -> None:
        """Forward every micro-batch once with the LoRA adapter disabled (the NF4 base alone, no
        gradient), keeping the last stage's completion log-probabilities for the preference loss.

        This is the reference model of DPO at no memory cost: the same stages, the same weights,
        the adapter off (or, for a run started from an adapter, that adapter swapped in for the
        pass), as TRL computes it for a PEFT model. The passes run in micro-batch order
        before the step's schedule, over the same wire; nothing of them is kept for backward.
        ``timed``: count the passes in the step's compute time (not for an evaluation).
        """
        with self._reference_policy():
            for index, rows, logits in self.forward_only(microbatches, timed=timed, kept=True):
                self.reference[index] = PairLogps.of(logits, rows.labels, kept=True)

    def _reference_forward(
        self, rows: TokenRows, index: int, inbox: Inbox | None, lora_layers: list[BaseTunerLayer]
    ) -> None:
        """Micro-batch ``index`` through the stage as the reference policy (the adapter disabled, no
        gradient), in the schedule's slot just before its forward: the last stage keeps its
        completion log-probabilities, the others send the activation on the reference channel.
        Folded into the schedule, the reference costs a forward per micro-batch and no pipeline
        fill and drain of its own. ``lora_layers``: the stage's (:meth:`_lora_layers`)."""
        with torch.no_grad(), _adapter_disabled(lora_layers):
            inputs = inbox.take(index) if inbox is not None else rows.input_ids.to(self.device)
            started = self.clock.start()
            output = self.stage(inputs, **self.positions(rows), keep=self._kept(rows, kept=True))
            if self.spec.is_last:
                self.reference[index] = PairLogps.of(output, rows.labels, kept=True)
            self.clock.stop(started)
        if not self.spec.is_last:
            self.wire.send(output, self.wire.next, tag=REFERENCE_TAG)

    def precompute_reference(self, microbatches: list[TokenRows], pairs: list[list[int]]) -> None:
        """``precompute_ref_log_probs``: the reference pass over every training pair once, before
        training (``pairs``: each micro-batch's pair indices); the last stage keeps each pair's
        log-probabilities and token counts, and the steps look them up instead of a pass each."""
        table: dict[int, torch.Tensor] = {}
        with self._reference_policy():
            for index, rows, logits in self.forward_only(microbatches, kept=True):
                found = PairLogps.of(logits, rows.labels, kept=True)
                values = torch.stack(
                    [
                        found.chosen,
                        found.rejected,
                        found.chosen_tokens.float(),
                        found.rejected_tokens.float(),
                    ],
                    1,
                ).detach()
                table.update(zip(pairs[index], values, strict=True))
        self.reference_table = table

    def _reference_from_table(self, pairs: list[list[int]]) -> None:
        """This step's reference log-probabilities from :attr:`reference_table` (the last stage only)."""
        if not self.spec.is_last:
            return
        assert self.reference_table is not None
        for index, indices in enumerate(pairs):
            values = torch.stack([self.reference_table[pair] for pair in indices])
            self.reference[index] = PairLogps(
                values[:, 0], values[:, 1], values[:, 2].long(), values[:, 3].long()
            )

    def forward_only(
        self, microbatches: list[TokenRows], *, timed: bool = False, kept: bool = False
    ) -> Iterator[tuple[int, TokenRows, torch.Tensor]]:
        """Forward the micro-batches in order without gradient: a stage before the last sends its
        activations on, the last stage yields ``(index, rows, logits)``; the wire is flushed at the
        end. ``timed`` adds the forwards to the stage clock (the step's compute time); ``kept``:
        the logits of the completion positions only (:meth:`_kept`)."""
        with torch.no_grad():
            for index, rows in enumerate(microbatches):
                inputs = self.inputs(rows, tag=FORWARD_TAG)
                started = self.clock.start() if timed else None
                output = self.stage(inputs, **self.positions(rows), keep=self._kept(rows, kept=kept))
                if self.spec.is_last:
                    yield index, rows, output  # what the last stage makes of the logits is timed too
                if started is not None:
                    self.clock.stop(started)
                if not self.spec.is_last:
                    self.wire.send(output, self.wire.next, tag=FORWARD_TAG)
        self.wire.flush()

    @contextmanager
    def _reference_policy(self) -> Iterator[None]:
        """The stage as the reference policy: the starting adapter swapped in, or the adapter disabled."""
        if self.reference_adapter is None:
            with self.stage.peft_model.disable_adapter():
                yield
            return
        named = self.stage.named_lora_parameters()
        trained = [param.detach().clone() for _, param in named]
        with torch.no_grad():
            for key, param in named:
                param.copy_(self.reference_adapter[key])
        try:
            yield
        finally:
            with torch.no_grad():
                for (_, param), value in zip(named, trained, strict=True):
                    param.copy_(value)

    def _lora_layers(self) -> list[BaseTunerLayer]:
        """The stage's LoRA layers, which :meth:`_reference_forward` switches off and on."""
        return [module for module in self.stage.peft_model.modules() if isinstance(module, BaseTunerLayer)]

    def _inbox(
        self,
        actions: list[tuple[str, int]],
        microbatches: list[TokenRows],
        kind: str,
        link: Link | None,
        tag: int,
    ) -> Inbox | None:
        """The receives of ``kind`` actions (activations for F, gradients for B) over ``link``, or None without one."""
        if link is None:
            return None
        shapes = deque(
            (index, (*microbatches[index].input_ids.shape, self.hidden_size))
            for action, index in actions
            if action == kind
        )
        return Inbox(self.wire, link, tag, shapes)

    def forward(
        self,
        rows: TokenRows,
        step_label_tokens: int,
        totals: StepTotals,
        *,
        received: torch.Tensor | None = None,
        index: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward one micro-batch; return (inputs, output), the output being the loss on the last stage.

        ``received`` is the previous stage's activation when it was already taken from an :class:`Inbox`.
        ``step_label_tokens`` divides the summed loss: the step's label tokens, or for a preference
        run its pairs. ``index`` is the micro-batch's place in the step (its reference log-probabilities).
        """
        inputs = received if received is not None else self.inputs(rows, tag=FORWARD_TAG)
        if not self.spec.is_first:
            inputs.requires_grad_(True)
        started = self.clock.start()
        kept = self.objective is not None and self.objective.reads_completions_only
        output = self.stage(inputs, **self.positions(rows), keep=self._kept(rows, kept=kept))
        if self.spec.is_last and self.objective is not None:
            losses, sums = micro_batch_losses(
                self.objective, output, rows, self.reference.get(index), kept=kept
            )
            output = losses.sum() / step_label_tokens
            totals.add_loss(output)
            totals.add_preference_sums(sums)
        elif self.spec.is_last:
            output = token_loss_sum(output, rows.labels) / step_label_tokens
            totals.add_loss(output)
        self.clock.stop(started)
        if not self.spec.is_last:
            self.wire.send(output, self.wire.next, tag=FORWARD_TAG)
        return inputs, output

    def backward(
        self,
        inputs: torch.Tensor,
        output: torch.Tensor,
        totals: StepTotals,
        *,
        gradient: torch.Tensor | None = None,
    ) -> None:
        """Backward one micro-batch from its output's gradient (or its loss); send its input's gradient back.

        ``gradient`` is the next stage's gradient when it was already taken from an :class:`Inbox`.
        """
        if gradient is None and not self.spec.is_last:
            gradient = self.wire.recv(tuple(output.shape), self.wire.next, tag=BACKWARD_TAG)
        started = self.clock.start()
        if self.spec.is_last and self.loss_scale is not None:
            output = output * self.loss_scale
        output.backward(gradient)
        self.clock.stop(started)
        if not self.spec.is_first:
            self.wire.send(inputs.grad, self.wire.previous, tag=BACKWARD_TAG)

    def inputs(self, rows: TokenRows, *, tag: int) -> torch.Tensor:
        """The stage's input for ``rows``: the token ids on stage 0, else the previous stage's activations."""
        if self.spec.is_first:
            return rows.input_ids.to(self.device)
        shape = (rows.input_ids.shape[0], rows.input_ids.shape[1], self.hidden_size)
        return self.wire.recv(shape, self.wire.previous, tag=tag)

    def _kept(self, rows: TokenRows, *, kept: bool) -> torch.Tensor | None:
        """With ``kept``, the last stage's :func:`~shardpool.train.preference.completion_positions`
        of ``rows``: the only logits a completion log-probability reads, so the final norm and
        ``lm_head`` run on those alone. None: every position's logits (and on other stages). The
        mask stays on the host, where the labels are: indexing with it waits for no device."""
        if not (kept and self.spec.is_last):
            return None
        return completion_positions(rows.labels)

    def positions(self, rows: TokenRows) -> dict[str, torch.Tensor | None]:
        """Position ids, and the attention mask unless the rows are packed (then the positions say it all)."""
        attention_mask = None if self.packed else rows.attention_mask.to(self.device)
        return {"attention_mask": attention_mask, "position_ids": rows.position_ids.to(self.device)}


@contextmanager
def _adapter_disabled(lora_layers: list[BaseTunerLayer]) -> Iterator[None]:
    """A stage's LoRA layers with the adapter off: what peft's ``disable_adapter`` does to each,
    without its walk over every module and its status report of the whole model first (together
    about 9 ms a call on a 4-layer CPU stage, against 1 ms for this; the folded reference switches
    once per micro-batch)."""
    for layer in lora_layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in lora_layers:
            layer.enable_adapters(True)
