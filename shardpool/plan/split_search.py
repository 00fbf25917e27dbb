"""The best layer split for a fixed device sequence under the simulated step (``plan.pipeline_sim``).

The simulated step is a longest path through the schedule's dependency graph, so it is at least
the length of any one path. For every stage *p* one path runs the first micro-batch's forward
down to *p* (``Σ_{j<p} F_j + sends``), then all of *p*'s ``2M`` actions (``M (F_p + B_p)``), then
the last gradient back to stage 0 (``Σ_{j<p} B_j + sends``) and stage 0's after-step work; another
ends with *p*'s own last send and after-step work. Each is affine in the layer counts, so:

- :func:`path_bound` is a lower bound of the step for a given split, O(S);
- :func:`sequence_lower_bound` is a lower bound over every split of a sequence, exact for its
  relaxation (preceding stages counted at one layer) by the min-max greedy split;
- :func:`best_split` is exact: a depth-first search over stage 0's count, then stage 1's, ...,
  pruned by the bound of the stages already placed plus a relaxation of the rest, simulating only
  the splits whose bound beats the best step found so far;
- :func:`quick_split` is the heuristic's: the min-max compute split, simulated, optionally
  improved by moving single layers between neighbours.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardpool.plan.pipeline_sim import simulate_step
from shardpool.plan.splits import min_max_split
from shardpool.plan.stage_costs import StageCosts

__all__ = [
    "REL_TOL",
    "BudgetExhausted",
    "SimulationBudget",
    "SplitProblem",
    "best_split",
    "path_bound",
    "quick_split",
    "sequence_lower_bound",
]

#: Relative tolerance under which two step times count as equal.
REL_TOL = 1e-9


class BudgetExhausted(Exception):
    """A search ran more simulations than its budget allows."""


class SimulationBudget:
    """Counts simulated steps; :meth:`spend` raises :class:`BudgetExhausted` past ``limit``."""

    def __init__(self, limit: float = math.inf) -> None:
        self.limit = limit
        self.used = 0

    def spend(self) -> None:
        """Count one simulation."""
        self.used += 1
        if self.used > self.limit:
            raise BudgetExhausted(f"more than {self.limit} simulations")


@dataclass(frozen=True)
class SplitProblem:
    """One device sequence to split: its stages' costs, the most layers each can hold, the layers
    to place, and the schedule's micro-batches."""

    costs: Sequence[StageCosts]
    caps: Sequence[int]
    layers: int
    microbatches: int
    schedule: str
    budget: SimulationBudget | None = None
    lead: int = 1

    def simulate(self, counts: Sequence[int]) -> float:
        """The simulated step of the split ``counts`` (counted against ``budget``)."""
        if self.budget is not None:
            self.budget.spend()
        stages = [c.times(n) for c, n in zip(self.costs, counts, strict=True)]
        return simulate_step(
            stages, microbatches=self.microbatches, schedule=self.schedule, lead=self.lead
        ).step_s

    def link_floor(self) -> float:
        """No split beats the busiest link: it carries ``M`` transfers one after another."""
        busiest = max(max(c.to_next.busy_s, c.to_previous.busy_s) for c in self.costs)
        return self.microbatches * busiest


def path_bound(problem: SplitProblem, counts: Sequence[int]) -> float:
    """A lower bound of the simulated step of ``counts``: the longest of the paths in the module docstring."""
    m, costs = problem.microbatches, problem.costs
    after_first = costs[0].after(counts[0])
    down = up = 0.0
    best = problem.link_floor()
    for p, (c, n) in enumerate(zip(costs, counts, strict=True)):
        forward, backward = c.forward(n), c.backward(n)
        tail = max(up + after_first, c.to_previous.seconds + c.after(n))
        best = max(best, down + m * (forward + backward) + tail)
        down += forward + c.to_next.seconds
        up += backward + (costs[p + 1].to_previous.seconds if p + 1 < len(costs) else 0.0)
    return best


def sequence_lower_bound(problem: SplitProblem) -> float | None:
    """A lower bound of the step over every split of this sequence; None when no split fits.

    The path of stage *p* counts the stages before it at one layer each; the min-max split of
    ``K_p + M C_p(n_p)`` is then exact (``plan.splits.min_max_split``).
    """
    m, costs = problem.microbatches, problem.costs
    fixed, per = [], []
    down = up = 0.0
    for p, c in enumerate(costs):
        fixed.append(down + up + m * c.fixed_s)
        per.append(m * c.per_layer_s)
        down += c.forward(1) + c.to_next.seconds
        up += c.backward(1) + (costs[p + 1].to_previous.seconds if p + 1 < len(costs) else 0.0)
    counts = min_max_split(fixed, per, problem.caps, problem.layers)
    if counts is None:
        return None
    worst = max(f + n * q for f, n, q in zip(fixed, counts, per, strict=True))
    return max(worst + costs[0].after(1), problem.link_floor())


