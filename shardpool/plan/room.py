"""The room a running stage has left, and what a new split or a growth would need beyond it.

At the re-balance check each rank reports its *room* (the bytes it can still take on now). A stage
may then gain only as many layers as its modelled peak can grow within the least room of its
replicas (:func:`layers_within_room`): another program that took memory since, or a model that
under-counts, shrinks the choice instead of failing the hand-over. Stages on one device (one
host's CPU, one GPU) share its room: their growths together must fit the least room any of them
measured. The split search stays exact under that joint bound (:func:`shared_room_caps`): the
splits that respect it are the union of the boxes under its maximal per-stage caps, so the best of
the exact searches within each box is the best split that fits. A job that grows in place when a
member joins is checked against its running ranks' rooms the same way (:func:`growth_shortfalls`).
Pure.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from shardpool.errors import ShardpoolError
from shardpool.plan.result import Plan, PlannedStage
from shardpool.plan.stage_costs import StageCosts

__all__ = [
    "MAX_SHARED_CAP_CHOICES",
    "growth_shortfalls",
    "layers_within_room",
    "memory_shortfalls",
    "shared_room_caps",
    "stage_rooms",
]

#: The most per-stage cap vectors that stages sharing a device are searched under; a fleet with
#: more (many growing stages on one device) is searched under each stage's own room alone, and
#: the launcher holds a split back whose stages outgrow their device together.
MAX_SHARED_CAP_CHOICES = 256


_MIB, _GIB = 2**20, 2**30


def stage_rooms(room_by_rank: Sequence[float], num_stages: int) -> list[float]:
    """Each stage's room: the least that any of its replicas reported (rank ``r`` runs stage ``r % S``)."""
    if not room_by_rank or len(room_by_rank) % num_stages:
        raise ShardpoolError(
            f"the check reports room for {len(room_by_rank)} ranks, not a multiple of the plan's {num_stages} stages"
        )
    return [min(room_by_rank[index::num_stages]) for index in range(num_stages)]


def shared_room_caps(
    plan: Plan,
    costs: Sequence[StageCosts],
    caps: Sequence[int],
    rooms: Sequence[float],
    *,
    limit: int = MAX_SHARED_CAP_CHOICES,
) -> list[list[int]]:
    """Per-stage layer caps under which stages sharing a device grow within its room together.

    Stages are grouped by ``(host, device)``; a group's stages may together grow their modelled
    peaks (``costs``, from the layers they hold now) by at most the least room among them. Every
    split that respects that is within one of the returned cap vectors (each at most ``caps``), so
    the best split under the joint bound is the best of the searches under each. ``[caps]`` when
    no two stages share a device; empty when the groups give more than ``limit`` vectors (the
    caller then searches under ``caps`` alone).
    """
    shared = [members for members in _device_groups(plan.stages).values() if len(members) > 1]
    per_group = []
    for members in shared:
        room = min(rooms[index] for index in members)
        held = [plan.stages[index].num_layers for index in members]
        options = _maximal(
            list(
                _caps_within(
                    [costs[index] for index in members], held, [caps[index] for index in members], room
                )
            )
        )
        per_group.append((members, options))
    if math.prod(len(options) for _, options in per_group) > limit:
        return []
    choices = []
    for picks in itertools.product(*(options for _, options in per_group)):
        stage_caps = list(caps)
        for (members, _), pick in zip(per_group, picks, strict=True):
            for index, cap in zip(members, pick, strict=True):
                stage_caps[index] = cap
        choices.append(stage_caps)
    return choices


def _caps_within(
    costs: Sequence[StageCosts], held: Sequence[int], caps: Sequence[int], room: float
) -> Iterator[tuple[int, ...]]:
    """Cap vectors for stages on one device whose growths above ``held`` sum to at most ``room``:
    each earlier stage at every count it can reach, the last one at the most the rest leaves.
    A count at or below what a stage holds needs no room."""
    reachable = []
    for count in range(min(held[0], caps[0]), caps[0] + 1):
        growth = max(0.0, costs[0].growth(held[0], count))
        if count > held[0] and growth > room:
            break
        reachable.append((count, growth))
    if len(costs) == 1:
        yield (reachable[-1][0],)
        return
    for count, growth in reachable:
        for rest in _caps_within(costs[1:], held[1:], caps[1:], room - growth):
            yield (count, *rest)


def _device_groups(placed: Sequence[PlannedStage | _Growth]) -> dict[tuple[str, str], list[int]]:
    """The indexes of the stages (or growths) on each device, by ``(host, device)``: those that
    share its memory. The split search and the check after it group alike."""
    groups: dict[tuple[str, str], list[int]] = {}
    for index, item in enumerate(placed):
        groups.setdefault((item.host, item.device), []).append(index)
    return groups


