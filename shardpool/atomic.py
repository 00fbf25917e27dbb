"""Atomic file writes: write to a temporary file beside the target, fsync, then rename over it.

A crash mid-write leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = ["write_bytes_atomic", "write_json_atomic", "save_tensors_atomic"]


def write_bytes_atomic(path: str | Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` in one rename."""
    target = Path(path)
    handle, temp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}-", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temp_name, mode)
        os.replace(temp_name, target)
    finally:
        if os.path.exists(temp_name):
            os.unlink(temp_name)


def write_json_atomic(path: str | Path, value: Any) -> None:
    """Replace ``path`` with ``value`` as indented JSON."""
    write_bytes_atomic(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def save_tensors_atomic(
    path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Replace ``path`` with a safetensors file of ``tensors`` (moved to CPU, made contiguous)."""
    target = Path(path)
    handle, temp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}-", suffix=".tmp")
    os.close(handle)
    try:
        prepared = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
        save_file(prepared, temp_name, metadata=metadata)
        os.chmod(temp_name, 0o644)
        os.replace(temp_name, target)
    finally:
        if os.path.exists(temp_name):
            os.unlink(temp_name)
