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


class _MemoryFiles:
    """A byte source over in-memory files that counts its range reads."""

    location = "memory:"

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.ranges: list[tuple[str, int, int]] = []

    def file_sizes(self) -> dict[str, int]:
        return {name: len(data) for name, data in self.files.items()}

    def read_range(self, name: str, start: int, stop: int) -> bytes:
        self.ranges.append((name, start, stop))
        return self.files[name][start:stop]

    def close(self) -> None:
        pass


def test_any_byte_source_is_read_by_headers_then_one_range_per_tensor(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(4, 3), "b": torch.arange(5)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    source = _MemoryFiles({"w.safetensors": (tmp_path / "w.safetensors").read_bytes(), "notes.txt": b"x"})
    reader = WeightReader(source)
    assert sorted(reader.names()) == ["a", "b"] and len(source.ranges) == 2, "two reads for the header"
    assert torch.equal(reader.read("b"), tensors["b"])
    entry = reader.entries["b"]
    assert source.ranges[-1] == ("w.safetensors", entry.start, entry.stop)
    assert reader.bytes_read == entry.stop - entry.start == 5 * 8
