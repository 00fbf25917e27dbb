"""Local device discovery and the `shardpool devices` command."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shardpool.agent.profiling import MAX_NF4_ERROR_CHARS
from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.builds import (
    bnb_arch_error,
    bnb_library_cuda_version,
    build_errors,
    runs_on,
    torch_arch_error,
)
from shardpool.plan.costmodel import Workload
from shardpool.plan.device_facts import (
    DeviceInfo,
    LayerProfile,
    format_compute_capability,
    layer_devices,
    nf4_probe_refusal,
    normalize_device,
    rocm_architecture,
)
from shardpool.plan.devices import device_info, list_devices, probe_nf4
from shardpool.plan.fleet import LinkSpec
from shardpool.plan.local_fleet import local_fleet
from shardpool.plan.planner import plan_pipeline

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_is_listed_last_with_its_ram() -> None:
    devices = list_devices()
    cpu = devices[-1]
    assert cpu.name == "cpu" and cpu.kind == "cpu"
    assert 0 < cpu.free_bytes <= cpu.total_bytes and cpu.threads >= 1


def test_normalize_and_unknown() -> None:
    assert normalize_device("cuda") == "cuda:0"
    assert normalize_device("CPU") == "cpu"
    with pytest.raises(ShardpoolError, match="unknown"):
        device_info("tpu:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message when CUDA is absent")
def test_missing_cuda_is_a_clear_error() -> None:
    with pytest.raises(ShardpoolError, match="not available"):
        device_info("cuda:0")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_cuda_device_memory() -> None:
    info = device_info("cuda:0")
    assert info.kind in ("cuda", "rocm") and 0 < info.free_bytes <= info.total_bytes


@pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs an Apple MPS device")
def test_mps_device_memory() -> None:
    info = device_info("mps")
    assert info.kind == "mps" and info.total_bytes > 0


@pytest.mark.slow
def test_devices_command_json(tmp_path: Path) -> None:
    env = {"SHARDPOOL_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    import os

    env = {**os.environ, **env}
    result = subprocess.run(
        [sys.executable, "-m", "shardpool", "devices", "configs/quickstart.yaml", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert rows[-1]["device"] == "cpu" and rows[-1]["ms_per_layer"] > 0
    assert (tmp_path / "profiles.json").is_file()


def test_the_cpu_computes_in_bf16_has_no_compute_capability_and_runs_nf4() -> None:
    cpu = device_info("cpu")
    assert (cpu.compute_capability, cpu.bf16, cpu.nf4_error) == (None, True, None)
    assert probe_nf4("cpu") is None  # a real bitsandbytes Linear4bit forward on the CPU


def test_a_device_without_4bit_kernels_gives_the_reason() -> None:
    reason = probe_nf4("meta")  # tensors without data: bitsandbytes cannot quantize there
    assert reason is not None and "\n" not in reason


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device; not run here")
def test_cuda_device_capability_and_bf16() -> None:
    info = device_info("cuda:0")
    if info.kind == "cuda":
        major, minor = torch.cuda.get_device_capability(0)
        assert info.compute_capability == f"{major}.{minor}"
        assert info.bf16 == (major >= 8)
    else:
        assert info.compute_capability is not None and info.compute_capability.startswith("gfx")


def test_compute_capability_and_rocm_names() -> None:
    assert format_compute_capability(8, 6) == "8.6"
    assert format_compute_capability(5, 2) == "5.2"
    assert rocm_architecture("gfx90a:sramecc+:xnack-") == "gfx90a"
    assert rocm_architecture("gfx1100") == "gfx1100"


M40 = DeviceInfo("cuda:1", "cuda", "Tesla M40", 24 << 30, 23 << 30, compute_capability="5.2", bf16=False,
                 nf4_error="Error named symbol not found at line 90")  # fmt: skip
RTX_3090 = DeviceInfo(
    "cuda:0", "cuda", "NVIDIA GeForce RTX 3090", 24 << 30, 23 << 30, compute_capability="8.6", bf16=True
)


def test_a_device_that_cannot_run_nf4_gets_no_layers_and_one_line() -> None:
    kept, refused = layer_devices([RTX_3090, M40], needs_nf4=True)
    assert kept == [RTX_3090]
    assert refused == [
        "cuda:1 (Tesla M40, 5.2) cannot run bitsandbytes 4-bit: Error named symbol not found at line 90; "
        "it gets no layers"
    ]
    assert layer_devices([RTX_3090, M40], needs_nf4=False) == ([RTX_3090, M40], [])
    assert nf4_probe_refusal(
        "mps", "Apple arm64 GPU", None, "NotImplementedError: no 4-bit\nmore"
    ).startswith("mps (Apple arm64 GPU) cannot run bitsandbytes 4-bit: NotImplementedError: no 4-bit; ")


def test_a_refused_device_named_in_the_config_is_refused_in_one_line() -> None:
    class Probe:
        def device_info(self, name: str) -> DeviceInfo:
            return M40

    shape = ModelShape.from_config_json(
        {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}, name="tiny")  # fmt: skip
    bitsandbytes = Workload(sequence_len=16, nf4_backend="bitsandbytes")
    with pytest.raises(
        ShardpoolError,
        match=r"^cuda:1, Tesla M40 \(compute capability 5.2\) cannot run bitsandbytes 4-bit: Error named "
        r"symbol not found at line 90; set shardpool.nf4_backend to auto or torch .*remove it from shardpool.devices$",
    ):
        local_fleet(["cuda:1"], shape=shape, workload=bitsandbytes, probe=Probe())  # type: ignore[arg-type]


#: An M40 on a host whose torch has no sm_52 kernels: discovery gives both errors the same line.
NO_SM52 = "the installed torch has no kernels for sm_52"
M40_NO_TORCH = replace(M40, arch_error=NO_SM52, nf4_error=NO_SM52)


def _report_rows(
    monkeypatch: pytest.MonkeyPatch, devices: list[DeviceInfo], workload: Workload
) -> tuple[list[dict[str, object]], list[tuple[str, object]]]:
    """``plan.report``'s rows for ``devices`` with a stand-in profile, and the (device, NF4 setting)
    each profile was asked for."""
    from shardpool.plan import report

    monkeypatch.setattr(report, "list_devices", lambda: devices)
    asked: list[tuple[str, object]] = []

    def stand_in_profile(
        shape: object, workload: Workload, *, device: str, threads: int | None
    ) -> LayerProfile:
        asked.append((device, workload.nf4_backend))
        return LayerProfile(0.25, 4096, None, device, "stand-in", threads, 3)

    monkeypatch.setattr(report, "profile_layer", stand_in_profile)
    return report.device_rows(None, workload), asked  # type: ignore[arg-type]


def test_a_device_whose_4bit_probe_failed_is_profiled_in_pytorch_and_keeps_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu = device_info("cpu", nf4=False)
    rows, asked = _report_rows(monkeypatch, [M40, cpu], Workload(sequence_len=16))
    assert asked == [("cuda:1", "torch"), ("cpu", "auto")]
    m40 = rows[0]
    assert m40["nf4_error"] == "Error named symbol not found at line 90"
    assert (m40["seconds_per_layer"], m40["activation_bytes"]) == (0.25, 4096)


def test_a_card_whose_pytorch_path_fails_too_is_left_unprofiled_and_the_others_still_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from shardpool.plan import report

    cpu = device_info("cpu", nf4=False)
    monkeypatch.setattr(report, "list_devices", lambda: [M40, cpu])

    def profile(shape: object, workload: Workload, *, device: str, threads: int | None) -> LayerProfile:
        if device == "cuda:1":
            raise RuntimeError("CUDA out of memory.\nTried to allocate 2.00 GiB " + "x" * 400)
        return LayerProfile(0.25, 4096, None, device, "stand-in", threads, 3)

    monkeypatch.setattr(report, "profile_layer", profile)
    m40, cpu_row = report.device_rows(None, Workload(sequence_len=16))  # type: ignore[arg-type]
    assert "seconds_per_layer" not in m40 and cpu_row["seconds_per_layer"] == 0.25
    assert m40["nf4_error"].startswith(f"{M40.nf4_error}; in plain PyTorch: CUDA out of memory. Tried")
    assert "\n" not in m40["nf4_error"] and len(m40["nf4_error"]) <= MAX_NF4_ERROR_CHARS


def test_an_unquantized_base_profiles_a_device_whose_4bit_probe_failed_as_any_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows, asked = _report_rows(monkeypatch, [M40], Workload(sequence_len=16, quantize=False))
    assert asked == [("cuda:1", "auto")]
    assert rows[0]["seconds_per_layer"] == 0.25 and rows[0]["nf4_error"] == M40.nf4_error


@pytest.mark.parametrize("quantize", [True, False])
def test_a_device_the_installed_torch_cannot_run_is_reported_but_not_profiled(
    monkeypatch: pytest.MonkeyPatch, quantize: bool
) -> None:
    cpu = device_info("cpu", nf4=False)
    rows, asked = _report_rows(monkeypatch, [M40_NO_TORCH, cpu], Workload(sequence_len=16, quantize=quantize))
    assert [device for device, _ in asked] == ["cpu"]
    assert rows[0]["nf4_error"] == M40_NO_TORCH.nf4_error
    assert "seconds_per_layer" not in rows[0] and "activation_bytes" not in rows[0]


# ---------------------------------------------------------------- builds: torch's and bitsandbytes' architectures

#: torch.cuda.get_arch_list() of a CUDA 13.0 torch (PyTorch 2.11's cu130 wheels) and of a CUDA 12.6 one.
CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]
CU126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
TORCH_CU130 = "2.11.0+cu130"


def _one_line(message: str | None) -> str:
    assert message is not None and "\n" not in message
    assert len(message) <= MAX_NF4_ERROR_CHARS  # an agent's device row carries it as nf4_error
    return message


def test_a_v100_under_a_cuda13_torch_is_refused_naming_a_cuda12_build() -> None:
    message = _one_line(torch_arch_error((7, 0), torch_version=TORCH_CU130, arch_list=CU130))
    assert message == (
        "the installed torch 2.11.0+cu130 has no kernels for sm_70 (it carries sm_75 to sm_120 and "
        "compute_120 PTX); install a CUDA 12.6 build of torch: "
        "pip install torch --index-url https://download.pytorch.org/whl/cu126"
    )
    assert torch_arch_error((7, 0), torch_version="2.11.0+cu126", arch_list=CU126) is None


@pytest.mark.parametrize(
    "capability", [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0), (12, 1)]
)
def test_turing_to_blackwell_run_on_a_cuda13_torch(capability: tuple[int, int]) -> None:
    assert torch_arch_error(capability, torch_version=TORCH_CU130, arch_list=CU130) is None


def test_a_newer_card_runs_on_ptx_and_only_on_ptx() -> None:
    up_to_hopper = ["sm_80", "sm_86", "sm_90"]
    assert torch_arch_error((12, 0), torch_version="t", arch_list=[*up_to_hopper, "compute_90"]) is None
    refused = _one_line(torch_arch_error((12, 0), torch_version="t", arch_list=up_to_hopper))
    assert "no kernels for sm_120 (it carries sm_80 to sm_90)" in refused
    assert refused.endswith("install a CUDA 13.0 build of torch: pip install torch --index-url "
                            "https://download.pytorch.org/whl/cu130")  # fmt: skip
    # Machine code runs within its major only; arch-specific (a) code on its own capability only.
    assert not runs_on((12, 0), ["sm_100"]) and runs_on((10, 3), ["sm_100"])
    assert not runs_on((8, 0), ["sm_86"]) and runs_on((8, 9), ["sm_86"])
    assert runs_on((9, 0), ["sm_90a"]) and not runs_on((9, 1), ["sm_90a"])
    assert not runs_on((7, 0), ["compute_75"]) and runs_on((8, 0), ["compute_75"])


def test_an_m40_is_refused_by_a_cuda13_torch_and_has_no_4bit_kernels_anywhere() -> None:
    torch_says = _one_line(torch_arch_error((5, 2), torch_version=TORCH_CU130, arch_list=CU130))
    assert "no kernels for sm_52" in torch_says and torch_says.endswith("/whl/cu126")
    # A CUDA 12.6 torch runs it (its sm_50 code runs on 5.2); bitsandbytes' CUDA 12.6 library does not.
    assert torch_arch_error((5, 2), torch_version="2.11.0+cu126", arch_list=CU126) is None
    bnb_says = _one_line(bnb_arch_error((5, 2), library="libbitsandbytes_cuda126.so", machine="x86_64"))
    assert bnb_says == (
        "bitsandbytes' CUDA 12.6 library has no 4-bit kernels for sm_52 (it carries sm_60 to sm_90 and "
        "compute_90 PTX); no bitsandbytes PyPI wheel has 4-bit kernels for sm_52; use it with "
        "`adapter: lora`, or leave it out"
    )


def test_bitsandbytes_libraries_by_cuda_version() -> None:
    assert [bnb_library_cuda_version(name) for name in (
        "libbitsandbytes_cuda130.so", "libbitsandbytes_cuda118.so", "libbitsandbytes_cuda126.dll",
        "libbitsandbytes_rocm64.so", "libbitsandbytes_cpu.so",
    )] == [(13, 0), (11, 8), (12, 6), None, None]  # fmt: skip
    v100_cu13 = _one_line(bnb_arch_error((7, 0), library="libbitsandbytes_cuda130.so", machine="x86_64"))
    assert "CUDA 13.0 library has no 4-bit kernels for sm_70" in v100_cu13
    assert v100_cu13.endswith("/whl/cu126")
    for library in ("libbitsandbytes_cuda126.so", "libbitsandbytes_cuda128.so"):
        assert bnb_arch_error((7, 0), library=library, machine="x86_64") is None
    for library in ("libbitsandbytes_cuda118.so", "libbitsandbytes_cuda126.so", "libbitsandbytes_cuda130.so"):
        assert bnb_arch_error((8, 6), library=library, machine="x86_64") is None
    assert bnb_arch_error((12, 0), library="libbitsandbytes_cuda126.so", machine="x86_64") is None  # PTX
    # Libraries the table does not describe: no opinion (the probe's error stands).
    assert bnb_arch_error((5, 2), library="libbitsandbytes_cuda126.so", machine="aarch64") is None
    assert bnb_arch_error((5, 2), library="libbitsandbytes_cuda140.so", machine="x86_64") is None


TINY_SHAPE = ModelShape.from_config_json(
    {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}, name="tiny")  # fmt: skip


V100 = DeviceInfo(
    "cuda:1", "cuda", "Tesla V100-SXM2-16GB", 16 << 30, 15 << 30, compute_capability="7.0", bf16=False
)


def test_discovery_skips_the_probe_where_torch_has_no_kernels_and_explains_a_failed_one() -> None:
    probed: list[str] = []

    def probe(result: str | None) -> Callable[[str], str | None]:
        def run(name: str) -> str | None:
            probed.append(name)
            return result

        return run

    def errors(info: DeviceInfo, arch_list: list[str], library: str | None, result: str | None) -> tuple:
        return build_errors(info, torch_version=TORCH_CU130, arch_list=arch_list, bnb_library=library,
                            machine="x86_64", probe=probe(result))  # fmt: skip

    arch_error, nf4_error = errors(V100, CU130, "libbitsandbytes_cuda130.so", None)
    assert arch_error is not None and "no kernels for sm_70" in arch_error and nf4_error == arch_error
    assert probed == []
    m40 = replace(M40, nf4_error=None)
    assert errors(m40, CU126, "libbitsandbytes_cuda126.so", "Error named symbol not found") == (
        None, bnb_arch_error((5, 2), library="libbitsandbytes_cuda126.so", machine="x86_64"),
    )  # fmt: skip
    assert errors(m40, CU126, "libbitsandbytes_cuda126.so", None) == (None, None)  # a source build ran
    assert errors(RTX_3090, CU130, "libbitsandbytes_cuda130.so", "OOM") == (None, "OOM")
    rocm = DeviceInfo("cuda:0", "rocm", "AMD Instinct MI50", 32 << 30, 30 << 30, compute_capability="gfx906")
    assert errors(rocm, ["gfx906", "gfx90a"], None, None) == (None, None)
    assert probed == ["cuda:1", "cuda:1", "cuda:0", "cuda:0"]  # never the V100's
    assert build_errors(V100, torch_version=TORCH_CU130, arch_list=CU130, bnb_library=None, machine="x86_64",
                        probe=None)[1] is None  # fmt: skip


def test_a_device_torch_cannot_run_gets_no_layers_even_without_nf4() -> None:
    reason = torch_arch_error((7, 0), torch_version=TORCH_CU130, arch_list=CU130)
    v100 = replace(V100, arch_error=reason, nf4_error=reason)
    line = f"cuda:1 (Tesla V100-SXM2-16GB, 7.0): {reason}; it gets no layers"
    assert layer_devices([RTX_3090, v100], needs_nf4=False) == ([RTX_3090], [line])
    assert layer_devices([RTX_3090, v100], needs_nf4=True) == ([RTX_3090], [line])

    class Probe:
        def device_info(self, name: str) -> DeviceInfo:
            return v100

    with pytest.raises(ShardpoolError) as raised:
        local_fleet(["cuda:1"], shape=TINY_SHAPE, workload=Workload(sequence_len=16), probe=Probe())  # type: ignore[arg-type]
    assert str(raised.value) == f"{line}; remove it from shardpool.devices"


# ---------------------------------------------------------------- ROCm devices through local planning


class RocmProbe:
    """Two ROCm GPUs as discovery reports them (torch says bf16 on both) and a fixed layer profile;
    records the compute bytes each was profiled with."""

    INFOS = {
        "cuda:0": DeviceInfo("cuda:0", "rocm", "AMD Instinct MI250X", 64 << 30, 60 << 30,
                             compute_capability="gfx90a", bf16=True),
        "cuda:1": DeviceInfo("cuda:1", "rocm", "AMD Instinct MI50", 32 << 30, 30 << 30,
                             compute_capability="gfx906", bf16=True),
    }  # fmt: skip

    def __init__(self) -> None:
        self.profiled: dict[str, int] = {}

    def device_info(self, name: str) -> DeviceInfo:
        return self.INFOS[name]

    def profile_layer(
        self, shape: ModelShape, workload: Workload, *, device: str, threads: int | None
    ) -> LayerProfile:
        self.profiled[device] = workload.compute_bytes
        return LayerProfile(0.01, 1 << 20, None, device, device, None, 3)

    def loopback(self) -> LinkSpec:
        return LinkSpec(bandwidth=8e9, latency=50e-6)

    def co_run_slowdown(self, copies: int, threads: int, *, shape: ModelShape, workload: Workload) -> float:
        return 1.0


def test_rocm_gpus_plan_locally_with_the_dtype_of_their_architecture() -> None:
    probe = RocmProbe()
    workload = Workload(sequence_len=16, precision="bf16", compute_bytes=2, stages=2)
    fleet = local_fleet(["cuda:0", "cuda:1"], shape=TINY_SHAPE, workload=workload, probe=probe)
    assert [(d.kind, d.compute_capability, d.bf16) for d in fleet.devices] == [
        ("rocm", None, True),
        ("rocm", None, False),
    ]
    assert probe.profiled == {"cuda:0": 2, "cuda:1": 2}
    plan = plan_pipeline(TINY_SHAPE, workload, fleet)
    assert {stage.device: stage.dtype for stage in plan.stages} == {"cuda:0": "bfloat16", "cuda:1": "float16"}
    assert sum(stage.num_layers for stage in plan.stages) == TINY_SHAPE.num_layers
    auto = plan_pipeline(TINY_SHAPE, replace(workload, precision="bf16-auto"), fleet)
    assert {stage.device: stage.dtype for stage in auto.stages} == {"cuda:0": "bfloat16", "cuda:1": "float32"}


def test_the_devices_table_without_a_config_says_how_each_device_computes_nf4(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``shardpool devices`` (no config): a row per device, the M40 on the PyTorch NF4 path with the
    reason as a note, and the caption asking for a config to profile."""
    from rich.console import Console

    from shardpool.plan import report

    monkeypatch.setattr(report, "list_devices", lambda: [M40, device_info("cpu", nf4=False)])
    listing = report.local_devices(None)
    assert [(row["device"], row["nf4"]) for row in listing.rows] == [
        ("cuda:1", "torch"),
        ("cpu", "bitsandbytes"),
    ]
    assert listing.rows[0]["total_gib"] == 24.0 and "ms_per_layer" not in listing.rows[0]
    assert listing.profiled is None and listing.notes == [listing.rows[0]["nf4_reason"]]
    console = Console(record=True, width=300)
    console.print(report.devices_table(listing))
    text = " ".join(console.export_text().split())  # the caption wraps at the table's width
    assert "pass a config to profile one layer of its model on each device" in text
    assert f"nf4: {listing.notes[0]}" in text and "Tesla M40" in text
