"""Planning NF4 on cards bitsandbytes has no kernels for (issue 41): each device's NF4 backend, its
costs on the PyTorch path, and unquantized bases sized in their dtype."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.device_facts import DeviceInfo, LayerProfile
from shardpool.plan.fleet import Fleet, LinkSpec, load_fleet
from shardpool.plan.local_fleet import local_fleet
from shardpool.plan.memory_model import nf4_bytes
from shardpool.plan.planner import STEP_TIE_S, plan_pipeline, resplit_plan
from shardpool.plan.precision import DeviceFacts, choose_nf4_backend
from shardpool.plan.result import Plan
from shardpool.plan.stage_costs import stage_costs
from shardpool.plan.time_model import modeled_times, torch_dequant_seconds
from tests.helpers.training import run_cli
from tests.plan.test_planner import BIG_WORKLOAD, EIGHT_B, GIB, ROOT, SEVENTY_B

#: Llama-2-70B QLoRA as the seed fleet was written down for: test_planner's 2,048 tokens, 16
#: micro-batches of 1 with gradient checkpointing, at bf16 at most.
SEVENTY_B_QLORA = replace(BIG_WORKLOAD, precision="bf16")

# ------------------------------------------------------------------------------- the choice

RTX3090 = DeviceFacts("cuda", "rtx3090", (8, 6), True)
M40 = DeviceFacts("cuda", "m40", (5, 2), False)
UNKNOWN = DeviceFacts("cuda", "gpu")
CPU = DeviceFacts("cpu", "cpu")
PROBE_FAILED = "RuntimeError: Error named symbol not found at line 90\nmore"
NO_ARCH = "the installed torch 2.11.0+cu130 has no kernels for sm_52 (it carries sm_75 to sm_120)"

# facts, probe error, arch error; then the backend (None: refused) under auto, bitsandbytes, torch
CHOICES = [
    ("capable card", RTX3090, None, None, "bitsandbytes", "bitsandbytes", "torch"),
    ("maxwell card", M40, None, None, "torch", None, "torch"),
    ("capability unknown", UNKNOWN, None, None, "bitsandbytes", "bitsandbytes", "torch"),
    ("probe passed", CPU, None, None, "bitsandbytes", "bitsandbytes", "torch"),
    ("probe failed", CPU, PROBE_FAILED, None, "torch", None, "torch"),
    ("no torch kernels", M40, None, NO_ARCH, None, None, None),
]


@pytest.mark.parametrize(
    ("facts", "nf4_error", "arch_error", "auto", "bitsandbytes", "torch"),
    [row[1:] for row in CHOICES],
    ids=[row[0] for row in CHOICES],
)
def test_the_nf4_backend_of_every_setting_on_every_kind_of_device(
    facts: DeviceFacts,
    nf4_error: str | None,
    arch_error: str | None,
    auto: str | None,
    bitsandbytes: str | None,
    torch: str | None,
) -> None:
    for setting, want in (("auto", auto), ("bitsandbytes", bitsandbytes), ("torch", torch)):
        choice = choose_nf4_backend(setting, facts, nf4_error=nf4_error, arch_error=arch_error)  # type: ignore[arg-type]
        assert choice.backend == want, setting
        assert choice.reason.startswith(facts.name) and "\n" not in choice.reason
        if want is None:  # a refusal says what to do
            assert (
                "gets no layers" in choice.reason or "shardpool.nf4_backend to auto or torch" in choice.reason
            )


def test_the_reasons_say_why_in_one_line() -> None:
    assert choose_nf4_backend("auto", M40).reason == (
        "m40 (compute capability 5.2): bitsandbytes has no 4-bit kernels for it; NF4 in plain PyTorch"
    )
    assert choose_nf4_backend("auto", CPU, nf4_error=PROBE_FAILED).reason == (
        "cpu: bitsandbytes' 4-bit probe failed (RuntimeError: Error named symbol not found at line 90); "
        "NF4 in plain PyTorch"
    )
    assert choose_nf4_backend("bitsandbytes", M40).reason.startswith(
        "m40 (compute capability 5.2) cannot run bitsandbytes NF4, which needs 6.0+"
    )
    assert choose_nf4_backend("torch", M40, arch_error=NO_ARCH).reason == (
        f"m40 (compute capability 5.2): {NO_ARCH}; it gets no layers"
    )
    with pytest.raises(ShardpoolError, match="shardpool.nf4_backend 'cuda' is unknown"):
        choose_nf4_backend("cuda", M40)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- the seed fleet


def _seed(*leave_out: str) -> Fleet:
    fleet = load_fleet(ROOT / "configs/fleet-seed.yaml")
    return replace(fleet, devices=tuple(d for d in fleet.devices if d.name not in leave_out))


def test_seventy_b_qlora_fits_the_seed_fleet_without_its_4090_with_m40_layers_in_pytorch() -> None:
    """Without the M40's layers, the 3090 and V100 lack about 10 GiB; the M40 on the PyTorch path fits it."""
    with pytest.raises(
        ShardpoolError, match=r"does not fit: about 10\.\d\d GiB are missing across 2 devices"
    ):
        plan_pipeline(SEVENTY_B, SEVENTY_B_QLORA, _seed("rtx4090", "m40"))
    with pytest.raises(ShardpoolError, match="does not fit"):  # bitsandbytes asked for: the M40 is refused
        plan_pipeline(SEVENTY_B, replace(SEVENTY_B_QLORA, nf4_backend="bitsandbytes"), _seed("rtx4090"))
    plan = plan_pipeline(SEVENTY_B, SEVENTY_B_QLORA, _seed("rtx4090"))
    assert plan.fits and not plan.refused and plan.stages[-1].stop == 80
    m40 = next(stage for stage in plan.stages if stage.slot == "m40")
    assert (m40.nf4_backend, m40.dtype) == ("torch", "float32")
    assert (
        m40.nf4_reason
        == "m40 (compute capability 5.2): bitsandbytes has no 4-bit kernels for it; NF4 in plain PyTorch"
    )
    assert m40.num_layers >= 10 and m40.memory_bytes <= 24 * GIB
    assert {stage.nf4_backend for stage in plan.stages if stage.slot != "m40"} == {"bitsandbytes"}


