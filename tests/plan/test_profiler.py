"""The layer profiler: real NF4 + LoRA layers, timed, cached per device, shape and workload."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan import profile_cache, profiler, sample_layer
from shardpool.plan.costmodel import Workload
from shardpool.plan.device_facts import DeviceInfo, LayerProfile
from shardpool.plan.profile_cache import cache_path
from shardpool.plan.profiler import profile_layer

ROOT = Path(__file__).resolve().parents[2]
TINY = ModelShape.from_config_dir(ROOT / "configs/models/tiny-llama.json")
WORKLOAD = Workload(micro_batch_size=1, sequence_len=64, lora_r=4)


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SHARDPOOL_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.slow
def test_profile_is_measured_then_cached(private_cache: Path) -> None:
    start = time.perf_counter()
    first = profile_layer(TINY, WORKLOAD, device="cpu")
    measured_s = time.perf_counter() - start
    assert first.seconds_per_layer > 0 and first.activation_bytes > 0 and first.runs >= 1
    assert first.seconds_min is not None and first.seconds_max is not None
    assert first.seconds_min <= first.seconds_per_layer <= first.seconds_max, "the spread of the runs"
    # Forward on its own, the ends of the model and the optimizer are measured too.
    assert first.forward_seconds is not None and 0 < first.forward_seconds < first.seconds_per_layer
    assert first.embed_seconds is not None and first.embed_seconds > 0
    assert first.head_forward_seconds and first.head_backward_seconds and first.optimizer_seconds
    assert measured_s < 30
    stored = json.loads(cache_path().read_text())
    assert cache_path().parent == private_cache and len(stored) == 1
    assert not list(private_cache.glob(".profiles-*"))  # the atomic write left no temp file
    again = profile_layer(TINY, WORKLOAD, device="cpu")
    assert again == first
    longer = profile_layer(TINY, replace(WORKLOAD, sequence_len=128), device="cpu")
    assert len(json.loads(cache_path().read_text())) == 2
    assert longer.activation_bytes > 1.8 * first.activation_bytes


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3"])
def test_other_architectures_profile(model_type: str) -> None:
    shape = replace(TINY, model_type=model_type, qkv_bias=model_type == "qwen2")
    profile = profile_layer(shape, WORKLOAD, use_cache=False, repeats=1)
    assert profile.seconds_per_layer > 0


@pytest.mark.slow
def test_checkpointing_and_threads_are_part_of_the_key() -> None:
    plain = profile_layer(TINY, WORKLOAD, threads=1)
    checkpointed = profile_layer(TINY, replace(WORKLOAD, gradient_checkpointing=True), threads=1)
    assert plain.threads == 1 and checkpointed.threads == 1
    assert len(json.loads(cache_path().read_text())) == 2


@pytest.mark.slow
def test_the_cpu_quota_is_recorded_and_part_of_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiler, "cpu_quota", lambda: 0.5)
    throttled = profile_layer(TINY, WORKLOAD, threads=1, repeats=1)
    monkeypatch.setattr(profiler, "cpu_quota", lambda: None)
    free = profile_layer(TINY, WORKLOAD, threads=1, repeats=1)
    assert (throttled.cpu_quota, free.cpu_quota) == (0.5, None)
    assert len(json.loads(cache_path().read_text())) == 2, "a re-throttled host measures again"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_cuda_profile_reports_peak_memory() -> None:
    profile = profile_layer(TINY, WORKLOAD, device="cuda:0", use_cache=False)
    assert profile.peak_bytes and profile.peak_bytes > 0


@pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs an Apple MPS device")
def test_mps_profile() -> None:
    assert profile_layer(TINY, WORKLOAD, device="mps", use_cache=False).seconds_per_layer > 0


def test_under_a_quota_the_short_parts_are_timed_in_samples_spanning_the_quota_periods() -> None:
    from shardpool.plan.confidence import QUOTA_SAMPLE_S
    from shardpool.plan.profiler import THROTTLED_PART_SAMPLES, _sampling

    # a 2 ms optimizer step: alone it lands inside or across a 100 ms period by chance
    per_sample, samples = _sampling(0.002, runs=9, throttled=True)
    assert per_sample * 0.002 >= QUOTA_SAMPLE_S and samples == THROTTLED_PART_SAMPLES
    assert _sampling(0.002, runs=9, throttled=False) == (1, 9)
    assert _sampling(0.002, runs=2, throttled=True)[1] == 2  # never more samples than the layer had
    assert _sampling(2.0, runs=9, throttled=True) == (1, 9)  # a pass longer than the sample: as before


# ---------------------------------------------------------------- the dtype a layer is profiled in (issue 45)


class _Built(Exception):
    """Stops a profile once its layer is built: the dtype is decided by then."""


_BUILD_LAYER = sample_layer.build_layer


def _built_dtype(monkeypatch: pytest.MonkeyPatch, workload: Workload) -> torch.dtype:
    """The dtype of the real NF4 + LoRA layer a CPU profile of ``workload`` builds."""
    built: list[torch.dtype] = []

    def build(*args: object) -> tuple:
        layer = _BUILD_LAYER(*args)  # type: ignore[arg-type]
        built.append(layer[2])
        raise _Built

    monkeypatch.setattr(sample_layer, "build_layer", build)
    with pytest.raises(_Built):
        profile_layer(TINY, workload, device="cpu", use_cache=False)
    return built[0]


def test_an_fp16_config_is_profiled_in_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    two_bytes = replace(WORKLOAD, compute_bytes=2)
    assert _built_dtype(monkeypatch, replace(two_bytes, precision="fp16")) == torch.float16
    assert _built_dtype(monkeypatch, replace(two_bytes, precision="bf16")) == torch.bfloat16
    assert _built_dtype(monkeypatch, replace(WORKLOAD, compute_bytes=4, precision="fp32")) == torch.float32


def test_fp16_and_bf16_profiles_are_cached_apart() -> None:
    keys = {
        profile_cache.profile_key(
            TINY, replace(WORKLOAD, compute_bytes=2), label="cpu", threads=1, dtype=dtype
        )
        for dtype in ("float16", "bfloat16")
    }
    assert len(keys) == 2


V100 = DeviceInfo("cuda:0", "cuda", "Tesla V100", 16 << 30, 15 << 30, compute_capability="7.0", bf16=False)
OLD_MAC = DeviceInfo("mps", "mps", "Apple x86_64 GPU", 8 << 30, 8 << 30, bf16=False)
MI50 = DeviceInfo("cuda:0", "rocm", "AMD MI50", 32 << 30, 30 << 30, compute_capability="gfx906", bf16=True)
RTX3090 = DeviceInfo("cuda:0", "cuda", "RTX 3090", 24 << 30, 23 << 30, compute_capability="8.6", bf16=True)


@pytest.mark.parametrize(
    ("info", "precision", "dtype"),
    [
        (V100, "fp16", "float16"),  # a V100 planned in fp16 is profiled in fp16, not in emulated bf16
        (V100, "bf16", "float16"),  # under bf16: true it computes in fp16 too
        (OLD_MAC, "bf16", "float16"),  # a Mac without bf16: what choose_dtype picks, never bf16
        (OLD_MAC, "bf16-auto", "float32"),
        (MI50, "bf16", "float16"),  # torch says bf16 on gfx906; the architecture says fp16
        (RTX3090, "fp16", "float16"),
    ],
    ids=["v100-fp16", "v100-bf16", "mac-bf16", "mac-auto", "mi50-bf16", "3090-fp16"],
)
def test_the_profiled_device_decides_the_dtype(
    monkeypatch: pytest.MonkeyPatch, info: DeviceInfo, precision: str, dtype: str
) -> None:
    """The profile asks for the profiled device's stage dtype (not the current CUDA device's bf16)."""
    asked: list[str] = []

    def measure(shape: ModelShape, workload: Workload, **options: object) -> LayerProfile:
        asked.append(str(options.get("dtype_name")))
        return LayerProfile(0.01, 1, None, info.name, info.label, None, 1)

    monkeypatch.setattr(profiler, "device_info", lambda name: info)
    monkeypatch.setattr(profiler, "_measure", measure)
    profile_layer(TINY, replace(WORKLOAD, compute_bytes=2, precision=precision), device=info.name)
    assert asked == [dtype]


# ---------------------------------------------------------------- the NF4 backend a layer is profiled on (issue 41)

M40 = DeviceInfo("cuda:1", "cuda", "Tesla M40", 24 << 30, 23 << 30, compute_capability="5.2", bf16=False,
                 nf4_error="Error named symbol not found at line 90")  # fmt: skip


def test_a_card_bitsandbytes_cannot_run_is_profiled_on_the_pytorch_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[object] = []

    def measure(shape: ModelShape, workload: Workload, **options: object) -> LayerProfile:
        asked.append(options.get("nf4_backend"))
        return LayerProfile(0.01, 1, None, M40.name, M40.label, None, 1)

    monkeypatch.setattr(profiler, "device_info", lambda name: M40)
    monkeypatch.setattr(profiler, "_measure", measure)
    profile_layer(TINY, WORKLOAD, device=M40.name)
    profile_layer(TINY, replace(WORKLOAD, quantize=False), device=M40.name)
    assert asked == ["torch", None]
    keys = json.loads(cache_path().read_text())
    assert sum("|nf4=torch|" in key for key in keys) == 1 and sum("-fp|" in key for key in keys) == 1
    with pytest.raises(ShardpoolError, match="cannot run bitsandbytes 4-bit.*nf4_backend to auto or torch"):
        profile_layer(TINY, replace(WORKLOAD, nf4_backend="bitsandbytes"), device=M40.name)


def _built_linears(monkeypatch: pytest.MonkeyPatch, workload: Workload) -> set[str]:
    """The classes of the frozen Linear modules in the layer a CPU profile of ``workload`` builds."""
    found: list[set[str]] = []

    def build(*args: object) -> tuple:
        model = _BUILD_LAYER(*args)[0]  # type: ignore[arg-type]
        found.append(
            {type(module).__name__ for name, module in model.named_modules() if name.endswith("base_layer")}
        )
        raise _Built

    monkeypatch.setattr(sample_layer, "build_layer", build)
    with pytest.raises(_Built):
        profile_layer(TINY, workload, device="cpu", use_cache=False)
    return found[0]


def test_the_profiled_layer_is_the_one_the_stage_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _built_linears(monkeypatch, WORKLOAD) == {"Linear4bit"}
    assert _built_linears(monkeypatch, replace(WORKLOAD, nf4_backend="torch")) == {"TorchNF4Linear"}
    assert _built_linears(monkeypatch, replace(WORKLOAD, quantize=False)) == {"Linear"}


@pytest.mark.slow
def test_an_unquantized_layer_profiles_without_counting_its_weights_as_activations() -> None:
    nf4 = profile_layer(TINY, WORKLOAD, use_cache=False, repeats=1)
    dense = profile_layer(TINY, replace(WORKLOAD, quantize=False), use_cache=False, repeats=1)
    assert dense.seconds_per_layer > 0 and dense.activation_bytes == nf4.activation_bytes
