"""Placing inference: KV cache bytes, a generating stage's memory and per-token time, the split."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from shardpool.errors import ShardpoolError
from shardpool.generate import local_placements
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.fleet import Device
from shardpool.plan.inference import (
    InferenceDevice,
    InferenceLoad,
    decode_seconds,
    fitting_split,
    inference_split,
    inference_stage,
    kv_cache_bytes,
)
from shardpool.plan.time_model import layer_forward_flops

ROOT = Path(__file__).resolve().parents[2]
LLAMA3_8B = ModelShape.from_config_dir(ROOT / "configs/models/llama-3-8b.json")
GIB = 2**30


def _gpus(*free_gib: float, seconds: tuple[float, ...] | None = None) -> list[InferenceDevice]:
    return [
        InferenceDevice(
            name=f"cuda:{i}",
            free_bytes=free * GIB,
            kind="cuda",
            compute_bytes=2,
            token_seconds_per_layer=1.0 if seconds is None else seconds[i],
        )
        for i, free in enumerate(free_gib)
    ]


def test_kv_cache_of_llama3_8b_is_128_kib_per_token_in_bf16() -> None:
    # Published shape: 32 layers, 8 KV heads of 128: 32 * 8 * 128 * 2 (k and v) * 2 bytes = 128 KiB.
    assert kv_cache_bytes(LLAMA3_8B, layers=32, tokens=1, dtype_bytes=2) == 128 * 1024
    # 8 sequences of 4096 tokens on a quarter of the layers in fp32: 8 KiB a layer and token, 2 GiB.
    assert (
        kv_cache_bytes(LLAMA3_8B, layers=8, tokens=8 * 4096, dtype_bytes=4)
        == 8 * 4096 * 8 * 8 * 1024
        == 2 * GIB
    )


def test_stage_memory_counts_the_kv_cache_of_every_slot() -> None:
    device = _gpus(80)[0]
    one = inference_stage(
        LLAMA3_8B, InferenceLoad(max_context=4096, max_slots=1), device, index=1, num_stages=3
    )
    eight = inference_stage(
        LLAMA3_8B, InferenceLoad(max_context=4096, max_slots=8), device, index=1, num_stages=3
    )
    kv_per_layer = kv_cache_bytes(LLAMA3_8B, layers=1, tokens=4096, dtype_bytes=2)
    assert eight.per_layer_bytes - one.per_layer_bytes == pytest.approx(7 * kv_per_layer)
    assert eight.fixed_bytes == one.fixed_bytes
    # The cache alone at max_slots = 1 is part of the layer's bytes, beside its NF4 weights (~0.1 GiB).
    assert one.per_layer_bytes > kv_per_layer > 0


def test_ends_hold_embeddings_and_lm_head_and_no_training_state() -> None:
    load = InferenceLoad(max_context=2048)
    device = _gpus(80)[0]
    first, middle, last = (inference_stage(LLAMA3_8B, load, device, index=i, num_stages=3) for i in range(3))
    embeddings = LLAMA3_8B.embedding_params() * 2
    assert first.fixed_bytes - middle.fixed_bytes == pytest.approx(embeddings)
    assert last.fixed_bytes - middle.fixed_bytes > embeddings  # lm_head, final norm, one position's logits
    # No gradients or optimizer states: a layer is far below training's 16 bytes per LoRA parameter.
    assert middle.per_layer_bytes < 0.14 * GIB


def test_split_gives_a_small_device_fewer_layers_within_its_memory() -> None:
    devices = _gpus(4, 12)
    split = inference_split(LLAMA3_8B, InferenceLoad(max_context=4096, max_slots=8), devices)
    counts = [stop - start for start, stop in split.layers]
    assert sum(counts) == 32 and counts[0] < counts[1]
    assert all(used <= d.free_bytes for used, d in zip(split.memory_bytes, devices, strict=True))
    # With room on both, the same speeds split evenly.
    even = inference_split(LLAMA3_8B, InferenceLoad(max_context=4096, max_slots=8), _gpus(16, 16))
    assert even.layers == [(0, 16), (16, 32)]


def test_fastest_device_gets_more_layers() -> None:
    split = inference_split(LLAMA3_8B, InferenceLoad(max_context=1024), _gpus(40, 40, seconds=(1e-3, 3e-3)))
    assert split.layers == [(0, 24), (24, 32)]
    assert split.token_seconds[0] == pytest.approx(split.token_seconds[1], rel=0.01)


def test_nothing_fits_names_the_device_in_one_line() -> None:
    with pytest.raises(ShardpoolError) as error:
        inference_split(LLAMA3_8B, InferenceLoad(max_context=8192, max_slots=64), _gpus(16, 16))
    message = str(error.value)
    assert "\n" not in message
    assert "does not fit for inference" in message and "GiB more" in message
    assert "cuda:0" in message or "cuda:1" in message
    assert "--max-concurrent" in message and "--max-context" in message


def test_device_that_cannot_hold_one_layer_is_named() -> None:
    # 2 GiB cannot hold stage 0's 1 GiB of bf16 embeddings, one layer and the 0.75 GiB CUDA reserve
    # beside an 8192-token prefill.
    with pytest.raises(ShardpoolError, match=r"cuda:0 needs \d+\.\d\d GiB more to hold 1 of the 32 layers"):
        inference_split(LLAMA3_8B, InferenceLoad(max_context=8192), _gpus(2, 40))


def test_fitting_split_keeps_the_preferred_split_when_it_fits() -> None:
    load = InferenceLoad(max_context=4096, max_slots=8)
    assert fitting_split(LLAMA3_8B, load, _gpus(16, 16), [(0, 16), (16, 32)]) == [(0, 16), (16, 32)]
    assert fitting_split(LLAMA3_8B, load, _gpus(4, 12), [(0, 16), (16, 32)])[0][1] < 16


def test_decode_time_is_the_profiled_forward_scaled_to_one_token() -> None:
    workload = Workload(micro_batch_size=1, sequence_len=512, compute_bytes=2)
    device = Device(
        name="gpu", memory_bytes=24 * GIB, seconds_per_layer=0.3, forward_seconds_per_layer=0.1,
        head_forward_seconds=0.05,
    )  # fmt: skip
    load = InferenceLoad(max_context=1024, lora_r=workload.lora_r)
    per_layer, head = decode_seconds(device, LLAMA3_8B, workload, load)
    one_token = replace(workload, sequence_len=1)
    token_flops = layer_forward_flops(LLAMA3_8B, one_token) + 4 * 1024 * LLAMA3_8B.q_dim - 2 * LLAMA3_8B.q_dim
    assert per_layer == pytest.approx(0.1 * token_flops / layer_forward_flops(LLAMA3_8B, workload))
    assert head == pytest.approx(0.05 / 512)


# ---------------------------------------------------------------------------- shardpool generate / serve


@pytest.fixture
def llama3_dir(tmp_path: Path) -> Path:
    """A model directory with Llama-3-8B's config.json (no weights are read to place it)."""
    shutil.copy(ROOT / "configs/models/llama-3-8b.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(b"")
    return tmp_path


def _layers(placements: list) -> list[tuple[int, int]]:
    return [(p.start, p.stop) for p in placements]


def test_local_placements_stay_even_without_a_context(llama3_dir: Path) -> None:
    placements = local_placements(llama3_dir, 2, ["cuda:0", "cuda:1"], free_bytes={"cuda:0": 1.0})
    assert _layers(placements) == [(0, 16), (16, 32)]


def test_local_placements_move_layers_off_a_tight_device(llama3_dir: Path) -> None:
    devices = ["cuda:0", "cuda:1"]
    roomy = {"cuda:0": 16 * GIB, "cuda:1": 16 * GIB}
    tight = {"cuda:0": 4 * GIB, "cuda:1": 12 * GIB}
    assert _layers(
        local_placements(llama3_dir, 2, devices, max_context=4096, max_slots=8, free_bytes=roomy)
    ) == [
        (0, 16),
        (16, 32),
    ]
    moved = local_placements(llama3_dir, 2, devices, max_context=4096, max_slots=8, free_bytes=tight)
    assert moved[0].stop < 16 and moved[-1].stop == 32
    assert [p.dtype for p in moved] == ["bfloat16", "bfloat16"]


def test_local_placements_refuse_what_the_cpu_cannot_hold(
    llama3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("shardpool.generate.cpu_memory", lambda: (8 * GIB, 3 * GIB))
    with pytest.raises(ShardpoolError, match="does not fit for inference: cpu"):
        local_placements(llama3_dir, 2, ["cpu"], max_context=4096)


def test_planner_page_shows_the_error_as_it_is_printed() -> None:
    with pytest.raises(ShardpoolError) as error:
        inference_split(LLAMA3_8B, InferenceLoad(max_context=8192, max_slots=16), _gpus(8, 8))
    assert f"\n{error.value}\n" in (ROOT / "docs/planner.md").read_text()


def _member_gpu(host: str, gib: float, capability: tuple[int, int], tflops: float, **extra: object) -> Device:
    return Device(
        name=f"{host}:cuda:0", memory_bytes=int(gib * GIB), host=host, tflops=tflops, kind="cuda",
        torch_device="cuda:0", compute_capability=capability, **extra,  # type: ignore[arg-type]
    )  # fmt: skip


MESH = [
    _member_gpu("home", 22, (8, 6), 35.0),  # an RTX 3090
    _member_gpu("lab", 15, (7, 0), 15.0),  # a V100
    _member_gpu("old", 11, (5, 2), 6.0, nf4_backend="torch"),  # an M40, NF4 in plain PyTorch
]


def test_mesh_placements_give_each_member_its_device_dtype_backend_and_a_fitting_share(
    llama3_dir: Path,
) -> None:
    from shardpool.generate import fleet_placements

    placements = fleet_placements(MESH, llama3_dir, None, max_context=4096, max_slots=8, lora_r=16, say=print)
    assert [(p.host, p.device, p.dtype, p.nf4_backend) for p in placements] == [
        ("home", "cuda:0", "bfloat16", None),
        ("lab", "cuda:0", "float32", None),  # no bf16 on a V100: fp32, as `bf16: auto` chooses
        ("old", "cuda:0", "float32", "torch"),
    ]
    assert placements[0].start == 0 and placements[-1].stop == LLAMA3_8B.num_layers
    assert all(a.stop == b.start for a, b in zip(placements, placements[1:], strict=False))
    layers = [p.stop - p.start for p in placements]
    assert layers[0] > layers[1] > layers[2], layers  # the faster device takes more


def test_mesh_placements_take_the_first_devices_and_say_when_fewer_are_online(llama3_dir: Path) -> None:
    from shardpool.generate import fleet_placements

    said: list[str] = []
    two = fleet_placements(MESH, llama3_dir, 2, max_context=1024, max_slots=1, lora_r=16, say=said.append)
    assert [p.host for p in two] == ["home", "lab"] and not said
    three = fleet_placements(MESH, llama3_dir, 5, max_context=1024, max_slots=1, lora_r=16, say=said.append)
    assert [p.host for p in three] == ["home", "lab", "old"]
    assert said == ["only 3 devices online: placing 3 stages"]
    with pytest.raises(ShardpoolError, match="no mesh member offers a device"):
        fleet_placements([], llama3_dir, None, max_context=1024, max_slots=1, lora_r=16, say=said.append)
