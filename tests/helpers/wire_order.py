"""A simulator of the pipeline's point-to-point traffic as a native collective library runs it.

NCCL (and RCCL, XCCL) run each communicator's operations on a rank in the order the rank issues
them, and a send completes only when the peer's matching receive runs: a large message (a real
activation is megabytes) is not buffered. gloo, which the CPU tests use, buffers every send, so
a wire plan that deadlocks on GPUs trains fine there. This module replays what
:meth:`shardpool.train.pipeline.StagePipe.run_schedule` issues, action by action, against the
channels a :class:`~shardpool.train.transport.GroupPlan` gives each direction of each boundary,
and reports whether every rank gets to the end of its step.

The model, per rank, in issue order:

- forward ``i``: receive activation ``i`` from the previous stage (the rank blocks until it has
  it), wait for the gradient sends the previous stage has proven received
  (:func:`~shardpool.contract.schedule.gradient_sends_proven`), send activation ``i`` on;
- backward ``i``: receive gradient ``i`` from the next stage, wait for activation send ``i`` to
  the next stage (its gradient proves it arrived), send the input's gradient back;
- at the step's end, wait for every send (:meth:`~shardpool.train.process_group.Wire.flush`).

A send never blocks the rank that issues it; on a native channel it waits in that rank's queue
for the channel until the peer's matching receive is at the head of the peer's queue. The first
operation of a rank on a native channel blocks the rank until the peer issues its first one on
it too (torch builds a point-to-point communicator lazily, at its first use, and building it is
collective). On a staged channel (``None``: the gloo world), a send is delivered at once.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from shardpool.contract.schedule import gradient_sends_proven, schedule_for

__all__ = ["Op", "WireOutcome", "rank_ops", "simulate_wire"]

FORWARD, BACKWARD = "F", "B"

#: ``channel(sender, receiver)``: the key of the communicator carrying sender's sends to receiver,
#: None for a buffered (gloo) one.
ChannelOf = Callable[[int, int], object]


@dataclass(frozen=True)
class Op:
    """One wire operation of a rank: ``kind`` is ``send``, ``recv``, ``wait`` (the sends to
    ``peer`` with ``tag`` up to ``index`` complete) or ``flush`` (every send complete)."""

    kind: str
    peer: int = -1
    tag: str = ""
    index: int = -1


@dataclass
class WireOutcome:
    """How the simulated step ended: ``finished`` or stuck, with each stuck rank's operation."""

    finished: bool
    stuck: dict[int, Op] = field(default_factory=dict)

    def __str__(self) -> str:
        if self.finished:
            return "every rank finished its step"
        return "deadlock: " + ", ".join(f"rank {rank} at {op}" for rank, op in sorted(self.stuck.items()))


def rank_ops(
    schedule: str, *, stage: int, num_stages: int, num_microbatches: int, lead: int, rank: int
) -> list[Op]:
    """The wire operations of global ``rank`` (stage ``stage`` of its pipeline), in the order
    ``StagePipe.run_schedule`` and the step-end flush issue them."""
    previous, following = rank - 1, rank + 1
    first, last = stage == 0, stage == num_stages - 1
    proven = gradient_sends_proven(
        schedule, stage=stage, num_stages=num_stages, num_microbatches=num_microbatches, lead=lead
    )
    ops: list[Op] = []
    actions = schedule_for(
        schedule, stage=stage, num_stages=num_stages, num_microbatches=num_microbatches, lead=lead
    )
    for kind, index in actions:
        if kind == FORWARD:
            if not first:
                ops.append(Op("recv", previous, FORWARD, index))
            if index in proven:
                ops.append(Op("wait", previous, BACKWARD, proven[index]))
            if not last:
                ops.append(Op("send", following, FORWARD, index))
        else:
            if not last:
                ops.append(Op("recv", following, BACKWARD, index))
                ops.append(Op("wait", following, FORWARD, index))
            if not first:
                ops.append(Op("send", previous, BACKWARD, index))
    ops.append(Op("flush"))
    return ops


