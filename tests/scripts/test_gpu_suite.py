"""The prepared GPU run's plumbing on the CPU: scripts/gpu_suite.sh --dry-run, the wheels' size check,
the report's parts read off gpu_check, and the stage-vs-peft benchmark's tiny run (docs/gpu.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from shardpool_dev.bench import stage_vs_peft
from shardpool_dev.bench.gpu import suite, suite_report

ROOT = Path(__file__).resolve().parents[2]
_SCRIPTS = ROOT / "scripts"

MIB = 2**20
#: Statuses a finished report may hold (none is left pending).
FINAL = {"ok", "fail", "timeout", "skipped", "no data", "above plan"}


def _suite(out: Path, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    return subprocess.run(
        ["bash", str(_SCRIPTS / "gpu_suite.sh"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout_s,
        check=False,
    )


def _parts(out: Path) -> dict[str, dict[str, Any]]:
    report = json.loads((out / "suite.json").read_text())
    assert report["complete"] is True
    return {row["part"]: row for row in report["parts"]}


# ----- the dry run ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("gpu-suite-out")
    return _suite(out, "--dry-run", "--force-timeout", "devices"), out


@pytest.mark.slow
def test_the_dry_run_reports_every_part_and_goes_on_past_a_timeout(
    dry_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    result, out = dry_run
    assert result.returncode == 1, result.stderr  # a part timed out
    parts = _parts(out)
    assert list(parts) == list(suite.PART_NAMES)
    assert {row["status"] for row in parts.values()} <= FINAL
    assert (parts["devices"]["status"], parts["devices"]["limit_s"], parts["devices"]["rc"]) == (
        "timeout",
        1,
        124,
    )
    # the parts after the timeout ran, each its CPU variant
    assert parts["install"]["status"] == "ok" and parts["install"]["details"]["cuda_available"] is False
    assert parts["gpu_check"]["status"] == "skipped", "an unknown run name in GPU_CHECK_RUNS fails here"
    assert "no CUDA device" in parts["gpu_check"]["summary"]
    expected_tests = len(suite.cuda_test_ids(ROOT / "tests", ROOT))
    assert parts["cuda_tests"]["details"]["counts"] == {
        "passed": 0, "failed": 0, "errors": 0, "skipped": expected_tests,
    }  # fmt: skip
    assert (parts["stage_vs_peft"]["status"], parts["stage_vs_peft"]["summary"]) == (
        "skipped",
        "not in the default run (--only stage_vs_peft)",
    )
    assert all(parts[name]["status"] == "no data" for name in suite.DERIVED_PARTS)
    assert parts["torch_nf4_vs_bnb"]["status"] == "ok"  # the dry run checks the bench's arguments only
    assert parts["generate"]["status"] == "ok"  # likewise


@pytest.mark.slow
def test_the_dry_run_writes_a_table_and_a_log_in_few_flat_files(
    dry_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    _, out = dry_run
    written = list(out.iterdir())
    assert len(written) <= suite.MAX_OUT_FILES and all(path.is_file() for path in written)
    table = (out / "suite.md").read_text()
    for name, row in _parts(out).items():
        assert f"| {name} | {row['status']} |" in table
    assert "dry run" in table
    assert "=== gpu_suite: devices (limit 1 s) ===" in (out / "suite.log").read_text()


def test_only_the_chosen_parts_run_and_the_rest_say_so(tmp_path: Path) -> None:
    result = _suite(tmp_path, "--dry-run", "--only", "torch_nf4_vs_bnb,stage_vs_peft")
    assert result.returncode == 0, result.stderr
    parts = _parts(tmp_path)
    assert parts.pop("torch_nf4_vs_bnb")["status"] == "ok"
    planned = parts.pop("stage_vs_peft")
    assert planned["status"] == "ok" and planned["details"]["workload"]["model"]["hidden_size"] == 4096
    assert {(row["status"], row["summary"]) for row in parts.values()} == {("skipped", "not chosen (--only)")}


def test_parts_the_budget_cannot_hold_are_skipped_with_the_reason(tmp_path: Path) -> None:
    result = _suite(tmp_path, "--dry-run", "--budget", "10", "--only", "install,devices")
    assert result.returncode == 0, result.stderr
    parts = _parts(tmp_path)
    assert parts["install"]["status"] == "skipped" and parts["install"]["summary"].startswith("budget: ")
    assert "needs 30 s" in parts["install"]["summary"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--only", "warp_drive"], "unknown part warp_drive"),
        (["--budget", "soon"], "--budget needs whole seconds"),
        (["--force-timeout", "nothing"], "--force-timeout needs a part name"),
        (["--frobnicate"], "unknown argument --frobnicate"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_status_2(tmp_path: Path, args: list[str], message: str) -> None:
    result = _suite(tmp_path, *args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr
    assert not (tmp_path / "suite.json").exists()


# ----- the wheels' size -----------------------------------------------------------------------


def test_tree_and_wheels_over_64_mib_are_refused_with_the_sizes() -> None:
    assert suite.size_problem(50 * MIB, 14 * MIB) is None  # exactly the limit still travels
    problem = suite.size_problem(7 * MIB, 58 * MIB)
    assert problem is not None and "65.0 MiB is over the device tool's 64 MiB" in problem
    assert "\n" not in problem and "carry fewer wheels" in problem


def _fake_wheel(directory: Path, name: str, size: int) -> None:
    with open(directory / name, "wb") as wheel:
        wheel.truncate(size)  # sparse: the size counts, no disk is used


def _size_check(wheels: Path, limit_mib: float = 64) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(_SCRIPTS / "gpu_suite_tools.py"), "size-check", "--wheels", str(wheels),
         "--limit-mib", str(limit_mib)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_the_size_check_passes_what_fits_and_refuses_what_does_not(tmp_path: Path) -> None:
    _fake_wheel(tmp_path, "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl", 41 * MIB)
    fits = _size_check(tmp_path)
    assert fits.returncode == 0, fits.stderr
    assert "41.00 MiB  bitsandbytes-0.50.2" in fits.stdout and "in all (limit 64 MiB)" in fits.stdout
    _fake_wheel(tmp_path, "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl", 30 * MIB)
    over = _size_check(tmp_path)
    assert over.returncode == 1 and over.stderr.startswith("gpu_wheels: working tree ")
    assert "is over the device tool's 64 MiB" in over.stderr


def test_two_versions_of_one_wheel_are_refused(tmp_path: Path) -> None:
    _fake_wheel(tmp_path, "pydantic-2.13.4-py3-none-any.whl", 1000)
    _fake_wheel(tmp_path, "pydantic-2.12.0-py3-none-any.whl", 1000)
    result = _size_check(tmp_path)
    assert result.returncode == 1 and "two versions of pydantic" in result.stderr


def test_gpu_wheels_check_only_downloads_nothing_and_applies_the_limit() -> None:
    env = dict(os.environ, PYTHON=sys.executable, GPU_WHEELS_LIMIT_MIB="1")
    result = subprocess.run(
        ["bash", str(_SCRIPTS / "gpu_wheels.sh"), "--check-only"],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 1  # the tracked tree alone is over 1 MiB
    assert "over the device tool's 1 MiB" in result.stderr and "working tree" in result.stdout


# ----- what the suite reads -------------------------------------------------------------------

_CUDA_TESTS = """
import pytest, torch

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu(): ...

