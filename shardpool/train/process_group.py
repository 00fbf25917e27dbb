"""A stage process's torch.distributed groups and the wire between neighbouring stages.

:func:`join_process_group` makes the gloo world group every rank joins, exchanges each rank's
device kind over it (a tensor of small integers; nothing is unpickled), and creates the
subgroups :func:`shardpool.train.transport.plan_groups` chooses, every rank calling for each in one
global order, so that only members build a communicator and torch's group names agree
(:meth:`~shardpool.train.transport.GroupPlan.creation_calls`). :class:`Wire` then moves activations and their gradients
across each boundary by the transport chosen for it: on the device through the pair's native
group, or through host memory over gloo, with pinned buffers and non-blocking copies on GPUs.
The store every rank meets at first is hosted by the launcher
(:func:`shardpool.train.rendezvous.rendezvous_store`).

gloo's TCP pairs carry no authentication, so right after the groups are made, and before any
training data flows, every pair of ranks of the world and of each gloo subgroup proves to each
other that both hold the run's key (:func:`prove_peers`, given a :class:`PeerCheck`): each rank
sends each other rank a fresh nonce over that pair and checks the answer. A process outside the
run that took a peer's place in a pair cannot answer, and the rank stops in one line. Native
(NCCL) groups need no check: their bootstrap only admits a rank that holds the communicator's
unique id, which reaches the ranks sealed.

A lone stage (a world of one rank) joins no group at all: it has no one to talk to, and a gloo
world would keep a transport thread that wakes every 10 ms for the whole run (gloo's TCP loop
polls with a 10 ms timeout), next to the compute threads on the same cores.
:func:`others_in_world` and :func:`world_barrier` are the guards the world collectives use.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from shardpool.errors import ShardpoolError
from shardpool.train.transport import (
    GroupPlan,
    RankDevice,
    decode_rank_device,
    encode_rank_device,
    plan_groups,
    staging_is_pinned,
)

__all__ = [
    "Groups",
    "Link",
    "PeerCheck",
    "Wire",
    "join_process_group",
    "leave_process_group",
    "local_rank_device",
    "others_in_world",
    "prove_peers",
    "select_device",
    "world_barrier",
]


def local_rank_device(device: torch.device, place: str) -> RankDevice:
    """This rank's device kind (ROCm told apart from CUDA) and whether its torch has the native backend."""
    kind = device.type
    if kind == "cuda" and getattr(torch.version, "hip", None):
        kind = "rocm"
    if kind in ("cuda", "rocm"):
        native = dist.is_nccl_available()
    elif kind == "xpu":
        native = bool(getattr(dist, "is_xccl_available", lambda: False)())
    else:
        native = False
    if kind not in ("cpu", "cuda", "rocm", "mps", "xpu"):
        raise ValueError(f"device {device} is not one shardpool can run a stage on")
    return RankDevice(kind, native, place)  # type: ignore[arg-type]


@dataclass
class Groups:
    """The process groups one rank uses: the gloo world (``None``), its boundaries' and its replicas'."""

    plan: GroupPlan
    created: dict[tuple[int, ...], Any]

    def channel(self, sender: int, receiver: int) -> tuple[Any, bool]:
        """The group that carries what ``sender`` sends its neighbour ``receiver`` (None: the gloo
        world), and whether the boundary is ``staged`` through host memory (:meth:`GroupPlan.channel`)."""
        key = self.plan.channel(sender, receiver)
        return (None, True) if key is None else (self.created[key], False)

    def replicas(self, stage: int) -> tuple[Any, bool] | None:
        """The replica group of ``stage`` and whether it is native (device tensors), or None."""
        entry = self.plan.replica_groups.get(stage)
        if entry is None:
            return None
        backend, ranks = entry
        return self.created[ranks], backend != "gloo"


class PeerCheck(Protocol):
    """How the ranks of a group prove to each other that they hold the run's key
    (:class:`shardpool.elastic.messages.PeerKey`)."""

    def challenge(self) -> bytes:
        """A fresh nonce to send one peer."""
        ...

    def answer(self, group: str, *, prover: int, verifier: int, nonce: bytes) -> bytes:
        """``prover``'s answer to the ``nonce`` that ``verifier`` sent it in ``group``."""
        ...

    def check(self, group: str, *, prover: int, verifier: int, nonce: bytes, proof: bytes) -> None:
        """Raise, in one line, when ``proof`` is not ``prover``'s answer to ``verifier``'s ``nonce``."""
        ...


