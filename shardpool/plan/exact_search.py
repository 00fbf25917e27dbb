"""Exhaustive search over device sequences, for fleets small enough to try every one.

Devices the cost model cannot tell apart (same host, speed, memory and kind) are merged, so
``k`` identical cards count once per position rather than ``k!`` times.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardpool.plan.search_context import Candidate, SearchContext, evaluate_sequence, is_better

__all__ = ["distinct_sequences", "exact_search"]


def distinct_sequences(
    ctx: SearchContext, allowed: Sequence[int], limit: int
) -> list[tuple[int, ...]] | None:
    """All ordered device subsets with lengths in ``allowed``, identical devices merged; None past ``limit``."""
    classes: dict[tuple, list[int]] = {}
    for d in range(len(ctx.devices)):
        classes.setdefault(ctx.signature(d), []).append(d)
    members = list(classes.values())
    remaining = [len(m) for m in members]
    out: list[tuple[int, ...]] = []
    top = max(allowed)
    wanted = set(allowed)

    def extend(prefix: list[int]) -> bool:
        if len(prefix) in wanted:
            out.append(tuple(prefix))
            if len(out) > limit:
                return False
        if len(prefix) == top:
            return True
        for c, group in enumerate(members):
            if remaining[c]:
                remaining[c] -= 1
                prefix.append(group[len(group) - remaining[c] - 1])
                ok = extend(prefix)
                prefix.pop()
                remaining[c] += 1
                if not ok:
                    return False
        return True

    return out if extend([]) else None


def exact_search(ctx: SearchContext, sequences: Sequence[tuple[int, ...]]) -> Candidate | None:
    """The best of ``sequences``; None when the model fits on none of them."""
    best = None
    for seq in sequences:
        candidate = evaluate_sequence(ctx, seq)
        if is_better(candidate, best):
            best = candidate
    return best
