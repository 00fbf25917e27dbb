"""Samples during training: greedy completions of the job's sample prompts, on the training stages.

At every periodic eval and at the end of training, the stages of replica 0 complete each prompt of
``job.sample_prompt_ids`` in turn, with the adapter as trained so far (unmerged, the model in eval
mode). Stage 0 embeds the prompt; each stage runs its layers with a KV cache of its own
(:meth:`~shardpool.model.stage.PipelineStage.forward_cached`) and sends the hidden states on over
the wire (:data:`SAMPLE_TAG`); the last stage takes the next token, the argmax of the last
position's logits, and sends it to every other stage of its pipeline over the gloo world
(:data:`TOKEN_TAG`): stage 0 feeds it back in, and each stage learns whether the sample goes on. A
sample ends after ``shardpool.sample_max_new_tokens`` tokens or at an end-of-sequence id of the
model's generation config. A lone stage does it all in its own process.

These are the layers and the arithmetic of peft's ``generate(do_sample=False)``, so the samples
after the last step equal it token for token (with ``wire_dtype`` the compute dtype). Rank 0
reports the new token ids (:class:`~shardpool.contract.events.SamplesEvent`); the launcher,
which holds the tokenizer, decodes them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardpool.contract.events import StageEvent
from shardpool.contract.job import Job
from shardpool.errors import ShardpoolError
from shardpool.train.pipeline import StagePipe

__all__ = ["SAMPLE_TAG", "TOKEN_TAG", "TokenRoute", "greedy_samples", "report_samples"]

#: The wire's channel of a sample's hidden states, and the world's of its tokens from the last stage
#: (after the pipeline's activations, gradients and reference activations, 1 to 3).
SAMPLE_TAG, TOKEN_TAG = 4, 5


@dataclass(frozen=True)
class TokenRoute:
    """Who hears each sampled token: the last stage's global rank, and the ranks of the other
    stages of its pipeline (empty for a lone stage)."""

    last: int
    others: tuple[int, ...]

    @classmethod
    def of_pipeline(cls, job: Job, replica: int) -> TokenRoute:
        """The route in ``replica``'s pipeline of ``job``."""
        ranks = [job.rank_of(replica=replica, stage=index) for index in range(job.num_stages)]
        return cls(last=ranks[-1], others=tuple(ranks[:-1]))


def report_samples(
    pipe: StagePipe, job: Job, *, step: int, rank: int, emit: Callable[[dict[str, Any]], None]
) -> None:
    """Complete the job's sample prompts on replica 0's pipeline after ``step``; its rank 0 reports
    them. Every rank calls this at the same point; the other replicas' ranks go on at once."""
    prompts = job.sample_prompt_ids
    if not prompts or job.replica_index(rank) != 0:
        return
    config = job.parsed_config()
    completions = greedy_samples(
        pipe,
        prompts,
        max_new_tokens=config.shardpool.sample_max_new_tokens,
        stop_ids=frozenset(job.eos_token_ids),
        route=TokenRoute.of_pipeline(job, replica=0),
    )
    if rank == job.rank_of(replica=0, stage=0):
        emit({"event": StageEvent.SAMPLES, "step": step, "token_ids": completions})


def greedy_samples(
    pipe: StagePipe,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Collection[int],
    route: TokenRoute,
) -> list[list[int]]:
    """Each prompt's greedy completion (its new token ids, an end-of-sequence id included) through
    this stage's pipeline; every stage of it calls this with the same prompts and gets the same ids.

    The stage computes in eval mode without gradients and is put back in the mode it was in; the
    wire's figures of the next step do not count the sampling's transfers.
    """
    _check_token_ids(prompts, int(pipe.stage.hf_config.vocab_size))
    wire = pipe.wire
    counted = (wire.bytes_sent, wire.wait_seconds)
    training = pipe.stage.training
    pipe.stage.eval()
    try:
        with torch.no_grad():
            completions = [
                _complete(pipe, prompt, max_new_tokens=max_new_tokens, stop_ids=stop_ids, route=route)
                for prompt in prompts
            ]
    finally:
        pipe.stage.train(training)
    wire.flush()
    wire.bytes_sent, wire.wait_seconds = counted
    return completions


def _complete(
    pipe: StagePipe,
    prompt: Sequence[int],
    *,
    max_new_tokens: int,
    stop_ids: Collection[int],
    route: TokenRoute,
) -> list[int]:
    """One prompt's new tokens: the prompt through a fresh cache, then one token at a time."""
    cache = pipe.stage.new_cache()
    chunk, start = list(prompt), 0
    new: list[int] = []
    while len(new) < max_new_tokens:
        token = _next_token(pipe, chunk, start=start, cache=cache, route=route)
        new.append(token)
        if token in stop_ids:
            break
        start, chunk = start + len(chunk), [token]
    return new


def _next_token(pipe: StagePipe, chunk: list[int], *, start: int, cache: Any, route: TokenRoute) -> int:
    """Run ``chunk`` (at positions from ``start``) through this stage; return the token the last
    stage picks after it."""
    spec, wire = pipe.spec, pipe.wire
    positions = torch.arange(start, start + len(chunk), device=pipe.device).unsqueeze(0)
    if spec.is_first:
        inputs = torch.tensor([chunk], dtype=torch.long, device=pipe.device)
    else:
        assert wire.previous is not None
        inputs = wire.recv((1, len(chunk), pipe.hidden_size), wire.previous, tag=SAMPLE_TAG)
    output = pipe.stage.forward_cached(inputs, cache=cache, position_ids=positions)
    if not spec.is_last:
        assert wire.next is not None
        wire.send(output, wire.next, tag=SAMPLE_TAG)
        received = torch.zeros(1, dtype=torch.int64)
        dist.recv(received, src=route.last, tag=TOKEN_TAG)
        return int(received)
    token = int(torch.argmax(output[0, -1].float()))
    sent = torch.tensor([token], dtype=torch.int64)
    for work in [dist.isend(sent, dst=peer, tag=TOKEN_TAG) for peer in route.others]:
        work.wait()
    return token


def _check_token_ids(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
    """Refuse a prompt id outside the model's vocabulary (every stage checks, so all stop together)."""
    for prompt in prompts:
        outside = [token for token in prompt if not 0 <= token < vocab_size]
        if outside:
            raise ShardpoolError(
                f"sample prompt token id {outside[0]} is outside the model's vocabulary of {vocab_size}; "
                "the launcher's tokenizer does not belong to this model"
            )
