"""scripts/bench_hetero.py: its pure helpers, and its --quick run where the machine allows
(root, network namespaces, wireguard-go and a writable cgroup cpu controller)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import pytest
from shardpool_dev.bench import cgroups as bench_cgroups
from shardpool_dev.bench import procfs, stats
from shardpool_dev.bench.hetero import beside as hetero_beside
from shardpool_dev.bench.hetero import lab, modes
from shardpool_dev.bench.hetero import summary as hetero_summary

from tests.helpers.scripts import run_script

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_hetero.py"

MOUNTS_V1 = """\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
MOUNTS_V2 = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n"


def test_v2_is_chosen_only_where_the_unified_hierarchy_has_the_cpu_controller() -> None:
    assert bench_cgroups.choose_cgroup(
        MOUNTS_V1, {"/sys/fs/cgroup/unified": "hugetlb\n"}
    ) == bench_cgroups.CgroupChoice("v1", Path("/sys/fs/cgroup/cpu"))
    assert bench_cgroups.choose_cgroup(MOUNTS_V2, {"/sys/fs/cgroup": "cpuset cpu io memory pids\n"}) == (
        bench_cgroups.CgroupChoice("v2", Path("/sys/fs/cgroup"))
    )
    assert bench_cgroups.choose_cgroup(MOUNTS_V2, {"/sys/fs/cgroup": "cpuset io memory\n"}) is None
    assert bench_cgroups.choose_cgroup("proc /proc proc rw 0 0\n", {}) is None


def test_quota_files_cap_at_the_given_cpus() -> None:
    assert bench_cgroups.quota_files("v2", 0.3) == {"cpu.max": "3000 10000"}
    assert bench_cgroups.quota_files("v1", 0.6, period_us=100_000) == {
        "cpu.cfs_period_us": "100000",
        "cpu.cfs_quota_us": "60000",
    }
    assert bench_cgroups.quota_files("v2", 0.01)["cpu.max"] == "1000 10000", "the kernel's 1 ms floor"


def test_the_period_is_whole_milliseconds_from_10_to_the_kernels_1000() -> None:
    assert modes.parse_period_ms("100") == 100_000
    assert modes.parse_period_ms("10") == bench_cgroups.PERIOD_US == 10_000
    for bad in ("9", "1001", "0", "2.5", "ms"):
        with pytest.raises(argparse.ArgumentTypeError, match="--period-ms"):
            modes.parse_period_ms(bad)


def test_every_host_cgroup_gets_the_chosen_period(tmp_path: Path) -> None:
    """Written where a v1 hierarchy would be mounted: a plain directory takes the same files (but,
    unlike cgroupfs, keeps them, so its directories are not removed on exit)."""
    choice = bench_cgroups.CgroupChoice("v1", tmp_path)
    with bench_cgroups.HostCgroups(choice, {"a": 0.6, "b": 0.3}, period_us=100_000) as cgroups:
        quotas = {
            label: (
                (cgroups.path(label) / "cpu.cfs_quota_us").read_text(),
                (cgroups.path(label) / "cpu.cfs_period_us").read_text(),
            )
            for label in ("a", "b")
        }
    assert quotas == {"a": ("60000", "100000"), "b": ("30000", "100000")}


def test_hosts_are_two_or_three_quotas_fastest_first() -> None:
    assert modes.parse_hosts("0.6,0.3") == (0.6, 0.3)
    assert modes.parse_hosts("1.0,0.5,0.25") == (1.0, 0.5, 0.25)
    for bad in ("0.6", "0.3,0.6", "1,1,1,1", "0.6,0", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError):
            modes.parse_hosts(bad)


def test_the_cgroup_filesystem_is_mounted_as_the_machine_has_it() -> None:
    assert bench_cgroups.cgroupfs_mounts(bench_cgroups.CgroupChoice("v2", Path("/sys/fs/cgroup"))) == (
        "mount -t cgroup2 cgroup2 /sys/fs/cgroup"
    )
    together = bench_cgroups.cgroupfs_mounts(
        bench_cgroups.CgroupChoice("v1", Path("/sys/fs/cgroup/cpu,cpuacct"))
    )
    assert together.endswith("mount -t cgroup -o cpu,cpuacct cgroup /sys/fs/cgroup/cpu,cpuacct")


