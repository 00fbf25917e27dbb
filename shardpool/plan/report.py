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
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from typing import Any

from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.device_facts import DeviceInfo
from shardpool.plan.devices import list_devices
from shardpool.plan.profiler import profile_layer

__all__ = ["DEVICE_FACT_FIELDS", "MEASURED_FIELDS", "device_rows", "main", "read_request"]

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
