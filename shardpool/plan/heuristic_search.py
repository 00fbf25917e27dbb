"""Local search over device sequences, for fleets too large to try every sequence.

Seeds are the fastest and the roomiest ``k`` devices for every allowed ``k``, arranged so one
host's devices sit together; each seed descends through swaps, replacements, removals and
insertions, then seeded random perturbations restart the descent until the budget of sequence
evaluations runs out. The budget counts evaluations, not seconds, so the same fleet gives the same
plan on any machine. Sequences are split by ``plan.split_search.quick_split`` (the min-max compute
split, simulated); the best one's split is then refined by single-layer moves.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence

from shardpool.plan.search_context import Candidate, SearchContext, evaluate_sequence, is_better, scored
from shardpool.plan.split_search import quick_split

__all__ = ["arrange", "heuristic_search", "neighbours"]


class _Budget:
    """Counts sequence evaluations against a fixed allowance."""

    def __init__(self, evaluations: int) -> None:
        self.left = evaluations

    @property
    def spent(self) -> bool:
        return self.left <= 0

    def evaluate(self, ctx: SearchContext, seq: tuple[int, ...], limit: Candidate | None) -> Candidate | None:
        self.left -= 1
        return evaluate_sequence(ctx, seq, exact=False, limit=limit)


def arrange(ctx: SearchContext, subset: Sequence[int]) -> tuple[int, ...]:
    """A sensible order: devices of one host together, hosts chained by their fastest links,
    roomier devices first within a host (early 1F1B stages hold more micro-batches)."""
    by_host: dict[str, list[int]] = {}
    for d in subset:
        by_host.setdefault(ctx.devices[d].host, []).append(d)
    for group in by_host.values():
        group.sort(key=lambda d: -ctx.devices[d].memory_bytes)
    hosts = list(by_host)
    if len(hosts) > 1:
        rep = {h: by_host[h][0] for h in hosts}

        def hop(a: str, b: str) -> float:
            return ctx.send_s[rep[a]][rep[b]]

        if len(hosts) <= 6:
            hosts = list(
                min(
                    itertools.permutations(hosts),
                    key=lambda p: sum(hop(a, b) for a, b in itertools.pairwise(p)),
                )
            )
        else:
            chain = [hosts[0]]
            rest = set(hosts[1:])
            while rest:
                nxt = min(rest, key=lambda h: (hop(chain[-1], h), h))
                chain.append(nxt)
                rest.remove(nxt)
            hosts = chain
    return tuple(d for h in hosts for d in by_host[h])


def neighbours(seq: tuple[int, ...], unused: Sequence[int], allowed: set[int]) -> Iterator[tuple[int, ...]]:
    """Sequences one move from ``seq``: swap two stages, replace, drop or insert a device."""
    s = len(seq)
    pairs = itertools.combinations(range(s), 2)
    if s > 24:
        pairs = (
            {(i, i + 1) for i in range(s - 1)}
            | {(0, j) for j in range(1, s)}
            | {(j, s - 1) for j in range(s - 1)}
        )
    for i, j in pairs:
        swapped = list(seq)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        yield tuple(swapped)
    for i in range(s):
        for u in unused:
            yield seq[:i] + (u,) + seq[i + 1 :]
    if s - 1 in allowed:
        for i in range(s):
            yield seq[:i] + seq[i + 1 :]
    if s + 1 in allowed:
        for u in unused[:8]:
            for i in range(s + 1):
                yield seq[:i] + (u,) + seq[i:]


def heuristic_search(
    ctx: SearchContext, allowed: Sequence[int], evaluations: int, *, start: Candidate | None = None
) -> Candidate | None:
    """Seed with the fastest (and, separately, the roomiest) k devices for every k, descend from
    the best seeds, then perturb and descend again (iterated local search) until ``evaluations``
    sequence evaluations are spent or many perturbations in a row bring nothing; finally refine
    the best sequence's split. ``start`` (an unfinished exact search's best) is one more seed.
    Deterministic: no clock, and a fixed random seed."""
    budget = _Budget(evaluations)
    n = len(ctx.devices)
    by_speed = sorted(range(n), key=lambda d: (ctx.seconds[d], -ctx.devices[d].memory_bytes, d))
    by_room = sorted(range(n), key=lambda d: (-ctx.devices[d].memory_bytes, ctx.seconds[d], d))
    seeds: list[Candidate] = []
    for k in allowed:
        for ranking in (by_speed, by_room):
            candidate = budget.evaluate(ctx, arrange(ctx, ranking[:k]), None)
            if candidate is not None:
                seeds.append(candidate)
    if start is not None:
        seeds.append(start)
    seeds.sort()
    allowed_set = set(allowed)

    def descend(current: Candidate) -> Candidate:
        improved = True
        while improved and not budget.spent:
            improved = False
            used = set(current.seq)
            unused = [d for d in by_speed if d not in used][:16]
            for seq in neighbours(current.seq, unused, allowed_set):
                candidate = budget.evaluate(ctx, seq, current)
                if is_better(candidate, current):
                    current, improved = candidate, True
                    break
                if budget.spent:
                    break
        return current

    best = None
    for seed in seeds[:3]:
        current = descend(seed)
        if is_better(current, best):
            best = current
    if best is None:
        return None
    rng = random.Random(0)
    stale = 0
    while stale < 40 and not budget.spent:
        seq = list(best.seq)
        for _ in range(2):
            used = set(seq)
            unused = [d for d in range(n) if d not in used]
            i = rng.randrange(len(seq))
            if unused and rng.random() < 0.5:
                seq[i] = rng.choice(unused)
            else:
                j = rng.randrange(len(seq))
                seq[i], seq[j] = seq[j], seq[i]
        start = budget.evaluate(ctx, tuple(seq), None)
        if start is None:
            stale += 1
            continue
        current = descend(start)
        if is_better(current, best):
            best, stale = current, 0
        else:
            stale += 1
    problem = ctx.problem(best.seq)
    refined = quick_split(problem, refine=True)
    if refined is not None and refined[0] < best.objective:
        best = scored(problem, best.seq, *refined)
    return best
