"""A stage's side of a re-shard: which state tensors it hands over or keeps, and the bounded wait."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from shardpool.contract.rebalance import decision_key, encode_decision
from shardpool.errors import ShardpoolError
from shardpool.train.rendezvous import rendezvous_store
from shardpool.train.reshard import await_decision, kept_state, state_for_layers


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


def test_the_decision_is_read_from_the_store_and_a_silent_launcher_is_one_line() -> None:
    store = rendezvous_store("127.0.0.1", timeout_s=5.0)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
    store.set(decision_key(3), encode_decision(None))
    assert await_decision(client, 3, timeout_s=5.0) == encode_decision(None).encode()
    started = time.monotonic()
    with pytest.raises(
        ShardpoolError, match=r"no re-balance decision from the launcher within 0.3 s after step 4"
    ):
        await_decision(client, 4, timeout_s=0.3)
    assert time.monotonic() - started < 5.0
