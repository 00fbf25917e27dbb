"""What the planner knows about a local device, without torch: its canonical name and kind, its
memory (:class:`DeviceInfo`) and one measured decoder layer on it (:class:`LayerProfile`).

``plan.devices`` and ``plan.profiler`` fill these in with torch; everything else in the plan
package reads them from here, so planning never imports torch.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardpool.plan.precision import DeviceFacts, parse_capability, rocm_has_bf16

__all__ = [
    "DEVICE_KINDS",
    "DeviceInfo",
    "LayerProfile",
    "Measurement",
    "arch_refusal",
    "cpu_model_name",
    "device_kind",
    "format_compute_capability",
    "layer_devices",
    "nf4_probe_refusal",
    "normalize_device",
    "rocm_architecture",
]

#: Kinds of device a stage can run on; the kind sets a stage's framework memory reserve.
DEVICE_KINDS: tuple[str, ...] = ("cuda", "rocm", "mps", "xpu", "cpu")


@dataclass(frozen=True)
class DeviceInfo:
    """One local device: torch name (``cuda:0``), kind (cuda, rocm, mps, xpu, cpu), product label,
    total and free memory in bytes, and (CPU only) the threads torch uses.

    Also what the precision and quantization choices need: the compute capability (``"8.6"`` on
    CUDA, the gfx architecture on ROCm, None on MPS, XPU and the CPU), whether torch computes in
    bf16 on it (None: not known), why bitsandbytes' 4-bit kernels cannot run on it (None: they
    ran, or were not probed), and why the installed torch has no kernels for it at all
    (``arch_error``, :mod:`shardpool.plan.builds`; None: it has, or nobody checked).
    """

    name: str
    kind: str
    label: str
    total_bytes: int
    free_bytes: int
    threads: int = 0
    compute_capability: str | None = None
    bf16: bool | None = None
    nf4_error: str | None = None
    arch_error: str | None = None

    def facts(self) -> DeviceFacts:
        """What the dtype chooser (``plan.precision``) knows about this device: the compute capability
        on CUDA, and bf16 support, which on ROCm its gfx architecture decides (:func:`rocm_has_bf16`:
        torch reports bf16 on every ROCm card)."""
        capability = parse_capability(self.compute_capability) if self.kind == "cuda" else None
        bf16 = self.bf16
        if self.kind == "rocm":
            from_arch = rocm_has_bf16(self.compute_capability)
            bf16 = bf16 if from_arch is None else from_arch
        return DeviceFacts(kind=self.kind, name=self.name, capability=capability, bf16=bf16)


@dataclass(frozen=True)
class LayerProfile:
    """A measured layer: median forward + backward seconds per micro-batch, bytes autograd saved
    for backward in one forward (no checkpointing), peak bytes the pass allocated on the device
    (accelerators only), the device label and the thread count used (CPU).

    Also, where measured (None in profiles from before they were): the median forward alone, the
    embedding lookup, final norm + ``lm_head`` + loss forward and backward (scaled to the full
    vocabulary), and one AdamW step with gradient clipping over the layer's LoRA parameters; how
    it was measured: the fastest and slowest of the ``runs`` timed forward + backward passes
    (``seconds_per_layer`` is their median) and the process's cgroup CPU quota in CPUs (None when
    unlimited).
    """

    seconds_per_layer: float
    activation_bytes: int
    peak_bytes: int | None
    device: str
    label: str
    threads: int | None
    runs: int
    forward_seconds: float | None = None
    embed_seconds: float | None = None
    head_forward_seconds: float | None = None
    head_backward_seconds: float | None = None
    optimizer_seconds: float | None = None
    seconds_min: float | None = None
    seconds_max: float | None = None
    cpu_quota: float | None = None
    ci95_rel: float | None = None


@dataclass(frozen=True)
class Measurement:
    """How a device's speed was measured, as ``plan.json`` records it per stage: the device's label,
    the threads the profile ran with (CPU), the CPU quota of the profiling process's cgroup (CPUs,
    None when unlimited), how many timed forward + backward passes and their fastest, median and
    slowest seconds (one layer, one micro-batch, before any slowdown for sharing the device), and
    the half-width of the 95% confidence interval over the median (:mod:`shardpool.plan.confidence`). None
    where the profile did not say (a member whose agent predates these fields)."""

    label: str
    threads: int | None
    cpu_quota: float | None
    runs: int | None
    seconds_min: float | None
    seconds_median: float
    seconds_max: float | None
    ci95_rel: float | None = None
    #: How many times slower the slot computed side by side with the other CPU slots of its host
    #: than alone (:mod:`shardpool.plan.co_run`); None for a slot alone on its device.
    co_run: float | None = None

    @classmethod
    def of(cls, profile: LayerProfile) -> Measurement:
        """The measurement record of a layer profile."""
        return cls(
            label=profile.label,
            threads=profile.threads,
            cpu_quota=profile.cpu_quota,
            runs=profile.runs,
            seconds_min=profile.seconds_min,
            seconds_median=profile.seconds_per_layer,
            seconds_max=profile.seconds_max,
            ci95_rel=profile.ci95_rel,
        )

    def to_json(self) -> dict[str, Any]:
        """This record as a ``plan.json`` stage's ``measured`` object."""
        return {
            "label": self.label,
            "threads": self.threads,
            "cpu_quota": self.cpu_quota,
            "runs": self.runs,
            "seconds_min": self.seconds_min,
            "seconds_median": self.seconds_median,
            "seconds_max": self.seconds_max,
            "ci95_rel": self.ci95_rel,
            "co_run": self.co_run,
        }


