"""Read single tensors out of a model's safetensors files by byte range, and record which were read.

A stage reads only the tensors it owns. Each tensor is read with one positioned read of exactly its
bytes (the safetensors header gives every tensor's offsets), so a stage holding 1/S of the layers
never touches, maps or pages in the rest of the file. The same byte ranges are what a remote stage
fetches from the launching machine. The record of names read is what tests check this against.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from mesh.files import AtomicFile
from shardpool.errors import ShardpoolError

__all__ = [
    "save_tensors",
    "WeightReader",
    "TensorEntry",
    "header_length",
    "parse_header",
    "read_header",
    "tensor_from_bytes",
]

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER_BYTES = 100 * 2**20


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: file, absolute byte range, dtype and shape."""

    file: Path
    start: int
    stop: int
    dtype: str
    shape: tuple[int, ...]


def header_length(prefix: bytes, source: str | Path) -> int:
    """The JSON header length announced by a safetensors file's first 8 bytes (checked for sanity).

    Split out of :func:`read_header` so a remote reader can parse a header it fetched by byte range.
    """
    if len(prefix) != 8:
        raise ShardpoolError(f"{source} is not a safetensors file (too short); re-save the model")
    (length,) = struct.unpack("<Q", prefix)
    if length > _MAX_HEADER_BYTES:
        raise ShardpoolError(f"{source} has a {length}-byte header; it is not a safetensors file")
    return int(length)


def parse_header(header: bytes, file: Path) -> dict[str, TensorEntry]:
    """Turn a safetensors JSON header (the bytes after the 8-byte length) into absolute byte ranges.

    ``file`` is recorded in each entry; for a remote file it is the name the file server knows it by.
    """
    try:
        parsed = json.loads(header)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ShardpoolError(f"{file} has a corrupt safetensors header; re-save the model") from None
    if not isinstance(parsed, dict):
        raise ShardpoolError(f"{file} has a corrupt safetensors header; re-save the model")
    data_start = 8 + len(header)
    entries = {}
    for name, info in parsed.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(offset) for offset in info["data_offsets"])
            dtype, shape = str(info["dtype"]), tuple(int(size) for size in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise ShardpoolError(
                f"{file} has a malformed header entry for {name!r}; re-save the model"
            ) from None
        if not 0 <= begin <= end:
            raise ShardpoolError(f"{file} gives {name!r} the byte range {begin}-{end}; re-save the model")
        entries[name] = TensorEntry(file, data_start + begin, data_start + end, dtype, shape)
    return entries


def read_header(file: Path) -> dict[str, TensorEntry]:
    """Parse a safetensors file's header into absolute byte ranges (no tensor data is read)."""
    with open(file, "rb") as handle:
        length = header_length(handle.read(8), file)
        header = handle.read(length)
    if len(header) != length:
        raise ShardpoolError(f"{file} is truncated inside its header; re-save the model")
    return parse_header(header, file)


def tensor_from_bytes(buffer: bytearray, entry: TensorEntry, name: str) -> torch.Tensor:
    """Build the tensor ``entry`` describes from exactly its bytes (shared with the remote reader)."""
    if entry.dtype not in _DTYPES:
        raise ShardpoolError(f"tensor {name!r} in {entry.file} has unsupported dtype {entry.dtype}")
    if len(buffer) != entry.stop - entry.start:
        raise ShardpoolError(
            f"tensor {name!r} in {entry.file} needs {entry.stop - entry.start} bytes, got {len(buffer)}"
        )
    if not buffer:
        return torch.empty(entry.shape, dtype=_DTYPES[entry.dtype])
    return torch.frombuffer(buffer, dtype=_DTYPES[entry.dtype]).reshape(entry.shape)


class WeightReader:
    """Recording, byte-range access to the tensors of a (possibly sharded) safetensors checkpoint."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.entries = _index_tensors(self.model_dir)
        self.names_read: list[str] = []
        self.bytes_read = 0

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint (from the file headers; no tensor data is read)."""
        return list(self.entries)

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds a tensor of this name."""
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of a tensor, from the header only (the tensor is not read or recorded)."""
        return self._entry(name).shape

    def read(self, name: str) -> torch.Tensor:
        """Read one tensor into CPU memory with a single positioned read, and record it."""
        entry = self._entry(name)
        if entry.dtype not in _DTYPES:
            raise ShardpoolError(f"tensor {name!r} in {entry.file} has unsupported dtype {entry.dtype}")
        size = entry.stop - entry.start
        buffer = bytearray(size)
        with open(entry.file, "rb", buffering=0) as handle:
            got = os.preadv(handle.fileno(), [buffer], entry.start) if size else 0
        if got != size:
            raise ShardpoolError(
                f"{entry.file} is truncated: {name!r} needs {size} bytes, got {got}; re-save the model"
            )
        self.names_read.append(name)
        self.bytes_read += size
        return tensor_from_bytes(buffer, entry, name)

    def _entry(self, name: str) -> TensorEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise ShardpoolError(
                f"tensor {name!r} is missing from {self.model_dir}; the checkpoint is incomplete"
            )
        return entry

    def close(self) -> None:
        """Nothing stays open between reads; kept so the reader works as a context manager."""

    def __enter__(self) -> WeightReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _index_tensors(model_dir: Path) -> dict[str, TensorEntry]:
    index_file = model_dir / "model.safetensors.index.json"
    if index_file.is_file():
        files = sorted(
            {
                model_dir / file
                for file in json.loads(index_file.read_text(encoding="utf-8"))["weight_map"].values()
            }
        )
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ShardpoolError(
            f"{model_dir} has no .safetensors files; re-save the model with safe_serialization=True"
        )
    entries: dict[str, TensorEntry] = {}
    for file in files:
        entries.update(read_header(file))
    return entries


def save_tensors(
    path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Replace ``path`` with a safetensors file of ``tensors`` (moved to CPU, made contiguous), atomically."""
    prepared = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
    with AtomicFile(path) as file:
        save_file(prepared, file.temp_path, metadata=metadata)
        file.commit()
