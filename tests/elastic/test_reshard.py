"""A stage's side of a re-shard: which state tensors it hands over or keeps, and the bounded wait."""

from __future__ import annotations

import multiprocessing
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardpool.contract.rebalance import ROOM_ENV
from shardpool.elastic import reshard
from shardpool.elastic.messages import (
    ControlStore,
    await_decision,
    control_key,
    decision_key,
    encode_decision,
)
from shardpool.elastic.reshard import exchange_state, kept_state, room_bytes, state_for_layers
from shardpool.errors import ShardpoolError
from shardpool.train.rendezvous import rendezvous_store


def _key(layer: int) -> str:
    return f"base_model.model.model.layers.{layer}.mlp.down_proj.lora_A.weight"


def _state(layers: range) -> dict[str, torch.Tensor]:
    tensors = {}
    for layer in layers:
        tensors[f"lora.{_key(layer)}"] = torch.full((2, 2), float(layer))
        tensors[f"optim.{_key(layer)}.exp_avg"] = torch.full((2, 2), layer + 0.5)
        tensors[f"optim.{_key(layer)}.step"] = torch.tensor(3.0)
    tensors["lora.base_model.model.lm_head.lora_A.weight"] = torch.ones(2)
    return tensors


def test_state_for_layers_takes_lora_and_every_optimizer_field_of_those_layers() -> None:
    chosen = state_for_layers(_state(range(2, 4)), [3])
    assert sorted(chosen) == [f"lora.{_key(3)}", f"optim.{_key(3)}.exp_avg", f"optim.{_key(3)}.step"]
    assert all(tensor.is_contiguous() and tensor.device.type == "cpu" for tensor in chosen.values())


def test_kept_state_holds_the_overlap_and_what_is_no_layer() -> None:
    kept = kept_state(_state(range(2, 5)), old=(2, 5), new=(3, 6))
    layers = sorted({name.split(".layers.")[1].split(".")[0] for name in kept if ".layers." in name})
    assert layers == ["3", "4"]
    assert "lora.base_model.model.lm_head.lora_A.weight" in kept


def test_a_cuda_ranks_room_counts_the_allocators_cache_and_its_step_peaks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """2 GiB free on the card and 1 GiB cached by this process; its steps peaked 3 GiB above the
    4 GiB it holds between them: 0 GiB of room, and 1 GiB once the peak was only 2 GiB above."""
    gib = 2**30
    peak = [7 * gib]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 4 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 5 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: peak[0])
    monkeypatch.delenv(ROOM_ENV, raising=False)
    assert room_bytes(torch.device("cuda", 0), rank=0) == 0
    peak[0] = 6 * gib
    assert room_bytes(torch.device("cuda", 0), rank=0) == gib


def test_a_cpu_ranks_room_is_measured_and_the_hook_replaces_it_for_the_ranks_it_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ROOM_ENV, raising=False)
    measured = room_bytes(torch.device("cpu"), rank=1)
    assert 0 < measured < reshard.cpu_room_bytes() + 2**30
    monkeypatch.setenv(ROOM_ENV, "0:5,2:7")
    assert [room_bytes(torch.device("cpu"), rank=rank) == value for rank, value in ((0, 5), (2, 7))] == [
        True
    ] * 2
    assert room_bytes(torch.device("cpu"), rank=1) > 1000, "a rank the hook does not name measures"
    monkeypatch.setenv(ROOM_ENV, "2=7")
    with pytest.raises(ShardpoolError, match="expected RANK:BYTES"):
        room_bytes(torch.device("cpu"), rank=1)


def test_the_decision_is_read_from_the_store_and_a_silent_launcher_is_one_line() -> None:
    hosted = rendezvous_store("127.0.0.1", timeout_s=5.0)
    key = control_key("s" * 64, addr="127.0.0.1", port=hosted.port)
    store = ControlStore(hosted, key)
    client = ControlStore(
        dist.TCPStore("127.0.0.1", hosted.port, is_master=False, timeout=timedelta(seconds=5)), key
    )
    store.set(decision_key(3), encode_decision(None))
    assert await_decision(client, 3, timeout_s=5.0) == encode_decision(None).encode()
    started = time.monotonic()
    with pytest.raises(
        ShardpoolError, match=r"no re-balance decision from the launcher after step 4 within 0.3 s"
    ):
        await_decision(client, 4, timeout_s=0.3)
    assert time.monotonic() - started < 5.0


def _handover_rank(rank: int, world_size: int, init_file: str, results: Any) -> None:
    """One rank of a 2-stage, 2-replica world: hand over [0, 3) [3, 6) -> [0, 4) [4, 6) by gloo."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        old, new = [(0, 3), (3, 6)], [(0, 4), (4, 6)]
        stage, replica = rank % 2, rank // 2
        tensors = {
            name: tensor + 100 * replica
            for name, tensor in _state(range(*old[stage])).items()
            if ".layers." in name
        }
        received = exchange_state(tensors, old=old, new=new, stage=stage, replica=replica, rank=rank)
        results.put((rank, {name: float(tensor.flatten()[0]) for name, tensor in received.items()}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_each_replica_hands_its_layers_to_its_own_new_owner(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=_handover_rank, args=(rank, 4, str(tmp_path / "init"), results))
        for rank in range(4)
    ]
    for process in processes:
        process.start()
    received = dict(results.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0
    for rank in (0, 2):  # stage 0 of each replica gains layer 3, from stage 1 of the same replica
        replica = rank // 2
        assert received[rank] == {
            f"lora.{_key(3)}": 3.0 + 100 * replica,
            f"optim.{_key(3)}.exp_avg": 3.5 + 100 * replica,
            f"optim.{_key(3)}.step": 3.0 + 100 * replica,
        }
    assert received[1] == received[3] == {}
