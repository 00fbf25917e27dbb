"""The pure helpers of scripts/gpu_check.py (the GPU runs themselves need CUDA; docs/gpu.md)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(_SCRIPTS))
gpu_check = importlib.import_module("gpu_check")


def test_every_cuda_layout_runs_in_every_dtype_the_device_has() -> None:
    names = [case.name for case in gpu_check.cases(bf16=True)]
    assert names == [
        f"{layout}/{dtype}"
        for layout in ("cuda", "cuda+cuda", "cuda+cpu")
        for dtype in ("fp32", "bf16", "fp16")
    ] + ["cuda+cuda/fp32 re-shard", "cuda+cpu/fp32 re-shard"]
    assert not any(case.dtype == "bf16" for case in gpu_check.cases(bf16=False))  # a V100 has no bf16


def test_the_config_of_a_case_names_its_devices_split_and_dtype(tmp_path: Path) -> None:
    config = gpu_check.run_config(
        gpu_check.Case("cuda+cpu", "bf16"), model=tmp_path, data=tmp_path / "d", output_dir=tmp_path / "o"
    )
    assert config["shardpool"] == {"devices": ["cuda:0", "cpu"], "layers": [3, 3], "rebalance": "off"}
    assert (config["bf16"], config["fp16"]) == (True, False)
    two_on_one = gpu_check.run_config(
        gpu_check.Case("cuda+cuda", "fp32"), model=tmp_path, data=tmp_path, output_dir=tmp_path
    )
    assert two_on_one["shardpool"]["devices"] == ["cuda:0", "cuda:0"] and not two_on_one["bf16"]


def test_a_reshard_case_forces_its_split_and_passes_only_if_it_moved_with_room_measured(
    tmp_path: Path,
) -> None:
    from shardpool.contract.rebalance import FORCE_ENV, forced_reshard

    assert gpu_check.FORCE_ENV == FORCE_ENV
    case = gpu_check.Case("cuda+cpu", "fp32", gpu_check.RESHARDS["cuda+cpu"])
    config = gpu_check.run_config(case, model=tmp_path, data=tmp_path, output_dir=tmp_path)
    assert config["shardpool"]["rebalance"] == "auto" and config["max_steps"] == 3
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FORCE_ENV, case.reshard)
        step, layers = forced_reshard()
    assert step == 2 < config["max_steps"] and layers == [(0, 4), (4, 6)]
    metrics = [
        {"step": 2, "loss": 5.0, "stage_room_bytes": [3e9, 2e10]},
        {"event": "rebalance", "step": 2, "to": [[0, 4], [4, 6]]},
    ]
    assert gpu_check.reshard_outcome(case, metrics) == {
        "resharded_to": [[0, 4], [4, 6]],
        "room_bytes": [3e9, 2e10],
        "reshard_ok": True,
    }
    assert not gpu_check.reshard_outcome(case, metrics[:1])["reshard_ok"], "no re-shard happened"
    no_room = [{"step": 2, "loss": 5.0, "stage_room_bytes": [0, 2e10]}, metrics[1]]
    assert not gpu_check.reshard_outcome(case, no_room)["reshard_ok"]
    assert gpu_check.reshard_outcome(gpu_check.Case("cuda", "fp32"), metrics) == {}


def test_a_run_is_compared_with_the_reference_within_its_dtypes_tolerance() -> None:
    reference = {"eval_loss": 5.0, "losses": [6.0, 5.5]}
    close = gpu_check.compare({"eval_loss": 5.0004, "losses": [6.0003, 5.5]}, reference, "fp32")
    assert close["ok"] and close["tolerance"] == 1e-3 and close["eval_loss_rel"] == pytest.approx(8e-5)
    assert not gpu_check.compare({"eval_loss": 5.05, "losses": [6.0, 5.5]}, reference, "fp32")["ok"]
    assert gpu_check.compare({"eval_loss": 5.05, "losses": [6.05, 5.5]}, reference, "bf16")["ok"]
    assert not gpu_check.compare({"eval_loss": 5.0, "losses": [6.0]}, reference, "bf16")[
        "ok"
    ]  # a step missing


def test_a_row_says_which_dtype_each_stage_ran_and_which_steps_the_loss_scale_skipped() -> None:
    plan = {"stages": [{"dtype": "float32"}, {"dtype": "float16"}, {}]}
    metrics = [
        {"step": 1, "loss": 5.0, "loss_scale": 65536.0, "skipped_step": True},
        {"step": 2, "loss": 4.9, "loss_scale": 32768.0, "skipped_step": False},
        {"step": 2, "eval_loss": 4.8},
    ]
    assert gpu_check.what_ran(plan, metrics) == {
        "stage_dtypes": ["fp32", "fp16", "config"],
        "skipped_steps": [1],
    }


def test_memory_ratios_set_each_cuda_stages_peaks_against_the_plan() -> None:
    plan = {"stages": [{"device": "cuda:0", "memory_bytes": 1000}, {"device": "cpu", "memory_bytes": 500}]}
    summary = {"ranks": [
        {"rank": 0, "stage": 0, "peak_device_bytes": 800, "peak_device_reserved_bytes": 1200},
        {"rank": 1, "stage": 1, "peak_device_bytes": None, "peak_device_reserved_bytes": None},
    ]}  # fmt: skip
    assert gpu_check.memory_ratios(plan, summary) == [
        {"stage": 0, "predicted_bytes": 1000, "max_allocated_bytes": 800, "max_reserved_bytes": 1200,
         "allocated_ratio": 0.8, "reserved_ratio": 1.2}
    ]  # fmt: skip


def test_the_table_has_a_line_per_run_and_names_failures() -> None:
    rows = [
        {"run": "cuda/fp32", "ok": True, "eval_loss": 5.0, "eval_loss_rel": 1e-5, "step_loss_rel": 2e-5,
         "tolerance": 1e-3, "memory": [{"stage": 0, "allocated_ratio": 0.8, "reserved_ratio": 1.2}]},
        {"run": "cuda+cpu/fp16", "error": "stage 0 (rank 0) failed: CUDA error", "ok": False},
    ]  # fmt: skip
    lines = gpu_check.format_table(rows).splitlines()
    assert (
        len(lines) == 4 and "0: 0.80/1.20" in lines[2] and lines[3].split()[:2] == ["cuda+cpu/fp16", "FAIL"]
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where CUDA is absent")
def test_without_cuda_it_says_skipped_in_one_line_and_exits_0() -> None:
    done = subprocess.run(
        [sys.executable, str(_SCRIPTS / "gpu_check.py")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.splitlines() == [
        "gpu_check: skipped: no CUDA device (torch.cuda.is_available() is False)"
    ]
