"""The messages that steer ranks: their store keys, their encoding and their checks, in one place.

The launcher and its ranks talk through the torch.distributed TCPStore the launcher hosts (the
rendezvous store). Every key either side reads or writes is named here, every value is encoded
and decoded here, and a value that breaks its message's rules is refused here
(:class:`~shardpool.contract.names.ContractError`), so that authenticating the store later is one
place too. The messages:

* **beat** (:func:`beat_key`): each rank of a run that keeps its state adds 1 every second;
* **copy counted** (:func:`live_key`): a rank's step-boundary copy after a step is written;
* **re-balance answer** (:func:`decision_key`): after the check step the launcher answers keep,
  new layers (:func:`encode_decision`) or new shares (:func:`encode_shares`); every rank reads it;
* **growth in place** (:mod:`shardpool.elastic.growth`): the joining ranks count themselves
  ready (:func:`ready_key`), the launcher publishes the grown job (:func:`grow_key`,
  :class:`Growth`), rank 0 writes the step the ranks grow after (:func:`step_key`) and what a
  joining rank cannot know (:func:`schedule_key`, :class:`GrowSchedule`); the grown process
  group meets under :func:`group_prefix`.

:func:`await_key` is the one way a rank waits for a message. Torch-free: the store is passed in.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from shardpool.contract.names import ContractError
from shardpool.contract.rebalance import LayerRanges
from shardpool.errors import ShardpoolError

__all__ = [
    "GrowSchedule",
    "Growth",
    "await_decision",
    "await_key",
    "beat_key",
    "check_same_stages",
    "decision_key",
    "decode_decision",
    "decode_growth",
    "decode_shares",
    "decode_step",
    "encode_decision",
    "encode_growth",
    "encode_shares",
    "group_prefix",
    "grow_key",
    "live_key",
    "ready_key",
    "schedule_key",
    "step_key",
]


# ----- keys -------------------------------------------------------------------------------------
def beat_key(rank: int, generation: int = 0) -> str:
    """The rendezvous-store counter a rank's beat thread adds to (a job grown in place,
    :mod:`shardpool.elastic.growth`, counts its ranks afresh under each generation)."""
    return f"shardpool/beat/{rank}" if generation == 0 else f"shardpool/beat/{generation}/{rank}"


def live_key(step: int) -> str:
    """The rendezvous-store counter of ranks whose step-boundary copy after ``step`` is written."""
    return f"shardpool/live/{step}"


def decision_key(step: int) -> str:
    """The rendezvous-store key the launcher answers the check after ``step`` at."""
    return f"shardpool/rebalance/{step}"


def grow_key(generation: int) -> str:
    """The store key the launcher sets once the joining ranks of ``generation`` are ready."""
    return f"shardpool/grow/{generation}"


def ready_key(generation: int) -> str:
    """The store counter of joining ranks of ``generation`` that have built their stage."""
    return f"shardpool/grow/{generation}/ready"


def step_key(generation: int) -> str:
    """The store key rank 0 sets to the step after which the job moves to ``generation``."""
    return f"shardpool/grow/{generation}/step"


def schedule_key(generation: int) -> str:
    """The store key rank 0 sets to the LR schedule's position and rates (JSON) for the joining ranks."""
    return f"shardpool/grow/{generation}/schedule"


def group_prefix(generation: int) -> str:
    """The store prefix of ``generation``'s process group (generation 0 uses the store as it is)."""
    return f"shardpool/group/{generation}/"


# ----- the re-balance answer --------------------------------------------------------------------
def encode_decision(layers: Sequence[tuple[int, int]] | None) -> str:
    """The store value of a check's answer: keep the plan (None), or every stage's new layers."""
    if layers is None:
        return json.dumps({"keep": True})
    return json.dumps({"layers": [[int(start), int(stop)] for start, stop in layers]})


def decode_decision(text: str | bytes, *, current: Sequence[tuple[int, int]]) -> LayerRanges | None:
    """The new layers a check's answer asks for, or None to keep ``current``; ContractError if malformed.

    The answer must keep the stage count and cover the same layers contiguously.
    """
    raw = _answer(text)
    if raw is None:
        return None
    try:
        layers = [(int(start), int(stop)) for start, stop in raw["layers"]]
    except (KeyError, TypeError, ValueError):
        raise ContractError(f"re-balance decision {str(raw)[:200]!r} is neither keep nor layers") from None
    check_same_stages(current, layers)
    return None if layers == list(current) else layers


def encode_shares(shares: Sequence[int] | None) -> str:
    """The store value of a data-parallel check's answer: keep the shares (None), or the new ones."""
    if shares is None:
        return json.dumps({"keep": True})
    return json.dumps({"shares": [int(share) for share in shares]})


def decode_shares(text: str | bytes, *, current: Sequence[int]) -> list[int] | None:
    """The new shares a data-parallel check's answer asks for, or None to keep ``current``;
    ContractError when malformed, or when they change the replica count or the step's micro-batches."""
    raw = _answer(text)
    if raw is None:
        return None
    try:
        shares = [int(share) for share in raw["shares"]]
    except (KeyError, TypeError, ValueError):
        raise ContractError(f"re-balance decision {str(raw)[:200]!r} is neither keep nor shares") from None
    if len(shares) != len(current) or sum(shares) != sum(current) or min(shares) < 1:
        raise ContractError(
            f"re-balance shares {shares} must give each of {len(current)} replicas at least 1 of the "
            f"step's {sum(current)} micro-batches"
        )
    return None if shares == list(current) else shares