def join_process_group(
    *,
    store: Any,
    rank: int,
    world_size: int,
    num_stages: int,
    replicas: int,
    device: torch.device,
    places: list[str],
    timeout: timedelta,
    peers: PeerCheck | None = None,
) -> Groups:
    """Join the gloo world group, learn every rank's device, and create this rank's subgroups.

    ``places[rank]`` names each rank's physical device (host and device), so ranks sharing one GPU
    are never put in one NCCL communicator. A world of one joins nothing (``store`` may be None):
    see the module's docstring. With ``peers``, every pair of the world and of each gloo subgroup
    proves the run's key (:func:`prove_peers`) before this returns.
    """
    select_device(device)
    if world_size == 1:
        lone = [local_rank_device(device, places[rank])]
        return Groups(plan_groups(lone, num_stages=num_stages, replicas=replicas), {})
    dist.init_process_group(backend="gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    if peers is not None:
        prove_peers(peers, group=None, name="world", rank=rank, ranks=range(world_size))
    mine = torch.tensor([encode_rank_device(local_rank_device(device, places[rank]))], dtype=torch.int64)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    devices = [decode_rank_device(int(code), places[index]) for index, code in enumerate(gathered)]
    plan = plan_groups(devices, num_stages=num_stages, replicas=replicas)
    created: dict[tuple[int, ...], Any] = {}
    for backend, ranks, member in plan.creation_calls(rank):
        group = dist.new_group(list(ranks), backend=backend, timeout=timeout)
        if member:
            created[ranks] = group
    if peers is not None:  # after every new_group call: each rank checks its groups in the one global order
        for backend, ranks, member in plan.creation_calls(rank):
            if member and backend == "gloo":
                name = f"gloo{list(ranks)}"
                prove_peers(peers, group=created[ranks], name=name, rank=rank, ranks=ranks)
    return Groups(plan, created)


def prove_peers(peers: PeerCheck, *, group: Any, name: str, rank: int, ranks: Sequence[int]) -> None:
    """Challenge every other rank of ``group`` (None: the world) over its own pair, and answer
    theirs: two rounds of 32-byte messages. Raises the first failed proof's line (from
    ``peers.check``); a peer that never answers fails at the group's timeout, named here.

    Point-to-point on every pair, not a collective: gloo's collectives go around a ring and would
    leave most pairs untried.
    """
    others = [int(peer) for peer in ranks if peer != rank]
    if not others:
        return
    nonces = {peer: peers.challenge() for peer in others}
    received = _swap(nonces, group=group, name=name)
    answers = {peer: peers.answer(name, prover=rank, verifier=peer, nonce=received[peer]) for peer in others}
    proofs = _swap(answers, group=group, name=name)
    for peer in others:
        peers.check(name, prover=peer, verifier=rank, nonce=nonces[peer], proof=proofs[peer])


def _swap(outgoing: dict[int, bytes], *, group: Any, name: str) -> dict[int, bytes]:
    """Send each peer its bytes and receive as many from it, over ``group``'s pair with that peer."""
    inboxes = {peer: torch.zeros(len(data), dtype=torch.uint8) for peer, data in outgoing.items()}
    sent = {peer: torch.tensor(list(data), dtype=torch.uint8) for peer, data in outgoing.items()}
    works = []
    for peer in outgoing:
        works.append((peer, dist.irecv(inboxes[peer], src=peer, group=group)))
        works.append((peer, dist.isend(sent[peer], dst=peer, group=group)))
    for peer, work in works:
        try:
            work.wait()
        except RuntimeError as error:
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ShardpoolError(
                f"rank {peer} of group {name} did not answer the peer check: {first}"
            ) from None
    return {peer: bytes(inbox.numpy().tobytes()) for peer, inbox in inboxes.items()}


#: Device kinds whose collective library binds to the process's current device: it must be set
#: before the rank's groups are made and before its first native send.
_CURRENT_DEVICE_KINDS = frozenset({"cuda", "xpu"})


def select_device(device: torch.device) -> None:
    """Make ``device`` this process's current device where its kind has one (CUDA and ROCm, XPU).

    NCCL and XCCL build a rank's communicators on the current device; left at index 0, every rank
    of a machine would put its communicator (and its allocator's context) on the first GPU.
    """
    if device.type in _CURRENT_DEVICE_KINDS:
        torch.get_device_module(device).set_device(device)


def others_in_world() -> bool:
    """Whether a world collective has anyone to talk to (a lone stage skips the round trip)."""
    return dist.is_initialized() and dist.get_world_size() > 1


def world_barrier() -> None:
    """Wait until every rank of the world gets here (at once for a lone stage)."""
    if dist.is_initialized():
        dist.barrier()


def leave_process_group() -> None:
    """Wait for every rank, then leave the world group (nothing to leave for a lone stage)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@dataclass(frozen=True)
class Link:
    """One neighbour: its global rank, the groups that carry this rank's sends to it and its sends
    to this rank (None: the gloo world; a native boundary has one group per direction, see
    :mod:`shardpool.train.transport`), and whether the tensor is staged through host memory
    (pinned when the device supports it)."""

    peer: int
    send_group: Any
    recv_group: Any
    staged: bool
    pinned: bool


@dataclass
class PostedRecv:
    """A receive from one neighbour, posted and not yet waited for."""

    wire: Wire
    link: Link
    tag: int
    buffer: torch.Tensor
    work: Any

    def wait(self) -> torch.Tensor:
        """The tensor, once it has arrived, on the stage's device and compute dtype (waiting counts as wait time)."""
        return self.wire._arrived(self)


@dataclass(frozen=True)
class Sent:
    """A send on the wire: its work handle, the buffer it reads, and its place on its channel
    (the ``seq``-th send to ``peer`` with ``tag`` since the last flush)."""

    work: Any
    payload: torch.Tensor
    peer: int
    tag: int
    seq: int


@dataclass
class Wire:
    """Point-to-point transfers of activations and their gradients between neighbouring stages.

    Tensors cross in ``wire_dtype`` and are cast to ``compute_dtype`` on arrival.
    """

    device: torch.device
    wire_dtype: torch.dtype
    compute_dtype: torch.dtype
    previous: Link | None
    next: Link | None
    pending: list[Sent] = field(default_factory=list)
    sent_on: dict[tuple[int, int], int] = field(default_factory=dict)  # (peer, tag) -> sends since flush
    wait_seconds: float = 0.0
    bytes_sent: int = 0

    @classmethod
    def for_rank(
        cls,
        groups: Groups,
        *,
        rank: int,
        is_first: bool,
        is_last: bool,
        device: torch.device,
        wire_dtype: torch.dtype,
        compute_dtype: torch.dtype,
    ) -> Wire:
        """The wire of ``rank``, with a link to each neighbour it has."""
        pinned = staging_is_pinned(device.type) and device.type != "cpu"

        def link(peer: int) -> Link:
            send_group, staged = groups.channel(rank, peer)
            recv_group, _ = groups.channel(peer, rank)
            return Link(peer, send_group, recv_group, staged, pinned and staged)

        return cls(
            device,
            wire_dtype,
            compute_dtype,
            previous=None if is_first else link(rank - 1),
            next=None if is_last else link(rank + 1),
        )

    def send(self, tensor: torch.Tensor, link: Link, *, tag: int) -> None:
        """Start sending without blocking; the buffer is kept alive until the send has completed.

        Sends that report completion are let go at every send, so a stage on a native (NCCL)
        link holds the buffers of the sends still on the wire, not every micro-batch's until
        :meth:`flush` at the step's end (at M = 32 on a large model, gigabytes of a GPU's memory).
        gloo reports a send complete only once it is waited for: its buffers go when the stage
        knows the neighbour has them (:meth:`delivered`), or at :meth:`flush`.
        """
        self.pending = [sent for sent in self.pending if not sent.work.is_completed()]
        payload = tensor.detach().to(self.wire_dtype).contiguous()
        if link.staged and payload.device.type != "cpu":
            host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=link.pinned)
            host.copy_(payload, non_blocking=link.pinned)
            if link.pinned:
                # gloo reads host memory from its own thread: the copy must have landed first.
                torch.get_device_module(payload.device).current_stream(payload.device).synchronize()
            payload = host
        seq = self.sent_on.get((link.peer, tag), 0)
        self.sent_on[(link.peer, tag)] = seq + 1
        work = dist.isend(payload, dst=link.peer, group=link.send_group, tag=tag)
        self.pending.append(Sent(work, payload, link.peer, tag, seq))
        self.bytes_sent += payload.numel() * payload.element_size()

    def recv(self, shape: tuple[int, ...], link: Link, *, tag: int) -> torch.Tensor:
        """Block until the neighbour's tensor arrives; return it on this stage's device and dtype."""
        return self.post_recv(shape, link, tag=tag).wait()

    def post_recv(self, shape: tuple[int, ...], link: Link, *, tag: int) -> PostedRecv:
        """Post a receive now, to be waited for later, so the transfer can land while this stage computes.

        On a native (NCCL-style) link the receive is issued at :meth:`PostedRecv.wait` instead, in
        the receive-only group of its direction: the library runs it on the device's stream, so
        waiting there costs the CPU nothing, and a receive issued early would only hold a buffer.
        """
        on_host = link.staged
        buffer = torch.empty(
            shape, dtype=self.wire_dtype, device="cpu" if on_host else self.device, pin_memory=link.pinned
        )
        work = dist.irecv(buffer, src=link.peer, group=link.recv_group, tag=tag) if on_host else None
        return PostedRecv(self, link, tag, buffer, work)

    def _arrived(self, posted: PostedRecv) -> torch.Tensor:
        started = time.perf_counter()
        if posted.work is None:
            dist.recv(posted.buffer, src=posted.link.peer, group=posted.link.recv_group, tag=posted.tag)
        else:
            posted.work.wait()
        self.wait_seconds += time.perf_counter() - started
        return posted.buffer.to(device=self.device, dtype=self.compute_dtype, non_blocking=posted.link.pinned)

    def delivered(self, link: Link, tag: int, *, through: int) -> None:
        """The neighbour has received sends 0..``through`` with ``tag`` over ``link`` since the last
        flush (a backward's gradient proves its forward's activation arrived): let their buffers go.

        Their waits return at once; a gloo send is complete only once waited for.
        """
        kept = []
        for sent in self.pending:
            if sent.peer == link.peer and sent.tag == tag and sent.seq <= through:
                sent.work.wait()
            else:
                kept.append(sent)
        self.pending = kept

    def flush(self) -> None:
        """Wait for every send started since the last flush."""
        started = time.perf_counter()
        for sent in self.pending:
            sent.work.wait()
        self.pending.clear()
        self.sent_on.clear()
        self.wait_seconds += time.perf_counter() - started
