"""This machine's devices as a fleet: one slot per configured stage, measured by a probe.

When ``k`` stages name the same device, it becomes ``k`` slots (``cpu#0``...) that run at the
same time, so each gets ``1/k`` of its free memory and of its speed (a CPU slot: of the cores and
quota, or what running side by side measured, whichever is slower). The measuring itself needs
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
    normalize_device,
)
from shardpool.plan.fleet import Device, Fleet, LinkSpec
from shardpool.plan.precision import DTYPE_BYTES, NF4Choice, choose_nf4_backend, stage_dtype

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

    def co_run_slowdown(self, copies: int, threads: int, *, shape: ModelShape, workload: Workload) -> float:
        """How many times slower each of ``copies`` CPU stages of ``threads`` threads computes a layer
        of ``shape`` side by side than alone (:func:`shardpool.plan.co_run.co_run_slowdown`)."""
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

    With an NF4 base each slot's backend is chosen here (``shardpool.nf4_backend``, a list giving
    one per entry of ``devices``): bitsandbytes where its 4-bit probe passed, else plain PyTorch
    under ``auto``; the slot is profiled on that backend and carries the choice to the planner.
    """
    if not devices:
        raise ShardpoolError("no local devices were given; set shardpool.devices, e.g. [cpu]")
    names = [normalize_device(name) for name in devices]
    counts = Counter(names)
    host = socket.gethostname()
    built: list[Device] = []
    seen: Counter[str] = Counter()
    for position, name in enumerate(names):
        share = counts[name]
        info = probe.device_info(name)
        # A device named in the config: say why it cannot take layers.
        if info.arch_error is not None:
            raise ShardpoolError(
                arch_refusal(name, info.label, info.compute_capability, info.arch_error)
                + "; remove it from shardpool.devices"
            )
        nf4 = _nf4_choice(info, workload, position)
        if nf4 is not None and nf4.backend is None:
            raise ShardpoolError(f"{nf4.reason}; or remove it from shardpool.devices")
        threads = None
        if info.kind == "cpu":
            threads = threads_per_stage or max(1, info.threads // share)
        # Profile in the dtype the stage will compute in (its device's choice under the config's cap).
        facts = replace(info.facts(), name=name)
        profiled = workload if nf4 is None else replace(workload, nf4_backend=nf4.backend)
        if workload.precision is not None:
            dtype = stage_dtype(facts, workload.precision, workload.compute_bytes)
            profiled = replace(profiled, compute_bytes=DTYPE_BYTES[dtype])
        profile = probe.profile_layer(shape, profiled, device=name, threads=threads)
        co_run = (
            probe.co_run_slowdown(share, threads, shape=shape, workload=profiled)
            if threads is not None and share > 1
            else None
        )
        slowdown = (
            float(share)
            if threads is None
            else _cpu_slowdown(share, threads, info.threads, profile.cpu_quota, co_run or 1.0)
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
                measurement=replace(Measurement.of(profile), co_run=co_run),
                # Discovery reports these where it knows them (None where it does not).
                compute_capability=facts.capability,
                bf16=facts.bf16,
                nf4_backend=nf4.backend if nf4 else None,
                nf4_reason=nf4.reason if nf4 else "",
            )
        )
    return Fleet(devices=tuple(built), loopback=probe.loopback())


def _nf4_choice(info: DeviceInfo, workload: Workload, position: int) -> NF4Choice | None:
    """How the slot at ``position`` of ``shardpool.devices`` computes with NF4 weights (its entry of a
    ``shardpool.nf4_backend`` list, or the one setting), from its 4-bit probe; None for an unquantized base."""
    if not workload.quantize:
        return None
    settings = workload.nf4_backend
    if isinstance(settings, tuple) and position >= len(settings):
        raise ShardpoolError(
            f"shardpool.nf4_backend gives {len(settings)} entries but entry {position} of shardpool.devices is {info.name}; "
            "give one entry per entry of shardpool.devices, or a single setting for all"
        )
    setting = settings[position] if isinstance(settings, tuple) else settings
    facts = replace(info.facts(), name=f"{info.name}, {info.label}")  # the messages name the card too
    return choose_nf4_backend(setting, facts, nf4_error=info.nf4_error)


def _cpu_slowdown(share: int, threads: int, cores: int, quota: float | None, measured: float = 1.0) -> float:
    """How much slower each of ``share`` CPU slots runs together than its profile, taken alone.

    Alone, a slot's ``threads`` get ``min(threads, quota)`` CPUs; together, the slots share the
    host's ``min(cores, quota)``. The cgroup CPU quota (``host.cpu_quota``, recorded with the
    profile) matters here: on a host throttled to one CPU, two slots of 8 threads each profile at
    one CPU but run at half of one, which the core count alone does not show. ``measured`` is the
    slowdown measured side by side on this host (:mod:`shardpool.plan.co_run`), which also sees
    what the counts cannot (shared caches, memory bandwidth, SMT siblings); the larger of the two
    is taken, so that a noisy measurement never claims more CPUs than the host has.
    """
    if quota is None:
        counted = share * threads / cores
    else:
        capacity = min(cores, quota)
        counted = share * min(threads, capacity) / capacity
    return max(1.0, counted, measured)


def _slowed(seconds: float | None, slowdown: float) -> float | None:
    """A measured time on a shared device (None stays unmeasured)."""
    return None if seconds is None else seconds * slowdown
