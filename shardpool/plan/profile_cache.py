"""The cache of layer profiles: one JSON file of profiles by key, shared by every process on a host.

A profile (:class:`~shardpool.plan.device_facts.LayerProfile`) is cached under a key naming what
it depends on (:func:`profile_key`: the device, its threads and CPU quota, the model shape, the
workload's layer settings, the dtype and NF4 backend, torch's version) in
``$SHARDPOOL_CACHE/profiles.json`` (default ``~/.cache/shardpool``). Writers take an exclusive
``flock`` and replace the file atomically, so profiles of several devices finishing at once all
land. A cache that cannot be read or written only costs a re-measurement.
"""

from __future__ import annotations

import fcntl
import json
from pathlib import Path
from typing import Any

from mesh.constants import cache_root
from mesh.files import atomic_write
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload

__all__ = ["cache_path", "cached_profile", "profile_key", "store_profile"]

#: Bumped when a profile gains measurements, so cached profiles without them are re-measured
#: (4: under a CPU quota the optimizer and the ends are timed in quota-spanning samples too).
_PROFILE_VERSION = 4


def cache_path() -> Path:
    """Where profiles are cached: ``$SHARDPOOL_CACHE/profiles.json`` or ``~/.cache/shardpool/profiles.json``."""
    return cache_root() / "profiles.json"


def profile_key(
    shape: ModelShape,
    workload: Workload,
    *,
    label: str,
    threads: int | None,
    quota: float | None = None,
    dtype: str | None = None,
    nf4_backend: str | None = None,
) -> str:
    """Cache key: device label, thread count, the process's CPU quota (a re-throttled host measures
    again), model shape digest, the workload's layer settings, the compute dtype profiled in
    (bf16 and fp16 are both 2 bytes) and the NF4 backend when it is plain PyTorch (a key without
    one is bitsandbytes', as before the backend was chosen)."""
    import torch

    return (
        f"{label}|threads={threads}|quota={quota}|{shape.key()}|{workload.profile_key()}"
        f"{'' if dtype is None else f'|dtype={dtype}'}{'|nf4=torch' if nf4_backend == 'torch' else ''}"
        f"|torch={torch.__version__}|v{_PROFILE_VERSION}"
    )


def cached_profile(key: str) -> dict[str, Any] | None:
    """The fields of the profile cached under ``key``, or None when there is none (or no readable cache)."""
    return _read_cache().get(key)


def store_profile(key: str, value: dict[str, Any]) -> None:
    """Add one profile to the cache: read, update and replace it under an exclusive lock.

    Profiles of several devices (or several members on one host) may finish at once; without the
    lock two writers would each read the old file and the second rename would drop the first's
    entry. The lock is ``flock`` on ``profiles.json.lock`` beside it (the file itself is replaced
    atomically, so it cannot carry the lock).
    """
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = _read_cache()
            data[key] = value
            atomic_write(path, json.dumps(data, indent=1, sort_keys=True).encode("utf-8"))
    except OSError:
        pass  # a cache that cannot be written only costs a re-measurement


def _read_cache() -> dict[str, Any]:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}
