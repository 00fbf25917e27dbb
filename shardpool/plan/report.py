"""``python -m shardpool.plan.report``: this machine's devices, each with one profiled layer, as JSON.

Reads one JSON object on stdin, ``{"shape": {fields of ModelShape}, "workload": {fields of
Workload}}``, and prints one JSON document on stdout, ``{"devices": [row, ...]}``, a row per
device (accelerators first, the CPU last) with its memory, compute capability, bf16 support and
NF4 probe (:data:`DEVICE_FACT_FIELDS`), and the measured time and activation
bytes of one NF4 + LoRA decoder layer (:func:`shardpool.plan.profiler.profile_layer`; in plain
PyTorch on a device bitsandbytes' 4-bit probe failed on), and the profile's further measurements
and how it was taken (:data:`MEASURED_FIELDS`).

The agent answers ``POST /v1/devices`` by running this module as a child process, as its
unprivileged run-as account, instead of importing torch itself: a driver or kernel that crashes,
hangs or exhausts memory then takes down only this child, and the agent stays torch-free and
small (:mod:`shardpool.agent.profiling`). Whatever torch, bitsandbytes or a driver prints goes to
stderr, so stdout carries the report alone. A failure exits non-zero with one line on stderr.

:func:`local_devices` lists the same devices for ``shardpool devices``, in the units people read
(GiB, milliseconds), and :func:`devices_table` is that list as a table.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Any

from shardpool.config import load_config
from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.device_facts import DeviceInfo
from shardpool.plan.devices import list_devices
from shardpool.plan.profiler import nf4_backend_for, profile_layer

__all__ = [
    "DEVICE_FACT_FIELDS",
    "MEASURED_FIELDS",
    "DeviceListing",
    "device_rows",
    "devices_table",
    "local_devices",
    "main",
    "read_request",
]

#: The profile's further measurements and how it was taken, each in a row under its
#: :class:`~shardpool.plan.device_facts.LayerProfile` name (None where not measured). A member's
#: agent passes them on (``shardpool.agent.profiling``) and the launcher's planner uses them.
MEASURED_FIELDS = (
    "forward_seconds",
    "embed_seconds",
    "head_forward_seconds",
    "head_backward_seconds",
    "optimizer_seconds",
    "runs",
    "seconds_min",
    "seconds_max",
    "cpu_quota",
    "ci95_rel",
)

#: What discovery says of each device beyond its memory, each in a row under its
#: :class:`~shardpool.plan.device_facts.DeviceInfo` name: the compute capability (or gfx name),
#: bf16 support, and, for a device bitsandbytes' 4-bit kernels cannot run on, why (its NF4 layer is
#: profiled in plain PyTorch; a device the installed torch cannot run at all has no profile).
DEVICE_FACT_FIELDS = ("compute_capability", "bf16", "nf4_error")

_MAX_REQUEST_BYTES = 8 * 2**20


def read_request(text: str) -> tuple[ModelShape, Workload]:
    """The model shape and workload of a report request (the JSON this module reads on stdin)."""
    try:
        request = json.loads(text)
        workload = dict(request["workload"])
        workload["lora_targets"] = tuple(workload.get("lora_targets", ()))
        return ModelShape(**request["shape"]), Workload(**workload)
    except (ValueError, TypeError, KeyError) as error:
        raise ShardpoolError(f"the report request is not a shape and a workload: {error}") from None


def device_rows(shape: ModelShape, workload: Workload) -> list[dict[str, Any]]:
    """Every local device with its memory and one profiled layer of ``shape`` under ``workload``.

    A device whose 4-bit probe failed (``nf4_error``, kept in its row so the launcher knows why) is
    profiled computing its NF4 layers in plain PyTorch, the path the launcher can give it layers
    on; with an unquantized base the probe does not matter. A device the installed torch has no
    kernels for (``arch_error``) is not profiled: it can take no layers at all.
    """
    rows = []
    for info in list_devices():
        row: dict[str, Any] = {
            "name": info.name,
            "kind": info.kind,
            "label": info.label,
            "total_bytes": info.total_bytes,
            "free_bytes": info.free_bytes,
            "threads": info.threads,
            **{name: getattr(info, name) for name in DEVICE_FACT_FIELDS},
        }
        if info.arch_error is None:
            threads = info.threads if info.kind == "cpu" else None
            profiled = _profiled_workload(info, workload)
            try:
                profile = profile_layer(shape, profiled, device=info.name, threads=threads)
            except Exception as error:  # noqa: BLE001 - the PyTorch path only: the row says why
                if profiled.nf4_backend != "torch" or profiled is workload:
                    raise
                # A card without 4-bit kernels whose PyTorch path fails too (out of memory, say)
                # is left unprofiled, as before that path: the member's other devices still count.
                row["nf4_error"] = _one_line(f"{info.nf4_error}; in plain PyTorch: {error}")
                rows.append(row)
                continue
            row |= {
                "seconds_per_layer": profile.seconds_per_layer,
                "activation_bytes": profile.activation_bytes,
                **{name: getattr(profile, name) for name in MEASURED_FIELDS},
            }
        rows.append(row)
    return rows


def _profiled_workload(info: DeviceInfo, workload: Workload) -> Workload:
    """The workload ``info``'s device is profiled under: on the PyTorch NF4 path where bitsandbytes'
    4-bit probe failed there and the base is NF4, else as asked."""
    if workload.quantize and info.nf4_error is not None:
        return replace(workload, nf4_backend="torch")
    return workload


#: The longest ``nf4_error`` an agent passes on (``shardpool.agent.profiling.MAX_NF4_ERROR_CHARS``).
_MAX_NF4_ERROR_CHARS = 300


def _one_line(text: str) -> str:
    """``text`` on one line, cut to what an agent's device row may carry."""
    flat = " ".join(text.split())
    return flat if len(flat) <= _MAX_NF4_ERROR_CHARS else flat[: _MAX_NF4_ERROR_CHARS - 3] + "..."


