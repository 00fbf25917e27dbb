"""Medians, per-pair ratios and the interleaved (ABBA) run orders every paired benchmark uses.

On a shared machine a slow minute hits both members of a pair alike, so the per-pair ratio cancels
it; these are the pure pieces that turn runs into that ratio and its spread."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

WARMUP_STEPS = 2


def median_after_warmup(values: Sequence[float], warmup: int = WARMUP_STEPS) -> float:
    """Median of ``values`` without the first ``warmup`` (all of them if nothing would be left)."""
    kept = list(values[warmup:]) or list(values)
    if not kept:
        raise ValueError("no values to take a median of")
    return float(statistics.median(kept))


def pair_ratios(a_values: Sequence[float], b_values: Sequence[float]) -> list[float]:
    """A ÷ B for each pair, in run order."""
    if len(a_values) != len(b_values) or not a_values:
        raise ValueError("pairs need as many A as B values, at least one")
    return [a / b for a, b in zip(a_values, b_values, strict=True)]


def ratio_summary(ratios: Sequence[float]) -> dict[str, float]:
    """Median, min, max and spread (max - min) of per-pair ratios."""
    if not ratios:
        raise ValueError("no ratios to summarize")
    return {
        "median": float(statistics.median(ratios)),
        "min": float(min(ratios)),
        "max": float(max(ratios)),
        "spread": float(max(ratios) - min(ratios)),
    }


def run_order(pairs: int, sides: Sequence[str] = ("A", "B")) -> list[tuple[int, str]]:
    """The interleaved order of the runs, pair by pair: A B, then B A, then A B, ...

    Every other pair runs its sides in reverse, so whatever favours the first (or the second)
    run of a pair favours each side equally often.
    """
    return [
        (pair, side) for pair in range(pairs) for side in (sides if pair % 2 == 0 else tuple(reversed(sides)))
    ]


def abba_order(modes: Sequence[str], repeats: int) -> list[tuple[str, int]]:
    """The runs as (way, repeat index from 0), in ABBA order: round 0 runs ``modes`` forwards, round 1
    backwards, round 2 forwards again, ... (fastest, pooled, pooled, fastest, fastest, pooled).

    Within a round the ways run back to back, so the i-th run of each way forms a side-by-side
    group; reversing every other round puts each way first as often as last, so a load that drifts
    slowly over the invocation favours neither."""
    order: list[tuple[str, int]] = []
    for repeat in range(repeats):
        ways = list(modes) if repeat % 2 == 0 else list(reversed(modes))
        order.extend((mode, repeat) for mode in ways)
    return order


def paired_ratios(
    tokens_by_run: Mapping[str, Sequence[float | None]], numerator: str, denominator: str
) -> list[float | None]:
    """Per round, ``numerator``'s tokens/s ÷ ``denominator``'s in that round (None where either is
    missing); as many as the rounds both ways ran."""
    tops, bottoms = tokens_by_run.get(numerator, ()), tokens_by_run.get(denominator, ())
    return [ratio(top, bottom) for top, bottom in zip(tops, bottoms, strict=False)]


def spread(values: Sequence[float | None], places: int = 3) -> dict[str, float | None]:
    """``median``, ``min`` and ``max`` of the values that are not None (each None when none are)."""
    present = [value for value in values if value is not None]
    if not present:
        return {"median": None, "min": None, "max": None}
    return {
        "median": round(statistics.median(present), places),
        "min": round(min(present), places),
        "max": round(max(present), places),
    }


def median_of(values: Sequence[float]) -> float | None:
    """The median, or None for no values."""
    return statistics.median(values) if values else None


def ratio(numerator: float | None, denominator: float | None, places: int = 3) -> float | None:
    """``numerator / denominator`` rounded, or None where either is missing or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, places)


def _rounded(value: float | None, places: int = 4) -> float | None:
    return None if value is None else round(value, places)
