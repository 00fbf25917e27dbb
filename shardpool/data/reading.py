"""Reading a dataset into row objects: JSON lines, a JSON array, or anything Hugging Face ``datasets`` reads.

A single ``.jsonl``/``.json`` file is read here, line by line, so every error names its line.
Parquet, CSV and Arrow files, directories (a dataset repository's layout, with ``data_files``,
``split`` and ``name``) and Hugging Face dataset snapshots are read with ``datasets.load_dataset``,
the library that defines those layouts; rows are then named ``file:row N``.

A ``.json`` file whose text starts with ``[`` is one JSON array of row objects (as ``json.dump``
writes a list, and as Hugging Face ``datasets`` reads it); any other file is JSON lines, one
object per line, blank lines skipped. The text must be UTF-8 (a leading byte-order mark is
allowed). Every problem is one :class:`ShardpoolError` line naming the file, the line or row,
and the fix; what the rows hold is checked in :mod:`shardpool.data.formats`.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any

from shardpool.config import DatasetSpec
from shardpool.errors import ShardpoolError

__all__ = ["read_rows"]

Rows = list[tuple[str, dict[str, Any]]]


def read_rows(spec: DatasetSpec, index: int) -> Rows:
    """The rows of dataset ``datasets[index]`` as ``(where, object)``, ``where`` naming file and line or row."""
    path = Path(spec.path)
    if _needs_datasets(spec, path):
        return _rows_from_datasets(spec, index, path)
    if not path.is_file():
        raise ShardpoolError(
            f"dataset file {spec.path!r} (datasets[{index}].path) does not exist; check the path (relative to the current directory)"
        )
    text = _utf8_text(spec.path, path.read_bytes())
    if path.suffix.lower() != ".json":
        rows = _line_rows(spec.path, text, fix="fix the line")
    elif text.lstrip().startswith("["):
        rows = _array_rows(spec.path, text)
    else:
        fix = "a .json file holds one JSON array of row objects, or one object per line"
        rows = _line_rows(spec.path, text, fix=fix)
    if not rows:
        raise ShardpoolError(
            f"dataset file {spec.path!r} has no rows; add JSON lines or remove it from `datasets`"
        )
    return rows


_FORMATS = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow", ".json": "json", ".jsonl": "json"}


def _needs_datasets(spec: DatasetSpec, path: Path) -> bool:
    """Whether ``datasets`` reads this one: a directory, a non-JSON format, or a split or file selection."""
    if path.is_dir() or spec.data_files is not None or spec.split is not None or spec.name is not None:
        return True
    return (spec.ds_type or _FORMATS.get(path.suffix.lower(), "json")) != "json"


def _rows_from_datasets(spec: DatasetSpec, index: int, path: Path) -> Rows:
    """Rows through ``datasets.load_dataset``, each named ``path:row N``; any failure is one line."""
    import datasets
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    split = spec.split or "train"
    try:
        if path.is_dir():
            loaded = datasets.load_dataset(str(path), name=spec.name, data_files=spec.data_files, split=split)
        elif path.is_file():
            builder = spec.ds_type or _FORMATS.get(path.suffix.lower(), "json")
            loaded = datasets.load_dataset(builder, data_files=spec.data_files or str(path), split=split)
        else:
            raise ShardpoolError(
                f"dataset {spec.path!r} (datasets[{index}].path) does not exist; check the path"
            )
    except ShardpoolError:
        raise
    except Exception as error:  # datasets raises many types (ValueError for a split, FileNotFoundError, ...)
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise ShardpoolError(
            f"cannot read dataset {spec.path!r} (datasets[{index}]) with split {split!r}: {reason}; "
            "check path, data_files, split and name"
        ) from None
    rows = [(f"{spec.path}:row {number}", dict(row)) for number, row in enumerate(loaded, start=1)]
    if not rows:
        raise ShardpoolError(f"dataset {spec.path!r} (datasets[{index}]) split {split!r} has no rows")
    return rows


def _utf8_text(name: str, data: bytes) -> str:
    """``data`` decoded as UTF-8 (without a leading byte-order mark), or one line saying where it is not."""
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as error:
        offset = skip + error.start
        line = data.count(b"\n", 0, offset) + 1
        raise ShardpoolError(
            f"{name}:{line}: not UTF-8 (byte 0x{data[offset]:02x} at byte offset {offset}); "
            f"re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 {name} > fixed.jsonl`"
        ) from None


def _line_rows(name: str, text: str, *, fix: str) -> Rows:
    """One object per line (``file:line``); blank lines are skipped but still counted.

    ``fix`` ends the message for a line that is not JSON.
    """
    rows: Rows = []
    # Only "\n" ends a line: str.splitlines would also split at U+2028 and the like, which JSON
    # strings may hold unescaped.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{name}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ShardpoolError(
                f"{where}: invalid JSON ({error.msg} at column {error.colno}); {fix}"
            ) from None
        if not isinstance(row, dict):
            raise ShardpoolError(
                f"{where}: expected a JSON object per line, got {type(row).__name__}; wrap the row in {{...}}"
            )
        rows.append((where, row))
    return rows


def _array_rows(name: str, text: str) -> Rows:
    """A JSON array of objects; each is named ``file row N`` (1-based, as lines are)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError as error:
        raise ShardpoolError(
            f"{name}:{error.lineno}: invalid JSON ({error.msg} at column {error.colno}); fix the file"
        ) from None
    if not isinstance(items, list):
        raise ShardpoolError(
            f"{name}: expected a JSON array of row objects, got {type(items).__name__}; write `[{{...}}, {{...}}]` or one object per line"
        )
    rows: Rows = []
    for number, row in enumerate(items, start=1):
        where = f"{name} row {number}"
        if not isinstance(row, dict):
            raise ShardpoolError(
                f"{where}: expected a JSON object in the array, got {type(row).__name__}; wrap the row in {{...}}"
            )
        rows.append((where, row))
    return rows
