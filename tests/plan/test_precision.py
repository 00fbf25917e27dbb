"""The per-stage dtype chooser, the NF4 refusal, and how plans carry both (issue 11)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.device_facts import DeviceInfo, rocm_architecture
from shardpool.plan.fleet import fleet_from_dict, load_fleet
from shardpool.plan.planner import evaluate_split, plan_pipeline
from shardpool.plan.precision import (
    DeviceFacts,
    choose_dtype,
    config_cap,
    nf4_refusal,
    parse_capability,
    rocm_has_bf16,
    stage_dtype,
)
from shardpool.plan.result import Plan
from tests.helpers.training import run_cli

ROOT = Path(__file__).resolve().parents[2]

V100 = DeviceFacts("cuda", "v100", (7, 0), False)
T4 = DeviceFacts("cuda", "t4", (7, 5), False)
RTX3090 = DeviceFacts("cuda", "rtx3090", (8, 6), True)
RTX4090 = DeviceFacts("cuda", "rtx4090", (8, 9), True)
M40 = DeviceFacts("cuda", "m40", (5, 2), False)
MPS = DeviceFacts("mps", "mps", None, True)
OLD_MPS = DeviceFacts("mps", "mps", None, False)
CPU = DeviceFacts("cpu", "cpu")
MI250 = DeviceFacts("rocm", "mi250", (9, 0), True)
UNKNOWN = DeviceFacts("cuda", "gpu")

# device, then the dtype under: fp32 config, bf16: true, bf16: auto, fp16: true
TABLE = [
    (V100, "float32", "float16", "float32", "float16"),
    (T4, "float32", "float16", "float32", "float16"),
    (RTX3090, "float32", "bfloat16", "bfloat16", "float16"),
    (RTX4090, "float32", "bfloat16", "bfloat16", "float16"),
    (M40, "float32", "float32", "float32", "float32"),
    (MPS, "float32", "bfloat16", "bfloat16", "float16"),
    (OLD_MPS, "float32", "float16", "float32", "float16"),
    (CPU, "float32", "bfloat16", "bfloat16", "float16"),
    (MI250, "float32", "bfloat16", "bfloat16", "float16"),
    (UNKNOWN, "float32", "bfloat16", "bfloat16", "float16"),
]


@pytest.mark.parametrize(("facts", "fp32", "bf16", "auto", "fp16"), TABLE, ids=[row[0].name for row in TABLE])
def test_dtype_chooser_table(facts: DeviceFacts, fp32: str, bf16: str, auto: str, fp16: str) -> None:
    got = [choose_dtype(facts, cap).dtype for cap in ("fp32", "bf16", "bf16-auto", "fp16")]
    assert got == [fp32, bf16, auto, fp16]
    for cap in ("fp32", "bf16", "bf16-auto", "fp16"):
        reason = choose_dtype(facts, cap).reason
        assert reason and "\n" not in reason


def test_config_cap_and_capability_parsing() -> None:
    assert [
        config_cap(False, False),
        config_cap(True, False),
        config_cap("auto", False),
        config_cap(False, True),
    ] == [
        "fp32",
        "bf16",
        "bf16-auto",
        "fp16",
    ]
    assert parse_capability("8.6") == (8, 6)
    assert parse_capability(7.0) == (7, 0)
    assert parse_capability(None) is None
    with pytest.raises(ShardpoolError, match="MAJOR.MINOR"):
        parse_capability("ampere")


def test_nf4_refused_below_pascal_only() -> None:
    assert nf4_refusal(M40) is not None and "6.0" in nf4_refusal(M40)
    for facts in (V100, RTX3090, MPS, CPU, MI250, UNKNOWN, DeviceFacts("cuda", "p100", (6, 0), False)):
        assert nf4_refusal(facts) is None


# gfx architecture -> native bf16 (issue 45): CDNA with bf16 matrix cores and RDNA3+ yes; Vega and RDNA1/2 no.
ROCM_BF16 = [
    ("gfx90a", True),  # MI210/MI250 (CDNA2)
    ("gfx942", True),  # MI300 (CDNA3)
    ("gfx950", True),  # MI350 (CDNA4)
    ("gfx908", True),  # MI100 (CDNA1, bf16 matrix cores)
    ("gfx1100", True),  # RX 7900 (RDNA3)
    ("gfx1201", True),  # RX 9070 (RDNA4)
    ("gfx906", False),  # MI50/MI60, Radeon VII (Vega20)
    ("gfx900", False),  # Vega10
    ("gfx1010", False),  # RX 5700 (RDNA1)
    ("gfx1030", False),  # RX 6800/6900 (RDNA2)
    ("gfx1031", False),  # RX 6700 (RDNA2)
]


@pytest.mark.parametrize(("arch", "bf16"), ROCM_BF16, ids=[arch for arch, _ in ROCM_BF16])
def test_rocm_bf16_follows_the_gfx_architecture(arch: str, bf16: bool) -> None:
    assert rocm_has_bf16(arch) is bf16
    assert rocm_has_bf16(rocm_architecture(f"{arch}:sramecc+:xnack-")) is bf16  # torch's gcnArchName


def test_rocm_bf16_is_unknown_without_a_gfx_name() -> None:
    assert [rocm_has_bf16(text) for text in (None, "", "8.6", "navi21")] == [None, None, None, None]


def _rocm(arch: str, *, torch_says_bf16: bool = True) -> DeviceInfo:
    """A ROCm device as discovery reports it (torch answers bf16 on every ROCm card)."""
    return DeviceInfo("cuda:0", "rocm", f"AMD {arch}", 32 << 30, 30 << 30, compute_capability=arch,
                      bf16=torch_says_bf16)  # fmt: skip


def test_a_rocm_card_without_bf16_computes_in_fp16_or_fp32_whatever_torch_says() -> None:
    mi50, mi250 = _rocm("gfx906").facts(), _rocm("gfx90a").facts()
    assert [choose_dtype(mi50, cap).dtype for cap in ("fp32", "bf16", "bf16-auto", "fp16")] == [
        "float32", "float16", "float32", "float16"
    ]  # fmt: skip
    assert [choose_dtype(mi250, cap).dtype for cap in ("fp32", "bf16", "bf16-auto", "fp16")] == [
        "float32", "bfloat16", "bfloat16", "float16"
    ]  # fmt: skip
    # No CUDA compute capability on ROCm: the gfx name is not parsed as one.
    assert (mi50.capability, mi50.bf16, mi250.bf16) == (None, False, True)
    # Where the architecture is not known, the reported flag stands.
    assert DeviceInfo("cuda:0", "rocm", "AMD", 1, 1, bf16=False).facts().bf16 is False


V100_INFO = DeviceInfo("cuda:0", "cuda", "Tesla V100-SXM2-16GB", 16 << 30, 15 << 30, compute_capability="7.0",
                       bf16=False)  # fmt: skip
RTX3090_INFO = DeviceInfo("cuda:1", "cuda", "NVIDIA GeForce RTX 3090", 24 << 30, 23 << 30,
                          compute_capability="8.6", bf16=True)  # fmt: skip
M40_INFO = DeviceInfo("cuda:2", "cuda", "Tesla M40", 24 << 30, 23 << 30, compute_capability="5.2", bf16=False)
OLD_MPS_INFO = DeviceInfo("mps", "mps", "Apple x86_64 GPU", 8 << 30, 8 << 30, bf16=False)
CPU_INFO = DeviceInfo("cpu", "cpu", "cpu", 8 << 30, 8 << 30, threads=4, bf16=True)


def test_stage_dtype_is_what_the_device_computes_in_under_the_cap() -> None:
    """The dtype a device is profiled in (issue 45): an fp16 config is fp16 wherever fp16 is fast,
    a V100 under bf16 is fp16, a Mac without bf16 gets fp16 or fp32, never bf16."""
    cases = [
        (RTX3090_INFO, "fp16", 2, "float16"),
        (RTX3090_INFO, "bf16", 2, "bfloat16"),
        (V100_INFO, "fp16", 2, "float16"),
        (V100_INFO, "bf16", 2, "float16"),
        (V100_INFO, "bf16-auto", 2, "float32"),
        (OLD_MPS_INFO, "bf16", 2, "float16"),
        (OLD_MPS_INFO, "bf16-auto", 2, "float32"),
        (CPU_INFO, "fp16", 2, "float16"),
        (_rocm("gfx906"), "bf16", 2, "float16"),
        # No cap (a member's profile request gives only compute_bytes): 2 bytes is the bf16: true choice.
        (CPU_INFO, None, 2, "bfloat16"),
        (V100_INFO, None, 2, "float16"),
        (OLD_MPS_INFO, None, 2, "float16"),
        (M40_INFO, None, 2, "float32"),
        (RTX3090_INFO, None, 4, "float32"),
    ]
    got = [stage_dtype(info.facts(), cap, size) for info, cap, size, _ in cases]
    assert got == [want for *_, want in cases]


def _seed_plan(**workload: object) -> Plan:
    shape = ModelShape.from_config_dir(str(ROOT / "configs/models/llama-3-8b.json"))
    fleet = load_fleet(ROOT / "configs/fleet-seed.yaml")
    base = Workload(sequence_len=2048, micro_batch_size=1, gradient_accumulation_steps=16, compute_bytes=2)
    from dataclasses import replace

    return plan_pipeline(shape, replace(base, **workload), fleet)


def test_seed_fleet_plan_shows_each_stage_dtype_and_the_m40_computes_nf4_in_pytorch() -> None:
    plan = _seed_plan(precision="bf16")
    dtypes = {stage.slot: stage.dtype for stage in plan.stages}
    assert dtypes == {"rtx3090": "bfloat16", "rtx4090": "bfloat16", "v100": "float16", "m40": "float32"}
    assert not plan.refused
    data = json.loads(json.dumps(plan.to_json()))
    assert [stage["dtype"] for stage in data["stages"]] == [stage.dtype for stage in plan.stages]
    again = Plan.from_json(data)
    assert [s.dtype for s in again.stages] == [s.dtype for s in plan.stages] and again.refused == plan.refused


def test_seed_fleet_plan_refuses_the_m40_when_bitsandbytes_is_asked_for() -> None:
    plan = _seed_plan(precision="bf16", nf4_backend="bitsandbytes")
    assert {stage.slot for stage in plan.stages} == {"rtx3090", "rtx4090", "v100"}
    assert set(plan.refused) == {"m40"} and "shardpool.nf4_backend to auto or torch" in plan.refused["m40"]


def test_lora_run_may_use_the_m40_in_fp32() -> None:
    plan = _seed_plan(precision="bf16", quantize=False, stages=4)
    assert not plan.refused
    assert {stage.slot: stage.dtype for stage in plan.stages}["m40"] == "float32"


def test_fp32_config_keeps_every_stage_fp32() -> None:
    plan = _seed_plan(precision="fp32", compute_bytes=4)
    assert {stage.dtype for stage in plan.stages} == {"float32"}


def test_stage_dtype_sets_its_compute_bytes_in_the_cost_model() -> None:
    """A V100 stage in fp16 and a 3090 stage in bf16 price like 2-byte stages; the M40 in fp32 like 4."""
    shape = ModelShape.from_config_dir(str(ROOT / "configs/models/tiny-llama.json"))
    devices = [
        {"name": name, "memory_gib": 24, "tflops": 30, "compute_capability": cc}
        for name, cc in (("a", "8.6"), ("m", "5.2"))
    ]
    fleet = fleet_from_dict({"devices": devices})
    mixed = Workload(precision="bf16", quantize=False, compute_bytes=2)
    plan = evaluate_split(shape, mixed, fleet, devices=["a", "m"], layers=[1, shape.num_layers - 1])
    all2 = evaluate_split(
        shape,
        Workload(compute_bytes=2, quantize=False),
        fleet,
        devices=["a", "m"],
        layers=[1, shape.num_layers - 1],
    )
    all4 = evaluate_split(
        shape,
        Workload(compute_bytes=4, quantize=False),
        fleet,
        devices=["a", "m"],
        layers=[1, shape.num_layers - 1],
    )
    assert [s.dtype for s in plan.stages] == ["bfloat16", "float32"]
    assert plan.stages[0].memory_breakdown == all2.stages[0].memory_breakdown
    assert plan.stages[1].memory_breakdown == all4.stages[1].memory_breakdown


def test_a_manual_split_on_a_refused_device_is_refused_in_one_line() -> None:
    shape = ModelShape.from_config_dir(str(ROOT / "configs/models/tiny-llama.json"))
    fleet = load_fleet(ROOT / "configs/fleet-seed.yaml")
    bitsandbytes = Workload(precision="bf16", nf4_backend="bitsandbytes")
    with pytest.raises(ShardpoolError, match="m40 .*NF4"):
        evaluate_split(shape, bitsandbytes, fleet, devices=["m40"], layers=[shape.num_layers])
    # Under auto the M40 computes NF4 in plain PyTorch, and the split is predicted.
    plan = evaluate_split(
        shape, Workload(precision="bf16"), fleet, devices=["m40"], layers=[shape.num_layers]
    )
    assert plan.fits and plan.stages[0].nf4_backend == "torch"


def test_fleet_file_rejects_a_bad_capability() -> None:
    with pytest.raises(ShardpoolError, match="compute_capability"):
        fleet_from_dict(
            {"devices": [{"name": "g", "memory_gib": 8, "tflops": 10, "compute_capability": "x"}]}
        )


def test_cli_plan_of_the_seed_fleet_shows_dtypes_and_nf4_backends() -> None:
    result = run_cli(
        "plan",
        "configs/quickstart.yaml",
        "--fleet",
        "configs/fleet-seed.yaml",
        "--model",
        "configs/models/llama-3-8b.json",
        "--set",
        "bf16=true",
        "--set",
        "sequence_len=2048",
        "--set",
        "micro_batch_size=1",
        "--set",
        "gradient_accumulation_steps=16",
        "--json",
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert {stage["slot"]: stage["dtype"] for stage in plan["stages"]} == {
        "rtx3090": "bfloat16",
        "rtx4090": "bfloat16",
        "v100": "float16",
        "m40": "float32",
    }
    assert {stage["slot"]: stage["nf4_backend"] for stage in plan["stages"]} == {
        "rtx3090": "bitsandbytes",
        "rtx4090": "bitsandbytes",
        "v100": "bitsandbytes",
        "m40": "torch",
    }
    assert plan["refused"] == {}


def test_plan_of_the_seed_fleet_alone_plans_the_workload_its_file_names(tmp_path: Path) -> None:
    """`shardpool plan --fleet configs/fleet-seed.yaml`, from any directory (issue 11's Done-when)."""
    result = run_cli("plan", "--fleet", str(ROOT / "configs/fleet-seed.yaml"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = {
        line.split("│")[2].strip(): line.split("│")[4].strip()
        for line in result.stdout.splitlines()
        if line.count("│") >= 7
    }
    assert rows == {"rtx3090": "bf16", "rtx4090": "bf16", "v100": "fp16", "m40": "fp32"}
    nf4 = {line.split("│")[2].strip(): line.split("│")[5].strip() for line in result.stdout.splitlines()
           if line.count("│") >= 8}  # fmt: skip
    assert nf4 == {"rtx3090": "bnb", "rtx4090": "bnb", "v100": "bnb", "m40": "torch"}
    assert (
        "nf4: m40 (compute capability 5.2): bitsandbytes has no 4-bit kernels for it; NF4 in plain PyTorch"
        in " ".join(result.stdout.split())
    )


def test_plan_without_a_config_needs_a_fleet_file_that_names_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardpool.cli import main

    bare = tmp_path / "fleet.yaml"
    bare.write_text("devices: [{name: g, memory_gib: 8, tflops: 10}]\n")
    assert main(["plan", "--fleet", str(bare)]) != 0
    assert f"fleet file {bare} has no plan: section" in capsys.readouterr().err
    assert main(["plan"]) != 0
    assert "shardpool plan needs a config" in capsys.readouterr().err
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("devices: [{name: g, memory_gib: 8, tflops: 10}]\nplan: {model: m.json}\n")
    assert main(["plan", "--fleet", str(wrong)]) != 0
    assert "plan.config" in capsys.readouterr().err
