"""Read single tensors out of a model's safetensors files by byte range, and record which were read.

A stage reads only the tensors it owns. Each tensor is one range read of exactly its bytes (the
safetensors header gives every tensor's offsets), so a stage holding 1/S of the layers never
touches, maps or pages in the rest of the checkpoint. :class:`WeightReader` does this over any
:class:`ByteSource`: :class:`LocalFiles` (a model directory, positioned reads) on the launching
machine, or :class:`shardpool.files.client.RemoteFiles` (verified HTTP range reads through the
launcher's file server, cached by content) on another member. The record of names read is what
tests check this against.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save_file

from mesh.files import AtomicFile
from shardpool.errors import ShardpoolError

__all__ = ["INDEX_FILE", "ByteSource", "LocalFiles", "TensorEntry", "WeightReader", "save_tensors"]

#: The file of a sharded checkpoint that maps each tensor to the safetensors file holding it.
INDEX_FILE = "model.safetensors.index.json"

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


class ByteSource(Protocol):
    """Named files whose byte ranges can be read: a model directory, or the launcher's file server."""

    @property
    def location(self) -> str:
        """Where the files are (a directory or a URL), for messages; ``location/name`` names a file."""
        ...

    def file_sizes(self) -> dict[str, int]:
        """Every file the source holds, by name, with its size in bytes."""
        ...

    def read_range(self, name: str, start: int, stop: int) -> bytes | bytearray:
        """Exactly bytes ``[start, stop)`` of file ``name``, or a one-line ShardpoolError."""
        ...

    def close(self) -> None:
        """Release what the source holds open; it stays usable."""
        ...


class LocalFiles:
    """The regular files directly inside one directory, read with positioned reads (no mapping)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @property
    def location(self) -> str:
        """The directory."""
        return str(self.root)

    def file_sizes(self) -> dict[str, int]:
        """The regular files directly inside the directory, with their sizes."""
        try:
            with os.scandir(self.root) as entries:
                return {entry.name: entry.stat().st_size for entry in entries if entry.is_file()}
        except OSError as error:
            raise ShardpoolError(f"cannot list the model directory {self.root}: {error.strerror}") from None

    def read_range(self, name: str, start: int, stop: int) -> bytearray:
        """Bytes ``[start, stop)`` of ``root/name`` into a new (writable) buffer; short files are refused."""
        if Path(name).name != name or name in (".", ".."):
            raise ShardpoolError(f"{name!r} is not a file name directly inside {self.root}")
        buffer = bytearray(stop - start)
        view, done = memoryview(buffer), 0
        with open(self.root / name, "rb", buffering=0) as handle:
            while done < len(buffer):  # one read returns at most ~2 GiB on Linux
                got = os.preadv(handle.fileno(), [view[done:]], start + done)
                if got == 0:
                    raise ShardpoolError(
                        f"{self.root / name} is truncated: bytes {start}-{stop} are past its end; re-save the model"
                    )
                done += got
        return buffer

    def close(self) -> None:
        """Nothing stays open between reads."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: file name in the source, absolute byte range, dtype and shape."""

    file: str
    start: int
    stop: int
    dtype: str
    shape: tuple[int, ...]


