"""The pure helpers of scripts/gpu_check.py (the GPU runs themselves need CUDA; docs/gpu.md)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from shardpool_dev.bench.gpu import cases, report, verdicts

_SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
_spec = importlib.util.spec_from_file_location("gpu_check", _SCRIPTS / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)  # the script, for its command line
_spec.loader.exec_module(gpu_check)


def test_every_cuda_layout_runs_in_every_dtype_the_device_has() -> None:
    names = [case.name for case in cases.cases(bf16=True)]
    assert names == [
        f"{layout}/{dtype}"
        for layout in ("cuda", "cuda+cuda", "cuda+cpu")
        for dtype in ("fp32", "bf16", "fp16")
    ] + ["cuda+cuda/fp32 re-shard", "cuda+cpu/fp32 re-shard"]
    assert not any(case.dtype == "bf16" for case in cases.cases(bf16=False))  # a V100 has no bf16


def test_the_config_of_a_case_names_its_devices_split_and_dtype(tmp_path: Path) -> None:
    config = cases.run_config(
        cases.Case("cuda+cpu", "bf16"), model=tmp_path, data=tmp_path / "d", output_dir=tmp_path / "o"
    )
    assert config["shardpool"] == {"devices": ["cuda:0", "cpu"], "layers": [3, 3], "rebalance": "off"}
    assert (config["bf16"], config["fp16"]) == (True, False)
    two_on_one = cases.run_config(
        cases.Case("cuda+cuda", "fp32"), model=tmp_path, data=tmp_path, output_dir=tmp_path
    )
    assert two_on_one["shardpool"]["devices"] == ["cuda:0", "cuda:0"] and not two_on_one["bf16"]


def test_a_reshard_case_forces_its_split_and_passes_only_if_it_moved_with_room_measured(
    tmp_path: Path,
) -> None:
    from shardpool.contract.rebalance import FORCE_ENV, forced_reshard

    assert cases.FORCE_ENV == FORCE_ENV
    case = cases.Case("cuda+cpu", "fp32", cases.RESHARDS["cuda+cpu"])
    config = cases.run_config(case, model=tmp_path, data=tmp_path, output_dir=tmp_path)
    assert config["shardpool"]["rebalance"] == "auto" and config["max_steps"] == 3
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FORCE_ENV, case.reshard)
        step, layers = forced_reshard()
    assert step == 2 < config["max_steps"] and layers == [(0, 4), (4, 6)]
    metrics = [
        {"step": 2, "loss": 5.0, "stage_room_bytes": [3e9, 2e10]},
        {"event": "rebalance", "step": 2, "to": [[0, 4], [4, 6]]},
    ]
    assert verdicts.reshard_outcome(case, metrics) == {
        "resharded_to": [[0, 4], [4, 6]],
        "room_bytes": [3e9, 2e10],
        "reshard_ok": True,
    }
    assert not verdicts.reshard_outcome(case, metrics[:1])["reshard_ok"], "no re-shard happened"
    no_room = [{"step": 2, "loss": 5.0, "stage_room_bytes": [0, 2e10]}, metrics[1]]
    assert not verdicts.reshard_outcome(case, no_room)["reshard_ok"]
    assert verdicts.reshard_outcome(cases.Case("cuda", "fp32"), metrics) == {}


def test_a_run_is_compared_with_the_reference_within_its_dtypes_tolerance() -> None:
    reference = {"eval_loss": 5.0, "losses": [6.0, 5.5]}
    close = verdicts.compare({"eval_loss": 5.0004, "losses": [6.0003, 5.5]}, reference, "fp32")
    assert close["ok"] and close["tolerance"] == 1e-3 and close["eval_loss_rel"] == pytest.approx(8e-5)
    assert not verdicts.compare({"eval_loss": 5.05, "losses": [6.0, 5.5]}, reference, "fp32")["ok"]
    assert verdicts.compare({"eval_loss": 5.05, "losses": [6.05, 5.5]}, reference, "bf16")["ok"]
    assert not verdicts.compare({"eval_loss": 5.0, "losses": [6.0]}, reference, "bf16")[
        "ok"
    ]  # a step missing


def test_a_row_says_which_dtype_each_stage_ran_and_which_steps_the_loss_scale_skipped() -> None:
    plan = {"stages": [{"dtype": "float32"}, {"dtype": "float16"}, {}]}
    metrics = [
        {"step": 1, "loss": 5.0, "loss_scale": 65536.0, "skipped_step": True},
        {"step": 2, "loss": 4.9, "loss_scale": 32768.0, "skipped_step": False},
        {"step": 2, "eval_loss": 4.8},
    ]
    assert verdicts.what_ran(plan, metrics) == {
        "stage_dtypes": ["fp32", "fp16", "config"],
        "skipped_steps": [1],
    }


GIB = 2**30


def test_the_runs_go_most_informative_first_and_the_order_names_every_run() -> None:
    every = cases.cases(bf16=True)
    assert [case.name for case in cases.by_priority(every)] == list(cases.PRIORITY)
    assert sorted(cases.PRIORITY) == sorted(case.name for case in every)
    first_three = [case.name for case in cases.by_priority(every)][:3]
    assert first_three == ["cuda/fp32", "cuda+cuda/fp32", "cuda+cpu/fp32"]  # each layout once, tightest dtype


def test_only_picks_runs_by_name_and_an_unknown_name_lists_the_valid_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    every = cases.cases(bf16=True)
    picked = cases.select(every, ["cuda/bf16", "cuda+cuda/fp32", "cuda/bf16"])
    assert [case.name for case in picked] == ["cuda/bf16", "cuda+cuda/fp32"]  # as named, once each
    assert len(cases.select(every, None)) == 11
    with pytest.raises(cases.UsageError, match="unknown run 'cuda/fp8'; pick from: cuda/fp32, ") as error:
        cases.select(every, ["cuda/fp8"])
    assert "cuda+cpu/fp32 re-shard" in str(error.value) and "\n" not in str(error.value)
    assert gpu_check.main(["--only", "cuda/fp8"]) == 2
    assert capsys.readouterr().err.count("\n") == 1  # one line
    assert gpu_check.main(["--list"]) == 0
    assert capsys.readouterr().out.splitlines() == list(cases.PRIORITY)


def test_allocated_memory_is_set_against_the_plan_without_its_reserve() -> None:
    # 3.0 GiB of planned tensors plus a 0.9 GiB reserve: the old ratio 3.2 / 3.9 = 0.82 hid the overrun
    plan = {"stages": [
        {"device": "cuda:0", "memory_bytes": int(3.9 * GIB), "memory_breakdown": {"reserve": int(0.9 * GIB)}},
        {"device": "cpu", "memory_bytes": 500, "memory_breakdown": {"reserve": 100}},
    ]}  # fmt: skip
    summary = {"ranks": [
        {"rank": 0, "stage": 0, "peak_device_bytes": int(3.2 * GIB), "peak_device_reserved_bytes": int(3.4 * GIB)},
        {"rank": 1, "stage": 1, "peak_device_bytes": None, "peak_device_reserved_bytes": None},
    ]}  # fmt: skip
    (row,) = verdicts.memory_ratios(plan, summary)
    assert row["predicted_tensor_bytes"] == pytest.approx(3.0 * GIB, abs=1)
    assert row["reserve_bytes"] == int(0.9 * GIB) and row["max_reserved_bytes"] == int(3.4 * GIB)
    assert row["allocated_ratio"] == pytest.approx(1.067) and row["above_plan"]
    under = {"ranks": [{"rank": 0, "stage": 0, "peak_device_bytes": int(2.7 * GIB)}]}
    (row,) = verdicts.memory_ratios(plan, under)
    assert row["allocated_ratio"] == pytest.approx(0.9) and not row["above_plan"]


def test_a_plan_without_a_breakdown_gets_the_planners_own_reserve() -> None:
    from shardpool.plan.memory_model import reserve_bytes

    tensors = 2 * GIB
    stage = {"device": "cuda:0", "memory_bytes": int(tensors + reserve_bytes("cuda", tensors))}
    assert verdicts.planned_reserve_bytes(stage) == pytest.approx(0.75 * GIB + 0.05 * tensors, abs=2)
    assert verdicts.planned_reserve_bytes({"memory_breakdown": {"reserve": 123}}) == 123


def test_a_resharded_stage_is_set_against_the_plan_that_gave_it_the_most_tensors() -> None:
    def stage(tensor_gib: float) -> dict[str, object]:
        reserve = int(0.8 * GIB)
        return {
            "device": "cuda:0",
            "memory_bytes": int(tensor_gib * GIB) + reserve,
            "memory_breakdown": {"reserve": reserve},
        }

    # 3 + 3 layers, then 1 + 5: stage 0 peaked with 3 layers, stage 1 with 5
    plan = {
        "stages": [stage(1.0), stage(5.0)],
        "history": [{"stages": [stage(3.0), stage(3.0)], "ended_at_step": 2}],
    }
    summary = {"ranks": [{"rank": 0, "stage": 0, "peak_device_bytes": int(2.7 * GIB)},
                         {"rank": 1, "stage": 1, "peak_device_bytes": int(4.5 * GIB)}]}  # fmt: skip
    ratios = [row["allocated_ratio"] for row in verdicts.memory_ratios(plan, summary)]
    assert ratios == [pytest.approx(0.9), pytest.approx(0.9)]  # not 2.7 against the 1.0 GiB of the last plan


def test_the_gpu_footprint_beyond_tensors_is_set_against_the_reserve() -> None:
    memory = [
        {
            "max_allocated_bytes": 2 * GIB,
            "max_reserved_bytes": int(2.2 * GIB),
            "reserve_bytes": int(0.8 * GIB),
        }
    ]
    over = verdicts.device_footprint(memory, int(2.9 * GIB))  # 0.9 GiB beyond tensors, 0.8 reserved for it
    assert over["reserve_ratio"] == pytest.approx(1.125) and over["above_plan"]
    assert over["beyond_allocator_bytes"] == pytest.approx(0.7 * GIB, abs=1)  # context, cuBLAS, NCCL
    assert over["beyond_tensors_bytes"] == pytest.approx(0.9 * GIB, abs=1)
    two_stages = memory * 2  # cuda+cuda: the GPU holds both stages, so both reserves count
    within = verdicts.device_footprint(two_stages, int(5.2 * GIB))
    assert within["reserve_ratio"] == pytest.approx(0.75) and not within["above_plan"]
    unmeasured = verdicts.device_footprint(memory, None)
    assert unmeasured["reserve_ratio"] is None and unmeasured["reserve_bytes"] == int(0.8 * GIB)


_BNB_SUCCESS = """================ bitsandbytes v0.48.2 ================
Platform: Linux
PyTorch: 2.11.0
Checking that the library is importable and callable...
SUCCESS!
"""
_BNB_LOAD_ERROR = """================ bitsandbytes v0.48.2 ================
bitsandbytes library load error: libcudart.so.13: cannot open shared object file: No such file or directory
Traceback (most recent call last):
OSError: libcudart.so.13: cannot open shared object file: No such file or directory
See above for details on why the library failed to load.
WARNING: Please be sure to sanitize sensitive info from the output before posting it.
"""


def test_the_bitsandbytes_pre_flight_passes_only_on_its_success_and_says_why_in_one_line() -> None:
    ok = verdicts.bitsandbytes_verdict(0, _BNB_SUCCESS)
    assert ok == {"version": "0.48.2", "ok": True, "detail": "python -m bitsandbytes: SUCCESS"}
    missing = verdicts.bitsandbytes_verdict(1, "/usr/bin/python3: No module named bitsandbytes\n")
    assert (
        not missing["ok"] and missing["detail"] == "bitsandbytes is not installed (pip install bitsandbytes)"
    )
    broken = verdicts.bitsandbytes_verdict(1, _BNB_LOAD_ERROR)
    assert not broken["ok"] and broken["detail"] == (
        "python -m bitsandbytes failed (exit 1): bitsandbytes library load error: libcudart.so.13: "
        "cannot open shared object file: No such file or directory"
    )
    cpu_only = "No CUDA, ROCm, or XPU detected; CPU library loaded successfully."
    no_cuda = verdicts.bitsandbytes_verdict(0, f"Platform: Linux\n{cpu_only}\nsome warning on stderr\n")
    assert not no_cuda["ok"] and no_cuda["detail"] == f"python -m bitsandbytes failed (exit 0): {cpu_only}"
    hung = verdicts.bitsandbytes_verdict(None, "")
    assert not hung["ok"] and "did not finish in 90 s" in hung["detail"]


def test_an_exclusive_compute_mode_skips_two_stage_processes_on_one_gpu() -> None:
    assert verdicts.parse_compute_mode("Exclusive_Process\n") == "Exclusive_Process"
    assert verdicts.parse_compute_mode("[N/A]\n") is None and verdicts.parse_compute_mode("") is None
    assert verdicts.blocked_layouts("Default") == {} and verdicts.blocked_layouts(None) == {}
    exclusive = verdicts.blocked_layouts("Exclusive_Process")
    assert list(exclusive) == ["cuda+cuda"] and "one process" in exclusive["cuda+cuda"]
    assert sorted(verdicts.blocked_layouts("Prohibited")) == ["cuda", "cuda+cpu", "cuda+cuda"]
    reshard = cases.Case("cuda+cuda", "fp32", cases.RESHARDS["cuda+cuda"])
    skip = verdicts.why_skipped(
        reshard, bf16=True, blocked=exclusive, elapsed_s=0, durations_s=[], budget_s=420
    )
    assert skip == exclusive["cuda+cuda"]
    assert verdicts.parse_smi_mib("81559\n") == 81559 * 2**20 and verdicts.parse_smi_mib("[N/A]") is None


def test_a_run_is_skipped_once_the_budget_cannot_fit_the_longest_run_so_far() -> None:
    case = cases.Case("cuda", "fp32")

    def skip(elapsed: float, durations: list[float]) -> str | None:
        return verdicts.why_skipped(
            case, bf16=True, blocked={}, elapsed_s=elapsed, durations_s=durations, budget_s=420
        )

    assert skip(300, [40, 90, 60]) is None  # 300 + 90 fits in 420
    assert skip(340, [40, 90, 60]) == "budget"  # 340 + 90 does not
    assert skip(10, []) is None
    bf16 = cases.Case("cuda", "bf16")
    no_bf16 = verdicts.why_skipped(bf16, bf16=False, blocked={}, elapsed_s=0, durations_s=[], budget_s=420)
    assert no_bf16 == "this device has no bf16"
    assert verdicts.run_timeout_s(340, 420) == 80 and verdicts.run_timeout_s(0, 420) == cases.RUN_TIMEOUT_S
    assert cases.DEFAULT_BUDGET_S < 15 * 60 and verdicts.run_timeout_s(500, 420) == 1


def test_skipped_runs_do_not_fail_the_check_but_a_check_that_ran_nothing_does() -> None:
    ran, skipped, failed = {"ok": True}, {"ok": None, "skipped": "budget"}, {"ok": False}
    assert verdicts.exit_status([ran, skipped]) == 0
    assert verdicts.exit_status([ran, failed, skipped]) == 1
    assert verdicts.exit_status([skipped, skipped]) == 1


def test_the_report_file_is_replaced_whole_after_every_run(tmp_path: Path) -> None:
    path = tmp_path / "gpu-check.json"
    report.write_report(path, {"runs": [{"run": "cuda/fp32"}], "complete": False})
    report.write_report(path, {"runs": [{"run": "cuda/fp32"}, {"run": "cuda+cuda/fp32"}], "complete": True})
    assert json.loads(path.read_text())["complete"] and len(json.loads(path.read_text())["runs"]) == 2
    assert [entry.name for entry in tmp_path.iterdir()] == ["gpu-check.json"]  # no temporary file left


def test_the_table_has_a_line_per_run_and_marks_what_the_plan_undercounts() -> None:
    rows = [
        {"run": "cuda+cuda/fp32", "ok": True, "eval_loss": 5.0, "eval_loss_rel": 1e-5, "step_loss_rel": 2e-5,
         "tolerance": 1e-3, "memory": [{"stage": 0, "allocated_ratio": 0.8}, {"stage": 1, "allocated_ratio": 1.067}],
         "footprint": {"reserve_ratio": 1.125}},
        {"run": "cuda+cpu/fp16", "error": "stage 0 (rank 0) failed: CUDA error", "ok": False},
        {"run": "cuda/fp16", "skipped": "budget", "ok": None},
    ]  # fmt: skip
    lines = report.format_table(rows).splitlines()
    assert len(lines) == 5 and lines[2].endswith("0: 0.80, 1: 1.07!; gpu: 1.12!")
    assert lines[3].split()[:2] == ["cuda+cpu/fp16", "FAIL"] and lines[4].split() == [
        "cuda/fp16",
        "skip",
        "budget",
    ]
    preflight = {
        "bitsandbytes": {"ok": False, "version": None, "detail": "bitsandbytes is not installed (pip install bitsandbytes)"},
        "compute_mode": {"mode": "Exclusive_Process", "source": "nvidia-smi"},
        "device_memory": "nvml",
    }  # fmt: skip
    assert report.format_preflight(preflight) == (
        "pre-flight: bitsandbytes ?: bitsandbytes is not installed (pip install bitsandbytes) | "
        "compute mode: Exclusive_Process (nvidia-smi) | GPU memory read by: nvml"
    )


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where CUDA is absent")
def test_without_cuda_it_says_skipped_in_one_line_and_exits_0() -> None:
    done = subprocess.run(
        [sys.executable, str(_SCRIPTS / "gpu_check.py")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.splitlines() == [
        "gpu_check: skipped: no CUDA device (torch.cuda.is_available() is False)"
    ]
