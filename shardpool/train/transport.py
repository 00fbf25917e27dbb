"""Which torch.distributed backend carries each kind of traffic, decided from the devices alone.

Every stage process joins one **gloo world group**: step-end collectives (loss and token counts,
the global gradient norm, stage timings), barriers and evaluation sums run there on CPU tensors,
whatever the devices. On top of it, ranks whose devices share a vendor collective library join
small **native subgroups** (NCCL on CUDA, RCCL, which torch also calls ``nccl``, on ROCm, XCCL on
Intel XPU):

* the two sides of a pipeline boundary whose devices are the same GPU kind, for point-to-point
  activations and gradients on the device: **one group per direction** (:meth:`GroupPlan.channel`).
  A native library runs one communicator's sends and receives in the order a rank issues them, and
  a send completes only once the peer's matching receive runs (NCCL keeps no buffer for a large
  message). With one communicator for both directions, 1F1B deadlocks: stage 0 issues send a0,
  send a1, recv g0 while stage 1 issues recv a0, send g0, recv a1, so send a1 and send g0 wait
  for each other. One communicator per direction carries only sends on one side and only receives
  on the other, each in micro-batch order, so they always match
  (``tests/train/test_wire_order.py`` simulates every schedule the planner can choose);
* the replicas of a stage on such devices, for the all-reduce of adapter gradients.

Every other boundary (CUDA↔CPU, CUDA↔MPS, ROCm↔CUDA, …) goes through gloo with the tensor
staged in CPU memory (pinned where the device supports it, copied without blocking).

Every rank calls ``new_group`` for every subgroup, in one global order (:meth:`GroupPlan.creation_calls`):
torch names a group from a per-process count of groups made so far, so members must agree on
that count. A rank outside a subgroup gets torch's non-member placeholder, before any communicator
is built, and asks for it with ``gloo``: a rank whose torch has no NCCL (a Mac, a CPU box) never
names NCCL, let alone constructs it. (``use_local_synchronization=True`` cannot be used here: it
hashes the ranks with that per-process count, so in a chain of three CUDA stages the middle rank,
which makes two groups, names its second one differently from its neighbour, and both wait until
the timeout; ``tests/train/test_process_group.py`` shows it.) The choice
is a pure function of each rank's device kind and whether its torch has that kind's backend, which
the ranks exchange over the gloo world group at start; this module imports no torch, so the
choice is tested on any machine (``tests/train/test_transport.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "DEVICE_KINDS",
    "NATIVE_BACKENDS",
    "Boundary",
    "GroupPlan",
    "RankDevice",
    "boundary_transport",
    "decode_rank_device",
    "encode_rank_device",
    "plan_groups",
    "staging_is_pinned",
]

DeviceKind = Literal["cpu", "cuda", "rocm", "mps", "xpu"]
DEVICE_KINDS: tuple[DeviceKind, ...] = ("cpu", "cuda", "rocm", "mps", "xpu")

#: The collective library of each GPU kind, as torch.distributed names its backend.
NATIVE_BACKENDS: dict[str, str] = {"cuda": "nccl", "rocm": "nccl", "xpu": "xccl"}

#: Device kinds whose host copies can come from page-locked memory (asynchronous DMA).
_PINNABLE = frozenset({"cuda", "rocm", "xpu"})


@dataclass(frozen=True)
class RankDevice:
    """What one rank runs on: its device kind, whether its torch has that kind's native backend,
    and which physical device it is (``place``, e.g. ``"hostA/cuda:0"``).

    Two ranks on one physical GPU cannot share an NCCL communicator, so they talk through gloo.
    """

    kind: DeviceKind
    native_available: bool = False
    place: str = ""

    @property
    def native_backend(self) -> str | None:
        """The backend this rank can use for device-to-device traffic, or None (gloo via CPU)."""
        backend = NATIVE_BACKENDS.get(self.kind)
        return backend if backend and self.native_available else None


@dataclass(frozen=True)
class Boundary:
    """How tensors cross one pipeline boundary.

    ``backend`` is ``"gloo"`` or a native backend; ``staged`` means the tensor travels through CPU
    memory (always true for gloo, since gloo reads host memory only).
    """

    backend: str

    @property
    def staged(self) -> bool:
        """Whether the tensor is copied to the host before it is sent, and to the device on arrival."""
        return self.backend == "gloo"


def boundary_transport(left: RankDevice, right: RankDevice) -> Boundary:
    """The transport of a boundary between two stages: native when both sides are the same GPU kind
    and both have its backend, else gloo through host memory.

    ROCm and CUDA are different kinds: RCCL and NCCL do not talk to each other. Two stages on the
    same physical device go through gloo too (NCCL refuses two ranks on one GPU).
    """
    distinct = not left.place or left.place != right.place
    if left.kind == right.kind and left.native_backend and right.native_backend and distinct:
        return Boundary(left.native_backend)
    return Boundary("gloo")


def staging_is_pinned(kind: str) -> bool:
    """Whether host staging buffers for this device kind should be page-locked (pinned)."""
    return kind in _PINNABLE


@dataclass(frozen=True)
class GroupPlan:
    """The subgroups a job needs beyond the gloo world group, in the order ranks create them.

    ``subgroups`` lists ``(backend, ranks)``; a rank creates, in this order, exactly those that
    contain it. A native boundary between ``a < b`` has two: ``(a, b)`` carries what ``a`` sends
    to ``b`` (activations) and ``(b, a)`` what ``b`` sends to ``a`` (gradients); torch sorts a
    group's ranks, so the order of the pair only tells the two apart. ``boundaries[(a, b)]`` is the
    transport between neighbouring ranks ``a < b``; ``replica_groups[stage]`` the ranks and backend
    that all-reduce that stage's gradients.
    """

    subgroups: tuple[tuple[str, tuple[int, ...]], ...]
    boundaries: dict[tuple[int, int], Boundary]
    replica_groups: dict[int, tuple[str, tuple[int, ...]]]

    def subgroups_of(self, rank: int) -> list[tuple[str, tuple[int, ...]]]:
        """The subgroups ``rank`` belongs to, in creation order."""
        return [(backend, ranks) for backend, ranks in self.subgroups if rank in ranks]

    def channel(self, sender: int, receiver: int) -> tuple[int, int] | None:
        """The subgroup that carries what ``sender`` sends its neighbour ``receiver``: the directed
        pair ``(sender, receiver)`` on a native boundary, None (the gloo world) on a staged one."""
        transport = self.boundaries[(min(sender, receiver), max(sender, receiver))]
        return None if transport.staged else (sender, receiver)

    def creation_calls(self, rank: int) -> list[tuple[str, tuple[int, ...], bool]]:
        """``(backend, ranks, member)`` for each ``new_group`` call ``rank`` makes, in the global order.

        Every rank calls for every subgroup, so torch's group names agree across ranks; a
        non-member asks for ``gloo`` (its group is never built, and its torch may lack NCCL).
        """
        return [
            (backend if rank in ranks else "gloo", ranks, rank in ranks) for backend, ranks in self.subgroups
        ]


def plan_groups(devices: list[RankDevice], *, num_stages: int, replicas: int) -> GroupPlan:
    """Subgroups and per-boundary transports for ``replicas`` pipelines of ``num_stages`` stages.

    ``devices[rank]`` describes each global rank (replica-major: ``rank = replica × S + stage``).
    Native subgroups are made only for native boundaries and for replica sets whose members all
    share a native backend on distinct physical devices; gloo replica groups serve the rest. No rank ever appears in a group
    of a backend its torch lacks.
    """
    if len(devices) != num_stages * replicas:
        raise ValueError(f"{len(devices)} rank devices for {num_stages} stages × {replicas} replicas")
    subgroups: list[tuple[str, tuple[int, ...]]] = []
    boundaries: dict[tuple[int, int], Boundary] = {}
    for replica in range(replicas):
        for stage in range(num_stages - 1):
            left = replica * num_stages + stage
            boundary = boundary_transport(devices[left], devices[left + 1])
            boundaries[(left, left + 1)] = boundary
            if not boundary.staged:
                subgroups.append((boundary.backend, (left, left + 1)))
                subgroups.append((boundary.backend, (left + 1, left)))
    replica_groups: dict[int, tuple[str, tuple[int, ...]]] = {}
    if replicas > 1:
        for stage in range(num_stages):
            ranks = tuple(replica * num_stages + stage for replica in range(replicas))
            backends = {devices[rank].native_backend for rank in ranks}
            kinds = {devices[rank].kind for rank in ranks}
            places = [devices[rank].place for rank in ranks]
            distinct = "" not in places and len(set(places)) == len(places)
            uniform = len(backends) == 1 and len(kinds) == 1 and distinct
            shared = next(iter(backends)) if uniform else None
            group = (shared or "gloo", ranks)
            replica_groups[stage] = group
            subgroups.append(group)
    return GroupPlan(tuple(subgroups), boundaries, replica_groups)


def encode_rank_device(device: RankDevice) -> int:
    """A small integer for exchanging a rank's kind and backend over a tensor collective (no pickle).

    ``place`` is not encoded: every rank reads it from the job.
    """
    return DEVICE_KINDS.index(device.kind) * 2 + int(device.native_available)


def decode_rank_device(code: int, place: str = "") -> RankDevice:
    """Inverse of :func:`encode_rank_device`, with the rank's ``place`` from the job."""
    kind_index, native = divmod(int(code), 2)
    if not 0 <= kind_index < len(DEVICE_KINDS):
        raise ValueError(f"rank device code {code} is out of range")
    return RankDevice(DEVICE_KINDS[kind_index], bool(native), place)