class WeightReader:
    """Recording, byte-range access to the tensors of a (possibly sharded) safetensors checkpoint.

    ``source`` is a model directory or any :class:`ByteSource`. ``file_names`` are the checkpoint's
    safetensors files in it; by default those the index (``model.safetensors.index.json``) names,
    else every ``.safetensors`` file. Only the headers are read up front; ``names_read`` and
    ``bytes_read`` record the tensors handed out since.
    """

    def __init__(self, source: ByteSource | str | Path, file_names: Sequence[str] | None = None) -> None:
        self.source: ByteSource = LocalFiles(source) if isinstance(source, (str, Path)) else source
        sizes = self.source.file_sizes()
        files = list(file_names) if file_names is not None else _checkpoint_files(self.source, sizes)
        if not files:
            raise ShardpoolError(
                f"{self.source.location} has no .safetensors files; re-save the model with safe_serialization=True"
            )
        self.entries: dict[str, TensorEntry] = {}
        for file in files:
            self.entries.update(_read_header(self.source, file, sizes))
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
        """Read one tensor into CPU memory with a single range read of exactly its bytes, and record it."""
        entry = self._entry(name)
        if entry.dtype not in _DTYPES:
            raise ShardpoolError(
                f"tensor {name!r} in {self.source.location}/{entry.file} has unsupported dtype {entry.dtype}"
            )
        data = self.source.read_range(entry.file, entry.start, entry.stop)
        buffer = data if isinstance(data, bytearray) else bytearray(data)
        if len(buffer) != entry.stop - entry.start:
            raise ShardpoolError(
                f"tensor {name!r} in {self.source.location}/{entry.file} needs "
                f"{entry.stop - entry.start} bytes, got {len(buffer)}"
            )
        self.names_read.append(name)
        self.bytes_read += len(buffer)
        if not buffer:
            return torch.empty(entry.shape, dtype=_DTYPES[entry.dtype])
        return torch.frombuffer(buffer, dtype=_DTYPES[entry.dtype]).reshape(entry.shape)

    def _entry(self, name: str) -> TensorEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise ShardpoolError(
                f"tensor {name!r} is missing from {self.source.location}; the checkpoint is incomplete"
            )
        return entry

    def close(self) -> None:
        """Close the source's connections (the reader stays usable: a remote source reconnects)."""
        self.source.close()

    def __enter__(self) -> WeightReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _checkpoint_files(source: ByteSource, sizes: dict[str, int]) -> list[str]:
    """The safetensors files of a checkpoint: those its index names, else every ``.safetensors`` file."""
    if INDEX_FILE not in sizes:
        return sorted(name for name in sizes if name.endswith(".safetensors"))
    where = f"{source.location}/{INDEX_FILE}"
    if sizes[INDEX_FILE] > _MAX_HEADER_BYTES:
        raise ShardpoolError(f"{where} is {sizes[INDEX_FILE]} bytes; it is not a safetensors index")
    try:
        weight_map = json.loads(source.read_range(INDEX_FILE, 0, sizes[INDEX_FILE]))["weight_map"]
        return sorted({str(file) for file in weight_map.values()})
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        raise ShardpoolError(f"{where} has no weight_map; re-save the model") from None


def _read_header(source: ByteSource, file: str, sizes: dict[str, int]) -> dict[str, TensorEntry]:
    """Parse one safetensors file's header (two range reads) into absolute byte ranges, checked against its size."""
    where = f"{source.location}/{file}"
    size = sizes.get(file)
    if size is None:
        raise ShardpoolError(f"{where} does not exist; the checkpoint is incomplete")
    prefix = source.read_range(file, 0, min(8, size))
    if len(prefix) != 8:
        raise ShardpoolError(f"{where} is not a safetensors file (too short); re-save the model")
    (length,) = struct.unpack("<Q", prefix)
    if length > _MAX_HEADER_BYTES:
        raise ShardpoolError(f"{where} has a {length}-byte header; it is not a safetensors file")
    if 8 + length > size:
        raise ShardpoolError(f"{where} is truncated inside its header; re-save the model")
    entries = _parse_header(source.read_range(file, 8, 8 + length), file, where)
    for tensor, entry in entries.items():
        if entry.stop > size:
            raise ShardpoolError(f"{where} is truncated: {tensor!r} ends past byte {size}; re-save the model")
    return entries


def _parse_header(header: bytes | bytearray, file: str, where: str) -> dict[str, TensorEntry]:
    """Turn a safetensors JSON header (the bytes after the 8-byte length) into absolute byte ranges."""
    try:
        parsed = json.loads(header)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ShardpoolError(f"{where} has a corrupt safetensors header; re-save the model") from None
    if not isinstance(parsed, dict):
        raise ShardpoolError(f"{where} has a corrupt safetensors header; re-save the model")
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
                f"{where} has a malformed header entry for {name!r}; re-save the model"
            ) from None
        if not 0 <= begin <= end:
            raise ShardpoolError(f"{where} gives {name!r} the byte range {begin}-{end}; re-save the model")
        entries[name] = TensorEntry(file, data_start + begin, data_start + end, dtype, shape)
    return entries


def save_tensors(
    path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Replace ``path`` with a safetensors file of ``tensors`` (moved to CPU, made contiguous), atomically."""
    prepared = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
    with AtomicFile(path) as file:
        save_file(prepared, file.temp_path, metadata=metadata)
        file.commit()
