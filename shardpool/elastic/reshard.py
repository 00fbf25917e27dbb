"""A stage's side of an in-place re-shard: which state it hands over, and the hand-over itself.

At a re-shard (:mod:`shardpool.elastic.rebalancing`) every rank keeps its process, its rank, its
device and its process groups; only its layers change. It takes its LoRA tensors and AdamW state
at the step boundary (by global adapter key, as checkpoints hold them), sends those of the layers
it loses to their new owner in the same replica, and receives those of the layers it gains. The
tensors travel as safetensors bytes over the gloo world group (nothing is unpickled), so every
optimizer's state fields travel as they are and the result is exact. The caller then rebuilds its
stage for the new layers and restores the state by key. A job that grows in place
(:mod:`shardpool.elastic.growth`) hands over the same way, in its new process group, by layer
position from rank to rank (:func:`exchange_by_position`): ranks renumber and the stage count changes.

Before any of that, at the end of the check step, each rank measures its room
(:func:`room_bytes`), which the launcher's decision respects (:mod:`shardpool.plan.room`).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence

import torch
import torch.distributed as dist
from safetensors.torch import load as load_tensor_bytes
from safetensors.torch import save as save_tensor_bytes

from shardpool.contract.rebalance import kill_rank, room_override
from shardpool.elastic.handover_plan import handovers, key_layer, state_position
from shardpool.host.memory_limit import cpu_room_bytes, room_after_peak

__all__ = [
    "HANDOVER_TAG",
    "exchange_by_position",
    "exchange_state",
    "kept_state",
    "module_layer",
    "room_bytes",
    "state_for_layers",
]

#: The tag of hand-over messages (the pipeline's are 1 and 2, and quiet at a step boundary).
HANDOVER_TAG = 7


def room_bytes(device: torch.device, *, rank: int) -> int:
    """The bytes this rank can still take on: its device's free memory, less what its step peaks
    already take above what it holds between steps (:func:`shardpool.host.memory_limit.room_after_peak`).

    CUDA counts the caching allocator's unused blocks as free and its peak since the stage started
    (loading included, so the figure errs low); CPU the machine's available memory within the
    process's cgroup and its resident peak; MPS Metal's recommended working set less what the
    driver holds. The test hook :data:`shardpool.contract.rebalance.ROOM_ENV` replaces the
    measurement for the ranks it names.
    """
    override = room_override(rank)
    if override is not None:
        return override
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        allocated = int(torch.cuda.memory_allocated(device))
        cached = int(torch.cuda.memory_reserved(device)) - allocated
        return room_after_peak(int(free) + cached, int(torch.cuda.max_memory_allocated(device)), allocated)
    if device.type == "mps":
        return max(0, int(torch.mps.recommended_max_memory()) - int(torch.mps.driver_allocated_memory()))
    if device.type == "xpu":
        total = int(torch.xpu.get_device_properties(device).total_memory)
        allocated = int(torch.xpu.memory_allocated(device))  # what is not allocated is free or cached here
        return room_after_peak(total - allocated, int(torch.xpu.max_memory_allocated(device)), allocated)
    return cpu_room_bytes()


def module_layer(path: str) -> int | None:
    """The decoder layer of a module path in the causal LM (``model.layers.N``), or None."""
    return key_layer(path + ".")


def state_key_layer(name: str) -> int | None:
    """The decoder layer of a state tensor (``lora.KEY`` or ``optim.KEY.FIELD``), or None."""
    return key_layer(name.split(".", 1)[1])


def state_for_layers(tensors: dict[str, torch.Tensor], layers: Sequence[int]) -> dict[str, torch.Tensor]:
    """The state tensors of ``layers``, on the host and contiguous (as safetensors writes them)."""
    wanted = set(layers)
    return _host_copies(tensors, [name for name in tensors if state_key_layer(name) in wanted])


def _host_copies(tensors: dict[str, torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]:
    """``names`` of ``tensors`` on the host and contiguous, as safetensors writes them."""
    return {name: tensors[name].detach().to("cpu").contiguous() for name in names}


def kept_state(
    tensors: dict[str, torch.Tensor], *, old: tuple[int, int], new: tuple[int, int]
) -> dict[str, torch.Tensor]:
    """The state tensors a stage keeps: those of layers in both its old and new range, and its non-layer ones."""
    keep = set(range(*old)) & set(range(*new))
    return {
        name: tensor
        for name, tensor in tensors.items()
        if (layer := state_key_layer(name)) is None or layer in keep
    }


def exchange_state(
    tensors: dict[str, torch.Tensor],
    *,
    old: Sequence[tuple[int, int]],
    new: Sequence[tuple[int, int]],
    stage: int,
    replica: int,
    rank: int,
) -> dict[str, torch.Tensor]:
    """Send the state of the layers this stage loses, receive that of the layers it gains; return the received.

    Ranks are replica-major (rank = replica × stages + stage); each replica hands over within
    itself, since replicas hold the same state.
    """
    num_stages = len(old)
    moves = handovers(old, new)
    peer = {index: replica * num_stages + index for index in range(num_stages)}
    outgoing = {
        peer[target]: state_for_layers(tensors, layers)
        for (source, target), layers in moves.items()
        if source == stage
    }
    sources = sorted(peer[source] for source, target in moves if target == stage)
    return _hand_over(outgoing, sources, rank=rank)


def exchange_by_position(
    tensors: dict[str, torch.Tensor],
    moves: dict[tuple[int, int], list[int]],
    *,
    rank: int,
    num_layers: int,
) -> dict[str, torch.Tensor]:
    """A job growing in place (:mod:`shardpool.elastic.growth`): send the state of the positions
    ``moves`` takes from this rank, receive what it brings here; return the received.

    ``moves`` is ``{(from rank, to rank): [positions]}`` in the grown job's ranks.
    """
    position_of = {name: state_position(name, num_layers) for name in tensors}
    outgoing: dict[int, dict[str, torch.Tensor]] = {}
    for (source, target), positions in moves.items():
        if source == rank:
            wanted = set(positions)
            outgoing[target] = _host_copies(
                tensors, [name for name in tensors if position_of[name] in wanted]
            )
    sources = sorted(source for source, target in moves if target == rank)
    return _hand_over(outgoing, sources, rank=rank)


def _hand_over(
    outgoing: dict[int, dict[str, torch.Tensor]], sources: Sequence[int], *, rank: int
) -> dict[str, torch.Tensor]:
    """Send each ``outgoing`` peer its tensors and receive from every rank in ``sources``.

    Sizes go first, then the bytes; sends are posted before receives, so no order of pairs can
    deadlock. The tensors cross as safetensors bytes over the world group (nothing is unpickled).
    """
    payloads = {target: save_tensor_bytes(tensors) for target, tensors in sorted(outgoing.items())}
    pending = [
        dist.isend(torch.tensor([len(payload)], dtype=torch.int64), target, tag=HANDOVER_TAG)
        for target, payload in payloads.items()
    ]
    sizes = {}
    for source in sources:
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, source, tag=HANDOVER_TAG)
        sizes[source] = int(size.item())
    pending += [
        dist.isend(torch.frombuffer(bytearray(payload), dtype=torch.uint8), target, tag=HANDOVER_TAG)
        for target, payload in payloads.items()
    ]
    if kill_rank() == rank:
        os.kill(os.getpid(), signal.SIGKILL)  # the test hook: a stage lost in the middle of a hand-over
    received: dict[str, torch.Tensor] = {}
    for source in sources:
        buffer = torch.empty(sizes[source], dtype=torch.uint8)
        dist.recv(buffer, source, tag=HANDOVER_TAG)
        received.update(load_tensor_bytes(buffer.numpy().tobytes()))
    for work in pending:
        work.wait()
    return received
