"""Read single tensors out of a model's safetensors files, and remember which ones were read.

A stage reads only the tensors it owns. safetensors memory-maps the file, so the bytes of tensors
that are never read are never paged in: a stage holding 1/S of the layers costs about 1/S of the
memory. The record of names read is what tests check that claim against.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from shardpool.errors import ShardpoolError

__all__ = ["WeightReader"]


class WeightReader:
    """Lazy, recording access to the tensors of a (possibly sharded) safetensors checkpoint."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.file_of_tensor = _index_tensors(self.model_dir)
        self.names_read: list[str] = []
        self._files = ExitStack()
        self._open: dict[Path, Any] = {}

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint (from the file headers; no tensor data is read)."""
        return list(self.file_of_tensor)

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds a tensor of this name."""
        return name in self.file_of_tensor

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of a tensor, from the file header only (the tensor is not read or recorded)."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        """Read one tensor to CPU memory and record that it was read."""
        handle = self._handle(name)
        self.names_read.append(name)
        return handle.get_tensor(name)

    def _handle(self, name: str) -> Any:
        file = self.file_of_tensor.get(name)
        if file is None:
            raise ShardpoolError(f"tensor {name!r} is missing from {self.model_dir}; the checkpoint is incomplete")
        handle = self._open.get(file)
        if handle is None:
            handle = self._files.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            self._open[file] = handle
        return handle

    def close(self) -> None:
        """Release the memory maps."""
        self._files.close()
        self._open.clear()

    def __enter__(self) -> WeightReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _index_tensors(model_dir: Path) -> dict[str, Path]:
    index_file = model_dir / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ShardpoolError(f"{model_dir} has no .safetensors files; re-save the model with safe_serialization=True")
    mapping: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                mapping[name] = file
    return mapping