def normalize_device(name: str) -> str:
    """Canonical torch device name: ``cuda`` becomes ``cuda:0``, ``CPU`` becomes ``cpu``."""
    text = str(name).strip().lower()
    if text in ("cuda", "xpu"):
        return f"{text}:0"
    if text in ("mps:0",):
        return "mps"
    if text.startswith("cpu"):
        return "cpu"
    return text


def device_kind(name: str) -> str:
    """The torch backend of a device name (``cuda`` for ``cuda:1``), before ROCm is told apart."""
    return normalize_device(name).partition(":")[0]


def cpu_model_name() -> str:
    """This machine's CPU model, from /proc/cpuinfo where there is one, for device labels and benchmarks."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or f"cpu ({os.cpu_count()} cores)"


def format_compute_capability(major: int, minor: int) -> str:
    """A CUDA compute capability as NVIDIA writes it: ``(8, 6)`` is ``"8.6"``."""
    return f"{int(major)}.{int(minor)}"


def rocm_architecture(gcn_arch_name: str) -> str:
    """The gfx name of a ROCm device from torch's ``gcnArchName`` (``gfx90a:sramecc+:xnack-`` is ``gfx90a``)."""
    return gcn_arch_name.split(":", 1)[0].strip()


def nf4_probe_refusal(name: str, label: str, compute_capability: str | None, reason: str) -> str:
    """The one line that says a device cannot run bitsandbytes' 4-bit kernels and gets no layers."""
    detail = f"{label}, {compute_capability}" if compute_capability else label
    first = reason.strip().splitlines()[0] if reason.strip() else "the 4-bit probe failed"
    return f"{name} ({detail}) cannot run bitsandbytes 4-bit: {first[:200]}; it gets no layers"


def arch_refusal(name: str, label: str, compute_capability: str | None, reason: str) -> str:
    """The one line that says the installed torch has no kernels for a device, which gets no layers
    (``reason`` names the build to install: :func:`shardpool.plan.builds.torch_arch_error`)."""
    detail = f"{label}, {compute_capability}" if compute_capability else label
    return f"{name} ({detail}): {reason.strip()}; it gets no layers"


def layer_devices(devices: list[DeviceInfo], *, needs_nf4: bool) -> tuple[list[DeviceInfo], list[str]]:
    """The devices that may be given layers, and one line for each that may not.

    A device the installed torch has no kernels for (``arch_error``) is always left out. With an
    NF4 base (``adapter: qlora``) so is a device whose 4-bit probe failed, never silently given
    layers it cannot run; with an unquantized base every other device may take layers.
    """
    kept: list[DeviceInfo] = []
    refused: list[str] = []
    for info in devices:
        if info.arch_error is not None:
            refused.append(arch_refusal(info.name, info.label, info.compute_capability, info.arch_error))
        elif needs_nf4 and info.nf4_error is not None:
            refused.append(nf4_probe_refusal(info.name, info.label, info.compute_capability, info.nf4_error))
        else:
            kept.append(info)
    return kept, refused