def test_the_gate_runs_the_command_only_after_a_line_and_keeps_the_arguments() -> None:
    argv = lab.gated_argv(["printf", "%s|", "a b", "$HOME"], prepare="false")
    done = subprocess.run(argv, input="go\n", capture_output=True, text=True, timeout=10)
    assert done.stdout == "a b|$HOME|", "arguments pass through unquoted, and a failing prepare is ignored"
    closed = subprocess.run(argv, input="", capture_output=True, text=True, timeout=10)
    assert closed.returncode != 0 and closed.stdout == "", "no line, no command"


def test_modes_keep_the_order_of_the_ways_and_refuse_unknown_ones() -> None:
    assert modes.parse_modes("pooled,even_split") == ("even_split", "pooled")
    assert modes.parse_modes("fastest_alone") == ("fastest_alone",)
    for bad in ("", "pooled,fast"):
        with pytest.raises(argparse.ArgumentTypeError):
            modes.parse_modes(bad)


def test_a_process_tree_is_its_root_and_every_descendant() -> None:
    parents = {1: 0, 10: 1, 11: 10, 12: 11, 20: 1, 21: 20}
    assert procfs.process_tree(10, parents) == {10, 11, 12}
    assert procfs.process_tree(12, parents) == {12}
    assert procfs.parent_pids()[os.getpid()] == os.getppid()


def test_the_stage_scope_keeps_a_hosts_own_processes_out_of_its_quota() -> None:
    assert lab.overhead_cgroup("a", "host") == "a"
    assert lab.overhead_cgroup("a", "stage") == "a-host"


def test_even_counts_put_the_extra_layers_first() -> None:
    assert modes.even_counts(16, 2) == [8, 8]
    assert modes.even_counts(16, 3) == [6, 5, 5]


def test_profile_swap_exchanges_the_same_model_and_workload_and_keeps_each_key() -> None:
    tail = "shape|mb1-seq128|torch=2|v3"
    first = {f"cpu AMD|threads=2|quota=0.6|{tail}": {"seconds_per_layer": 1.0}, "other|x|y|z": {"s": 9}}
    second = {f"cpu AMD|threads=2|quota=0.3|{tail}": {"seconds_per_layer": 2.0}}
    new_first, new_second, swapped = hetero_summary.swap_profile_entries(first, second)
    assert swapped == 1
    assert new_first[f"cpu AMD|threads=2|quota=0.6|{tail}"] == {"seconds_per_layer": 2.0}
    assert new_second[f"cpu AMD|threads=2|quota=0.3|{tail}"] == {"seconds_per_layer": 1.0}
    assert new_first["other|x|y|z"] == {"s": 9}


def test_repeats_are_a_whole_number_of_one_or_more() -> None:
    assert modes.parse_repeats("1") == 1 and modes.parse_repeats("3") == 3
    for bad in ("0", "-1", "1.5", "two"):
        with pytest.raises(argparse.ArgumentTypeError):
            modes.parse_repeats(bad)


def test_repeated_runs_go_in_abba_order_and_are_named_after_their_round() -> None:
    ways = ("fastest_alone", "pooled")
    assert stats.abba_order(ways, 1) == [("fastest_alone", 0), ("pooled", 0)], "as without --repeats"
    assert [mode for mode, _ in stats.abba_order(ways, 3)] == [
        "fastest_alone", "pooled", "pooled", "fastest_alone", "fastest_alone", "pooled"
    ]  # fmt: skip
    assert stats.abba_order(ways, 2)[2:] == [("pooled", 1), ("fastest_alone", 1)]
    assert [mode for mode, _ in stats.abba_order(modes.MODES, 2)] == [*modes.MODES, *reversed(modes.MODES)]
    assert modes.run_name("pooled", 0) == "pooled", "the first run keeps today's file names"
    assert modes.run_name("pooled", 1) == "pooled-2"


