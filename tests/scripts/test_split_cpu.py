"""scripts/split_cpu.py: its pure helpers, and its --quick run where the machine allows (root and a
writable cgroup cpu controller)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
from shardpool_dev.bench import cgroups
from shardpool_dev.bench import split as split_lib

from tests.helpers.scripts import run_script

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "split_cpu.py"


def test_a_split_names_layers_and_the_host_of_each_stage() -> None:
    split = split_lib.parse_split("6,5,5@a,b,a", hosts=2, num_layers=16)
    assert split.layers == (6, 5, 5) and split.hosts == ("a", "b", "a")
    assert split.name == "6,5,5@a,b,a"
    assert split_lib.parse_split("16", hosts=2, num_layers=16).hosts == ("a",), "one stage: host a"
    for bad in ("11,5@a", "11,5@a,c", "10,5@a,b", "11,0,5@a,b,a", "x@a"):
        with pytest.raises(argparse.ArgumentTypeError):
            split_lib.parse_split(bad, hosts=2, num_layers=16)


def test_runs_go_in_abba_order() -> None:
    assert split_lib.abba(["w", "s"], 3) == ["w", "s", "s", "w", "w", "s"]


def test_a_stage_is_told_by_its_command_line_and_its_rank_is_the_last_argument() -> None:
    assert split_lib.stage_rank(["python", "-m", "shardpool.elastic.rank", "job.json", "2"]) == 2
    assert split_lib.stage_rank(["python", "-m", "shardpool", "finetune", "run.yaml"]) is None
    assert split_lib.stage_rank([]) is None


def test_cpu_and_page_faults_per_step_are_counted_per_stage_and_cpu_added_up_per_host() -> None:
    before = {10: (1.0, 0.1, 100), 11: (2.0, 0.0, 0), 12: (0.0, 0.0, 7)}
    after = {10: (5.0, 0.5, 4100), 11: (4.0, 0.2, 10), 12: (3.0, 0.2, 7)}
    figures = split_lib.window_figures(before, after, {10: 0, 11: 1, 12: 2}, ("a", "b", "a"), steps=2)
    assert [stage["cpu_s_per_step"] for stage in figures["stages"]] == [2.2, 1.1, 1.6]
    assert [stage["system_s_per_step"] for stage in figures["stages"]] == [0.2, 0.1, 0.1]
    assert [stage["minor_faults_per_step"] for stage in figures["stages"]] == [2000, 5, 0]
    assert figures["host_cpu_s_per_step"] == {"a": 3.8, "b": 1.1}
    assert figures["cpu_s_per_step"] == 4.9


def test_each_split_is_the_median_of_its_runs_and_a_ratio_to_the_first() -> None:
    runs = [
        {"split": "w", "wall_s_per_step": 8.0, "cpu_s_per_step": 5.0},
        {"split": "s", "wall_s_per_step": 6.0, "cpu_s_per_step": 5.5},
        {"split": "s", "wall_s_per_step": 7.0, "cpu_s_per_step": 5.3},
        {"split": "w", "wall_s_per_step": 9.0, "cpu_s_per_step": 5.2},
    ]
    medians = split_lib.summarize(runs, ["w", "s"])
    assert medians["w"] == {
        "runs": 2, "wall_s_per_step": 8.5, "cpu_s_per_step": 5.1, "step_over_first": 1.0, "cpu_over_first": 1.0,
    }  # fmt: skip
    assert medians["s"]["step_over_first"] == round(6.5 / 8.5, 3)
    assert medians["s"]["cpu_over_first"] == round(5.4 / 5.1, 3)


@pytest.mark.slow  # not ``timing``: what it asserts (each stage measured, b held to its quota) holds under load
def test_quick_run_measures_each_stage_under_its_hosts_quota() -> None:
    if os.geteuid() != 0 or cgroups.cgroup_skip_reason() is not None:
        pytest.skip("needs root and a writable cgroup cpu controller")
    run = run_script(_SCRIPT, "--quick", "--repeats", "1", "--steps", "12")
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert list(report["splits"]) == list(split_lib.QUICK_SPLITS)
    assert report["cfs_period_ms"] == 10
    whole, split = report["runs"]
    assert [stage["host"] for stage in whole["stages"]] == ["a"]
    assert [stage["host"] for stage in split["stages"]] == ["a", "b"]
    assert all(stage["cpu_s_per_step"] > 0 for run in report["runs"] for stage in run["stages"])
    # b's stage ran under its 0.5 quota: it never had more CPU than that while the step lasted.
    assert split["host_cpu_s_per_step"]["b"] <= 0.5 * split["wall_s_per_step"] * 1.1, split
    assert not list(cgroups.detect_cgroup().mount.glob(f"shardpool-bench-{run.pid}")), "cgroups removed"
