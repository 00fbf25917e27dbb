"""The prepared-data file: both splits of a run in one safetensors file that every stage reads.

The launcher tokenizes once and writes this file; stage processes load it instead of tokenizing
again. Its header carries ``packed`` and the row counters, so the file alone restores
:class:`~shardpool.data.rows.PreparedData`.
"""

from __future__ import annotations

import os
from pathlib import Path

from mesh.files import AtomicFile
from shardpool.data.rows import ROW_FIELDS, PreparedData, TokenRows
from shardpool.errors import ShardpoolError

__all__ = ["load_prepared", "save_prepared"]

_FORMAT_NAME = "shardpool-prepared-data"
_FORMAT_VERSION = "1"


def save_prepared(data: PreparedData, path: str | os.PathLike[str]) -> None:
    """Write both splits to one safetensors file, atomically (temporary file, then rename).

    Stage processes load the same file instead of tokenizing again; the header carries ``packed``
    and the counters, so the file alone restores :class:`PreparedData`.
    """
    from safetensors.torch import save_file

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"{split}.{name}": getattr(rows, name).contiguous()
        for split, rows in (("train", data.train), ("eval", data.eval))
        for name in ROW_FIELDS
    }
    metadata = {
        "format": _FORMAT_NAME,
        "version": _FORMAT_VERSION,
        "packed": "true" if data.packed else "false",
        "dropped_rows": str(data.dropped_rows),
        "truncated_rows": str(data.truncated_rows),
        "sequence_len": str(data.train.sequence_len),
    }
    with AtomicFile(target) as file:
        save_file(tensors, file.temp_path, metadata=metadata)
        file.commit()


def load_prepared(path: str | os.PathLike[str]) -> PreparedData:
    """Read a file written by :func:`save_prepared`."""
    from safetensors import safe_open

    source = Path(path)
    if not source.is_file():
        raise ShardpoolError(f"prepared data file {str(source)!r} does not exist; prepare the data again")
    try:
        with safe_open(str(source), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception:
        raise ShardpoolError(
            f"{str(source)!r} is not a readable safetensors file; delete it and prepare the data again"
        ) from None
    if metadata.get("format") != _FORMAT_NAME or metadata.get("version") != _FORMAT_VERSION:
        raise ShardpoolError(
            f"{str(source)!r} is not shardpool prepared data (version {_FORMAT_VERSION}); delete it and prepare again"
        )
    try:
        train, evals = (
            TokenRows(*(tensors[f"{split}.{name}"] for name in ROW_FIELDS)) for split in ("train", "eval")
        )
    except (KeyError, ValueError):
        raise ShardpoolError(
            f"{str(source)!r} is incomplete or malformed; delete it and prepare the data again"
        ) from None
    return PreparedData(
        train=train,
        eval=evals,
        packed=metadata.get("packed") == "true",
        dropped_rows=int(metadata.get("dropped_rows", "0")),
        truncated_rows=int(metadata.get("truncated_rows", "0")),
    )