def test_the_side_by_side_ratio_is_the_median_of_each_rounds_ratio() -> None:
    runs = {
        "fastest_alone": [{"tokens_per_s": 100.0}, {"tokens_per_s": 160.0}, {"tokens_per_s": 120.0}],
        "pooled": [{"tokens_per_s": 130.0}, {"tokens_per_s": 200.0}, {"tokens_per_s": 150.0}],
    }
    order = stats.abba_order(("fastest_alone", "pooled"), 3)
    summary = hetero_summary.repeats_summary(order, runs)
    assert summary["count"] == 3
    assert summary["order"] == [
        "fastest_alone",
        "pooled",
        "pooled-2",
        "fastest_alone-2",
        "fastest_alone-3",
        "pooled-3",
    ]
    assert summary["tokens_per_s_by_run"]["pooled"] == [130.0, 200.0, 150.0]
    assert summary["tokens_per_s_median"] == {"fastest_alone": 120.0, "pooled": 150.0}
    assert summary["pooled_over_fastest_by_round"] == [1.3, 1.25, 1.25]
    assert summary["pooled_over_fastest"] == {"median": 1.25, "min": 1.25, "max": 1.3}
    # the ratio of the medians (150 / 120 = 1.25) need not be the median ratio: each round is its own pair
    assert summary["even_over_fastest"] == {"median": None, "min": None, "max": None}
    assert summary["even_over_fastest_by_round"] == []


def test_all_alone_rounds_compare_pooled_with_a_beside_busy_hosts_and_with_every_host_alone() -> None:
    """Round by round: pooled ÷ host a's tokens/s while b trained alone beside it, and pooled ÷ a + b
    alone at once (the hosts' separate throughput); a round without b's figure has neither sum."""
    runs = {
        "fastest_alone": [{"tokens_per_s": 120.0}, {"tokens_per_s": 125.0}],
        "all_alone": [
            {"tokens_per_s": 100.0, "beside": {"b": {"tokens_per_s": 50.0, "steps_measured": 5}}},
            {"tokens_per_s": 110.0, "beside": {"b": {"tokens_per_s": None, "steps_measured": 0}}},
        ],
        "pooled": [{"tokens_per_s": 135.0}, {"tokens_per_s": 143.0}],
    }
    order = stats.abba_order(("fastest_alone", "all_alone", "pooled"), 2)
    assert [modes.run_name(mode, repeat) for mode, repeat in order] == [
        "fastest_alone", "all_alone", "pooled", "pooled-2", "all_alone-2", "fastest_alone-2"
    ]  # fmt: skip
    summary = hetero_summary.repeats_summary(order, runs)
    assert summary["pooled_over_fastest_by_round"] == [1.125, 1.144]
    assert summary["pooled_over_fastest_beside_by_round"] == [1.35, 1.3]
    assert summary["pooled_over_fastest_beside"] == {"median": 1.325, "min": 1.3, "max": 1.35}
    assert summary["every_host_alone_tokens_per_s_by_round"] == [150.0, None]
    assert summary["pooled_over_every_host_alone_by_round"] == [0.9, None]
    assert summary["pooled_over_every_host_alone"] == {"median": 0.9, "min": 0.9, "max": 0.9}
    assert hetero_summary.every_host_tokens({"tokens_per_s": 100.0}) is None, "no host beside it: no sum"


def test_a_host_beside_trains_the_same_run_longer_with_its_quotas_threads(tmp_path: Path) -> None:
    config = {"max_steps": 14, "output_dir": "/x/out", "shardpool": {"placement": "local", "layers": [16]}}
    beside = hetero_beside.beside_config(config, tmp_path / "out-b", 0.3, "stage")
    assert beside["max_steps"] == 14 * hetero_beside.BESIDE_STEPS_FACTOR and beside["output_dir"] == str(
        tmp_path / "out-b"
    )
    assert beside["shardpool"] == {"placement": "local", "layers": [16], "threads_per_stage": 1}
    assert config["shardpool"] == {"placement": "local", "layers": [16]}, (
        "the fastest host's config is untouched"
    )
    assert "threads_per_stage" not in hetero_beside.beside_config(config, tmp_path, 0.3, "host")["shardpool"]


