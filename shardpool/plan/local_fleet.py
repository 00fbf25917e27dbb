"""This machine's devices as a fleet: one slot per configured stage, measured by a probe.

When ``k`` stages name the same device, it becomes ``k`` slots (``cpu#0``...) that run at the
same time, so each gets ``1/k`` of its free memory and of its speed. The measuring itself needs
torch, so it is behind :class:`DeviceProbe`: ``plan.profiler.TorchProbe`` is the real one, and
this module (like the rest of the planner) never imports torch.
"""

from __future__ import annotations

import socket
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.device_facts import (
    DeviceInfo,
    LayerProfile,
    Measurement,
    arch_refusal,
    nf4_probe_refusal,
    normalize_device,
)
from shardpool.plan.fleet import Device, Fleet, LinkSpec
from shardpool.plan.precision import DTYPE_BYTES, stage_dtype

__all__ = ["DeviceProbe", "local_fleet"]


class DeviceProbe(Protocol):
    """Measures devices of this machine for :func:`local_fleet`."""

    def device_info(self, name: str) -> DeviceInfo:
        """Kind, label, free memory and (CPU) threads of the device ``name``."""
        ...

    def profile_layer(
        self, shape: ModelShape, workload: Workload, *, device: str, threads: int | None
    ) -> LayerProfile:
        """Forward + backward time and activation bytes of one decoder layer on ``device``."""
        ...

    def loopback(self) -> LinkSpec:
        """The link between two stages on this machine."""
        ...


def local_fleet(
    devices: Sequence[str],
    *,
    shape: ModelShape,
    workload: Workload,
    probe: DeviceProbe,
    threads_per_stage: int | None = None,
) -> Fleet:
    """Build a fleet from local torch device names, e.g. ``["cpu", "cpu", "cpu"]`` or ``["cuda:0", "cpu"]``.

    Each slot is profiled through ``probe`` (which caches). A CPU slot is profiled with
    ``threads // k`` threads (at least 1), or ``threads_per_stage`` (the config's
    ``shardpool.threads_per_stage``) when given, and slowed further when the slots oversubscribe
    the cores or the cgroup CPU quota the profile ran under; an accelerator slot takes ``k`` times
    the measured layer time.
    """
    if not devices:
        raise ShardpoolError("no local devices were given; set shardpool.devices, e.g. [cpu]")
    names = [normalize_device(name) for name in devices]
    counts = Counter(names)
    host = socket.gethostname()
    built: list[Device] = []
    seen: Counter[str] = Counter()
    for name in names:
        share = counts[name]
        info = probe.device_info(name)
        # A device named in the config: say why it cannot take layers.
        if info.arch_error is not None:
            raise ShardpoolError(
                arch_refusal(name, info.label, info.compute_capability, info.arch_error)
                + "; remove it from shardpool.devices"
            )
        if info.nf4_error is not None:
            raise ShardpoolError(
                nf4_probe_refusal(name, info.label, info.compute_capability, info.nf4_error)
                + "; remove it from shardpool.devices"
            )
        threads = None
        if info.kind == "cpu":
            threads = threads_per_stage or max(1, info.threads // share)
        # Profile in the dtype the stage will compute in (its device's choice under the config's cap).
        facts = replace(info.facts(), name=name)
        profiled = workload
        if workload.precision is not None:
            dtype = stage_dtype(facts, workload.precision, workload.compute_bytes)
            profiled = replace(workload, compute_bytes=DTYPE_BYTES[dtype])
        profile = probe.profile_layer(shape, profiled, device=name, threads=threads)
        slowdown = (
            float(share)
            if threads is None
            else _cpu_slowdown(share, threads, info.threads, profile.cpu_quota)
        )
        slot = name if share == 1 else f"{name}#{seen[name]}"
        seen[name] += 1
        built.append(
            Device(
                name=slot,
                memory_bytes=info.free_bytes // share,
                host=host,
                seconds_per_layer=profile.seconds_per_layer * slowdown,
                kind=info.kind,
                torch_device=name,
                activation_bytes_per_layer=profile.activation_bytes,
                shared_by=share,
                forward_seconds_per_layer=_slowed(profile.forward_seconds, slowdown),
                embed_seconds=_slowed(profile.embed_seconds, slowdown),
                head_forward_seconds=_slowed(profile.head_forward_seconds, slowdown),
                head_backward_seconds=_slowed(profile.head_backward_seconds, slowdown),
                optimizer_seconds_per_layer=_slowed(profile.optimizer_seconds, slowdown),
                measurement=Measurement.of(profile),
                # Discovery reports these where it knows them (None where it does not).
                compute_capability=facts.capability,
                bf16=facts.bf16,
            )
        )
    return Fleet(devices=tuple(built), loopback=probe.loopback())


def _cpu_slowdown(share: int, threads: int, cores: int, quota: float | None) -> float:
    """How much slower each of ``share`` CPU slots runs together than its profile, taken alone.

    Alone, a slot's ``threads`` get ``min(threads, quota)`` CPUs; together, the slots share the
    host's ``min(cores, quota)``. The cgroup CPU quota (``host.cpu_quota``, recorded with the
    profile) matters here: on a host throttled to one CPU, two slots of 8 threads each profile at
    one CPU but run at half of one, which the core count alone does not show.
    """
    if quota is None:
        return max(1.0, share * threads / cores)
    capacity = min(cores, quota)
    return max(1.0, share * min(threads, capacity) / capacity)


def _slowed(seconds: float | None, slowdown: float) -> float | None:
    """A measured time on a shared device (None stays unmeasured)."""
    return None if seconds is None else seconds * slowdown