@dataclass(frozen=True)
class DeviceListing:
    """What ``shardpool devices`` shows: a row per local device, what was profiled on each, and notes."""

    rows: list[dict[str, Any]]
    #: What each row's ``ms_per_layer`` times (``one NF4 + LoRA layer of NAME``); None without a config.
    profiled: str | None = None
    #: Why a device computes NF4 in plain PyTorch, or not at all (one per such device).
    notes: list[str] = field(default_factory=list)


def local_devices(config_path: str | None, *, profile: bool = True) -> DeviceListing:
    """Every local device with its memory and, given a config, its profiled layer time.

    Backs ``shardpool devices``. A row says how a stage on the device computes with NF4 weights
    (``nf4``: bitsandbytes, torch or no; None for an unquantized base) and why; a device that
    cannot compute the layer gets no profile (and no layers in a plan).
    """
    rows: list[dict[str, Any]] = []
    shape = workload = None
    if config_path and profile:
        config = load_config(config_path)
        shape = ModelShape.from_config_dir(config.base_model)
        workload = Workload.from_config(config)
    notes: list[str] = []
    for info in list_devices():
        nf4 = nf4_backend_for(info, workload or Workload())
        row: dict[str, Any] = {
            "device": info.name,
            "kind": info.kind,
            "label": info.label,
            "total_gib": round(info.total_bytes / 2**30, 2),
            "free_gib": round(info.free_bytes / 2**30, 2),
            "compute_capability": info.compute_capability,
            "bf16": info.bf16,
            # How a stage here computes with NF4 weights (None: an unquantized base), and why.
            "nf4": None if nf4 is None else (nf4.backend or "no"),
            "nf4_reason": None if nf4 is None else nf4.reason,
        }
        if nf4 is not None and nf4.backend != "bitsandbytes":
            notes.append(nf4.reason)
        runs = info.arch_error is None and (nf4 is None or nf4.backend is not None)
        if shape is not None and workload is not None and runs:
            measured = profile_layer(shape, workload, device=info.name)
            row["ms_per_layer"] = round(measured.seconds_per_layer * 1e3, 3)
            row["activation_mib_per_layer"] = round(measured.activation_bytes / 2**20, 2)
        elif shape is not None:  # it cannot compute the layer: no profile, and no layers in a plan
            row |= {"ms_per_layer": None, "activation_mib_per_layer": None}
        rows.append(row)
    if shape is None:
        return DeviceListing(rows, None, notes)
    base = "NF4" if workload is None or workload.quantize else "unquantized"
    return DeviceListing(rows, f"one {base} + LoRA layer of {shape.name}", notes)


def devices_table(listing: DeviceListing) -> Any:
    """A rich Table of ``listing``: a row per device; the caption says what to pass to profile, and why
    a device computes NF4 other than with bitsandbytes."""
    from rich.table import Table

    rows = listing.rows
    title = "local devices" + ("" if listing.profiled is None else f" ({listing.profiled})")
    lines = (
        []
        if listing.profiled is not None
        else ["pass a config to profile one layer of its model on each device"]
    )
    caption = "\n".join(lines + [f"nf4: {note}" for note in listing.notes]) or None
    table = Table(title=title, caption=caption)
    for column in (column for column in rows[0] if column != "nf4_reason"):
        header = "capability" if column == "compute_capability" else column
        table.add_column(
            header, justify="right" if column not in ("device", "kind", "label", "nf4") else "left"
        )
    for row in rows:
        table.add_row(
            *("-" if value is None else str(value) for key, value in row.items() if key != "nf4_reason")
        )
    return table


def main() -> int:
    """Read the request on stdin, print the report on stdout; 1 with a one-line error on failure."""
    report = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # anything else printed, even by C code, goes to stderr
    try:
        shape, workload = read_request(sys.stdin.read(_MAX_REQUEST_BYTES))
        rows = device_rows(shape, workload)
    except ShardpoolError as error:
        print(f"shardpool.plan.report: error: {error}", file=sys.stderr)
        return 1
    with report:
        report.write(json.dumps({"devices": rows}).encode("utf-8") + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