def test_a_metrics_line_still_being_written_is_not_read(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert hetero_summary.read_jsonl(metrics) == [{"step": 1, "loss": 2.0}]


def test_all_alone_runs_only_when_asked_for() -> None:
    assert "all_alone" in modes.MODES and "all_alone" not in modes.DEFAULT_MODES
    assert modes.parse_modes("all_alone,fastest_alone,pooled") == ("fastest_alone", "all_alone", "pooled")


def test_a_round_with_a_missing_figure_has_no_ratio_and_is_left_out_of_the_spread() -> None:
    tokens = {"fastest_alone": [100.0, None], "pooled": [150.0, 140.0]}
    assert stats.paired_ratios(tokens, "pooled", "fastest_alone") == [1.5, None]
    assert stats.paired_ratios(tokens, "even_split", "fastest_alone") == []
    assert stats.spread([1.5, None, 1.1]) == {"median": 1.3, "min": 1.1, "max": 1.5}


def test_a_process_in_a_throttled_cgroup_is_told_apart_by_pid_and_command() -> None:
    assert procfs.process_kind(7, "python -m shardpool mesh up", agent=7) == "agent"
    assert procfs.process_kind(8, "/usr/bin/python3 -m shardpool.elastic.rank job.json 1", agent=7) == "stage"
    assert procfs.process_kind(9, "python -m shardpool.plan.report", agent=7) == "profiler"
    assert procfs.process_kind(10, "wireguard-go wg0", agent=None) == "other"


def test_an_other_process_is_named_by_the_start_of_its_command_line() -> None:
    assert procfs.command_label("python3", "/usr/bin/python3 -m mesh.node.syncd --state-dir /x/y") == (
        "python3 -m mesh.node.syncd --state-dir"
    )
    assert procfs.command_label("kworker/0", "") == "kworker/0"


def test_cpu_ticks_come_from_utime_and_stime_of_proc_stat() -> None:
    stat = "123 (gloo (x) y) S 1 2 3 4 5 6 7 8 9 10 40 2 30 30 20 0 4 0 100 0 0"
    assert procfs.stat_cpu_ticks(stat) == ("gloo (x) y", 42), "utime 40 + stime 2; cutime, cstime left out"
    name, ticks = procfs.stat_cpu_ticks(Path(f"/proc/{os.getpid()}/stat").read_text())
    assert name and ticks >= 0


def test_cpu_seconds_by_kind_count_what_each_process_used_since_the_first_sample() -> None:
    cpu = procfs.ProcessCpu
    first = {1: cpu("agent", "python", 500), 2: cpu("other", "wireguard-go", 100)}
    last = {
        1: cpu("agent", "python", 520),
        2: cpu("other", "wireguard-go", 130),
        3: cpu("stage", "python", 900, first_seen_s=10.0, last_seen_s=40.0),  # started during the run
        4: cpu("profiler", "python", 50),
        5: cpu("other", "syncd", 10),
    }
    used = procfs.cpu_seconds_by_kind(first, last, ticks_per_s=100)
    assert used == {
        "stage": 9.0,
        "profiler": 0.5,
        "agent": 0.2,
        "other": 0.4,
        "other_by_name": {"syncd": 0.1, "wireguard-go": 0.3},
        "stage_seen_s": 30.0,
        "stage_cpus": 0.3,
    }
    assert procfs.cpu_seconds_by_kind({}, {}, ticks_per_s=100)["stage_cpus"] is None


def test_seen_windows_say_when_each_stage_and_profiler_ran_after_the_start() -> None:
    cpu = procfs.ProcessCpu
    seen = {
        1: cpu("stage", "s", 1, 140.0, 230.0),
        2: cpu("profiler", "p", 1, 110.04, 130.0),
        3: cpu("profiler", "p", 1, 150.0, 170.0),
        4: cpu("agent", "a", 1, 100.0, 230.0),
    }
    assert procfs.seen_windows(seen, since=100.0) == {
        "stage": [[40.0, 130.0]],
        "profiler": [[10.0, 30.0], [50.0, 70.0]],
    }


def test_a_process_keeps_its_kind_when_its_command_line_empties_at_exit() -> None:
    cpu = procfs.ProcessCpu
    last = {
        3: cpu("other", "python", 1, 1.0, 1.0),
        4: cpu("stage", "python -m shardpool.elastic.rank", 50, 0.5, 1.0),
    }
    now = {
        3: cpu("profiler", "python -m shardpool.plan.report", 20, 2.0, 2.0),
        4: cpu("other", "python", 70, 2.0, 2.0),
    }
    assert procfs.merged_sample(last, now) == {
        3: cpu("profiler", "python -m shardpool.plan.report", 20, 1.0, 2.0),  # exec'd since the last sample
        4: cpu("stage", "python -m shardpool.elastic.rank", 70, 0.5, 2.0),  # a zombie: kind kept, ticks new
    }
    assert procfs.merged_sample(last, {})[4].ticks == 50, "gone: its last ticks stay"


def test_cpu_stat_delta_is_each_counters_growth() -> None:
    before = "nr_periods 10\nnr_throttled 4\nthrottled_time 1000\n"
    after = "nr_periods 110\nnr_throttled 54\nthrottled_time 91000\nusage_usec 7\n"
    assert procfs.cpu_stat_delta(before, after) == {
        "nr_periods": 100,
        "nr_throttled": 50,
        "throttled_time": 90000,
        "usage_usec": 7,
    }
    assert procfs.cpu_stat_delta("", "") == {}


def _step(step: int, seconds: float, compute: list[float], wait: list[float]) -> dict:
    return {
        "step": step,
        "loss": 1.0 / step,
        "step_seconds": seconds,
        "tokens_per_s": 100.0 / seconds,
        "stage_compute_s": compute,
        "stage_wait_s": wait,
    }


def test_a_run_is_summarized_after_warmup_per_stage_and_per_layer() -> None:
    plan = {
        "predicted_step_s": 1.5,
        "stages": [
            {"host": "a", "layers": [0, 3], "device": "cpu", "measured": {"seconds_median": 0.1}},
            {"host": "b", "layers": [3, 4], "device": "cpu", "measured": {"seconds_median": 0.2}},
        ],
    }
    records = [_step(1, 9.0, [5.0, 5.0], [1.0, 1.0])] + [
        _step(step, 2.0, [1.5, 0.8], [0.1, 0.9]) for step in range(2, 5)
    ]
    records.append({"step": 4, "eval_loss": 0.5})
    summary = hetero_summary.summarize_run(records, plan, warmup=1)
    assert summary["steps_trained"] == 4 and summary["steps_measured"] == 3
    assert summary["step_s"] == 2.0 and summary["tokens_per_s"] == 50.0
    assert summary["predicted_over_measured_step"] == 0.75
    assert summary["stage_wait_over_step"] == [0.05, 0.45]
    assert summary["compute_s_per_layer_by_host"] == {"a": 0.5, "b": 0.8}
    assert "after_rebalance" not in summary
    assert hetero_summary.profiled_seconds_per_layer([plan]) == {"a": 0.1, "b": 0.2}


def test_a_rebalanced_run_compares_each_plan_with_its_own_steps() -> None:
    plan = {
        "predicted_step_s": 1.0,
        "history": [{"predicted_step_s": 3.0}],
        "stages": [
            {"host": "a", "layers": [0, 2], "device": "cpu"},
            {"host": "b", "layers": [2, 4], "device": "cpu"},
        ],
    }
    records = [_step(step, 2.0, [1.0, 1.0], [0.0, 0.0]) for step in range(1, 4)]
    records.append(
        {"event": "rebalance", "step": 3, "from": [[0, 3], [3, 4]], "to": [[0, 2], [2, 4]],
         "predicted_step_s": 1.0, "current_step_s": 2.0, "reason": "measured"}
    )  # fmt: skip
    records += [_step(step, 1.25, [1.0, 1.0], [0.0, 0.0]) for step in range(4, 8)]
    summary = hetero_summary.summarize_run(records, plan, warmup=1)
    assert summary["predicted_step_s"] == 3.0, "the plan the run started with"
    assert summary["predicted_over_measured_step"] == 1.5, "against the steps before the re-shard"
    assert summary["after_rebalance"] == {
        "steps_measured": 3,
        "predicted_step_s": 1.0,
        "step_s": 1.25,
        "predicted_over_measured_step": 0.8,
    }
    assert summary["compute_s_per_layer_by_host"] is None
    assert len(hetero_summary.rebalance_events(records)) == 1


def test_recovery_from_swapped_profiles_is_the_first_step_that_stays_near_the_pooled_run() -> None:
    assert hetero_summary.first_step_reaching([10, 50, 95, 60, 100, 100, 100], 90) == 5
    assert hetero_summary.first_step_reaching([100, 100], 90) == 1
    assert hetero_summary.first_step_reaching([10, 20], 90) is None
    assert hetero_summary.first_step_reaching([], 90) is None
    swapped = {"tokens_per_s": 80.0, "tokens_per_s_by_step": [40.0, 45.0, 95.0, 96.0]}
    event = {"event": "rebalance", "step": 2}
    summary = hetero_summary.swapped_summary(swapped, {"tokens_per_s": 100.0}, [event])
    assert summary["first_step_at_90pct_of_pooled"] == 3 and summary["over_pooled"] == 0.8
    assert summary["rebalanced"] and summary["rebalances"] == [event]


@pytest.mark.netns
@pytest.mark.slow
def test_quick_even_split_trains_on_both_hosts_and_the_quota_throttles() -> None:
    """The even split alone (``--modes even_split``): it forms the mesh, throttles both hosts,
    profiles each under its quota and trains on both, which only a real run can show; the other
    two ways differ from it by their ``shardpool`` block (``mode_settings``, above) and are the
    full bench's figures. All three ways took 119 s of the suite; the even split alone 65 s at
    1.0 + 0.5 CPU, most of it host b's imports (its profiler's and its stage's). At 0.75 (57 s) b
    trained faster per layer than a in one CI run (0.027 against 0.034 s): a stage that waits on
    its neighbour does not use all of a 1.0 quota, so 1.0 and 0.75 are too close; b stays at 0.5.
    Until 2026-11-25 the test also compared b's compute per layer with a's and ran alone
    (``timing``: the other tests waited 81-85 s); what the quota does is now read where it shows
    whatever else loads the machine: b's stage never got more CPU than its quota, and the kernel
    throttled b's cgroup."""
    reason = lab.skip_reason()
    if reason is not None:
        pytest.skip(reason)
    script = run_script(_SCRIPT, "--quick", "--modes", "even_split", "--hosts", "1.0,0.5")
    assert script.returncode == 0, script.stderr[-2000:]
    report = json.loads(script.stdout)
    assert "skipped" not in report, report
    assert list(report["runs"]) == ["even_split"] and report["pooled_over_fastest"] is None
    run = report["runs"]["even_split"]
    assert run["steps_trained"] == modes.QUICK["max_steps"], run
    assert run["tokens_per_s"] > 0 and run["step_s"] > 0 and run["predicted_step_s"] > 0
    assert all(seconds > 0 for seconds in run["stage_compute_s"]), run
    assert report["quota_scope"] == "stage" and report["cfs_period_ms"] == 10
    assert len(report["runs"]["even_split"]["plan"]) == 2
    assert report["seconds_per_layer_by_host"]["profile_cpu_quota"] == {"a": 1.0, "b": 0.5}
    b = run["cgroup_cpu_s"]["b"]
    assert 0 < b["stage_cpus"] <= 0.5 * 1.1, b  # 10 %: the 0.5 s sampling's edges
    assert b["cpu_stat"]["nr_throttled"] > 0, b
    assert all(seconds > 0 for seconds in report["seconds_per_layer_by_host"]["even_split_compute"].values())
    assert not list(bench_cgroups.detect_cgroup().mount.glob(f"shardpool-bench-{script.pid}")), (
        "cgroups removed"
    )
    assert (
        f"sp{script.pid}-"
        not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    )