#: model, micro-batch size, seed-fleet devices left out (the 70B without the 4090 needs the M40: above)
STEP_CASES = [(SEVENTY_B, 1, ()), (EIGHT_B, 1, ()), (EIGHT_B, 2, ()), (EIGHT_B, 1, ("rtx4090",)),
              (EIGHT_B, 2, ("rtx4090",))]  # fmt: skip


@pytest.mark.parametrize(
    ("shape", "micro_batch_size", "without"),
    STEP_CASES,
    ids=["70b", "8b", "8b-mb2", "8b-no-4090", "8b-mb2-no-4090"],
)
def test_the_m40_takes_layers_only_where_the_predicted_step_is_shorter(
    shape: ModelShape, micro_batch_size: int, without: tuple[str, ...]
) -> None:
    workload = replace(SEVENTY_B_QLORA, micro_batch_size=micro_batch_size, warmup_lead=None)
    with_m40 = plan_pipeline(shape, workload, _seed(*without))
    without_m40 = plan_pipeline(shape, workload, _seed(*without, "m40"))
    assert with_m40.predicted_step_s <= without_m40.predicted_step_s + STEP_TIE_S
    uses_m40 = "m40" in {stage.slot for stage in with_m40.stages}
    assert uses_m40 == (with_m40.predicted_step_s < without_m40.predicted_step_s - STEP_TIE_S)


def test_the_seed_fleets_70b_plan_puts_a_layer_on_the_m40() -> None:
    """The full seed fleet: one layer on the M40 unloads the 3090, the bottleneck (224.9 s against 226.1 s)."""
    plan = plan_pipeline(SEVENTY_B, SEVENTY_B_QLORA, _seed())
    assert [(stage.slot, stage.num_layers) for stage in plan.stages if stage.slot == "m40"] == [("m40", 1)]
    assert plan.predicted_step_s == pytest.approx(224.92, abs=0.01)
    assert plan_pipeline(SEVENTY_B, SEVENTY_B_QLORA, _seed("m40")).predicted_step_s == pytest.approx(
        226.07, abs=0.01
    )


# ------------------------------------------------------------------------------- costs of the PyTorch path


def _m40_costs(backend: str, workload: Workload = SEVENTY_B_QLORA) -> tuple[object, object]:
    fp32 = replace(workload, compute_bytes=4)
    device = _seed().device("m40")
    times = device.times(SEVENTY_B, fp32, nf4_backend=backend)
    costs = stage_costs(
        SEVENTY_B, fp32, times=times, capacity_bytes=device.memory_bytes, kind="cuda", index=1, num_stages=3,
        nf4_backend=backend,
    )  # fmt: skip
    return times, costs


