"""Each stage's compute dtype, chosen from its device's capability under the config's cap.

The config's ``bf16``/``fp16`` keys say how low a precision the user accepts ("at most this
precision"), precision ordered by mantissa bits: fp32 (23) > fp16 (10) > bf16 (7). Each device then
computes in the fastest dtype it supports well within that cap, so ``bf16: true`` allows bf16,
fp16 and fp32, and ``fp16: true`` allows fp16 and fp32 but never bf16:

==========================  ====  ==============  ===============  ==============
device                      fp32  ``bf16: true``  ``bf16: auto``   ``fp16: true``
==========================  ====  ==============  ===============  ==============
CUDA >= 8.0 (3090, 4090)    fp32  bf16            bf16             fp16
CUDA 7.x (V100, T4)         fp32  fp16            fp32             fp16
CUDA < 7.0 (P40, M40)       fp32  fp32            fp32             fp32
ROCm / MPS / XPU with bf16  fp32  bf16            bf16             fp16
ROCm / MPS / XPU without    fp32  fp16            fp32             fp16
CPU                         fp32  bf16            bf16             fp16
capability unknown          fp32  bf16            bf16             fp16
==========================  ====  ==============  ===============  ==============

``bf16: auto`` is ``bf16: true`` without the fp16 fallback: bf16 where supported, else fp32.
A 7.x card under ``bf16: true`` computes in fp16 because it has fp16 tensor cores and no bf16;
the run then uses dynamic loss scaling. Cards below 7.0 have no tensor cores, and their half
precision is either slow (P40) or no faster than fp32 (M40), so they stay in fp32. A CPU stage
of an fp16 run computes in fp16 as asked (torch computes it on any x86 or ARM CPU; it is native
only with AVX512-FP16 or ARM FP16, else slower than bf16, which is why ``bf16`` suits CPUs).
A device whose capability nobody reported (a fleet file without ``compute_capability``, a
member whose agent predates it) follows the config unchanged.

On ROCm, torch says every card computes bf16, so :func:`rocm_has_bf16` decides it from the gfx
architecture instead; discovery records its answer as the device's ``bf16``. :func:`stage_dtype`
is the dtype a device is profiled in: the one its stage will compute in.

:func:`nf4_refusal` says in one line why bitsandbytes cannot compute with NF4 layers on a device
(it needs CUDA compute capability 6.0; see its comment for the source), and
:func:`choose_nf4_backend` how a stage on it computes with them instead (``shardpool.nf4_backend``):
bitsandbytes' kernels where they run, else the same stored weights in plain PyTorch
(``shardpool.model.nf4``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from shardpool.errors import ShardpoolError

__all__ = [
    "DTYPE_BYTES",
    "DTYPE_SHORT",
    "NF4_MIN_CAPABILITY",
    "NF4_SETTINGS",
    "Cap",
    "DeviceFacts",
    "NF4Choice",
    "NF4Setting",
    "PrecisionChoice",
    "choose_dtype",
    "choose_nf4_backend",
    "config_cap",
    "nf4_refusal",
    "parse_capability",
    "rocm_has_bf16",
    "stage_dtype",
]

#: The config's cap: what ``bf16``/``fp16`` allow (``bf16-auto`` is ``bf16: auto``).
Cap = Literal["fp32", "bf16", "bf16-auto", "fp16"]

#: Bytes per element of each compute dtype name.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Short names for tables and messages.
DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_CAP_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "bf16-auto": "bfloat16", "fp16": "float16"}

#: bitsandbytes' NF4/FP4 kernels need CUDA compute capability 6.0 (Pascal) or newer: its
#: installation guide (huggingface.co/docs/bitsandbytes/v0.48.1/installation, "NF4/FP4
#: quantization 6.0+"); Maxwell (5.x: M40, GTX 900) builds left the PyPI wheels in 0.48.0
#: (bitsandbytes-foundation/bitsandbytes#1755) and Maxwell code paths were removed in #1806.
NF4_MIN_CAPABILITY = (6, 0)

#: ``shardpool.nf4_backend``: bitsandbytes' kernels, plain PyTorch, or (auto) the first where it runs.
NF4Setting = Literal["auto", "bitsandbytes", "torch"]
NF4_SETTINGS: tuple[NF4Setting, ...] = ("auto", "bitsandbytes", "torch")


@dataclass(frozen=True)
class DeviceFacts:
    """What the chooser needs to know about one device: its kind (cpu, cuda, rocm, mps, xpu),
    CUDA compute capability (``(8, 6)``; None when unknown or not CUDA), whether it computes
    bf16 (None when unknown) and a name for messages."""

    kind: str
    name: str
    capability: tuple[int, int] | None = None
    bf16: bool | None = None


@dataclass(frozen=True)
class PrecisionChoice:
    """A stage's compute dtype (``float32``, ``bfloat16``, ``float16``) and why, in one line."""

    dtype: str
    reason: str

    @property
    def short(self) -> str:
        """fp32, bf16 or fp16."""
        return DTYPE_SHORT[self.dtype]


