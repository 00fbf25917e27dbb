"""Which state moves where when a running job changes shape: pure arithmetic on layers and ranks.

A re-shard keeps the stages and moves layer boundaries: :func:`handovers` says which stage hands
which layers to which. A job that grows in place (:mod:`shardpool.elastic.growth`) keeps every
running rank's process when every place of the running job keeps as many ranks in the grown plan
(:func:`in_place_ranks`); the state then moves by position (:func:`state_position`: a decoder
layer, the embedding before them, what follows the last) from rank to rank
(:func:`job_growth_moves`). Pure and torch-free: the launcher and the ranks share it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from shardpool.contract.names import ContractError

__all__ = [
    "EMBED_POSITION",
    "growth_moves",
    "handovers",
    "in_place_ranks",
    "job_growth_moves",
    "key_layer",
    "owner_of",
    "position_owners",
    "state_position",
]

_LAYER_IN_KEY = re.compile(r"(?:^|\.)layers\.([0-9]+)\.")


#: Embedding-side state (``embed_tokens``): it goes with the first stage.
EMBED_POSITION = -1


_EMBED_NAMES = ("embed_tokens", "wte", "word_embeddings")


def key_layer(adapter_key: str) -> int | None:
    """The decoder layer a global adapter key belongs to (``...layers.N....``), or None for other modules."""
    match = _LAYER_IN_KEY.search(adapter_key)
    return int(match.group(1)) if match else None


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
