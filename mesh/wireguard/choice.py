"""Choosing a WireGuard backend (kernel when the kernel has it, else wireguard-go) and building it.

This module sits above both implementations (:mod:`mesh.wireguard.kernel`,
:mod:`mesh.wireguard.userspace`), which only import the interface and data types of
:mod:`mesh.wireguard.backend`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mesh.errors import MeshError
from mesh.wireguard.backend import WireGuardBackend
from mesh.wireguard.kernel import KernelBackend, kernel_wireguard_available
from mesh.wireguard.userspace import UserspaceBackend

__all__ = ["BACKENDS", "choose_backend", "kernel_available", "make_backend"]

BACKENDS = ("kernel", "userspace")


def kernel_available() -> bool:
    """Probe whether the kernel can make WireGuard links (module loaded or loadable)."""
    return kernel_wireguard_available()


def choose_backend(requested: str | None) -> str:
    """Pick ``kernel`` when the kernel has WireGuard, else ``userspace``; honour a forced choice."""
    if requested is not None:
        if requested not in BACKENDS:
            raise MeshError(f"--backend {requested!r} is unknown: use kernel or userspace")
        return requested
    if kernel_available():
        return "kernel"
    if shutil.which("wireguard-go"):
        return "userspace"
    raise MeshError(
        "no WireGuard found: this kernel has no wireguard module and wireguard-go is not installed "
        "(apt-get install wireguard-go wireguard-tools)"
    )


def make_backend(name: str, run_dir: Path, log_dir: Path) -> WireGuardBackend:
    """Build the backend called ``name``; the userspace one keeps wireguard-go's pid in ``run_dir``."""
    if name == "kernel":
        return KernelBackend()
    if name == "userspace":
        return UserspaceBackend(run_dir, log_dir)
    raise MeshError(f"backend {name!r} is unknown: use kernel or userspace")