def _answer(text: str | bytes) -> Any:
    """A check's answer as JSON, or None when it keeps the plan; ContractError when it is not JSON."""
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ContractError(f"re-balance decision is not JSON ({error})") from None
    return None if isinstance(raw, dict) and raw.get("keep") is True else raw


def check_same_stages(current: Sequence[tuple[int, int]], layers: Sequence[tuple[int, int]]) -> None:
    """Refuse new layers that change the stage count, leave a stage empty or skip a layer."""
    if len(layers) != len(current):
        raise ContractError(f"re-balance to {len(layers)} stages; the run has {len(current)}")
    expected = current[0][0]
    for start, stop in layers:
        if start != expected or stop <= start:
            raise ContractError(f"re-balance layers {list(layers)} are not contiguous non-empty ranges")
        expected = stop
    if expected != current[-1][1]:
        raise ContractError(f"re-balance layers end at {expected}; the model has {current[-1][1]}")


# ----- growing in place -------------------------------------------------------------------------
@dataclass(frozen=True)
class Growth:
    """A grow decision: the grown job (as JSON), each running rank's rank in it, and the running
    job's layers (every stage's ``[start, stop)``), which the joining ranks do not know."""

    job: dict[str, Any]
    ranks: dict[int, int]
    old_layers: list[tuple[int, int]]


def encode_growth(job: dict[str, Any], ranks: dict[int, int], old_layers: Sequence[tuple[int, int]]) -> str:
    """The store value of :func:`grow_key`."""
    return json.dumps(
        {
            "job": job,
            "ranks": {str(old): new for old, new in sorted(ranks.items())},
            "from": [[start, stop] for start, stop in old_layers],
        }
    )


def decode_growth(text: str | bytes) -> Growth:
    """:func:`encode_growth`'s value read back; ContractError if it is malformed."""
    try:
        raw = json.loads(text)
        job = raw["job"]
        ranks = {int(old): int(new) for old, new in raw["ranks"].items()}
        old_layers = [(int(start), int(stop)) for start, stop in raw["from"]]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError):
        raise ContractError(f"grow decision {str(text)[:200]!r} is not a job and its ranks") from None
    if not isinstance(job, dict):
        raise ContractError("grow decision: its job is not an object")
    if len(set(ranks.values())) != len(ranks):
        raise ContractError(f"grow decision gives two running ranks one rank: {ranks}")
    return Growth(job, ranks, old_layers)


def decode_step(text: str | bytes) -> int:
    """The step of :func:`step_key`'s value; ContractError if it is not a step."""
    try:
        step = int(text)
    except (TypeError, ValueError):
        raise ContractError(f"grow step {str(text)[:50]!r} is not a step number") from None
    if step < 0:
        raise ContractError(f"grow step {step} is negative")
    return step


@dataclass(frozen=True)
class GrowSchedule:
    """What a joining rank cannot know (:func:`schedule_key`): the LR schedule's position and
    rates, the loss scale's state (fp16 runs) and the eval loss before training."""

    scheduler_steps: int
    rates: list[float]
    loss_scale: list[float] | None
    eval_before: float | None

    def encode(self) -> str:
        """The store value of :func:`schedule_key`."""
        return json.dumps(
            {
                "scheduler_steps": self.scheduler_steps,
                "rates": self.rates,
                "loss_scale": self.loss_scale,
                "eval_before": self.eval_before,
            }
        )

    @classmethod
    def decode(cls, text: str | bytes) -> GrowSchedule:
        """:meth:`encode`'s value read back; ContractError if it is malformed."""
        try:
            raw = json.loads(text)
            scale = raw["loss_scale"]
            before = raw["eval_before"]
            schedule = cls(
                scheduler_steps=int(raw["scheduler_steps"]),
                rates=[float(rate) for rate in raw["rates"]],
                loss_scale=None if scale is None else [float(value) for value in scale],
                eval_before=None if before is None else float(before),
            )
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError):
            raise ContractError(
                f"grow schedule {str(text)[:200]!r} is not a schedule's position and rates"
            ) from None
        if schedule.scheduler_steps < 0 or not schedule.rates:
            raise ContractError(f"grow schedule {str(text)[:200]!r} has no position or no rates")
        return schedule


# ----- waiting for a message --------------------------------------------------------------------
def await_key(store: Any, key: str, *, timeout_s: float, what: str) -> bytes:
    """The value of ``key`` on the rendezvous ``store`` once it is set; ShardpoolError naming
    ``what`` after ``timeout_s`` (a launcher or a rank that is gone must not leave a stage waiting)."""
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        return bytes(store.get(key))
    except RuntimeError as error:  # torch.distributed.DistError is a RuntimeError
        detail = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ShardpoolError(f"no {what} within {timeout_s:g} s (is the launcher gone?): {detail}") from None


def await_decision(store: Any, step: int, *, timeout_s: float) -> bytes:
    """The launcher's answer to the check after ``step``, read from the rendezvous ``store``.

    Waits at most ``timeout_s``: a launcher that is gone must not leave its stages waiting.
    """
    return await_key(
        store,
        decision_key(step),
        timeout_s=timeout_s,
        what=f"re-balance decision from the launcher after step {step}",
    )
