"""Whether the installed torch and bitsandbytes builds carry kernels for a CUDA device, and which
build to install when they do not.

A CUDA build holds machine code for a list of architectures (``sm_86``) and sometimes PTX
(``compute_120``) that the driver compiles for newer ones. An ``sm_XY`` binary runs on compute
capability X.Y' with Y' >= Y (same major only: ``sm_100`` does not run on 12.0); ``sm_XYa`` only on
X.Y itself; ``compute_XY`` PTX on any capability >= X.Y. torch says what it carries
(``torch.cuda.get_arch_list()``); bitsandbytes does not, so :data:`BNB_CUDA_LIBRARIES` writes down
what its PyPI wheels' libraries carry, by the CUDA version in the library's file name
(``libbitsandbytes_cuda130.so``).

These are pure functions of those facts; ``plan.devices`` gathers them at discovery and records
the answers as a device's ``arch_error`` (torch has no kernels: no layers at all) and
``nf4_error`` (bitsandbytes has none: no NF4 layers). Each answer is one line naming the build to
install.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

from shardpool.plan.device_facts import DeviceInfo
from shardpool.plan.precision import parse_capability

__all__ = [
    "BNB_CUDA_LIBRARIES",
    "TORCH_CUDA_BUILDS",
    "Arch",
    "bnb_arch_error",
    "bnb_library_cuda_version",
    "build_errors",
    "parse_arch",
    "runs_on",
    "torch_arch_error",
]


class TorchBuild(NamedTuple):
    """One of PyTorch's CUDA wheel builds: its index tag (``cu126``), CUDA version and architectures."""

    tag: str
    cuda: tuple[int, int]
    archs: tuple[str, ...]


class BnbLibrary(NamedTuple):
    """The bitsandbytes CUDA libraries built with CUDA ``low`` to ``high`` and what they carry."""

    low: tuple[int, int]
    high: tuple[int, int]
    archs: tuple[str, ...]