def _maximal(vectors: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The vectors no other one is at least as large as in every place (order kept)."""
    return [
        vector
        for vector in vectors
        if not any(
            other != vector and all(o >= v for o, v in zip(other, vector, strict=True)) for other in vectors
        )
    ]


def layers_within_room(costs: StageCosts, layers: int, room: float, *, most: int) -> int:
    """The most layers, up to ``most``, that a stage holding ``layers`` can go to when its modelled
    peak (:meth:`StageCosts.memory`) may grow by at most ``room`` bytes. Never fewer than ``layers``:
    giving layers away needs no room."""
    count = layers
    while count < most and costs.growth(layers, count + 1) <= room:
        count += 1
    return count


def memory_shortfalls(
    plan: Plan, layers: Sequence[tuple[int, int]], room_by_rank: Sequence[float]
) -> list[str]:
    """One phrase per stage to which ``layers`` give more than its room (how much more its modelled
    peak needs, and how much room it has), then one per device whose stages grow by more together
    than the least room any of them measured (stages on one host's CPU or one GPU share its free
    memory, and a stage that gives layers away may free them only after another has built its
    own). Empty when the split fits (or the plan has no costs)."""
    rooms = stage_rooms(room_by_rank, len(plan.stages))
    growths = [
        _Growth(
            noun="stage",
            number=index,
            slot=stage.slot or stage.device,
            host=stage.host,
            device=stage.device,
            need=stage.costs.growth(stage.num_layers, stop - start),
            layers=stop - start,
            room=room,
        )
        for index, (stage, (start, stop), room) in enumerate(zip(plan.stages, layers, rooms, strict=True))
        if stage.costs is not None
    ]
    return _shortfall_phrases(growths)


def growth_shortfalls(
    running: Plan, grown: Plan, renumber: dict[int, int], room_by_rank: Sequence[float]
) -> list[str]:
    """:func:`memory_shortfalls` for a job that grows in place from ``running`` to ``grown``
    (a member joined): one phrase per running rank whose stage in ``grown`` needs more than the room
    it measured, then one per device whose running ranks outgrow it together. ``renumber`` maps each
    running rank to its rank in the grown job (rank ``r`` runs stage ``r % S`` of its plan). A rank
    gains memory where its new stage holds more layers, or the same layers at a position with more
    micro-batches in flight. Empty when every running rank fits (or a plan has no costs)."""
    if len(room_by_rank) != len(renumber):
        raise ShardpoolError(
            f"the job's ranks reported room for {len(room_by_rank)} ranks, not its {len(renumber)}"
        )
    growths = []
    for rank, new_rank in sorted(renumber.items()):
        old = running.stages[rank % len(running.stages)]
        new = grown.stages[new_rank % len(grown.stages)]
        if old.costs is None or new.costs is None:
            continue
        need = new.costs.memory(new.num_layers) - old.costs.memory(old.num_layers)
        growths.append(
            _Growth(
                noun="rank",
                number=rank,
                slot=new.slot or new.device,
                host=old.host,
                device=old.device,
                need=need,
                layers=new.num_layers,
                room=room_by_rank[rank],
            )
        )
    return _shortfall_phrases(growths)


@dataclass(frozen=True)
class _Growth:
    """What one stage (or rank) would add to its modelled peak, against the room it measured."""

    noun: str  # "stage" or "rank"
    number: int
    slot: str
    host: str
    device: str
    need: float
    layers: int
    room: float


def _shortfall_phrases(growths: Sequence[_Growth]) -> list[str]:
    """One phrase per growth above its own room, then one per device whose other growths exceed,
    together, the least room among them."""
    phrases = [
        f"{growth.noun} {growth.number} ({growth.slot}) needs {_size(growth.need)} more for {growth.layers} layers and "
        f"has {_size(growth.room)} of room"
        for growth in growths
        if growth.need > growth.room
    ]
    fitting = [growth for growth in growths if 0 < growth.need <= growth.room]
    for (host, device), indexes in _device_groups(fitting).items():
        growing = [fitting[index] for index in indexes]
        if len(growing) < 2:
            continue
        need, room = sum(growth.need for growth in growing), min(growth.room for growth in growing)
        if need > room:
            numbers = " and ".join(str(growth.number) for growth in growing)
            phrases.append(
                f"{growing[0].noun}s {numbers} ({device} on {host}) need {_size(need)} more together and have "
                f"{_size(room)} of room"
            )
    return phrases


def _size(nbytes: float) -> str:
    return f"{nbytes / _GIB:.2f} GiB" if nbytes >= _GIB else f"{nbytes / _MIB:.1f} MiB"
