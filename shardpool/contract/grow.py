"""Growing a running job in place: a member that joins gets stages, the running stages keep their processes.

A supervised mesh run (:mod:`shardpool.contract.liveness`) that finds a member worth taking
(issue 16) grows its job instead of restarting it, when every member of the running job keeps as
many stage processes in the grown plan as it has now (:func:`in_place_ranks`) and the replica
count stays. The grown job is the old one with the new plan's stages, ``generation`` one higher.
Its protocol, on the launcher's rendezvous store:

1. The launcher starts the joining member's ranks with the grown job and ``joining`` set. Each
   builds its stage (base layers, fresh LoRA), loads the data, and adds 1 to :func:`ready_key`.
2. Once every joining rank is ready, the launcher sets :func:`grow_key` to
   :func:`encode_growth`: the grown job and each running rank's new rank.
3. Rank 0 of the running job looks for that key after every step and tells every rank in the
   step's timing all-gather, so all of them stop after the same step ``S``. Rank 0 writes ``S``
   to :func:`step_key` and what a joining rank cannot know to :func:`schedule_key` (the LR
   schedule's position and rates, the loss scale, the eval loss before training).
4. Every rank leaves the old process group and joins the grown one (its store keys under
   :func:`group_prefix`); the layers' LoRA and optimizer state go by rank from the old owner to
   the new one (:func:`growth_moves`), the running ranks rebuild their stage around the base
   layers they keep, and the joining ranks start training at step ``S + 1``.

Pure and torch-free: the launcher and the stages share it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardpool.contract.names import ContractError
from shardpool.contract.rebalance import key_layer

__all__ = [
    "Growth",
    "decode_growth",
    "encode_growth",
    "group_prefix",
    "grow_key",
    "growth_moves",
    "job_growth_moves",
    "in_place_ranks",
    "position_owners",
    "ready_key",
    "schedule_key",
    "state_position",
    "step_key",
]

#: Embedding-side state (``embed_tokens``): it goes with the first stage.
EMBED_POSITION = -1

_EMBED_NAMES = ("embed_tokens", "wte", "word_embeddings")


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


def in_place_ranks(
    old_hosts: Sequence[str], new_hosts: Sequence[str], *, old_replicas: int, new_replicas: int
) -> dict[int, int] | None:
    """Each running rank's rank in the grown job, or None when the job cannot grow in place.

    ``old_hosts[rank]`` and ``new_hosts[rank]`` name where every rank runs (its member, and its
    device there). A job grows in place when the replica count stays, it grows, and every place of
    the running job has as many ranks in the grown one (a place's ranks keep their order); the
    grown job's other ranks are on the members that join.
    """
    if old_replicas != new_replicas or len(new_hosts) <= len(old_hosts):
        return None
    mapping: dict[int, int] = {}
    for host in dict.fromkeys(old_hosts):
        old = [rank for rank, name in enumerate(old_hosts) if name == host]
        new = [rank for rank, name in enumerate(new_hosts) if name == host]
        if len(old) != len(new):
            return None
        mapping.update(zip(old, new, strict=True))
    return mapping


def state_position(name: str, num_layers: int) -> int:
    """Where a state tensor lives: its decoder layer, :data:`EMBED_POSITION` for the embedding's,
    ``num_layers`` for what follows the last layer (final norm, ``lm_head``).

    ``name`` is a stage-state name (``lora.KEY`` or ``optim.KEY.FIELD``).
    """
    key = name.split(".", 1)[1] if "." in name else name
    layer = key_layer(key)
    if layer is not None:
        return layer
    return EMBED_POSITION if any(part in key for part in _EMBED_NAMES) else num_layers


def position_owners(layers: Sequence[tuple[int, int]], ranks: Sequence[int]) -> dict[int, int]:
    """The rank holding each position of one pipeline: ``ranks[i]`` runs stage ``i`` with ``layers[i]``."""
    owners = {EMBED_POSITION: ranks[0], layers[-1][1]: ranks[-1]}
    for (start, stop), rank in zip(layers, ranks, strict=True):
        owners.update(dict.fromkeys(range(start, stop), rank))
    return owners


def growth_moves(old_owners: dict[int, int], new_owners: dict[int, int]) -> dict[tuple[int, int], list[int]]:
    """Which positions go from which rank to which (``{(from, to): [positions]}``, in order).

    Both maps are in the grown job's ranks; positions that stay with their rank do not appear.
    """
    if set(old_owners) != set(new_owners):
        raise ContractError("a grown job must hold the same layers as the running one")
    moves: dict[tuple[int, int], list[int]] = {}
    for position in sorted(old_owners):
        source, target = old_owners[position], new_owners[position]
        if source != target:
            moves.setdefault((source, target), []).append(position)
    return moves


def job_growth_moves(
    old_layers: Sequence[tuple[int, int]],
    new_layers: Sequence[tuple[int, int]],
    *,
    replicas: int,
    renumber: dict[int, int],
) -> dict[tuple[int, int], list[int]]:
    """:func:`growth_moves` of every replica of a job that grows from ``old_layers`` to ``new_layers``.

    Ranks are replica-major in both jobs; ``renumber`` maps each running rank to its grown rank.
    Each replica hands over within itself, since replicas hold the same state.
    """
    moves: dict[tuple[int, int], list[int]] = {}
    old_stages, new_stages = len(old_layers), len(new_layers)
    for replica in range(replicas):
        old_ranks = [renumber[replica * old_stages + stage] for stage in range(old_stages)]
        new_ranks = [replica * new_stages + stage for stage in range(new_stages)]
        moves |= growth_moves(position_owners(old_layers, old_ranks), position_owners(new_layers, new_ranks))
    return moves