def parse_capability(text: Any) -> tuple[int, int] | None:
    """``"8.6"`` (or ``8.6``, ``(8, 6)``) as ``(8, 6)``; None for None; a clear error otherwise."""
    if text is None:
        return None
    if isinstance(text, tuple | list) and len(text) == 2:
        return int(text[0]), int(text[1])
    major, sep, minor = str(text).strip().partition(".")
    if not (major.isdigit() and (not sep or minor.isdigit())):
        raise ShardpoolError(f'compute capability {text!r} is not MAJOR.MINOR; write it like "8.6"')
    return int(major), int(minor or 0)


def config_cap(bf16: bool | str, fp16: bool) -> Cap:
    """The cap of a config's ``bf16`` (True, False or ``"auto"``) and ``fp16`` keys."""
    if bf16 is True:
        return "bf16"
    if bf16 == "auto":
        return "bf16-auto"
    if fp16:
        return "fp16"
    return "fp32"


def choose_dtype(facts: DeviceFacts, cap: Cap) -> PrecisionChoice:
    """The dtype a stage on ``facts``'s device computes in under ``cap``, with a one-line reason.

    See the module docstring for the table; it never goes below the cap (fp32 stays fp32).
    """
    if cap == "fp32":
        return PrecisionChoice("float32", "the config asks for fp32 (neither bf16 nor fp16 set)")
    half = _half_support(facts)
    if half is None:
        return PrecisionChoice(_CAP_DTYPE[cap], f"{facts.name}: capability unknown; following the config")
    has_bf16, has_fp16, why = half
    if cap == "fp16":
        if has_fp16:
            return PrecisionChoice("float16", f"{facts.name}: fp16 as configured ({why})")
        return PrecisionChoice("float32", f"{facts.name}: fp32, no fast fp16 ({why})")
    if has_bf16:
        return PrecisionChoice("bfloat16", f"{facts.name}: bf16 ({why})")
    if cap == "bf16" and has_fp16:
        return PrecisionChoice("float16", f"{facts.name}: fp16 with loss scaling, no bf16 ({why})")
    return PrecisionChoice("float32", f"{facts.name}: fp32, no bf16 ({why})")


def _half_support(facts: DeviceFacts) -> tuple[bool, bool, str] | None:
    """(computes bf16 well, computes fp16 well, why) for a device; None when nothing is known.

    "Well" is what the cap may choose: a CPU does both (fp16 slowly without AVX512-FP16, but a
    config that asks for fp16 gets it there).
    """
    if facts.kind == "cpu":
        return True, True, "a CPU"
    if facts.kind == "cuda":
        cc = facts.capability
        if cc is None:
            return None if facts.bf16 is None else (facts.bf16, True, "bf16 support reported")
        text = f"compute capability {cc[0]}.{cc[1]}"
        if cc >= (8, 0):
            return True, True, text
        if cc >= (7, 0):
            return False, True, text
        return False, False, f"{text}, no tensor cores"
    if facts.bf16 is None:
        return None
    return facts.bf16, True, f"{facts.kind} {'with' if facts.bf16 else 'without'} bf16"


def stage_dtype(facts: DeviceFacts, cap: Cap | None, compute_bytes: int) -> str:
    """The dtype a stage on ``facts``'s device computes in, and so the dtype to profile it in.

    With the config's cap that is :func:`choose_dtype`'s choice. Without one (a workload that only
    gives ``compute_bytes``, as a mesh member's profile request does), 4 bytes is fp32 and 2 bytes is
    the choice under ``bf16: true``: bf16 where the device computes it, else fp16, else fp32 (a card
    below 7.0), so a V100 is profiled in fp16 and a Mac without bf16 never asks for it.
    """
    if cap is None:
        cap = "fp32" if compute_bytes >= 4 else "bf16"
    return choose_dtype(facts, cap).dtype


