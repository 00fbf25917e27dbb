"""The layer profiler: real NF4 + LoRA layers, timed, cached per device, shape and workload."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shardpool.model.shape import ModelShape
from shardpool.plan import profiler
from shardpool.plan.costmodel import Workload
from shardpool.plan.profiler import cache_path, profile_layer

ROOT = Path(__file__).resolve().parents[2]
TINY = ModelShape.from_config_dir(ROOT / "configs/models/tiny-llama.json")
WORKLOAD = Workload(micro_batch_size=1, sequence_len=64, lora_r=4)


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SHARDPOOL_CACHE", str(tmp_path))
    return tmp_path


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


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3"])
def test_other_architectures_profile(model_type: str) -> None:
    shape = replace(TINY, model_type=model_type, qkv_bias=model_type == "qwen2")
    profile = profile_layer(shape, WORKLOAD, use_cache=False, repeats=1)
    assert profile.seconds_per_layer > 0


def test_checkpointing_and_threads_are_part_of_the_key() -> None:
    plain = profile_layer(TINY, WORKLOAD, threads=1)
    checkpointed = profile_layer(TINY, replace(WORKLOAD, gradient_checkpointing=True), threads=1)
    assert plain.threads == 1 and checkpointed.threads == 1
    assert len(json.loads(cache_path().read_text())) == 2


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
