"""Local devices torch can see: CUDA (ROCm included), MPS, XPU and the CPU, with their memory.

The CPU is a device like the others; its memory is the RAM this process may use (the cgroup
limit, when one is set, caps what ``/proc/meminfo`` reports). Device names and the
:class:`DeviceInfo` record are torch-free and live in ``plan.device_facts``.
"""

from __future__ import annotations

import platform
from pathlib import Path

import psutil
import torch

from shardpool.errors import ShardpoolError
from shardpool.plan.device_facts import DeviceInfo, cpu_model_name, device_kind, normalize_device

__all__ = ["device_info", "list_devices", "synchronize"]


def list_devices() -> list[DeviceInfo]:
    """Every device torch sees here, accelerators first and the CPU last."""
    found: list[DeviceInfo] = []
    if torch.cuda.is_available():
        found += [device_info(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        found += [device_info(f"xpu:{i}") for i in range(torch.xpu.device_count())]
    if torch.backends.mps.is_available():
        found.append(device_info("mps"))
    found.append(device_info("cpu"))
    return found


def device_info(name: str) -> DeviceInfo:
    """Name, kind, label and memory of one local device; a clear error when it isn't available."""
    name = normalize_device(name)
    kind, _, index_text = name.partition(":")
    index = int(index_text) if index_text.isdigit() else 0
    if kind == "cpu":
        return _cpu_info()
    if kind == "cuda":
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ShardpoolError(
                f"device {name} is not available here; run `shardpool devices` to list devices"
            )
        free, total = torch.cuda.mem_get_info(index)
        flavour = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        return DeviceInfo(name, flavour, torch.cuda.get_device_name(index), int(total), int(free))
    if kind == "xpu":
        if not (hasattr(torch, "xpu") and torch.xpu.is_available()) or index >= torch.xpu.device_count():
            raise ShardpoolError(
                f"device {name} is not available here; run `shardpool devices` to list devices"
            )
        props = torch.xpu.get_device_properties(index)
        total = int(props.total_memory)
        try:
            free = int(torch.xpu.mem_get_info(index)[0])
        except (AttributeError, RuntimeError):
            free = total - int(torch.xpu.memory_reserved(index))
        return DeviceInfo(name, "xpu", str(props.name), total, free)
    if kind == "mps":
        if not torch.backends.mps.is_available():
            raise ShardpoolError("device mps is not available here; run `shardpool devices` to list devices")
        # Unified memory: Metal's recommended working set is the usable share of RAM.
        total = int(torch.mps.recommended_max_memory())
        free = max(0, total - int(torch.mps.driver_allocated_memory()))
        return DeviceInfo("mps", "mps", f"Apple {platform.machine()} GPU", total, free)
    raise ShardpoolError(f"device {name!r} is unknown; use cpu, cuda[:N], mps or xpu[:N]")


def synchronize(name: str) -> None:
    """Wait for queued work on a device (so timings measure the work, not its launch)."""
    kind = device_kind(name)
    if kind == "cuda":
        torch.cuda.synchronize(name)
    elif kind == "mps":
        torch.mps.synchronize()
    elif kind == "xpu":
        torch.xpu.synchronize(name)


def _cpu_info() -> DeviceInfo:
    memory = psutil.virtual_memory()
    total, free = int(memory.total), int(memory.available)
    limit = _cgroup_limit()
    if limit is not None and limit < total:
        used = _cgroup_usage() or 0
        total, free = limit, max(0, min(free, limit - used))
    return DeviceInfo("cpu", "cpu", cpu_model_name(), total, free, threads=torch.get_num_threads())


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        value = _read_int(Path(path))
        if value is not None and value < 1 << 60:
            return value
    return None


def _cgroup_usage() -> int | None:
    for path in ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"):
        value = _read_int(Path(path))
        if value is not None:
            return value
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