def rocm_has_bf16(arch: str | None) -> bool | None:
    """Whether a ROCm device of gfx architecture ``arch`` (``gfx90a``) computes bf16 natively; None
    when ``arch`` is not a gfx name.

    torch on ROCm answers ``torch.cuda.is_bf16_supported()`` with True on every card, so the
    architecture decides. bf16 is native on CDNA with matrix cores (gfx908 MI100, gfx90a MI200,
    gfx94x MI300, gfx95x MI350) and on RDNA3 and later (gfx11xx, gfx12xx). Vega (gfx900, gfx906
    MI50/MI60) and RDNA1/RDNA2 (gfx101x, gfx103x) have fast fp16 but no bf16: they get fp16 (or
    fp32, where the config's cap says) from :func:`choose_dtype`. Architectures not named here
    count as without bf16.
    """
    match = re.fullmatch(r"gfx([0-9a-f]+)", (arch or "").strip().lower())
    if match is None:
        return None
    code = match.group(1)
    if len(code) == 4:  # RDNA: gfx10xx is RDNA1/RDNA2, gfx11xx RDNA3, gfx12xx RDNA4
        return not code.startswith("10")
    if len(code) == 3 and code[0] == "9":  # GCN 5 (Vega) and CDNA
        return code in ("908", "90a") or code[1] in "45"
    return False


@dataclass(frozen=True)
class NF4Choice:
    """How a stage on one device computes with NF4 weights, ``bitsandbytes`` or ``torch``, and why in
    one line; ``backend`` None: it cannot (``reason`` then says why and what to do)."""

    backend: Literal["bitsandbytes", "torch"] | None
    reason: str


def nf4_refusal(facts: DeviceFacts) -> str | None:
    """Why bitsandbytes cannot compute with NF4 layers on ``facts``'s device, in one line; None when
    it can (or nobody knows). Such a device computes them in plain PyTorch (:func:`choose_nf4_backend`)."""
    cc = facts.capability
    if facts.kind == "cuda" and cc is not None and cc < NF4_MIN_CAPABILITY:
        return (
            f"{facts.name} (compute capability {cc[0]}.{cc[1]}) cannot run bitsandbytes NF4, which needs "
            f"6.0+ (Maxwell left bitsandbytes in 0.48); set shardpool.nf4_backend to auto or torch to "
            f"compute its NF4 layers in plain PyTorch, use `adapter: lora`, or leave it out"
        )
    return None


def choose_nf4_backend(
    setting: NF4Setting,
    facts: DeviceFacts,
    *,
    nf4_error: str | None = None,
    arch_error: str | None = None,
) -> NF4Choice:
    """How a stage on ``facts``'s device computes with NF4 weights under ``shardpool.nf4_backend``.

    ``nf4_error`` is why bitsandbytes' 4-bit probe failed on it (a local device); without a probe,
    its compute capability decides (:func:`nf4_refusal`). ``auto`` takes bitsandbytes where it runs,
    else PyTorch; ``torch`` is PyTorch anywhere; ``bitsandbytes`` where it cannot run is refused.
    A device the installed torch has no kernels for (``arch_error``) is refused whatever the setting:
    not even the PyTorch path runs there.
    """
    who = _described(facts)
    if arch_error is not None:
        return NF4Choice(None, f"{who}: {_first_line(arch_error)}; it gets no layers")
    if nf4_error is not None:
        missing = f"bitsandbytes' 4-bit probe failed ({_first_line(nf4_error)[:160]})"
        refused = (
            f"{who} cannot run bitsandbytes 4-bit: {_first_line(nf4_error)[:160]}; set "
            f"shardpool.nf4_backend to auto or torch to compute its NF4 layers in plain PyTorch, or leave it out"
        )
    else:
        refused = nf4_refusal(facts) or ""
        missing = "bitsandbytes has no 4-bit kernels for it" if refused else ""
    if setting == "torch":
        return NF4Choice("torch", f"{who}: NF4 in plain PyTorch, as shardpool.nf4_backend says")
    if setting == "bitsandbytes":
        if refused:
            return NF4Choice(None, refused)
        return NF4Choice("bitsandbytes", f"{who}: bitsandbytes' 4-bit kernels, as shardpool.nf4_backend says")
    if setting != "auto":
        raise ShardpoolError(f"shardpool.nf4_backend {setting!r} is unknown; use {', '.join(NF4_SETTINGS)}")
    if missing:
        return NF4Choice("torch", f"{who}: {missing}; NF4 in plain PyTorch")
    return NF4Choice("bitsandbytes", f"{who}: bitsandbytes' 4-bit kernels")


def _described(facts: DeviceFacts) -> str:
    """``m40 (compute capability 5.2)``, or the bare name where the capability is unknown."""
    cc = facts.capability
    return facts.name if cc is None else f"{facts.name} (compute capability {cc[0]}.{cc[1]})"


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0].strip() if lines else "unknown error"
