"""Exhaustive search over device sequences, for fleets small enough to try every one.

Devices the cost model cannot tell apart (same host, times, memory and kind) are merged, so
``k`` identical cards count once per position rather than ``k!`` times. Sequences are visited in
order of a lower bound of their step (``plan.split_search.sequence_lower_bound``), and the search
stops once that bound exceeds the best step found: no later sequence can beat it. Each visited
sequence gets its exact best split, so the result is the optimum of the cost model. The search
stops past a number of simulated steps, a count rather than a time, so whether a fleet is planned
exactly is the same on any machine; the planner then hands its best so far to the local search.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from shardpool.plan.search_context import Candidate, SearchContext, evaluate_sequence, is_better
from shardpool.plan.split_search import REL_TOL, BudgetExhausted, SimulationBudget, sequence_lower_bound

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


def exact_search(
    ctx: SearchContext, sequences: Sequence[tuple[int, ...]], *, simulations: float = math.inf
) -> tuple[Candidate | None, bool]:
    """The best of ``sequences`` with its best split (None when the model fits on none of them),
    and whether the search completed: past ``simulations`` simulated steps it stops with the best
    found so far.

    Ties go to fewer stages, then to the sequence visited first (the lower bound, then the listing).
    """
    bounded = []
    for order, seq in enumerate(sequences):
        bound = sequence_lower_bound(ctx.problem(seq))
        if bound is not None:
            bounded.append((bound, len(seq), order, seq))
    bounded.sort()
    best = None
    ctx.budget = SimulationBudget(simulations)
    try:
        for bound, _, _, seq in bounded:
            if best is not None and bound > best.objective * (1 + REL_TOL):
                break
            candidate = evaluate_sequence(ctx, seq, limit=best)
            if is_better(candidate, best):
                best = candidate
    except BudgetExhausted:
        return best, False
    finally:
        ctx.budget = SimulationBudget()
    return best, True
