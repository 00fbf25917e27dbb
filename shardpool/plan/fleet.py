"""Fleets: the devices a plan may use and the links between their hosts.

A fleet comes from a YAML file of (possibly hypothetical) devices described by memory and
TFLOPS (:func:`load_fleet`), from this machine's measured devices (``plan.local_fleet``), from
the mesh members' agents (``launch.mesh_launcher``), or is made up for benchmarks
(:func:`heterogeneous_fleet`).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.device_facts import DEVICE_KINDS, Measurement
from shardpool.plan.precision import DeviceFacts, parse_capability
from shardpool.plan.time_model import (
    DEFAULT_EFFICIENCY,
    DeviceTimes,
    layer_flops,
    modeled_times,
    torch_dequant_seconds,
)

__all__ = [
    "DEFAULT_LINK",
    "DEFAULT_LOOPBACK",
    "Device",
    "Fleet",
    "FleetPlanRequest",
    "LinkSpec",
    "fleet_from_dict",
    "fleet_plan_request",
    "heterogeneous_fleet",
    "load_fleet",
]

GIB = 2**30


@dataclass(frozen=True)
class LinkSpec:
    """A one-way transfer path: ``bandwidth`` in bytes/s and ``latency`` in seconds."""

    bandwidth: float
    latency: float

    def seconds(self, nbytes: float) -> float:
        """Time to move ``nbytes`` over this link."""
        return nbytes / self.bandwidth + self.latency


#: Between stages on one host: activations go device -> host memory -> device (PCIe-class).
DEFAULT_LOOPBACK = LinkSpec(bandwidth=8e9, latency=50e-6)
#: Between hosts with no listed link: 1 Gbit/s Ethernet through the WireGuard mesh.
DEFAULT_LINK = LinkSpec(bandwidth=1e9 / 8, latency=1e-3)


@dataclass(frozen=True)
class Device:
    """One place a stage can run.

    ``name`` is unique in the fleet (``cpu#1`` when several stages share the CPU);
    ``torch_device`` is what to hand to torch (``cpu``, ``cuda:0``; empty for hypothetical
    devices). Speed is either measured (``seconds_per_layer``: forward + backward of one layer
    per micro-batch, already slowed down for sharing) or nominal (``tflops`` x ``efficiency``).
    ``memory_bytes`` is what the plan may use on it. A profiled device may also carry its
    measured forward share of the layer, embedding, ``lm_head`` + loss and optimizer times
    (seconds, slowed down like ``seconds_per_layer``); what is missing is modeled
    (:func:`~shardpool.plan.time_model.modeled_times`). ``measurement`` says how the profile was
    taken (``plan.json`` records it per stage). ``compute_capability`` (CUDA, ``(7, 0)``) and
    ``bf16`` (whether it computes bf16) choose its stage's dtype (``plan.precision``); None when unknown.
    ``nf4_backend`` and ``nf4_reason``: how a local device computes with NF4 weights and why, chosen
    when it was profiled (``plan.local_fleet``); None for a device whose choice the planner makes
    from the config and its compute capability (``plan.precision.choose_nf4_backend``).
    """

    name: str
    memory_bytes: int
    host: str = "local"
    seconds_per_layer: float | None = None
    tflops: float | None = None
    efficiency: float = DEFAULT_EFFICIENCY
    kind: str = "cuda"
    torch_device: str = ""
    activation_bytes_per_layer: float | None = None
    shared_by: int = 1
    forward_seconds_per_layer: float | None = None
    embed_seconds: float | None = None
    head_forward_seconds: float | None = None
    head_backward_seconds: float | None = None
    optimizer_seconds_per_layer: float | None = None
    measurement: Measurement | None = None
    compute_capability: tuple[int, int] | None = None
    bf16: bool | None = None
    nf4_backend: str | None = None
    nf4_reason: str = ""

    def facts(self) -> DeviceFacts:
        """What the precision chooser and the NF4 check know about this device."""
        return DeviceFacts(kind=self.kind, name=self.name, capability=self.compute_capability, bf16=self.bf16)

    def times(self, shape: ModelShape, workload: Workload, *, nf4_backend: str | None = None) -> DeviceTimes:
        """This device's compute times: measured where the profile has them, else modeled.

        A device modeled from ``tflops`` that computes its NF4 layers in plain PyTorch
        (``nf4_backend`` ``torch``) also dequantizes every weight in each pass
        (:func:`~shardpool.plan.time_model.torch_dequant_seconds`); a measured one was profiled so.
        """
        modeled = modeled_times(
            shape,
            workload,
            layer_s=self.layer_seconds(shape, workload),
            kind=self.kind,
            forward_s=self.forward_seconds_per_layer,
        )

        def pick(measured: float | None, fallback: float) -> float:
            return fallback if measured is None else measured

        forward_extra = backward_extra = 0.0
        if nf4_backend == "torch" and workload.quantize and self.seconds_per_layer is None and self.tflops:
            forward_extra, backward_extra = torch_dequant_seconds(shape, workload, tflops=self.tflops)
        return DeviceTimes(
            layer_forward_s=modeled.layer_forward_s + forward_extra,
            layer_backward_s=modeled.layer_backward_s + backward_extra,
            embed_s=pick(self.embed_seconds, modeled.embed_s),
            head_forward_s=pick(self.head_forward_seconds, modeled.head_forward_s),
            head_backward_s=pick(self.head_backward_seconds, modeled.head_backward_s),
            optimizer_per_layer_s=pick(self.optimizer_seconds_per_layer, modeled.optimizer_per_layer_s),
        )

    def layer_seconds(self, shape: ModelShape, workload: Workload) -> float:
        """Forward + backward seconds of one decoder layer per micro-batch on this device."""
        if self.seconds_per_layer is not None:
            return self.seconds_per_layer
        if not self.tflops:
            raise ShardpoolError(f"device {self.name} has neither tflops nor a measured speed; give tflops")
        return layer_flops(shape, workload) / (self.tflops * 1e12 * self.efficiency)


@dataclass(frozen=True)
class Fleet:
    """Devices plus the links between their hosts (unordered host pairs)."""

    devices: tuple[Device, ...]
    links: Mapping[frozenset[str], LinkSpec] = None  # type: ignore[assignment]
    loopback: LinkSpec = DEFAULT_LOOPBACK
    default_link: LinkSpec = DEFAULT_LINK

    def __post_init__(self) -> None:
        if self.links is None:
            object.__setattr__(self, "links", {})
        if not self.devices:
            raise ShardpoolError("the fleet has no devices; list at least one device")
        names = Counter(device.name for device in self.devices)
        duplicates = sorted(name for name, count in names.items() if count > 1)
        if duplicates:
            raise ShardpoolError(
                f"device names {duplicates} appear more than once; give each device a unique name"
            )

    def link(self, host_a: str, host_b: str) -> LinkSpec:
        """The link used between two hosts (loopback when they are the same host)."""
        if host_a == host_b:
            return self.loopback
        return self.links.get(frozenset((host_a, host_b)), self.default_link)

    def device(self, name: str) -> Device:
        """The device called ``name``."""
        for device in self.devices:
            if device.name == name:
                return device
        raise ShardpoolError(f"the fleet has no device {name!r}; use one of {[d.name for d in self.devices]}")

    @property
    def hosts(self) -> list[str]:
        """Hosts in first-seen order."""
        return list(dict.fromkeys(device.host for device in self.devices))


# ---------------------------------------------------------------------------- fleet files


class _LinkEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hosts: tuple[str, str]
    bandwidth_gbps: float = Field(gt=0, description="Gbit/s")
    latency_ms: float = Field(ge=0)


class _PathEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bandwidth_gbps: float = Field(gt=0)
    latency_ms: float = Field(ge=0)


class _DeviceEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    memory_gib: float = Field(gt=0)
    tflops: float | None = Field(default=None, gt=0)
    seconds_per_layer: float | None = Field(default=None, gt=0)
    efficiency: float = Field(default=DEFAULT_EFFICIENCY, gt=0, le=1)
    host: str | None = None
    kind: str = "cuda"
    compute_capability: str | float | None = Field(default=None, description='CUDA compute capability, "8.6"')
    bf16: bool | None = None

    @model_validator(mode="after")
    def _speed_given(self) -> _DeviceEntry:
        if self.tflops is None and self.seconds_per_layer is None:
            raise ValueError("give tflops (datasheet or measured) or seconds_per_layer")
        if self.kind not in DEVICE_KINDS:
            raise ValueError(f"kind {self.kind!r} is unknown; use {', '.join(DEVICE_KINDS)}")
        try:
            parse_capability(self.compute_capability)
        except ShardpoolError:
            raise ValueError('compute_capability is MAJOR.MINOR in quotes, e.g. "8.6"') from None
        return self


class _PlanEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    config: str = Field(min_length=1)
    model: str | None = None
    set: list[str] = []


class _FleetFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    devices: list[_DeviceEntry]
    links: list[_LinkEntry] = []
    loopback: _PathEntry | None = None
    default_link: _PathEntry | None = None
    plan: _PlanEntry | None = None


@dataclass(frozen=True)
class FleetPlanRequest:
    """What a fleet file's ``plan:`` section asks ``shardpool plan --fleet FILE`` to plan when no
    config is given: a config and a model (paths resolved against the fleet file) and ``--set``
    overrides, so the file can carry the workload its devices were written down for."""

    config: str
    model: str | None
    overrides: tuple[str, ...]


def fleet_plan_request(path: str | Path) -> FleetPlanRequest | None:
    """The ``plan:`` section of the fleet file at ``path`` (checked with the whole file), or None."""
    path = Path(path)
    load_fleet(path)  # the same one-line errors as planning it
    data = yaml.safe_load(path.read_text())
    entry = _FleetFile.model_validate(data).plan if isinstance(data, dict) else None
    if entry is None:
        return None
    model = str(path.parent / entry.model) if entry.model else None
    return FleetPlanRequest(str(path.parent / entry.config), model, tuple(entry.set))


def load_fleet(path: str | Path) -> Fleet:
    """Read a fleet YAML file (a list of devices, or a mapping with ``devices`` and ``links``)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ShardpoolError(
            f"fleet file {path} does not exist; pass an existing --fleet YAML file"
        ) from None
    except (OSError, yaml.YAMLError) as error:
        detail = " ".join(str(error).split())
        raise ShardpoolError(f"cannot read fleet file {path} ({detail}); fix its YAML") from None
    return fleet_from_dict(data, source=str(path))


def fleet_from_dict(data: Any, *, source: str = "fleet") -> Fleet:
    """Validate a parsed fleet file and build the :class:`Fleet`; errors name the field and the fix."""
    if data is None or data == []:
        data = {"devices": []}
    if isinstance(data, list):
        data = {"devices": data}
    if not isinstance(data, dict):
        raise ShardpoolError(
            f"{source}: expected a list of devices or a mapping with 'devices'; fix the fleet file"
        )
    if not data.get("devices"):
        raise ShardpoolError(
            f"{source}: the fleet has zero devices; list at least one device under 'devices'"
        )
    try:
        parsed = _FleetFile.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "fleet"
        message = first["msg"].removeprefix("Value error, ")
        raise ShardpoolError(
            f"{source}: {where}: {message} (got {first.get('input')!r}); fix the fleet file"
        ) from None

    devices = []
    for entry in parsed.devices:
        devices.append(
            Device(
                name=entry.name,
                memory_bytes=int(entry.memory_gib * GIB),
                host=entry.host or entry.name,
                seconds_per_layer=entry.seconds_per_layer,
                tflops=entry.tflops,
                efficiency=entry.efficiency,
                kind=entry.kind,
                compute_capability=parse_capability(entry.compute_capability),
                bf16=entry.bf16,
            )
        )
    hosts = {device.host for device in devices}
    links: dict[frozenset[str], LinkSpec] = {}
    for position, entry in enumerate(parsed.links):
        a, b = entry.hosts
        where = f"{source}: links.{position}"
        if a == b:
            raise ShardpoolError(
                f"{where}: links host {a!r} to itself; set 'loopback' for same-host transfers"
            )
        unknown = sorted({a, b} - hosts)
        if unknown:
            raise ShardpoolError(f"{where}: host {unknown[0]!r} has no device; use a host of a listed device")
        pair = frozenset((a, b))
        if pair in links:
            raise ShardpoolError(
                f"{where}: the link {a} <-> {b} is listed twice; keep one entry per host pair"
            )
        links[pair] = LinkSpec(bandwidth=entry.bandwidth_gbps * 1e9 / 8, latency=entry.latency_ms / 1e3)
    extra: dict[str, LinkSpec] = {}
    for key in ("loopback", "default_link"):
        entry = getattr(parsed, key)
        if entry is not None:
            extra[key] = LinkSpec(bandwidth=entry.bandwidth_gbps * 1e9 / 8, latency=entry.latency_ms / 1e3)
    return Fleet(devices=tuple(devices), links=links, **extra)


# ---------------------------------------------------------------------------- made-up fleets


def heterogeneous_fleet(num_devices: int = 64, num_hosts: int = 8) -> Fleet:
    """A made-up mixed fleet for scale benchmarks and tests: 8 to 80 GiB, 7 to 300 TFLOPS.

    Device ``i`` is on host ``i % num_hosts``; every pair of hosts has a 10 Gbit/s, 0.2 ms link.
    """
    memories_gib, tflops = [8, 12, 16, 24, 48, 80], [7, 35, 80, 125, 300]
    devices = tuple(
        Device(
            name=f"gpu{i}",
            host=f"host{i % num_hosts}",
            memory_bytes=memories_gib[i % len(memories_gib)] * GIB,
            tflops=tflops[(i * 7) % len(tflops)],
        )
        for i in range(num_devices)
    )
    links = {
        frozenset((f"host{a}", f"host{b}")): LinkSpec(bandwidth=1.25e9, latency=2e-4)
        for a, b in itertools.combinations(range(num_hosts), 2)
    }
    return Fleet(devices=devices, links=links)
