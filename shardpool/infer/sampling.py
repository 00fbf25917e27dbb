"""Choosing the next token from a last stage's logits: greedy, or sampled with temperature, top-k
and top-p (nucleus), reproducible under a seed.

The filters follow transformers' logits warpers in their order (temperature, top-k, top-p) and
their tie rules, so the same settings mean what they mean in ``generate``: greedy is the argmax of
the fp32 logits, as ``generate(do_sample=False)`` takes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardpool.errors import ShardpoolError

__all__ = ["Sampling", "next_token", "seeded_generator"]


@dataclass(frozen=True)
class Sampling:
    """How one sequence picks its tokens. ``temperature`` 0 is greedy (the other fields unused)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise ShardpoolError(f"temperature {self.temperature} is outside 0..100; use 0 for greedy")
        if not 0.0 < self.top_p <= 1.0:
            raise ShardpoolError(f"top_p {self.top_p} must be above 0 and at most 1")
        if self.top_k < 0:
            raise ShardpoolError(f"top_k {self.top_k} must be 0 (off) or positive")
        if not 0 <= self.seed < 2**53:
            raise ShardpoolError(f"seed {self.seed} must be between 0 and 2**53")

    @property
    def greedy(self) -> bool:
        """Whether the argmax is taken."""
        return self.temperature == 0.0

    def encode(self) -> list[float]:
        """The four float64 values that carry these settings across the ring."""
        return [self.temperature, self.top_p, float(self.top_k), float(self.seed)]

    @classmethod
    def decode(cls, values: list[float]) -> Sampling:
        """The settings :meth:`encode` wrote."""
        temperature, top_p, top_k, seed = values
        return cls(temperature=temperature, top_p=top_p, top_k=int(top_k), seed=int(seed))


def seeded_generator(sampling: Sampling, device: torch.device | str = "cpu") -> torch.Generator:
    """The random stream of one sequence: seeded by its settings, so a rerun draws the same tokens."""
    generator = torch.Generator(device=device)
    generator.manual_seed(sampling.seed)
    return generator


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The token chosen from one position's ``logits`` (shape ``[vocab]``)."""
    scores = logits.float()
    if sampling.greedy:
        return int(torch.argmax(scores))
    scores = scores / sampling.temperature
    if 0 < sampling.top_k < scores.numel():
        threshold = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    if sampling.top_p < 1.0:
        ascending, order = torch.sort(scores)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1.0 - sampling.top_p
        drop[-1] = False  # the most likely token always stays
        scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probabilities = scores.softmax(dim=-1)
    return int(torch.multinomial(probabilities, 1, generator=generator))