def test_a_pytorch_path_stage_holds_its_dequantization_and_takes_longer() -> None:
    """On the M40 (fp32), the PyTorch dequantization of Llama-2-70B's largest Linear (the MLP's
    28,672 x 8,192) holds, beyond the dequantized weight bitsandbytes holds too, the blocks' absmax and
    one chunk of temporaries; and each pass moves 12 more bytes a weight, at 0.04 bytes per datasheet FLOP."""
    bnb_times, bnb = _m40_costs("bitsandbytes")
    torch_times, torch = _m40_costs("torch")
    largest = 28672 * 8192
    extra = int(largest * 4 / 64 + 6 * 2**20)  # 0.11 GiB
    assert torch.fixed_breakdown["torch_dequantize"] == extra
    assert "torch_dequantize" not in bnb.fixed_breakdown
    assert torch.fixed_bytes - bnb.fixed_bytes == extra
    assert torch.per_layer_bytes == bnb.per_layer_bytes
    assert torch.breakdown(4)["torch_dequantize"] == extra
    once = SEVENTY_B.layer_linear_params() * 12 / (0.04 * 6.8e12)
    assert torch_dequant_seconds(SEVENTY_B, replace(SEVENTY_B_QLORA, compute_bytes=4), tflops=6.8) == (
        pytest.approx(once),
        pytest.approx(2 * once),  # the backward and the checkpointed recompute
    )
    assert once == pytest.approx(0.0377, abs=1e-3)
    assert torch_times.layer_forward_s - bnb_times.layer_forward_s == pytest.approx(once)
    assert torch_times.layer_backward_s - bnb_times.layer_backward_s == pytest.approx(2 * once)


def test_a_device_measured_on_the_pytorch_path_is_not_slowed_again() -> None:
    measured = replace(_seed().device("m40"), seconds_per_layer=4.0, tflops=None)
    times = measured.times(SEVENTY_B, SEVENTY_B_QLORA, nf4_backend="torch")
    assert times.layer_s == pytest.approx(4.0)


# ------------------------------------------------------------------------------- unquantized bases


def test_an_unquantized_base_is_sized_in_the_stages_dtype() -> None:
    """A Llama-2-70B layer: 1.59 GiB in bf16, 3.19 GiB in fp32, 421 MiB in NF4."""
    lora = replace(SEVENTY_B_QLORA, quantize=False)
    times = modeled_times(SEVENTY_B, lora, layer_s=1.0, kind="cuda")

    def per_layer(workload: Workload) -> dict[str, float]:
        costs = stage_costs(SEVENTY_B, workload, times=times, capacity_bytes=80 * GIB, kind="cuda", index=0,
                            num_stages=2)  # fmt: skip
        return dict(costs.per_layer_breakdown)

    dense = SEVENTY_B.layer_linear_params() + SEVENTY_B.layer_dense_params()
    assert per_layer(lora)["weights"] == 2 * dense and 2 * dense / GIB == pytest.approx(1.594, abs=0.001)
    assert per_layer(replace(lora, compute_bytes=4))["weights"] == 4 * dense
    assert "weights" not in per_layer(SEVENTY_B_QLORA)
    nf4 = per_layer(SEVENTY_B_QLORA)["weights_nf4"]
    assert (
        nf4
        == sum(nf4_bytes(p) for p in SEVENTY_B.linear_params().values()) + 2 * SEVENTY_B.layer_dense_params()
    )
    assert nf4 / 2**20 == pytest.approx(421, abs=1)  # 0.41 GiB