def quick_split(
    problem: SplitProblem, *, limit: float = math.inf, refine: bool = False
) -> tuple[float, list[int]] | None:
    """The min-max compute split, simulated, when it could beat ``limit``; with ``refine``, then
    single layers moved between neighbouring stages while that shortens the step. None when no
    split fits or none found beats ``limit``."""
    costs = problem.costs
    counts = min_max_split(
        [c.fixed_s for c in costs], [c.per_layer_s for c in costs], problem.caps, problem.layers
    )
    if counts is None or path_bound(problem, counts) >= limit * (1 - REL_TOL):
        return None
    best = problem.simulate(counts)
    improved = refine
    while improved:
        improved = False
        for i in range(len(counts) - 1):
            for give, take in ((i, i + 1), (i + 1, i)):
                if counts[give] <= 1 or counts[take] >= problem.caps[take]:
                    continue
                trial = list(counts)
                trial[give] -= 1
                trial[take] += 1
                if path_bound(problem, trial) >= best * (1 - REL_TOL):
                    continue
                step = problem.simulate(trial)
                if step < best * (1 - REL_TOL):
                    best, counts, improved = step, trial, True
    if best >= limit * (1 - REL_TOL):
        return None
    return best, counts


def best_split(
    problem: SplitProblem, *, limit: float = math.inf, allow_tie: bool = False
) -> tuple[float, list[int]] | None:
    """The split with the smallest simulated step, if it beats ``limit`` (or ties it, with
    ``allow_tie``); None otherwise or when no split fits. Exact: see the module docstring."""
    costs, m, layers = problem.costs, problem.microbatches, problem.layers
    s_count = len(costs)
    caps = [min(cap, layers) for cap in problem.caps]
    if min(caps) < 1 or sum(caps) < layers or s_count > layers:
        return None
    cut = limit * (1 + REL_TOL) if allow_tie else limit * (1 - REL_TOL)
    found: list[tuple[float, list[int]]] = []
    start = quick_split(problem, limit=math.inf)
    if start is not None and start[0] <= cut:
        found.append(start)
        cut = start[0] * (1 - REL_TOL)
    floor = problem.link_floor()
    if floor > cut:
        return found[-1] if found else None

    # Suffix data of the relaxation of stages k.. holding R layers: max_t C_t(1), and the water
    # level (R + Σ cf_t / cp_t) / Σ 1 / cp_t of max_t C_t(n_t) over real n_t summing to R.
    cap_after = [0] * (s_count + 1)
    one_layer = [0.0] * (s_count + 1)
    ratio = [0.0] * (s_count + 1)
    inverse = [0.0] * (s_count + 1)
    for k in range(s_count - 1, -1, -1):
        c = costs[k]
        cap_after[k] = cap_after[k + 1] + caps[k]
        one_layer[k] = max(one_layer[k + 1], c.seconds(1))
        if c.per_layer_s > 0 and inverse[k + 1] >= 0:
            ratio[k] = ratio[k + 1] + c.fixed_s / c.per_layer_s
            inverse[k] = inverse[k + 1] + 1 / c.per_layer_s
        else:
            inverse[k] = -1.0  # a stage with free layers: no water level, only the one-layer floor

    def rest_level(k: int, remaining: int) -> float:
        level = one_layer[k]
        if inverse[k] > 0:
            level = max(level, (remaining + ratio[k]) / inverse[k])
        return level

    counts = [0] * s_count

    def search(p: int, remaining: int, down: float, up: float, after_first: float) -> None:
        nonlocal cut
        c = costs[p]
        back = costs[p + 1].to_previous.seconds if p + 1 < s_count else 0.0
        if p == s_count - 1:
            n = remaining
            if not 1 <= n <= caps[p]:
                return
            first_after = c.after(n) if p == 0 else after_first
            tail = max(up + first_after, c.to_previous.seconds + c.after(n))
            if down + m * c.seconds(n) + tail > cut:
                return
            counts[p] = n
            if path_bound(problem, counts) > cut:
                return
            step = problem.simulate(counts)
            if step <= cut:
                found.append((step, list(counts)))
                cut = step * (1 - REL_TOL)
            return
        later = s_count - 1 - p
        low = max(1, remaining - cap_after[p + 1])
        high = min(caps[p], remaining - later)
        for n in range(low, high + 1):
            forward, backward = c.forward(n), c.backward(n)
            first_after = c.after(n) if p == 0 else after_first
            tail = max(up + first_after, c.to_previous.seconds + c.after(n))
            if down + m * (forward + backward) + tail > cut:
                break  # this stage's own path only grows with n
            next_down = down + forward + c.to_next.seconds
            next_up = up + backward + back
            if next_down + m * rest_level(p + 1, remaining - n) + next_up + first_after > cut:
                continue  # the stages after it are still too loaded; give this one more
            counts[p] = n
            # The step only grows with any stage's layers, so the prefix with one layer on every
            # later stage bounds every completion; it grows with n too.
            light = counts[: p + 1] + [1] * later
            if problem.simulate(light) > cut:
                break
            search(p + 1, remaining - n, next_down, next_up, first_after)

    search(0, layers, 0.0, 0.0, 0.0)
    return found[-1] if found else None
