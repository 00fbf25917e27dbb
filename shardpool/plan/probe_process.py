"""Measure this machine's accelerators in a child process, so that no training process keeps their memory.

Measuring a GPU creates a CUDA (or XPU, MPS) context on it, a few hundred MiB, and leaves the
profiled layer in torch's caching allocator. A process that measures and then trains (rank 0
under torchrun) or waits for its stage processes (the local launcher) would hold both for the
whole run: memory the plan counted as free. So ``shardpool finetune`` and torchrun's rank 0
measure through :class:`ProcessProbe`: discovery, the NF4 probe and the layer profile of each
accelerator run in one child process, started with ``spawn`` (a fresh interpreter, so no CUDA
state crosses either way), which ends with the planning (the ``with`` block), before any stage
starts. The CPU is measured in this process as before (:func:`measured_in_child`): it keeps no
context, and a CPU-only plan pays for no child. The child reads and writes the same profile
cache (``profiles.json``) as this process.

``shardpool plan`` and ``shardpool devices`` measure in their own process: they exit when they
have printed, and no stage ever runs in them.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.device_facts import DeviceInfo, LayerProfile, device_kind
from shardpool.plan.fleet import LinkSpec
from shardpool.plan.measuring_process import MeasuringProcess

__all__ = ["ProcessProbe", "measured_in_child"]

_Result = TypeVar("_Result")


def measured_in_child(device: str) -> bool:
    """Whether ``device`` is measured in the child process: every accelerator (``cuda``, ``xpu``,
    ``mps``, any index), since measuring one leaves a context and cached memory on it; the CPU
    keeps nothing of the kind, so it is measured in this process."""
    return device_kind(device) != "cpu"


class ProcessProbe:
    """The :class:`~shardpool.plan.local_fleet.DeviceProbe` of a process that goes on to train or to
    wait for its stages: accelerators measured in a :class:`MeasuringProcess`, the CPU here.

    The child starts at the first accelerator measured and ends when the ``with`` block does (or
    at :meth:`close`), so measure inside the block and start stages after it; a probe used again
    later starts a new child. ``in_child`` chooses the devices measured in the child (default
    :func:`measured_in_child`); ``use_cache`` is :class:`~shardpool.plan.profiler.TorchProbe`'s.
    """

    def __init__(
        self, *, use_cache: bool = True, in_child: Callable[[str], bool] = measured_in_child
    ) -> None:
        self.use_cache = use_cache
        self.in_child = in_child
        self._child: MeasuringProcess | None = None

    def device_info(self, name: str) -> DeviceInfo:
        """Kind, label, free memory and (CPU) threads of a local device."""
        return self._measure(name, _device_info, name, self.use_cache)

    def profile_layer(
        self, shape: ModelShape, workload: Workload, *, device: str, threads: int | None
    ) -> LayerProfile:
        """One decoder layer profiled on ``device`` (see :func:`shardpool.plan.profiler.profile_layer`)."""
        return self._measure(device, _profile_layer, shape, workload, device, threads, self.use_cache)

    def loopback(self) -> LinkSpec:
        """The measured link between two stages on this machine (TCP over 127.0.0.1: no device touched)."""
        from shardpool.plan.profiler import TorchProbe

        return TorchProbe(use_cache=self.use_cache).loopback()

    def co_run_slowdown(self, copies: int, threads: int, *, shape: ModelShape, workload: Workload) -> float:
        """How much slower ``copies`` CPU stages compute a layer of ``shape`` side by side than alone,
        measured in CPU-only child processes of its own (:mod:`shardpool.plan.co_run`)."""
        from shardpool.plan.profiler import TorchProbe

        return TorchProbe(use_cache=self.use_cache).co_run_slowdown(
            copies, threads, shape=shape, workload=workload
        )

    def close(self, *, at_once: bool = False) -> None:
        """End the measuring child, if one was started (see :meth:`MeasuringProcess.close`)."""
        child, self._child = self._child, None
        if child is not None:
            child.close(at_once=at_once)

    def __enter__(self) -> ProcessProbe:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close(at_once=error is not None)

    def _measure(self, device: str, function: Callable[..., _Result], *args: Any) -> _Result:
        """``function(*args)`` in the child when ``device`` is measured there, else here."""
        if not self.in_child(device):
            return function(*args)
        if self._child is None:
            self._child = MeasuringProcess()
        return self._child.call(function, *args)


# ---------------------------------------------------------------------------- what is measured


def _device_info(name: str, use_cache: bool) -> DeviceInfo:
    from shardpool.plan.profiler import TorchProbe

    return TorchProbe(use_cache=use_cache).device_info(name)


def _profile_layer(
    shape: ModelShape, workload: Workload, device: str, threads: int | None, use_cache: bool
) -> LayerProfile:
    """The layer profile, after which the profiled layer's memory goes back to the device: a later
    :func:`_device_info` of the same device (a second stage on it) then sees it free again."""
    import gc

    import torch

    from shardpool.plan.profiler import TorchProbe

    profile = TorchProbe(use_cache=use_cache).profile_layer(shape, workload, device=device, threads=threads)
    gc.collect()
    backend = {"cuda": torch.cuda, "xpu": getattr(torch, "xpu", None), "mps": torch.mps}.get(
        device_kind(device)
    )
    if backend is not None:
        backend.empty_cache()
    return profile