#: PyTorch's CUDA builds on download.pytorch.org, newest first, with the architectures their Linux
#: x86 wheels carry (PyTorch's RELEASE.md support matrix for releases 2.11 and 2.12: CUDA 13 builds
#: start at Turing, with PTX for 12.0 on Linux; the CUDA 12.6 build is the one that still carries
#: Maxwell, Pascal and Volta). Used only to name the build to install.
TORCH_CUDA_BUILDS: tuple[TorchBuild, ...] = (
    TorchBuild("cu130", (13, 0), ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120")),
    TorchBuild("cu126", (12, 6), ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")),
)

#: What bitsandbytes' x86-64 Linux PyPI wheels (0.48 to 0.50) carry in each CUDA library: its
#: ``.github/scripts/build-cuda.sh`` targets 60-90 below CUDA 12.8, 70-120 on 12.8 and 12.9 and
#: 75-120 on CUDA 13, and its CMakeLists adds PTX for the highest target. bitsandbytes loads the
#: library of torch's CUDA version (``bitsandbytes.cextension``), so torch's build picks the row.
BNB_CUDA_LIBRARIES: tuple[BnbLibrary, ...] = (
    BnbLibrary(
        (11, 0), (12, 7), ("sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "compute_90")
    ),
    BnbLibrary(
        (12, 8),
        (12, 9),
        ("sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "compute_120"),
    ),
    BnbLibrary(
        (13, 0), (13, 99), ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "compute_120")
    ),
)

_INDEX_URL = "https://download.pytorch.org/whl/"


class Arch(NamedTuple):
    """One entry of an architecture list: machine code (``sm``) or PTX (``compute``), the compute
    capability it was built for and its suffix (``a``: that capability only; ``f``: its family)."""

    code: str
    capability: tuple[int, int]
    suffix: str


def parse_arch(entry: str) -> Arch | None:
    """``"sm_86"`` as ``Arch("sm", (8, 6), "")``, ``"compute_120"`` as ``Arch("compute", (12, 0), "")``,
    ``"sm_90a"`` as ``Arch("sm", (9, 0), "a")``; None for anything else (a ROCm ``gfx`` name)."""
    match = re.fullmatch(r"(sm|compute)_(\d+)(\d)([af]?)", entry.strip())
    if match is None:
        return None
    return Arch(match.group(1), (int(match.group(2)), int(match.group(3))), match.group(4))


def runs_on(capability: tuple[int, int], arch_list: Sequence[str]) -> bool:
    """Whether code built for ``arch_list`` runs on a device of compute capability ``capability``.

    An ``sm_XY`` binary (and ``sm_XYf``) runs on the same major with a minor of at least Y; ``sm_XYa``
    and ``compute_XYa`` only on X.Y; ``compute_XY`` PTX on any capability from X.Y on, compiled by
    the driver when first used.
    """
    for arch in filter(None, map(parse_arch, arch_list)):
        if arch.suffix == "a":
            fits = capability == arch.capability
        elif arch.code == "sm" or arch.suffix == "f":
            fits = capability[0] == arch.capability[0] and capability[1] >= arch.capability[1]
        else:
            fits = capability >= arch.capability
        if fits:
            return True
    return False


def torch_arch_error(
    capability: tuple[int, int], *, torch_version: str, arch_list: Sequence[str]
) -> str | None:
    """Why the installed torch (``torch.__version__``, ``torch.cuda.get_arch_list()``) cannot run on a
    CUDA device of ``capability``, in one line naming the build to install; None when it can, or
    when the list says nothing about CUDA (a CPU or ROCm build)."""
    if not any(parse_arch(entry) for entry in arch_list) or runs_on(capability, arch_list):
        return None
    sm = _sm(capability)
    build = next((build for build in TORCH_CUDA_BUILDS if runs_on(capability, build.archs)), None)
    if build is None:
        fix = f"no PyTorch CUDA build shardpool knows of carries {sm}; leave this device out"
    else:
        fix = (
            f"install a CUDA {build.cuda[0]}.{build.cuda[1]} build of torch: "
            f"pip install torch --index-url {_INDEX_URL}{build.tag}"
        )
    return (
        f"the installed torch {torch_version} has no kernels for {sm} (it carries {_span(arch_list)}); {fix}"
    )


def bnb_library_cuda_version(library: str) -> tuple[int, int] | None:
    """The CUDA version of a bitsandbytes library from its file name (``libbitsandbytes_cuda130.so`` is
    ``(13, 0)``, ``cuda118`` is ``(11, 8)``); None for any other library (CPU, ROCm, XPU)."""
    match = re.search(r"libbitsandbytes_cuda(\d\d)(\d+)", library)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def bnb_arch_error(capability: tuple[int, int], *, library: str, machine: str) -> str | None:
    """Why bitsandbytes' CUDA library ``library`` (the file it loads) has no 4-bit kernels for a device
    of ``capability``, in one line naming the build to install; None when it has them, or when
    :data:`BNB_CUDA_LIBRARIES` does not describe that library (another CUDA version, or ``machine``
    is not x86-64, whose wheels carry other targets)."""
    version = bnb_library_cuda_version(library)
    if version is None or machine not in ("x86_64", "AMD64"):
        return None
    loaded = _bnb_library(version)
    if loaded is None or runs_on(capability, loaded.archs):
        return None
    sm = _sm(capability)
    build = next((build for build in TORCH_CUDA_BUILDS if _runs_nf4(capability, build)), None)
    if build is None:
        fix = f"no bitsandbytes PyPI wheel has 4-bit kernels for {sm}; use it with `adapter: lora`, or leave it out"
    else:
        fix = (
            f"install a CUDA {build.cuda[0]}.{build.cuda[1]} build of torch, whose bitsandbytes library "
            f"has them: pip install torch --index-url {_INDEX_URL}{build.tag}"
        )
    return (
        f"bitsandbytes' CUDA {version[0]}.{version[1]} library has no 4-bit kernels for {sm} "
        f"(it carries {_span(loaded.archs)}); {fix}"
    )


def build_errors(
    info: DeviceInfo,
    *,
    torch_version: str,
    arch_list: Sequence[str],
    bnb_library: str | None,
    machine: str,
    probe: Callable[[str], str | None] | None,
) -> tuple[str | None, str | None]:
    """A discovered device's ``(arch_error, nf4_error)``: why torch has no kernels for it, and why
    bitsandbytes' 4-bit kernels cannot run on it (``probe``, the tiny NF4 forward pass; None: not probed).

    Where torch has no kernels the probe is not run (it cannot pass) and both errors are torch's.
    Where the probe fails on CUDA and :func:`bnb_arch_error` explains why, its line (which names the
    build to install) replaces the probe's error. The probe decides: a library built from source
    for more targets than the PyPI wheel passes it.
    """
    capability = parse_capability(info.compute_capability) if info.kind == "cuda" else None
    arch_error = None
    if capability is not None:
        arch_error = torch_arch_error(capability, torch_version=torch_version, arch_list=arch_list)
    if probe is None:
        return arch_error, None
    if arch_error is not None:
        return arch_error, arch_error
    nf4_error = probe(info.name)
    if nf4_error is not None and capability is not None and bnb_library is not None:
        nf4_error = bnb_arch_error(capability, library=bnb_library, machine=machine) or nf4_error
    return None, nf4_error


def _bnb_library(version: tuple[int, int] | None) -> BnbLibrary | None:
    if version is None:
        return None
    return next((lib for lib in BNB_CUDA_LIBRARIES if lib.low <= version <= lib.high), None)


def _runs_nf4(capability: tuple[int, int], build: TorchBuild) -> bool:
    """Whether both a torch build and the bitsandbytes library it makes bitsandbytes load run on ``capability``."""
    library = _bnb_library(build.cuda)
    return runs_on(capability, build.archs) and library is not None and runs_on(capability, library.archs)


def _sm(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def _span(arch_list: Sequence[str]) -> str:
    """``sm_75 to sm_120 and compute_120 PTX``: the machine code range and any PTX of an arch list."""
    archs = [arch for arch in map(parse_arch, arch_list) if arch is not None]
    binaries = sorted(arch.capability for arch in archs if arch.code == "sm")
    ptx = sorted(arch.capability for arch in archs if arch.code == "compute")
    parts = [f"{_sm(binaries[0])} to {_sm(binaries[-1])}"] if binaries else []
    parts += [f"compute_{major}{minor} PTX" for major, minor in ptx]
    return " and ".join(parts) or "no CUDA code"