def test_a_lora_plan_of_the_seed_fleet_sizes_its_base_in_each_stages_dtype() -> None:
    result = run_cli("plan", "--fleet", "configs/fleet-seed.yaml", "--set", "adapter=lora", "--set",
                     "load_in_4bit=false", "--json", cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    bytes_per_weight = {"bfloat16": 2, "float16": 2, "float32": 4}
    dense = EIGHT_B.layer_linear_params() + EIGHT_B.layer_dense_params()
    for stage in plan["stages"]:
        layers = stage["layers"][1] - stage["layers"][0]
        assert "nf4_backend" not in stage and "weights_nf4" not in stage["memory_breakdown"]
        assert stage["memory_breakdown"]["weights"] == layers * dense * bytes_per_weight[stage["dtype"]]
    assert "m40" in {stage["slot"] for stage in plan["stages"]}


# ------------------------------------------------------------------------------- plans carry the choice


def test_plan_json_and_a_resplit_keep_each_stages_nf4_backend() -> None:
    plan = plan_pipeline(SEVENTY_B, SEVENTY_B_QLORA, _seed())
    backends = [(stage.nf4_backend, stage.nf4_reason) for stage in plan.stages]
    assert (
        "torch",
        "m40 (compute capability 5.2): bitsandbytes has no 4-bit kernels for it; NF4 in plain PyTorch",
    ) in backends
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert [(stage.nf4_backend, stage.nf4_reason) for stage in again.stages] == backends
    assert again.stages[1].memory_breakdown == plan.stages[1].memory_breakdown
    costs = [stage.costs for stage in plan.stages]
    counts = [stage.num_layers for stage in plan.stages]
    resplit = resplit_plan(plan, costs, counts, microbatches=16, schedule="1f1b", search="calibrated")  # type: ignore[arg-type]
    assert [(stage.nf4_backend, stage.nf4_reason) for stage in resplit.stages] == backends


def test_a_data_parallel_plan_gives_every_replica_its_backend() -> None:
    tiny = ModelShape.from_config_dir(ROOT / "configs/models/tiny-llama.json")
    workload = Workload(sequence_len=64, gradient_accumulation_steps=8, precision="bf16", data_parallel="on")
    plan = plan_pipeline(tiny, workload, _seed())
    assert plan.is_data_parallel and len(plan.data_parallel) >= 2
    for replica in plan.data_parallel:
        assert replica.nf4_backend == ("torch" if replica.slot == "m40" else "bitsandbytes")


def test_a_list_gives_each_pipeline_stage_its_setting_and_the_stage_count() -> None:
    listed = replace(SEVENTY_B_QLORA, nf4_backend=("torch", "auto", "bitsandbytes"))
    plan = plan_pipeline(SEVENTY_B, listed, _seed())
    assert len(plan.stages) == 3
    assert [stage.nf4_backend for stage in plan.stages][0::2] == ["torch", "bitsandbytes"]
    assert plan.stages[1].nf4_backend == ("torch" if plan.stages[1].slot == "m40" else "bitsandbytes")
    assert plan.stages[2].slot != "m40"  # bitsandbytes there: the M40 cannot be that stage
    with pytest.raises(ShardpoolError, match="nf4_backend names 3 stages but 2 are planned"):
        plan_pipeline(SEVENTY_B, replace(listed, stages=2), _seed())


def test_the_config_check_refuses_a_list_of_another_stage_count() -> None:
    from pydantic import ValidationError

    from shardpool.config.schema import ShardpoolSection

    with pytest.raises(ValidationError, match="stage counts disagree"):
        ShardpoolSection(devices=["cpu", "cpu"], nf4_backend=["auto", "torch", "torch"])
    assert ShardpoolSection(devices=["cpu", "cpu"], nf4_backend=["auto", "torch"]).nf4_backend == [
        "auto",
        "torch",
    ]


# ------------------------------------------------------------------------------- local devices


class StandInProbe:
    """This machine's CPU, but with a failed 4-bit probe; records the backend each profile asks for."""

    def __init__(self, nf4_error: str | None) -> None:
        from shardpool.plan.devices import device_info

        self.info: DeviceInfo = replace(device_info("cpu", nf4=False), nf4_error=nf4_error)
        self.asked: list[object] = []

    def device_info(self, name: str) -> DeviceInfo:
        return self.info

    def profile_layer(
        self, shape: ModelShape, workload: Workload, *, device: str, threads: int | None
    ) -> LayerProfile:
        self.asked.append(workload.nf4_backend)
        return LayerProfile(0.01, 1000, None, device, self.info.label, threads, 3)

    def loopback(self) -> LinkSpec:
        return LinkSpec(bandwidth=8e9, latency=50e-6)

    def co_run_slowdown(self, copies: int, threads: int, *, shape: ModelShape, workload: Workload) -> float:
        return 1.0


def test_a_local_device_that_fails_the_4bit_probe_computes_nf4_in_pytorch_under_auto() -> None:
    tiny = ModelShape.from_config_dir(ROOT / "configs/models/tiny-llama.json")
    workload = Workload(sequence_len=64, gradient_accumulation_steps=4)
    probe = StandInProbe(PROBE_FAILED)
    fleet = local_fleet(["cpu"], shape=tiny, workload=workload, probe=probe)
    assert probe.asked == ["torch"]  # profiled on the path it will run
    plan = plan_pipeline(tiny, workload, fleet)
    assert not plan.refused and plan.stages[0].nf4_backend == "torch"
    assert plan.stages[0].nf4_reason.startswith("cpu, ") and "4-bit probe failed" in plan.stages[0].nf4_reason
    assert plan.stages[0].memory_breakdown["torch_dequantize"] > 0
    with pytest.raises(
        ShardpoolError, match="cannot run bitsandbytes 4-bit.*remove it from shardpool.devices"
    ):
        local_fleet(["cpu"], shape=tiny, workload=replace(workload, nf4_backend="bitsandbytes"), probe=probe)


def test_a_local_list_goes_with_the_devices_entries() -> None:
    tiny = ModelShape.from_config_dir(ROOT / "configs/models/tiny-llama.json")
    workload = Workload(sequence_len=64, gradient_accumulation_steps=4, nf4_backend=("bitsandbytes", "torch"))
    probe = StandInProbe(None)
    fleet = local_fleet(["cpu", "cpu"], shape=tiny, workload=workload, probe=probe)
    assert probe.asked == ["bitsandbytes", "torch"]
    assert [device.nf4_backend for device in fleet.devices] == ["bitsandbytes", "torch"]
