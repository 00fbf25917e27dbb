"""Evaluation: the mean next-token loss over the eval split, through replica 0's pipeline (for a
preference run, the mean preference loss over the eval pairs).

Forward only, micro-batch by micro-batch, summed over tokens on the last stage and divided by the
label tokens of the whole split. After training, the last stage also keeps the logits of the first
eval batch (``eval_logits.safetensors``), so a test can compare them with peft's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardpool.data.rows import TokenRows
from shardpool.data.steps import consecutive_pairs, pair_rows
from shardpool.train.loss import label_tokens, token_loss_sum
from shardpool.train.pipeline import FORWARD_TAG, StagePipe
from shardpool.train.preference import micro_batch_losses
from shardpool.train.process_group import others_in_world
from shardpool.train.runfiles import RunFiles

__all__ = ["EVAL_LOGITS", "evaluate"]

EVAL_LOGITS = "eval_logits.safetensors"


def evaluate(
    pipe: StagePipe,
    rows: TokenRows,
    *,
    micro_batch_size: int,
    replica: int,
    logits_to: RunFiles | None = None,
) -> float | None:
    """Mean next-token loss over ``rows`` through replica 0's pipeline (None if there are no rows).

    Every rank joins the final all-reduce; other replicas contribute nothing. With ``logits_to``
    the last stage saves the first batch's logits there.
    """
    if len(rows) == 0:
        return None
    if pipe.objective is not None:
        return _preference_loss(pipe, rows, micro_batch_size=micro_batch_size, replica=replica)
    size = micro_batch_size
    loss_sum, token_count = 0.0, 0
    pipe.stage.eval()
    with torch.no_grad():
        for start in range(0, len(rows) if replica == 0 else 0, size):
            batch = rows.select(range(start, min(start + size, len(rows))))
            inputs = pipe.inputs(batch, tag=FORWARD_TAG)
            output = pipe.stage(inputs, **pipe.positions(batch))
            if not pipe.spec.is_last:
                pipe.wire.send(output, pipe.wire.next, tag=FORWARD_TAG)
                continue
            loss_sum += float(token_loss_sum(output, batch.labels))
            token_count += label_tokens(batch.labels)
            if logits_to is not None and start == 0:
                _save_eval_logits(logits_to, batch, output)
    pipe.wire.flush()
    pipe.stage.train()
    summary = torch.tensor([loss_sum, float(token_count)], dtype=torch.float64)
    if others_in_world():
        dist.all_reduce(summary)
    return float(summary[0] / summary[1]) if summary[1] > 0 else None


def _preference_loss(
    pipe: StagePipe, rows: TokenRows, *, micro_batch_size: int, replica: int
) -> float | None:
    """Mean preference loss over the eval pairs, as TRL's ``eval_loss``: the reference pass over
    every eval micro-batch (DPO, IPO), then the policy forward, both without gradient."""
    pairs = len(rows) // 2
    batches = [
        rows.select(pair_rows(indices, pairs))
        for indices in consecutive_pairs(pairs if replica == 0 else 0, micro_batch_size)
    ]
    assert pipe.objective is not None
    pipe.stage.eval()
    if pipe.objective.needs_reference:
        pipe.reference_pass(batches, timed=False)
    loss_sum = 0.0
    for index, batch, logits in pipe.forward_only(batches):
        losses, _ = micro_batch_losses(pipe.objective, logits, batch, pipe.reference.get(index))
        loss_sum += float(losses.sum())
    pipe.reference.clear()
    pipe.stage.train()
    summary = torch.tensor(
        [loss_sum, float(pairs if pipe.spec.is_last and replica == 0 else 0)], dtype=torch.float64
    )
    if others_in_world():
        dist.all_reduce(summary)
    return float(summary[0] / summary[1]) if summary[1] > 0 else None


def _save_eval_logits(files: RunFiles, batch: TokenRows, logits: torch.Tensor) -> None:
    files.save_tensors(
        EVAL_LOGITS,
        {
            "input_ids": batch.input_ids,
            "attention_mask": batch.attention_mask,
            "position_ids": batch.position_ids,
            "logits": logits.float(),
        },
    )
