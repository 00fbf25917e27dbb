"""Measure one NF4 + LoRA decoder layer on a device: forward and backward time and activation bytes.

The layer is built from the model shape alone (random weights): its Linear modules are
quantized to NF4 with bitsandbytes (blocksize 64, double quantization) and wrapped with
LoRA by peft, exactly as a training stage holds them. They compute on the NF4 backend a stage on
that device would use (``shardpool.nf4_backend``: bitsandbytes' kernels, or plain PyTorch where
they do not run; :func:`~shardpool.plan.precision.choose_nf4_backend`); for an unquantized base
(``adapter: lora``) they stay plain Linear modules in the stage's dtype. After a warm-up, the median of a few
timed forward + backward passes at the configured micro-batch and sequence length is the
profile (its fastest and slowest run and the process's cgroup CPU quota are kept with it), with the
forward timed on its own too. The ends of the model are timed the same way:
the embedding lookup, and final norm + ``lm_head`` + the loss forward and backward on a slice
of at most :data:`HEAD_VOCAB` vocabulary rows, scaled to the full vocabulary (both are linear
in it); and one AdamW step with gradient clipping over the layer's LoRA parameters. Results are cached per device, model shape and workload in
``$SHARDPOOL_CACHE/profiles.json`` (default ``~/.cache/shardpool``), written atomically.
:class:`TorchProbe` hands these measurements to ``plan.local_fleet``, and :func:`show_devices`
prints them for ``shardpool devices``.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from mesh.constants import cache_root
from mesh.files import atomic_write
from shardpool.config import load_config
from shardpool.errors import ShardpoolError
from shardpool.host.cpu_quota import cpu_quota
from shardpool.model.shape import ModelShape
from shardpool.plan.confidence import ci95_relative, measured_enough, passes_per_sample
from shardpool.plan.costmodel import Workload
from shardpool.plan.device_facts import DeviceInfo, LayerProfile, normalize_device
from shardpool.plan.devices import device_info, list_devices, synchronize
from shardpool.plan.fleet import LinkSpec
from shardpool.plan.links import measure_loopback
from shardpool.plan.precision import NF4Choice, choose_nf4_backend, stage_dtype

__all__ = ["HEAD_VOCAB", "TorchProbe", "cache_path", "profile_key", "profile_layer", "show_devices"]

#: Vocabulary rows of the ``lm_head`` slice the profiler times (then scales to the full vocabulary).
HEAD_VOCAB = 8192
#: Bumped when a profile gains measurements, so cached profiles without them are re-measured
#: (4: under a CPU quota the optimizer and the ends are timed in quota-spanning samples too).
_PROFILE_VERSION = 4
#: Samples of the short parts of a step (optimizer, ends) under a CPU quota, each spanning
#: QUOTA_SAMPLE_S: three seconds per part and profile instead of a few milliseconds.
THROTTLED_PART_SAMPLES = 3

_LAYER_CLASSES = {
    "llama": ("llama", "Llama"),
    "mistral": ("mistral", "Mistral"),
    "qwen2": ("qwen2", "Qwen2"),
    "qwen3": ("qwen3", "Qwen3"),
}


def cache_path() -> Path:
    """Where profiles are cached: ``$SHARDPOOL_CACHE/profiles.json`` or ``~/.cache/shardpool/profiles.json``."""
    return cache_root() / "profiles.json"


def profile_key(
    shape: ModelShape,
    workload: Workload,
    *,
    label: str,
    threads: int | None,
    quota: float | None = None,
    dtype: str | None = None,
    nf4_backend: str | None = None,
) -> str:
    """Cache key: device label, thread count, the process's CPU quota (a re-throttled host measures
    again), model shape digest, the workload's layer settings, the compute dtype profiled in
    (bf16 and fp16 are both 2 bytes) and the NF4 backend when it is plain PyTorch (a key without
    one is bitsandbytes', as before the backend was chosen)."""
    import torch

    return (
        f"{label}|threads={threads}|quota={quota}|{shape.key()}|{workload.profile_key()}"
        f"{'' if dtype is None else f'|dtype={dtype}'}{'|nf4=torch' if nf4_backend == 'torch' else ''}"
        f"|torch={torch.__version__}|v{_PROFILE_VERSION}"
    )


def profile_layer(
    shape: ModelShape,
    workload: Workload,
    *,
    device: str = "cpu",
    threads: int | None = None,
    repeats: int = 3,
    use_cache: bool = True,
) -> LayerProfile:
    """Profile one NF4 + LoRA decoder layer of ``shape`` on ``device`` (cached).

    The layer computes in the dtype a stage on that device would (:func:`~shardpool.plan.precision.stage_dtype`
    of the device under the workload's cap), so a V100 planned in fp16 is profiled in fp16, and on
    the NF4 backend it would (:func:`nf4_backend_for`). ``threads`` (CPU only) runs the benchmark
    with that many torch threads, for CPU slots that share the processor. Raises ShardpoolError
    when the layer does not fit or the device is unusable.
    """
    device = normalize_device(device)
    info = device_info(device)
    label = f"{device} {info.label}"
    quota = cpu_quota()
    dtype = stage_dtype(info.facts(), workload.precision, workload.compute_bytes)
    nf4 = nf4_backend_for(info, workload)
    if nf4 is not None and nf4.backend is None:
        raise ShardpoolError(nf4.reason)
    backend = nf4.backend if nf4 is not None else None
    key = profile_key(
        shape,
        workload,
        label=label,
        threads=threads if info.kind == "cpu" else None,
        quota=quota,
        dtype=dtype,
        nf4_backend=backend,
    )
    if use_cache:
        cached = _read_cache().get(key)
        if cached is not None:
            try:
                return LayerProfile(**cached)
            except TypeError:
                pass
    with _threads(threads if info.kind == "cpu" else None):
        profile = _measure(
            shape, workload, device=device, label=label, threads=threads, repeats=repeats,
            throttled=info.kind == "cpu" and quota is not None, dtype_name=dtype, nf4_backend=backend,
        )  # fmt: skip
    profile = replace(profile, cpu_quota=quota)
    if use_cache:
        _write_cache(key, asdict(profile))
    return profile


def nf4_backend_for(info: DeviceInfo, workload: Workload) -> NF4Choice | None:
    """How a stage on the local device ``info`` computes with NF4 weights under the workload's
    ``shardpool.nf4_backend`` (``auto`` for a per-stage list, whose entries ``plan.local_fleet``
    hands over one at a time), from its 4-bit probe; None for an unquantized base."""
    if not workload.quantize:
        return None
    setting = "auto" if isinstance(workload.nf4_backend, tuple) else workload.nf4_backend
    facts = replace(info.facts(), name=info.name)
    return choose_nf4_backend(setting, facts, nf4_error=info.nf4_error, arch_error=info.arch_error)


class TorchProbe:
    """Measures this machine with torch for ``plan.local_fleet.local_fleet`` (a ``DeviceProbe``):
    device memory, one profiled layer (cached unless ``use_cache`` is False) and the loopback."""

    def __init__(self, *, use_cache: bool = True) -> None:
        self.use_cache = use_cache

    def device_info(self, name: str) -> DeviceInfo:
        """Kind, label, free memory and (CPU) threads of a local device."""
        return device_info(name)

    def profile_layer(
        self, shape: ModelShape, workload: Workload, *, device: str, threads: int | None
    ) -> LayerProfile:
        """One decoder layer profiled on ``device`` (see :func:`profile_layer`)."""
        return profile_layer(shape, workload, device=device, threads=threads, use_cache=self.use_cache)

    def loopback(self) -> LinkSpec:
        """The measured link between two stages on this machine (TCP over 127.0.0.1)."""
        measured = measure_loopback()
        return LinkSpec(bandwidth=measured.bandwidth, latency=measured.latency)


# ---------------------------------------------------------------------------- building the layer


def _build_layer(
    shape: ModelShape, workload: Workload, device: str, dtype_name: str, nf4_backend: str | None = None
) -> tuple[Any, Any, Any]:
    """One decoder layer with LoRA computing in ``dtype_name`` (``float16``), its rotary embedding
    and its torch dtype: quantized to NF4 on ``nf4_backend`` (None: bitsandbytes) unless the
    workload's base is unquantized."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig

    module_name, prefix = _LAYER_CLASSES[shape.model_type]
    modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    layer_cls = getattr(modeling, f"{prefix}DecoderLayer")
    rotary_cls = getattr(modeling, f"{prefix}RotaryEmbedding")
    fields = shape.to_hf_config()
    fields.pop("model_type")
    fields["num_hidden_layers"] = 1
    config = AutoConfig.for_model(shape.model_type, **fields)
    config._attn_implementation = "sdpa"
    dtype = getattr(torch, dtype_name)

    with torch.device("meta"):
        layer = layer_cls(config, layer_idx=0)
    generator = torch.Generator().manual_seed(0)
    for parent in list(layer.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(
                    parent,
                    child_name,
                    _nf4_linear(child, dtype, device, generator, nf4_backend or "bitsandbytes")
                    if workload.quantize
                    else _dense_linear(child, dtype, device, generator),
                )
    for module in layer.modules():
        for param_name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                fill = torch.zeros if param_name == "bias" else torch.ones
                module.register_parameter(
                    param_name,
                    torch.nn.Parameter(fill(param.shape, dtype=dtype, device=device), requires_grad=False),
                )

    class _Holder(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.layer = inner

        def forward(self, hidden: torch.Tensor, position_embeddings: Any) -> torch.Tensor:
            out = self.layer(hidden, position_embeddings=position_embeddings)
            return out[0] if isinstance(out, tuple) else out

    holder = _Holder(layer)
    if workload.lora_r > 0:
        lora = LoraConfig(
            r=workload.lora_r,
            lora_alpha=2 * workload.lora_r,
            lora_dropout=0.0,
            target_modules=sorted(set(workload.lora_targets)),
        )
        holder = get_peft_model(holder, lora)
        holder.to(device)
    rotary = rotary_cls(config=config).to(device)
    return holder, rotary, dtype


def _nf4_linear(linear: Any, dtype: Any, device: str, generator: Any, backend: str) -> Any:
    """``linear``'s shape with random weights, quantized to NF4 as a stage does it, on ``backend``."""
    import torch

    from shardpool.model.nf4 import quantize_linear

    weight = torch.randn(linear.out_features, linear.in_features, generator=generator, dtype=dtype) * 0.02
    bias = torch.zeros(linear.out_features, dtype=dtype) if linear.bias is not None else None
    return quantize_linear(weight, bias, device=device, compute_dtype=dtype, backend=backend)  # type: ignore[arg-type]


def _dense_linear(linear: Any, dtype: Any, device: str, generator: Any) -> Any:
    """``linear``'s shape with random frozen weights in ``dtype``, as an unquantized base holds it."""
    import torch

    dense = torch.nn.Linear(
        linear.in_features, linear.out_features, bias=linear.bias is not None, device=device, dtype=dtype
    )
    with torch.no_grad():
        weight = torch.randn(linear.out_features, linear.in_features, generator=generator, dtype=dtype)
        dense.weight.copy_(weight * 0.02)
        if dense.bias is not None:
            dense.bias.zero_()
    return dense.requires_grad_(False)


# ---------------------------------------------------------------------------- measuring


def _measure(
    shape: ModelShape,
    workload: Workload,
    *,
    device: str,
    label: str,
    threads: int | None,
    repeats: int,
    throttled: bool = False,
    dtype_name: str = "float32",
    nf4_backend: str | None = None,
) -> LayerProfile:
    import torch
    import torch.utils.checkpoint

    try:
        model, rotary, dtype = _build_layer(shape, workload, device, dtype_name, nf4_backend)
        hidden = torch.randn(
            workload.micro_batch_size, workload.sequence_len, shape.hidden_size, dtype=dtype, device=device
        )
        positions = torch.arange(workload.sequence_len, device=device).unsqueeze(0)
        position_embeddings = rotary(hidden, positions.expand(workload.micro_batch_size, -1))

        def step() -> float:
            """One forward + backward; returns the forward's seconds."""
            x = hidden.detach().requires_grad_(True)
            start = time.perf_counter()
            if workload.gradient_checkpointing:
                out = torch.utils.checkpoint.checkpoint(model, x, position_embeddings, use_reentrant=False)
            else:
                out = model(x, position_embeddings)
            synchronize(device)
            forward = time.perf_counter() - start
            out.float().sum().backward()
            return forward

        activation_bytes = _saved_bytes(
            lambda: model(hidden.detach().requires_grad_(True), position_embeddings),
            frozen={
                param.untyped_storage().data_ptr() for param in model.parameters() if not param.requires_grad
            },
        )
        _reset_peak(device)
        warmup = 0.0
        for attempt in range(3):  # warm-up: kernels, allocator; a third only while runs are cheap
            synchronize(device)
            start = time.perf_counter()
            step()
            synchronize(device)
            warmup = time.perf_counter() - start
            if attempt >= 1 and warmup > 0.5:
                break
        times, forwards = [], []
        per_sample = passes_per_sample(warmup, throttled=throttled)
        began = time.perf_counter()
        # At least `repeats` samples, then until the confidence target (shardpool.plan.confidence).
        while True:
            start = time.perf_counter()
            forward_seconds = sum(step() for _ in range(per_sample))
            synchronize(device)
            times.append((time.perf_counter() - start) / per_sample)
            forwards.append(forward_seconds / per_sample)
            if warmup > 5.0 or (
                len(times) >= repeats and measured_enough(times, spent_seconds=time.perf_counter() - began)
            ):
                break
        runs = len(times)
        peak = _peak(device)
        optimizer_s = _time_optimizer(model, device, runs, throttled=throttled)
        ends = _time_ends(shape, workload, hidden, dtype, device, runs, throttled=throttled)
    except torch.OutOfMemoryError:
        raise ShardpoolError(
            f"one decoder layer does not fit on {device} at micro_batch_size={workload.micro_batch_size}, "
            f"sequence_len={workload.sequence_len}; lower them or enable gradient_checkpointing"
        ) from None
    return LayerProfile(
        seconds_per_layer=statistics.median(times),
        activation_bytes=activation_bytes,
        peak_bytes=peak,
        device=device,
        label=label,
        threads=threads,
        runs=runs * per_sample,
        forward_seconds=statistics.median(forwards),
        embed_seconds=ends[0],
        head_forward_seconds=ends[1],
        head_backward_seconds=ends[2],
        optimizer_seconds=optimizer_s,
        seconds_min=min(times),
        seconds_max=max(times),
        ci95_rel=ci95_relative(times),
    )


def _time_optimizer(model: Any, device: str, runs: int, *, throttled: bool = False) -> float:
    """Median seconds of one AdamW step with gradient clipping over ``model``'s trainable parameters
    (their gradients are left from the timed backward passes), as a stage runs it each step.

    Under a CPU quota (``throttled``) each sample times enough steps to span
    :data:`~shardpool.plan.confidence.QUOTA_SAMPLE_S`, like the layer's passes: a single step of
    a millisecond is timed fast or slow by where in the quota period it falls.
    """
    import torch

    params = [param for param in model.parameters() if param.requires_grad and param.grad is not None]
    if not params:
        return 0.0
    optimizer = torch.optim.AdamW(params, lr=1e-6)

    def steps(count: int) -> float:
        synchronize(device)
        start = time.perf_counter()
        for _ in range(count):
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
        synchronize(device)
        return (time.perf_counter() - start) / count

    steps(1)  # the first step allocates the AdamW state
    per_sample, samples = _sampling(steps(1), runs, throttled=throttled)
    return statistics.median(steps(per_sample) for _ in range(samples))


def _sampling(pass_seconds: float, runs: int, *, throttled: bool) -> tuple[int, int]:
    """Passes per sample and samples for a short part of a step (the optimizer, the ends): ``runs``
    single passes, or under a CPU quota :data:`THROTTLED_PART_SAMPLES` samples spanning
    :data:`~shardpool.plan.confidence.QUOTA_SAMPLE_S` each."""
    per_sample = passes_per_sample(pass_seconds, throttled=throttled)
    return per_sample, (min(runs, THROTTLED_PART_SAMPLES) if per_sample > 1 else runs)


def _time_ends(
    shape: ModelShape,
    workload: Workload,
    hidden: Any,
    dtype: Any,
    device: str,
    runs: int,
    *,
    throttled: bool = False,
) -> tuple[float, float, float]:
    """Median seconds of the embedding lookup, and of final norm + ``lm_head`` + summed cross-entropy
    forward and backward (input gradient only: both are frozen), scaled to the full vocabulary.

    Under a CPU quota (``throttled``) each sample sums the parts over enough passes to span
    :data:`~shardpool.plan.confidence.QUOTA_SAMPLE_S` (see :func:`_time_optimizer`).
    """
    import torch

    vocab = min(shape.vocab_size, HEAD_VOCAB)
    generator = torch.Generator().manual_seed(0)
    embed = torch.nn.Embedding(vocab, shape.hidden_size, device=device, dtype=dtype).requires_grad_(False)
    norm = torch.nn.RMSNorm(shape.hidden_size, device=device, dtype=dtype).requires_grad_(False)
    head = torch.nn.Linear(shape.hidden_size, vocab, bias=False, device=device, dtype=dtype).requires_grad_(
        False
    )
    size = (workload.micro_batch_size, workload.sequence_len)
    ids = torch.randint(vocab, size, generator=generator).to(device)

    def one_pass() -> tuple[float, float, float]:
        synchronize(device)
        start = time.perf_counter()
        embed(ids)
        synchronize(device)
        middle = time.perf_counter()
        x = hidden.detach().requires_grad_(True)
        logits = head(norm(x))
        loss = torch.nn.functional.cross_entropy(
            logits.float().view(-1, vocab), ids.view(-1), reduction="sum"
        )
        synchronize(device)
        forward_end = time.perf_counter()
        loss.backward()
        synchronize(device)
        return middle - start, forward_end - middle, time.perf_counter() - forward_end

    one_pass()  # warms up
    per_sample, samples = _sampling(sum(one_pass()), runs, throttled=throttled)
    embeds, forwards, backwards = [], [], []
    for _ in range(samples):
        parts = [one_pass() for _ in range(per_sample)]
        embeds.append(sum(part[0] for part in parts) / per_sample)
        forwards.append(sum(part[1] for part in parts) / per_sample)
        backwards.append(sum(part[2] for part in parts) / per_sample)
    scale = shape.vocab_size / vocab
    return (
        statistics.median(embeds),
        statistics.median(forwards) * scale,
        statistics.median(backwards) * scale,
    )


def _saved_bytes(forward: Any, *, frozen: set[int] | None = None) -> int:
    """Bytes of distinct storages autograd keeps for backward during ``forward()``, less the frozen
    base weights (``frozen``: their storages' addresses), which it saves as views (the transposed
    weight of an unquantized Linear is no Parameter)."""
    import torch

    storages: dict[tuple[str, int], int] = {}
    skip = frozen or set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.nn.Parameter) and not _is_quantized_weight(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in skip:
                storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = forward()
    del out
    return int(sum(storages.values()))


def _is_quantized_weight(tensor: Any) -> bool:
    return type(tensor).__name__ == "Params4bit"


def _reset_peak(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: str) -> int | None:
    import torch

    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(device))
    return None


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    import torch

    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------- cache