@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA, wrapped"
)
def test_wrapped(): ...

@pytest.mark.skipif(torch.cuda.is_available(), reason="the message without CUDA")
def test_without_a_gpu(): ...

def test_anywhere(): ...
"""


def test_the_cuda_tests_are_those_that_skip_without_cuda(tmp_path: Path) -> None:
    (tmp_path / "tests" / "plan").mkdir(parents=True)
    (tmp_path / "tests" / "plan" / "test_gpu.py").write_text(_CUDA_TESTS)
    assert suite.cuda_test_ids(tmp_path / "tests", tmp_path) == [
        "tests/plan/test_gpu.py::test_on_a_gpu",
        "tests/plan/test_gpu.py::test_wrapped",
    ]
    found = suite.cuda_test_ids(ROOT / "tests", ROOT)
    assert "tests/plan/test_devices.py::test_cuda_device_capability_and_bf16" in found
    assert "tests/plan/test_devices.py::test_missing_cuda_is_a_clear_error" not in found


def test_pytest_counts_read_the_junit_report(tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    report.write_text(
        "<testsuites><testsuite>"
        '<testcase name="a"/><testcase name="b"><skipped/></testcase>'
        '<testcase name="c"><failure message="x"/></testcase><testcase name="d"><error/></testcase>'
        "</testsuite></testsuites>"
    )
    assert suite.pytest_counts(report) == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1}


def _run(name: str, ok: bool, **fields: Any) -> dict[str, Any]:
    layout, dtype = name.split(" ")[0].split("/")
    return {"run": name, "layout": layout, "dtype": dtype, "ok": ok, **fields}


def test_the_parts_read_off_gpu_check_report_its_runs() -> None:
    memory = {
        "cuda/fp32": [{"stage": 0, "allocated_ratio": 0.8}],
        "cuda+cpu/fp32": [{"stage": 0, "allocated_ratio": 1.2}],
    }
    report = {
        "runs": [
            _run("cuda/fp32", True, memory=memory["cuda/fp32"]),
            _run("cuda+cuda/fp32", True, memory=[]),
            _run("cuda+cuda/fp16", False, skipped_steps=[1]),
            _run("cuda+cpu/fp32", True, memory=memory["cuda+cpu/fp32"]),
            {"run": "cuda/fp16", "layout": "cuda", "dtype": "fp16", "skipped": "budget", "ok": None},
        ]
    }
    derived = suite.derived_parts(report)
    assert derived["s2_one_gpu"][:2] == ("fail", "1/2 cuda+cuda runs within tolerance")
    assert derived["fp16_loss_scaling"][:2] == ("fail", "0/1 fp16 runs within tolerance")
    assert derived["fp16_loss_scaling"][2]["cuda+cuda/fp16"]["skipped_steps"] == [1]
    status, summary, details = derived["memory_vs_plan"]
    assert (
        status == "above plan"
        and "cuda+cpu/fp32: 0:1.2" in summary
        and details["cuda/fp32"] == memory["cuda/fp32"]
    )
    assert {part[0] for part in suite.derived_parts(None).values()} == {"no data"}


def test_a_part_killed_before_its_limit_failed_and_one_stopped_at_it_timed_out() -> None:
    assert suite.stopped_by_timeout(124, 200, 200) and suite.stopped_by_timeout(137, 210, 200)
    assert not suite.stopped_by_timeout(137, 30, 200)  # killed early, e.g. for memory
    assert not suite.stopped_by_timeout(0, 200, 200)
    so_far = {"runs": [_run("cuda/fp32", True), {"run": "cuda/bf16", "skipped": "budget", "ok": None}]}
    assert suite.status_of("gpu_check", 124, "", so_far, timed_out=True) == (
        "timeout",
        "stopped at its time limit; so far: 1/1 runs within tolerance, 1 skipped",
    )
    assert suite.status_of("gpu_check", 137, "Killed\n", so_far, timed_out=False)[0] == "fail"
    no_torch = {"torch": "error: ModuleNotFoundError: No module named 'torch'", "pydantic": "2.13.4"}
    assert suite.status_of("install", 0, "", no_torch, timed_out=False) == (
        "fail",
        "cannot import torch: error: ModuleNotFoundError: No module named 'torch'",
    )


# ----- the stage-vs-peft benchmark ------------------------------------------------------------


def test_the_benchmark_model_has_llama_3_8b_layers() -> None:
    planned = stage_vs_peft.workload(stage_vs_peft.FULL, device="cuda:0", pairs=1)
    assert planned["model"] == {**stage_vs_peft.LLAMA3_8B, "num_layers": 2}
    assert planned["full_model_parameters"] == 8_030_261_248  # Llama-3-8B's parameter count
    assert (planned["sequence_len"], planned["micro_batch_size"], planned["lora_r"]) == (2048, 1, 16)
    assert planned["compute_dtype"] == "bf16"
    assert stage_vs_peft.examples_per_row(40.0, 2048) * 40 >= 2048


@pytest.mark.slow
def test_the_tiny_benchmark_trains_both_sides_on_the_cpu(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(_SCRIPTS / "bench_stage_vs_peft.py"), "--tiny", "--json", str(tmp_path / "b.json")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report == json.loads((tmp_path / "b.json").read_text())
    side_a, side_b = report["runs"]["A"][0], report["runs"]["B"][0]
    assert side_a["stages"] == 1 and side_a["tokens_per_s"] > 0 and side_b["tokens_per_s"] > 0
    # the report rounds ratios to 4 places: within half of the last place
    assert report["tokens_per_s_ratio_a_over_b"] == pytest.approx(
        side_a["tokens_per_s"] / side_b["tokens_per_s"], abs=5e-5
    )
    assert report["peak_memory_ratio_a_over_b"] == pytest.approx(
        side_a["peak_rss_bytes"] / side_b["peak_rss_bytes"], abs=5e-5
    )
    assert report["data"]["shortest_row_tokens"] > report["workload"]["sequence_len"]


def _bench_part_status(out: Path, part: str, file_name: str, report: dict[str, Any]) -> tuple[str, str]:
    """The status and summary line the suite gives ``part`` once its bench wrote ``report`` to
    ``file_name`` in ``out`` and exited 0."""
    (out / file_name).write_text(json.dumps(report))
    details = suite_report.part_details(part, out, "", None)
    return suite.status_of(part, 0, "", details, timed_out=False)


def test_the_pytorch_nf4_part_reads_the_paired_bench_it_ran(tmp_path: Path) -> None:
    report = {
        "tokens_per_s_ratio_a_over_b": {"median": 1.62, "min": 1.6, "max": 1.64, "spread": 0.04},
        "peak_memory_b_minus_a_median_bytes": 30 * suite.MIB,
        "dequantized_linear_bytes": 21 * suite.MIB + suite.MIB // 2,
    }
    status, summary = _bench_part_status(tmp_path, "torch_nf4_vs_bnb", "nf4-bench.json", report)
    assert status == "ok"
    assert summary == (
        "tokens/s bitsandbytes / PyTorch path 1.620; PyTorch path's extra peak 30.0 MiB against one "
        "dequantized linear, 21.5 MiB (target <= 110 %)"
    )


def test_the_generation_part_reads_the_bench_it_ran(tmp_path: Path) -> None:
    report = {
        "one_stage_over_peft": {"median": 1.042, "min": 1.01, "max": 1.07, "spread": 0.06},
        "two_stages_concurrent_over_alone": {"median": 3.5, "min": 3.4, "max": 3.6, "spread": 0.2},
        "time_to_first_token_s": {"prompt_tokens": 512, "one_stage": 0.031, "two_stages": 0.048},
    }
    status, summary = _bench_part_status(tmp_path, "generate", "generate.json", report)
    assert status == "ok"
    assert summary == (
        "one stage ÷ peft generate 1.042 (target >= 0.9); two stages on one GPU, 8 in flight ÷ one "
        "alone 3.500 (target >= 1.6); first token after 512 tokens 0.031 s / 0.048 s"
    )
