"""The device the GPU check runs on: whether there is one, its memory in use, its compute mode, its facts."""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
import sys
from typing import Any

from shardpool_dev.bench.gpu.cases import PREFLIGHT_TIMEOUT_S
from shardpool_dev.bench.gpu.verdicts import (
    NVML_COMPUTE_MODES,
    bitsandbytes_verdict,
    blocked_layouts,
    parse_compute_mode,
    parse_smi_mib,
)


def skip_reason() -> str | None:
    """Why this machine cannot run the check (no torch with CUDA), or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


class GpuMemory:
    """The used memory and compute mode of one GPU, read without a CUDA context in this process (a
    context here would count as the stages' footprint and, under an exclusive compute mode, keep
    them off the GPU): NVML through the driver's ``libnvidia-ml.so.1`` (as torch reads device
    counts), else ``nvidia-smi``. ``source`` is None where neither answers."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.source: str | None = None
        self._nvml: Any = None
        self._handle = ctypes.c_void_p()
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            if (
                nvml.nvmlInit_v2() == 0
                and nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self._handle)) == 0
            ):
                self._nvml, self.source = nvml, "nvml"
        except (OSError, AttributeError):
            pass
        if self.source is None and shutil.which("nvidia-smi"):
            self.source = "nvidia-smi"

    def used_bytes(self) -> int | None:
        """The GPU's used memory now (every process's, the driver's own included)."""
        if self._nvml is not None:
            info = _NvmlMemory()
            return (
                int(info.used)
                if self._nvml.nvmlDeviceGetMemoryInfo(self._handle, ctypes.byref(info)) == 0
                else None
            )
        if self.source == "nvidia-smi":
            return parse_smi_mib(self._smi("memory.used", "--format=csv,noheader,nounits"))
        return None

    def compute_mode(self) -> tuple[str | None, str | None]:
        """The compute mode and where it was read (nvidia-smi first, else NVML)."""
        if shutil.which("nvidia-smi"):
            mode = parse_compute_mode(self._smi("compute_mode", "--format=csv,noheader"))
            if mode is not None:
                return mode, "nvidia-smi"
        if self._nvml is not None:
            value = ctypes.c_int(-1)
            if self._nvml.nvmlDeviceGetComputeMode(self._handle, ctypes.byref(value)) == 0:
                return NVML_COMPUTE_MODES.get(value.value), "nvml"
        return None, None

    def _smi(self, query: str, fmt: str) -> str:
        try:
            done = subprocess.run(
                ["nvidia-smi", f"--query-gpu={query}", fmt, "-i", str(self.index)],
                capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout if done.returncode == 0 else ""


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def nvml_index() -> int:
    """NVML's index of ``cuda:0`` (CUDA_VISIBLE_DEVICES taken into account), 0 where torch cannot say."""
    import torch

    try:
        return int(torch.cuda._get_nvml_device_index(0))
    except Exception:  # a private helper: any failure means "assume the first GPU"
        return 0


def _child(code: list[str], timeout_s: float) -> tuple[int | None, str, str]:
    """Run a Python child; its exit status (None: timed out), stdout and stderr."""
    try:
        done = subprocess.run(
            [sys.executable, *code], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return None, "", ""
    return done.returncode, done.stdout, done.stderr


_FACTS = (
    "import json, torch; p = torch.cuda.get_device_properties(0); print(json.dumps({"
    "'device': p.name, 'compute_capability': f'{p.major}.{p.minor}', 'torch': torch.__version__, "
    "'bf16': torch.cuda.is_bf16_supported(including_emulation=False)}))"
)


def device_facts() -> dict[str, Any] | str:
    """The GPU's name, capability and bf16 support, read in a child (so no context stays here); or
    the one line saying why they could not be read."""
    code, out, err = _child(["-c", _FACTS], PREFLIGHT_TIMEOUT_S)
    facts = [line for line in out.splitlines() if line.startswith("{")]
    if code != 0 or not facts:
        errors = [line for line in err.splitlines() if line.strip()]
        return f"the GPU's facts could not be read (exit {code}): {errors[-1] if errors else 'no output'}"
    return dict(json.loads(facts[-1]))


def preflight_checks(gpu: GpuMemory) -> dict[str, Any]:
    """bitsandbytes' own diagnostic, the compute mode and what it rules out, and the memory reader."""
    code, out, err = _child(["-m", "bitsandbytes"], PREFLIGHT_TIMEOUT_S)
    mode, source = gpu.compute_mode()
    return {
        "bitsandbytes": bitsandbytes_verdict(code, out + err),
        "compute_mode": {"mode": mode, "source": source, "blocked": blocked_layouts(mode)},
        "device_memory": gpu.source,
    }
