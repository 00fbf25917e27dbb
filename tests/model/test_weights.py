"""shardpool.model.weights: byte-range reads return exactly what safetensors stores, and are recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardpool.errors import ShardpoolError
from shardpool.model.weights import WeightReader


def test_reads_match_safetensors_for_every_dtype(tmp_path: Path) -> None:
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(4, 2).to(torch.bfloat16),
        "f16": torch.randn(7).to(torch.float16),
        "i64": torch.arange(6).reshape(2, 3),
        "u8": torch.arange(10, dtype=torch.uint8),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with WeightReader(tmp_path) as reader:
        for name, expected in load_file(str(tmp_path / "model.safetensors")).items():
            got = reader.read(name)
            assert got.dtype == expected.dtype and torch.equal(got, expected), name
            assert reader.shape(name) == tuple(expected.shape)
        assert sorted(reader.names_read) == sorted(tensors)
        assert reader.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values())


def test_sharded_checkpoints_are_indexed(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    reader = WeightReader(tmp_path)
    assert torch.equal(reader.read("b"), torch.zeros(3))
    assert reader.names_read == ["b"]


def test_missing_tensor_and_truncated_file_are_one_line_errors(tmp_path: Path) -> None:
    save_file({"w": torch.ones(1000)}, str(tmp_path / "model.safetensors"))
    reader = WeightReader(tmp_path)
    with pytest.raises(ShardpoolError, match="missing"):
        reader.read("nope")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ShardpoolError, match="truncated"):
        WeightReader(tmp_path).read("w")
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(ShardpoolError, match="not a safetensors file"):
        WeightReader(tmp_path)
