"""Measure one NF4 + LoRA decoder layer on a device: forward and backward time and activation bytes.

The layer (:func:`~shardpool.plan.sample_layer.build_layer`) is the one a training stage holds,
built from the model shape alone with random weights, on the NF4 backend a stage on that device
would use (``shardpool.nf4_backend``: bitsandbytes' kernels, or plain PyTorch where they do not
run; :func:`~shardpool.plan.precision.choose_nf4_backend`), or unquantized in the stage's dtype
(``adapter: lora``). After a warm-up, the median of a few
timed forward + backward passes at the configured micro-batch and sequence length is the
profile (its fastest and slowest run and the process's cgroup CPU quota are kept with it), with the
forward timed on its own too. The ends of the model are timed the same way:
the embedding lookup, and final norm + ``lm_head`` + the loss forward and backward on a slice
of at most :data:`HEAD_VOCAB` vocabulary rows, scaled to the full vocabulary (both are linear
in it); and one AdamW step with gradient clipping over the layer's LoRA parameters. Results are
cached per device, model shape and workload (:mod:`shardpool.plan.profile_cache`).
:class:`TorchProbe` hands these measurements to ``plan.local_fleet``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from typing import Any

from shardpool.errors import ShardpoolError
from shardpool.host.cpu_quota import cpu_quota
from shardpool.model.shape import ModelShape
from shardpool.plan.confidence import ci95_relative, measured_enough, passes_per_sample
from shardpool.plan.costmodel import Workload
from shardpool.plan.device_facts import DeviceInfo, LayerProfile, normalize_device
from shardpool.plan.devices import device_info, synchronize
from shardpool.plan.fleet import LinkSpec
from shardpool.plan.links import measure_loopback
from shardpool.plan.precision import NF4Choice, choose_nf4_backend, stage_dtype
from shardpool.plan.profile_cache import cached_profile, profile_key, store_profile
from shardpool.plan.sample_layer import layer_run

__all__ = [
    "HEAD_VOCAB",
    "THROTTLED_PART_SAMPLES",
    "TorchProbe",
    "layer_settings",
    "nf4_backend_for",
    "profile_layer",
]

#: Vocabulary rows of the ``lm_head`` slice the profiler times (then scales to the full vocabulary).
HEAD_VOCAB = 8192
#: Samples of the short parts of a step (optimizer, ends) under a CPU quota, each spanning
#: QUOTA_SAMPLE_S: three seconds per part and profile instead of a few milliseconds.
THROTTLED_PART_SAMPLES = 3


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
    dtype, backend = layer_settings(info, workload)
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
        cached = cached_profile(key)
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
        store_profile(key, asdict(profile))
    return profile


def layer_settings(info: DeviceInfo, workload: Workload) -> tuple[str, str | None]:
    """The compute dtype and NF4 backend (None: bitsandbytes or an unquantized base) of a stage on
    the local device ``info``, as its layer is profiled; ShardpoolError when no backend can run it."""
    dtype = stage_dtype(info.facts(), workload.precision, workload.compute_bytes)
    nf4 = nf4_backend_for(info, workload)
    if nf4 is not None and nf4.backend is None:
        raise ShardpoolError(nf4.reason)
    return dtype, nf4.backend if nf4 is not None else None


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

    def co_run_slowdown(self, copies: int, threads: int, *, shape: ModelShape, workload: Workload) -> float:
        """How much slower ``copies`` CPU stages compute a layer of ``shape`` side by side than alone
        (cached unless ``use_cache`` is False; see :mod:`shardpool.plan.co_run`)."""
        from shardpool.plan.co_run import CpuLayer, co_run_slowdown

        info = device_info("cpu")
        dtype, backend = layer_settings(info, workload)
        layer = CpuLayer(
            shape=shape, workload=workload, label=f"cpu {info.label}", dtype=dtype, nf4_backend=backend
        )
        return co_run_slowdown(copies, threads, layer, use_cache=self.use_cache)


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

    try:
        run = layer_run(shape, workload, device, dtype_name, nf4_backend)
        model, hidden, position_embeddings, dtype = run.model, run.hidden, run.position_embeddings, run.dtype
        step = run.step
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
