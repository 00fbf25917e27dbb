"""The re-balance protocol between the launcher and its stages, and which layers change hands.

A run with ``shardpool.rebalance: auto`` has one check step (``Job.rebalance_at``): after that
step every rank waits on the rendezvous-store key :func:`decision_key`, which the launcher writes
once it has the step's ``step`` event: :func:`encode_decision` of ``None`` (keep the plan) or of
the new ``[start, stop)`` of every stage. Every rank reads the same key, so they agree without a
collective. A re-shard keeps the stages, their ranks and devices; only the layer boundaries move,
and :func:`handovers` says which stage hands which layers to which. Pure and torch-free: the
launcher (:mod:`shardpool.launch.rebalancing`) and the stages (:mod:`shardpool.train.reshard`) share it.

Every rank measures, at the end of the check step, how much memory it can still take on (its
room: what is free, less what its own step peaks already take), and the check step's ``step``
event carries those figures (``stage_room_bytes``), so the launcher's decision never gives a
stage more layers than its device has room for now, whatever the plan assumed.

Test hooks (tests only): :data:`FORCE_ENV` makes the launcher decide a given re-shard at a given
step, whatever the measurements say; :data:`KILL_ENV` makes one rank kill itself in the middle of
the hand-over; :data:`ROOM_ENV` makes ranks report a given room instead of measuring it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

from shardpool.contract.names import ContractError

__all__ = [
    "FORCE_ENV",
    "FORCE_SHARES_ENV",
    "KILL_ENV",
    "WARMUP_STEPS",
    "ROOM_ENV",
    "LayerRanges",
    "check_step",
    "decision_key",
    "decode_decision",
    "decode_shares",
    "encode_decision",
    "encode_shares",
    "forced_reshard",
    "forced_shares",
    "handovers",
    "key_layer",
    "kill_rank",
    "owner_of",
    "parse_forced_reshard",
    "room_override",
]

#: Steps a run trains before its check: the first is warm-up, the rest are measured.
WARMUP_STEPS = 3
#: Test hook: ``STEP:START-STOP,START-STOP,...`` makes the launcher re-shard to those layers after STEP.
FORCE_ENV = "SHARDPOOL_TEST_RESHARD"
#: Test hook: ``STEP:SHARE,SHARE,...`` makes the launcher of a data-parallel run move to those shares after STEP.
FORCE_SHARES_ENV = "SHARDPOOL_TEST_RESHARE"
#: Test hook: the global rank that kills itself (SIGKILL) in the middle of a re-shard's hand-over.
KILL_ENV = "SHARDPOOL_TEST_RESHARD_KILL_RANK"
#: Test hook: ``RANK:BYTES,RANK:BYTES,...``: those global ranks report BYTES of room at the check.
ROOM_ENV = "SHARDPOOL_TEST_RESHARD_ROOM"

LayerRanges = list[tuple[int, int]]  # each stage's [start, stop), in pipeline order

_ROOM = re.compile(r"[0-9]+:[0-9]+(?:,[0-9]+:[0-9]+)*")
_FORCED = re.compile(r"([0-9]+):([0-9]+-[0-9]+(?:,[0-9]+-[0-9]+)*)")
_FORCED_SHARES = re.compile(r"([0-9]+):([0-9]+(?:,[0-9]+)+)")
_LAYER_IN_KEY = re.compile(r"(?:^|\.)layers\.([0-9]+)\.")


def decision_key(step: int) -> str:
    """The rendezvous-store key the launcher answers the check after ``step`` at."""
    return f"shardpool/rebalance/{step}"


def check_step(
    mode: str, *, first_step: int, total_steps: int, num_stages: int, data_parallel: bool = False
) -> int | None:
    """The step after which a run checks its plan, or None (``rebalance: off``, one stage and no
    replicas on shares of the step, or too short to gain).

    The forced re-shard of :data:`FORCE_ENV` sets the step where it is given. Otherwise the check
    comes :data:`WARMUP_STEPS` after the run's first step (a resumed run measures itself afresh),
    and only when at least one step follows it.
    """
    if mode == "off" or (num_stages < 2 and not data_parallel):
        return None
    forced = forced_shares() if data_parallel else forced_reshard()
    step = forced[0] if forced else first_step + WARMUP_STEPS
    return step if first_step < step < total_steps else None


def forced_reshard() -> tuple[int, LayerRanges] | None:
    """The (step, layers) the test hook :data:`FORCE_ENV` forces, or None when it is unset."""
    value = os.environ.get(FORCE_ENV, "").strip()
    return parse_forced_reshard(value) if value else None


def parse_forced_reshard(value: str) -> tuple[int, LayerRanges]:
    """The (step, layers) of a :data:`FORCE_ENV` value ``STEP:START-STOP,START-STOP,...``."""
    match = _FORCED.fullmatch(value)
    if match is None:
        raise ContractError(f"{FORCE_ENV}={value!r}: expected STEP:START-STOP,START-STOP,... e.g. 3:0-4,4-6")
    ranges = [tuple(int(bound) for bound in part.split("-")) for part in match.group(2).split(",")]
    return int(match.group(1)), [(start, stop) for start, stop in ranges]


def forced_shares() -> tuple[int, list[int]] | None:
    """The (step, shares) the test hook :data:`FORCE_SHARES_ENV` forces, or None when it is unset."""
    value = os.environ.get(FORCE_SHARES_ENV, "").strip()
    if not value:
        return None
    match = _FORCED_SHARES.fullmatch(value)
    if match is None:
        raise ContractError(f"{FORCE_SHARES_ENV}={value!r}: expected STEP:SHARE,SHARE,... e.g. 3:2,1")
    return int(match.group(1)), [int(share) for share in match.group(2).split(",")]


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


def kill_rank() -> int | None:
    """The rank the test hook :data:`KILL_ENV` kills during the hand-over, or None."""
    value = os.environ.get(KILL_ENV, "")
    return int(value) if value.isdigit() else None


def room_override(rank: int) -> int | None:
    """The room the test hook :data:`ROOM_ENV` makes ``rank`` report, or None (measure it)."""
    value = os.environ.get(ROOM_ENV, "").strip()
    if not value:
        return None
    if _ROOM.fullmatch(value) is None:
        raise ContractError(f"{ROOM_ENV}={value!r}: expected RANK:BYTES,RANK:BYTES,... e.g. 2:1000")
    rooms = dict(part.split(":") for part in value.split(","))
    return int(rooms[str(rank)]) if str(rank) in rooms else None


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


def owner_of(layer: int, layers: Sequence[tuple[int, int]]) -> int:
    """The stage whose ``[start, stop)`` holds ``layer``."""
    for index, (start, stop) in enumerate(layers):
        if start <= layer < stop:
            return index
    raise ContractError(f"layer {layer} is in no stage of {list(layers)}")


def handovers(
    old: Sequence[tuple[int, int]], new: Sequence[tuple[int, int]]
) -> dict[tuple[int, int], list[int]]:
    """Which layers each stage hands to which: ``{(from stage, to stage): [layers]}``, in layer order.

    Layers that stay where they are do not appear, nor does what is not a decoder layer (the
    embedding stays with the first stage, the norm and ``lm_head`` with the last).
    """
    moves: dict[tuple[int, int], list[int]] = {}
    for layer in range(old[0][0], old[-1][1]):
        source, target = owner_of(layer, old), owner_of(layer, new)
        if source != target:
            moves.setdefault((source, target), []).append(layer)
    return moves


def key_layer(adapter_key: str) -> int | None:
    """The decoder layer a global adapter key belongs to (``...layers.N....``), or None for other modules."""
    match = _LAYER_IN_KEY.search(adapter_key)
    return int(match.group(1)) if match else None