@dataclass
class _Rank:
    ops: list[Op]
    pc: int = 0
    issued: bool = False  # the op at pc is in its channel's queue (a receive waiting to match)
    sends_done: dict[tuple[int, str], set[int]] = field(default_factory=lambda: defaultdict(set))
    sends_issued: dict[tuple[int, str], set[int]] = field(default_factory=lambda: defaultdict(set))

    @property
    def op(self) -> Op | None:
        return self.ops[self.pc] if self.pc < len(self.ops) else None


def simulate_wire(ops_by_rank: dict[int, list[Op]], channel: ChannelOf) -> WireOutcome:
    """Run every rank's ``ops`` until all finish or none can move; see the module's docstring."""
    ranks = {rank: _Rank(ops) for rank, ops in ops_by_rank.items()}
    queues: dict[tuple[int, object], deque[Op]] = defaultdict(deque)  # (rank, channel) -> issued ops
    mailbox: dict[tuple[int, int, str], deque[int]] = defaultdict(deque)  # buffered: (src, dst, tag)
    arrived_at_init: set[tuple[int, object]] = set()
    received: dict[int, set[tuple[int, str, int]]] = defaultdict(set)

    def key_of(rank: int, op: Op) -> object:
        return channel(rank, op.peer) if op.kind == "send" else channel(op.peer, rank)

    def advance(rank: int) -> bool:
        state = ranks[rank]
        op = state.op
        if op is None:
            return False
        if op.kind in ("send", "recv"):
            key = key_of(rank, op)
            if key is not None and (rank, key) not in arrived_at_init:
                arrived_at_init.add((rank, key))
                return True
            if key is not None and (op.peer, key) not in arrived_at_init:
                return False  # building the communicator waits for the peer's first use
            if op.kind == "send":
                state.sends_issued[(op.peer, op.tag)].add(op.index)
                if key is None:
                    mailbox[(rank, op.peer, op.tag)].append(op.index)
                    state.sends_done[(op.peer, op.tag)].add(op.index)
                else:
                    queues[(rank, key)].append(op)
                state.pc += 1
                return True
            if key is None:
                box = mailbox[(op.peer, rank, op.tag)]
                if not box:
                    return False
                assert box[0] == op.index, f"rank {rank} expected {op} but {box[0]} is next"
                box.popleft()
                state.pc += 1
                return True
            if not state.issued:
                queues[(rank, key)].append(op)
                state.issued = True
                return True
            if (op.peer, op.tag, op.index) in received[rank]:
                state.pc += 1
                state.issued = False
                return True
            return False
        done = state.sends_done
        if op.kind == "wait":
            wanted = {index for index in state.sends_issued[(op.peer, op.tag)] if index <= op.index}
            if not wanted <= done[(op.peer, op.tag)]:
                return False
        elif any(issued - done[key] for key, issued in state.sends_issued.items()):
            return False
        state.pc += 1
        return True

    def match() -> bool:
        moved = False
        for (rank, key), queue in list(queues.items()):
            while queue and queue[0].kind == "send":
                send = queue[0]
                peer_queue = queues[(send.peer, key)]
                if not peer_queue or peer_queue[0].kind != "recv":
                    break
                recv = peer_queue[0]
                assert (recv.tag, recv.index) == (send.tag, send.index), (
                    f"rank {send.peer} receives {recv} where rank {rank} sends {send} on one channel"
                )
                queue.popleft()
                peer_queue.popleft()
                ranks[rank].sends_done[(send.peer, send.tag)].add(send.index)
                received[send.peer].add((rank, send.tag, send.index))
                moved = True
        return moved

    moving = True
    while moving:
        moving = match()
        for rank in ranks:
            while advance(rank):
                moving = True
    stuck = {rank: state.op for rank, state in ranks.items() if state.op is not None}
    return WireOutcome(not stuck, stuck)  # type: ignore[arg-type]


def pipeline_ops(
    schedule: str, *, num_stages: int, num_microbatches: int, lead: int, replicas: int = 1
) -> dict[int, list[Op]]:
    """Every rank's operations for ``replicas`` pipelines of ``num_stages`` stages (rank = replica × S + stage)."""
    return {
        replica * num_stages + stage: rank_ops(
            schedule,
            stage=stage,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            lead=lead,
            rank=replica * num_stages + stage,
        )
        for replica in range(replicas)
        for stage in range(num_stages)
    }
