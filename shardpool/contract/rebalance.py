"""When a run checks its plan, and the re-balance test hooks.

A run with ``shardpool.rebalance: auto`` has one check step (``Job.rebalance_at``,
:func:`check_step`): after it every rank waits for the launcher's answer
(:mod:`shardpool.elastic.messages`), which keeps the plan or moves the layer boundaries (or a
data-parallel run's shares). Every rank measures, at the end of the check step, how much memory it
can still take on (its room), and the check step's ``step`` event carries those figures
(``stage_room_bytes``), so the launcher's decision never gives a stage more layers than its device
has room for now.

Test hooks (tests only): :data:`FORCE_ENV` makes the launcher decide a given re-shard at a given
step, whatever the measurements say; :data:`FORCE_SHARES_ENV` the same for a data-parallel run's
shares; :data:`KILL_ENV` makes one rank kill itself in the middle of the hand-over; :data:`ROOM_ENV`
makes ranks report a given room instead of measuring it. Pure and torch-free.
"""

from __future__ import annotations

import os
import re

from shardpool.contract.names import ContractError

__all__ = [
    "FORCE_ENV",
    "FORCE_SHARES_ENV",
    "KILL_ENV",
    "ROOM_ENV",
    "WARMUP_STEPS",
    "LayerRanges",
    "check_step",
    "forced_reshard",
    "forced_shares",
    "kill_rank",
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
