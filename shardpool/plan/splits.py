"""Contiguous layer splits: baselines (even, proportional) and the exact split for a fixed device order.

For a fixed sequence of devices every stage's time is affine in its layer count, so the split
that minimizes the slowest stage is found greedily (:func:`min_max_split`); the searches in
``plan.exact_search`` and ``plan.heuristic_search`` only choose the sequence.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from shardpool.errors import ShardpoolError

__all__ = ["even_split", "min_max_split", "proportional_split", "ranges_from_counts"]


def even_split(num_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Split ``num_layers`` into ``n_stages`` contiguous ranges as evenly as possible (baseline)."""
    return proportional_split(num_layers, [1.0] * n_stages)


def proportional_split(num_layers: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous ranges with layer counts proportional to ``weights`` (e.g. memory), each >= 1.

    Largest-remainder rounding; used as a baseline and by the benchmark.
    """
    n = len(weights)
    if n == 0 or num_layers < n:
        raise ShardpoolError(
            f"cannot split {num_layers} layers into {n} stages; use at most {num_layers} stages"
        )
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ShardpoolError("split weights must be non-negative with a positive sum")
    spare = num_layers - n
    total = sum(weights)
    shares = [spare * w / total for w in weights]
    counts = [1 + math.floor(s) for s in shares]
    order = sorted(range(n), key=lambda i: shares[i] - math.floor(shares[i]), reverse=True)
    for i in order[: num_layers - sum(counts)]:
        counts[i] += 1
    return ranges_from_counts(counts)


def ranges_from_counts(counts: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of consecutive stages holding ``counts`` layers each."""
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def min_max_split(
    fixed: Sequence[float], per: Sequence[float], caps: Sequence[int], layers: int
) -> list[int] | None:
    """Layer counts minimizing ``max(fixed[i] + n_i * per[i])`` with ``1 <= n_i <= caps[i]``, summing to ``layers``.

    Exact: any split with bottleneck T gives stage i at most ``count_i(T)`` layers, and this
    greedy stops at the smallest T whose counts reach ``layers``.
    """
    s = len(fixed)
    if s > layers or min(caps) < 1 or sum(min(c, layers) for c in caps) < layers:
        return None
    counts = [1] * s
    heap = [(fixed[i] + 2 * per[i], i) for i in range(s) if caps[i] >= 2]
    heapq.heapify(heap)
    for _ in range(layers - s):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        if counts[i] < caps[i]:
            heapq.heappush(heap, (fixed[i] + (counts[i] + 1) * per[i], i))
    return counts