def _read_cache() -> dict[str, Any]:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(key: str, value: dict[str, Any]) -> None:
    """Add one profile to the cache: read, update and replace it under an exclusive lock.

    Profiles of several devices (or several members on one host) may finish at once; without the
    lock two writers would each read the old file and the second rename would drop the first's
    entry. The lock is ``flock`` on ``profiles.json.lock`` beside it (the file itself is replaced
    atomically, so it cannot carry the lock).
    """
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = _read_cache()
            data[key] = value
            atomic_write(path, json.dumps(data, indent=1, sort_keys=True).encode("utf-8"))
    except OSError:
        pass  # a cache that cannot be written only costs a re-measurement


# ---------------------------------------------------------------------------- shardpool devices


def show_devices(config_path: str | None, *, profile: bool = True, as_json: bool = False) -> list[dict]:
    """Print every local device with its memory and, given a config, its profiled layer time.

    Backs ``shardpool devices``; returns the rows it printed.
    """
    rows: list[dict] = []
    shape = workload = None
    if config_path and profile:
        config = load_config(config_path)
        shape = ModelShape.from_config_dir(config.base_model)
        workload = Workload.from_config(config)
    notes: list[str] = []
    for info in list_devices():
        nf4 = nf4_backend_for(info, workload or Workload())
        row: dict = {
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
    if as_json:
        print(json.dumps(rows, indent=2))
        return rows
    from rich.console import Console
    from rich.table import Table

    base = "NF4" if workload is None or workload.quantize else "unquantized"
    title = "local devices" + ("" if shape is None else f" (one {base} + LoRA layer of {shape.name})")
    lines = [] if shape is not None else ["pass a config to profile one layer of its model on each device"]
    caption = "\n".join(lines + [f"nf4: {note}" for note in notes]) or None
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
    Console().print(table)
    return rows
