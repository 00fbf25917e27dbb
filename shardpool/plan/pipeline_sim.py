"""The pipeline step as the stages run it: an event simulation of the 1F1B or GPipe action orders.

Each stage's device is one resource that runs its actions (:mod:`shardpool.contract.schedule`) in
order; each link direction between neighbouring stages is another, carrying one transfer at a time
in the order they were sent. A forward of micro-batch *i* on stage *s* waits for its activation
from stage *s* − 1 to arrive, a backward for its gradient from stage *s* + 1; sends never block the
sender, so a stage computes while its output is on the wire. A transfer occupies its link for
``busy_s`` (bytes / bandwidth) and arrives ``latency_s`` later. A stage's schedule finishes when its
last action has run and its last send has arrived (the runtime flushes its sends); then it reduces
its adapter gradients across replicas and steps its optimizer (``after_s``). The step is the
latest stage's finish plus its ``after_s``. Every start time is the longest path to that action
in the schedule's dependency graph, so the step is monotone in every duration.

Several stages may share one device (``devices``: a V-shaped placement, where the first device
also holds the last stage). Such a device runs one action at a time, the one of its stages' next
actions that can start first; among actions that can start at once, a backward before a forward
and a later stage before an earlier one (freeing activations first). That is the order a rank
holding those stages runs them in when it takes whichever action has its input. Its stages'
``after_s`` run one after another once all of them have finished. Links stay one resource per
stage and direction, so two stages of one device sending the same way do not queue for the wire. A
shared device's choices depend on the durations, so there (as in any list schedule) adding time
can, rarely, shorten the step; with a device per stage the step is monotone as above.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from shardpool.contract.schedule import schedule_for
from shardpool.errors import ShardpoolError

__all__ = ["NO_TRANSFER", "StageTimes", "StepSimulation", "Transfer", "simulate_step"]


@dataclass(frozen=True)
class Transfer:
    """One tensor sent to a neighbour: the seconds it occupies the link and the latency after it."""

    busy_s: float = 0.0
    latency_s: float = 0.0

    @property
    def seconds(self) -> float:
        """From the start of the send to its arrival, on an idle link."""
        return self.busy_s + self.latency_s


#: No neighbour in that direction (the ends of the pipeline), or a free transfer.
NO_TRANSFER = Transfer()


@dataclass(frozen=True)
class StageTimes:
    """One stage's seconds per micro-batch: its forward and backward compute, its sends to the next
    stage (activations) and to the previous one (gradients), and what follows its schedule once
    per step (gradient all-reduce across replicas and the optimizer step)."""

    forward_s: float
    backward_s: float
    to_next: Transfer = NO_TRANSFER
    to_previous: Transfer = NO_TRANSFER
    after_s: float = 0.0


@dataclass(frozen=True)
class StepSimulation:
    """A simulated step: its seconds, and per stage when its schedule finished and how long it computed."""

    step_s: float
    finish_s: tuple[float, ...]
    compute_s: tuple[float, ...]
    #: The device of each stage where the simulation was given them (stages on one device share it).
    devices: tuple[int, ...] = ()

    @property
    def device_compute_s(self) -> tuple[float, ...]:
        """Compute seconds of each device (each stage's alone without ``devices``)."""
        if not self.devices:
            return self.compute_s
        totals: dict[int, float] = {}
        for device, seconds in zip(self.devices, self.compute_s, strict=True):
            totals[device] = totals.get(device, 0.0) + seconds
        return tuple(totals.values())

    @property
    def bubble_fraction(self) -> float:
        """Fraction of the step the busiest device does not compute (fill, drain, waits, after-step work)."""
        if self.step_s <= 0:
            return 0.0
        return max(0.0, 1.0 - max(self.device_compute_s) / self.step_s)


@lru_cache(maxsize=256)
def _orders(
    schedule: str, num_stages: int, microbatches: int, lead: int = 1
) -> tuple[tuple[tuple[bool, int], ...], ...]:
    """Each stage's actions as ``(is_forward, micro-batch)``, cached per schedule, lead and shape."""
    try:
        return tuple(
            tuple(
                (kind == "F", index)
                for kind, index in schedule_for(
                    schedule, stage=stage, num_stages=num_stages, num_microbatches=microbatches, lead=lead
                )
            )
            for stage in range(num_stages)
        )
    except KeyError:
        raise ShardpoolError(f"schedule {schedule!r} is unknown; use '1f1b' or 'gpipe'") from None


def simulate_step(
    stages: Sequence[StageTimes],
    *,
    microbatches: int,
    schedule: str,
    devices: Sequence[int] | None = None,
    lead: int = 1,
) -> StepSimulation:
    """Simulate one optimizer step of ``stages`` (in pipeline order) over ``microbatches`` micro-batches.

    Deterministic and exact for the model described in the module docstring: every action starts
    at the later of its device becoming free and its input arriving. ``devices`` names each stage's
    device where some stages share one (default: every stage has its own). ``lead`` is the 1F1B
    warm-up depth (:func:`~shardpool.contract.schedule.warmup_forwards`).
    """
    count = len(stages)
    if count == 0 or microbatches < 1:
        raise ShardpoolError(f"cannot simulate {count} stages over {microbatches} micro-batches")
    orders = _orders(schedule, count, microbatches, lead)
    if devices is not None:
        if len(devices) != count:
            raise ShardpoolError(f"{len(devices)} devices given for {count} stages; give one per stage")
        return _simulate_shared(stages, tuple(devices), microbatches, orders, schedule)
    unknown = -1.0
    # arrivals[s][i]: when stage s has activation i (forward) or gradient i (backward).
    forward_in = [[unknown] * microbatches for _ in range(count)]
    backward_in = [[unknown] * microbatches for _ in range(count)]
    for index in range(microbatches):
        forward_in[0][index] = 0.0
    device_free = [0.0] * count
    link_next_free = [0.0] * count
    link_previous_free = [0.0] * count
    last_arrival = [0.0] * count
    position = [0] * count
    remaining = count * 2 * microbatches
    last = count - 1
    while remaining:
        progressed = False
        for s in range(count):
            order, p, free = orders[s], position[s], device_free[s]
            times = stages[s]
            while p < len(order):
                is_forward, index = order[p]
                if is_forward:
                    ready = forward_in[s][index]
                elif s == last:
                    ready = 0.0  # its own forward ran earlier in the same order
                else:
                    ready = backward_in[s][index]
                if ready < 0.0:
                    break
                free = (free if free > ready else ready) + (
                    times.forward_s if is_forward else times.backward_s
                )
                if is_forward and s < last:
                    link = times.to_next
                    start = free if free > link_next_free[s] else link_next_free[s]
                    link_next_free[s] = start + link.busy_s
                    arrival = start + link.busy_s + link.latency_s
                    forward_in[s + 1][index] = arrival
                    last_arrival[s] = max(last_arrival[s], arrival)
                elif not is_forward and s > 0:
                    link = times.to_previous
                    start = free if free > link_previous_free[s] else link_previous_free[s]
                    link_previous_free[s] = start + link.busy_s
                    arrival = start + link.busy_s + link.latency_s
                    backward_in[s - 1][index] = arrival
                    last_arrival[s] = max(last_arrival[s], arrival)
                p += 1
                remaining -= 1
                progressed = True
            position[s], device_free[s] = p, free
        if not progressed:
            raise ShardpoolError(f"the {schedule} schedule deadlocked in simulation; this is a bug")
    finish = tuple(max(device_free[s], last_arrival[s]) for s in range(count))
    step = max(finish[s] + stages[s].after_s for s in range(count))
    compute = tuple(microbatches * (t.forward_s + t.backward_s) for t in stages)
    return StepSimulation(step_s=step, finish_s=finish, compute_s=compute)


def _simulate_shared(
    stages: Sequence[StageTimes],
    devices: tuple[int, ...],
    microbatches: int,
    orders: tuple[tuple[tuple[bool, int], ...], ...],
    schedule: str,
) -> StepSimulation:
    """:func:`simulate_step` where stages may share a device: each turn commits, over all stages, the
    next action that can start first (ties: backward, then the later stage). Every action whose
    input is not known yet depends on one not committed, which starts no earlier, so committing the
    earliest is exact."""
    count, last = len(stages), len(stages) - 1
    forward_in = [[0.0 if s == 0 else -1.0] * microbatches for s in range(count)]
    backward_in = [[-1.0] * microbatches for _ in range(count)]
    device_free = dict.fromkeys(devices, 0.0)
    link_next_free, link_previous_free = [0.0] * count, [0.0] * count
    last_arrival, stage_end, position = [0.0] * count, [0.0] * count, [0] * count

    def send(s: int, link: Transfer, link_free: list[float], done: float) -> float:
        """Put stage ``s``'s transfer on its link when both are free; when it arrives."""
        link_free[s] = max(done, link_free[s]) + link.busy_s
        arrival = link_free[s] + link.latency_s
        last_arrival[s] = max(last_arrival[s], arrival)
        return arrival

    for _ in range(count * 2 * microbatches):
        best: tuple[float, bool, int] | None = None
        for s in range(count):
            if position[s] == len(orders[s]):
                continue
            is_forward, index = orders[s][position[s]]
            ready = forward_in[s][index] if is_forward else 0.0 if s == last else backward_in[s][index]
            if ready < 0.0:
                continue
            candidate = (max(device_free[devices[s]], ready), is_forward, -s)
            if best is None or candidate < best:
                best = candidate
        if best is None:
            raise ShardpoolError(f"the {schedule} schedule deadlocked in simulation; this is a bug")
        start, is_forward, s = best[0], best[1], -best[2]
        index = orders[s][position[s]][1]
        times = stages[s]
        end = start + (times.forward_s if is_forward else times.backward_s)
        device_free[devices[s]] = stage_end[s] = end
        position[s] += 1
        if is_forward and s < last:
            forward_in[s + 1][index] = send(s, times.to_next, link_next_free, end)
        elif not is_forward and s > 0:
            backward_in[s - 1][index] = send(s, times.to_previous, link_previous_free, end)
    finish = tuple(max(stage_end[s], last_arrival[s]) for s in range(count))
    step = 0.0
    for device in device_free:
        mine = [s for s in range(count) if devices[s] == device]
        step = max(step, max(finish[s] for s in mine) + sum(stages[s].after_s for s in mine))
    compute = tuple(microbatches * (t.forward_s + t.backward_s) for t in stages)
    return StepSimulation(step_s=step, finish_s=finish, compute_s=compute, devices=devices)
