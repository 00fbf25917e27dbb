"""Local devices torch can see: CUDA (ROCm included), MPS, XPU and the CPU, with their memory.

The CPU is a device like the others; its memory is the RAM this process may use: what
``/proc/meminfo`` reports, capped by the memory limit of this process's cgroup or an ancestor's
(:mod:`shardpool.host.memory_limit`). Device names and the
:class:`DeviceInfo` record are torch-free and live in ``plan.device_facts``.

Each CUDA device is checked against the installed builds: whether torch carries kernels for its
architecture and, where the 4-bit probe fails, whether bitsandbytes' library does
(:mod:`shardpool.plan.builds`). On ROCm, bf16 support comes from the gfx architecture
(:func:`shardpool.plan.precision.rocm_has_bf16`), not from torch, which reports it on every card.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import replace

import torch

from shardpool.errors import ShardpoolError
from shardpool.host.cpu_quota import available_cpus
from shardpool.host.memory_limit import cpu_memory
from shardpool.plan.builds import build_errors
from shardpool.plan.device_facts import (
    DeviceInfo,
    cpu_model_name,
    device_kind,
    format_compute_capability,
    normalize_device,
    rocm_architecture,
)
from shardpool.plan.precision import rocm_has_bf16

__all__ = ["device_info", "list_devices", "probe_nf4", "synchronize"]


def list_devices(*, nf4: bool = True) -> list[DeviceInfo]:
    """Every device torch sees here, accelerators first and the CPU last (each probed for NF4 unless ``nf4`` is False)."""
    names: list[str] = []
    if torch.cuda.is_available():
        names += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        names += [f"xpu:{i}" for i in range(torch.xpu.device_count())]
    if torch.backends.mps.is_available():
        names.append("mps")
    names.append("cpu")
    return [device_info(name, nf4=nf4) for name in names]


def device_info(name: str, *, nf4: bool = True) -> DeviceInfo:
    """Name, kind, label, memory, compute capability and bf16 support of one local device, whether the
    installed torch has kernels for it, and (unless ``nf4`` is False) whether bitsandbytes' 4-bit
    kernels run on it; a clear error when it isn't available."""
    info = _device_info(normalize_device(name))
    arch_error, nf4_error = build_errors(
        info,
        torch_version=torch.__version__,
        arch_list=torch.cuda.get_arch_list() if info.kind == "cuda" else [],
        bnb_library=_bnb_library_name() if nf4 and info.kind == "cuda" else None,
        machine=platform.machine(),
        probe=probe_nf4 if nf4 else None,
    )
    return replace(info, arch_error=arch_error, nf4_error=nf4_error)


@functools.cache
def probe_nf4(name: str) -> str | None:
    """Why a tiny bitsandbytes ``Linear4bit`` (NF4) cannot run a forward pass on ``name``; None when it can.

    A device bitsandbytes has no 4-bit kernels for (an old compute capability, a backend it was
    not built for) fails here, once per process, rather than halfway into a stage's first step.
    """
    try:
        import bitsandbytes as bnb

        layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4")
        layer = layer.to(torch.device(name))
        with torch.no_grad():
            out = layer(torch.ones(2, 64, device=torch.device(name)))
        if not bool(torch.isfinite(out).all()):
            return "its 4-bit forward pass gave non-finite values"
    except Exception as error:  # noqa: BLE001 - any failure means no NF4 here; the line says which
        text = str(error).strip().splitlines()
        return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
    return None


@functools.cache
def _bnb_library_name() -> str | None:
    """The file name of the CUDA library bitsandbytes loads here (``libbitsandbytes_cuda130.so``: it
    follows torch's CUDA version, or ``BNB_CUDA_VERSION``); None without CUDA or bitsandbytes."""
    try:
        from bitsandbytes.cextension import get_cuda_bnb_library_path
        from bitsandbytes.cuda_specs import get_cuda_specs

        specs = get_cuda_specs()
        return None if specs is None else get_cuda_bnb_library_path(specs).name
    except Exception:  # noqa: BLE001 - no library to name: the 4-bit probe reports what is wrong
        return None


def _device_info(name: str) -> DeviceInfo:
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
        if flavour == "rocm":
            capability = rocm_architecture(
                str(getattr(torch.cuda.get_device_properties(index), "gcnArchName", ""))
            )
            bf16 = rocm_has_bf16(capability)  # torch's is_bf16_supported() is True on every ROCm card
        else:
            capability = format_compute_capability(*torch.cuda.get_device_capability(index))
            with torch.cuda.device(index):
                bf16 = bool(torch.cuda.is_bf16_supported(including_emulation=False))
        return DeviceInfo(
            name, flavour, torch.cuda.get_device_name(index), int(total), int(free),
            compute_capability=capability or None, bf16=bf16,
        )  # fmt: skip
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
        bf16_check = getattr(torch.xpu, "is_bf16_supported", None)
        return DeviceInfo(
            name, "xpu", str(props.name), total, free, bf16=bool(bf16_check()) if bf16_check else None
        )
    if kind == "mps":
        if not torch.backends.mps.is_available():
            raise ShardpoolError("device mps is not available here; run `shardpool devices` to list devices")
        # Unified memory: Metal's recommended working set is the usable share of RAM.
        total = int(torch.mps.recommended_max_memory())
        free = max(0, total - int(torch.mps.driver_allocated_memory()))
        return DeviceInfo("mps", "mps", f"Apple {platform.machine()} GPU", total, free, bf16=_mps_bf16())
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
    total, free = cpu_memory()
    return DeviceInfo(
        "cpu",
        "cpu",
        cpu_model_name(),
        total,
        free,
        threads=min(torch.get_num_threads(), available_cpus()),
        bf16=True,
    )


def _mps_bf16() -> bool:
    """Whether this Mac's torch computes in bf16 on MPS (macOS 14 and later); torch says by refusing."""
    try:
        return bool((torch.ones(2, dtype=torch.bfloat16, device="mps") * 2).sum().item() == 4)
    except (RuntimeError, TypeError):
        return False
