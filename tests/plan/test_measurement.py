"""How a profile was taken travels into plan.json: the cgroup CPU quota parsers (pure, fed sample
file contents), the report's measured fields, and each stage's ``measured`` record."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardpool.host.cpu_quota import cgroup_paths, cpu_quota, parse_cfs_quota, parse_cpu_max, usable_cpus
from shardpool.model.shape import ModelShape
from shardpool.plan import report
from shardpool.plan.costmodel import Workload
from shardpool.plan.device_facts import DeviceInfo, LayerProfile, Measurement
from shardpool.plan.fleet import Device, Fleet
from shardpool.plan.local_fleet import local_fleet
from shardpool.plan.planner import plan_pipeline
from shardpool.plan.result import Plan
from tests.plan.test_planner import EIGHT_B, FixedProbe

V1_CGROUP = """12:pids:/user.slice
4:cpu,cpuacct:/slow.slice/job
3:memory:/slow.slice/job
1:name=systemd:/user.slice
0::/
"""
V2_CGROUP = "0::/system.slice/member.service\n"
PROFILE = LayerProfile(
    0.01, 1000, None, "cpu", "cpu test", 2, 5, forward_seconds=0.004, embed_seconds=0.001,
    head_forward_seconds=0.002, head_backward_seconds=0.003, optimizer_seconds=0.0005,
    seconds_min=0.009, seconds_max=0.013, cpu_quota=0.6, ci95_rel=0.04,
)  # fmt: skip


def test_cgroup_paths_finds_the_v1_cpu_controller_and_the_v2_path() -> None:
    assert cgroup_paths(V1_CGROUP) == ("/slow.slice/job", "/")
    assert cgroup_paths(V2_CGROUP) == (None, "/system.slice/member.service")
    assert cgroup_paths("garbage\n2:cpuacct:/x\n") == (None, None)


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("max 100000\n", None), ("60000 100000\n", 0.6), ("30000 100000", 0.3), ("200000 50000", 4.0),
     ("150000", 1.5), ("", None), ("x 100000", None), ("0 100000", None)],
)  # fmt: skip
def test_parse_cpu_max(text: str, cpus: float | None) -> None:
    assert parse_cpu_max(text) == (None if cpus is None else pytest.approx(cpus))


def test_parse_cfs_quota() -> None:
    assert parse_cfs_quota("-1\n", "100000\n") is None
    assert parse_cfs_quota("30000\n", "100000\n") == pytest.approx(0.3)
    assert parse_cfs_quota("50000", "0") is None
    assert parse_cfs_quota("junk", "100000") is None


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(
    ("cores", "quota", "threads"),
    [
        (2, None, 2),
        (16, None, 16),
        (2, 0.3, 1),
        (2, 0.6, 1),
        (2, 1.0, 1),
        (4, 1.5, 2),
        (2, 3.0, 2),
        (1, None, 1),
    ],
)
def test_usable_cpus_caps_threads_at_the_quota_rounded_up(
    cores: int, quota: float | None, threads: int
) -> None:
    # A stage under a 0.6-CPU quota runs one thread: a second one only waits for the quota.
    assert usable_cpus(cores, quota) == threads


def test_cpu_quota_v2_takes_the_tightest_quota_up_to_the_root(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text(V2_CGROUP)
    root = tmp_path / "fs"
    _write(root / "system.slice/member.service/cpu.max", "max 100000\n")
    assert cpu_quota(proc_self_cgroup=proc, root=root) is None
    _write(root / "system.slice/cpu.max", "50000 100000\n")
    assert cpu_quota(proc_self_cgroup=proc, root=root) == pytest.approx(0.5)
    _write(root / "system.slice/member.service/cpu.max", "30000 100000\n")
    assert cpu_quota(proc_self_cgroup=proc, root=root) == pytest.approx(0.3)


def test_cpu_quota_v1_reads_cfs_quota_and_period(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text(V1_CGROUP)
    root = tmp_path / "fs"
    _write(root / "cpu/slow.slice/job/cpu.cfs_quota_us", "-1\n")
    _write(root / "cpu/slow.slice/job/cpu.cfs_period_us", "100000\n")
    assert cpu_quota(proc_self_cgroup=proc, root=root) is None
    _write(root / "cpu/slow.slice/job/cpu.cfs_quota_us", "60000\n")
    assert cpu_quota(proc_self_cgroup=proc, root=root) == pytest.approx(0.6)
    assert cpu_quota(proc_self_cgroup=tmp_path / "missing", root=root) is None


def test_the_report_row_carries_the_measured_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    info = DeviceInfo("cpu", "cpu", "cpu test", 8 << 30, 4 << 30, threads=2)
    monkeypatch.setattr(report, "list_devices", lambda: [info])
    monkeypatch.setattr(report, "profile_layer", lambda shape, workload, *, device, threads: PROFILE)
    (row,) = report.device_rows(EIGHT_B, Workload())
    assert row["seconds_per_layer"] == 0.01 and row["threads"] == 2
    assert {name: row[name] for name in report.MEASURED_FIELDS} == {
        "forward_seconds": 0.004, "embed_seconds": 0.001, "head_forward_seconds": 0.002,
        "head_backward_seconds": 0.003, "optimizer_seconds": 0.0005, "runs": 5,
        "seconds_min": 0.009, "seconds_max": 0.013, "cpu_quota": 0.6, "ci95_rel": 0.04,
    }  # fmt: skip


def test_plan_json_records_how_each_stage_device_was_measured() -> None:
    workload = Workload(sequence_len=512)
    fleet = local_fleet(["cpu", "cpu"], shape=EIGHT_B, workload=workload, probe=FixedProbe(PROFILE))
    fleet = Fleet(
        devices=tuple(Device(**{**d.__dict__, "memory_bytes": 64 << 30}) for d in fleet.devices),
        loopback=fleet.loopback,
    )
    plan = plan_pipeline(EIGHT_B, workload, fleet)
    expected = {
        "label": "cpu test", "threads": 2, "cpu_quota": 0.6, "runs": 5,
        "seconds_min": 0.009, "seconds_median": 0.01, "seconds_max": 0.013, "ci95_rel": 0.04,
        "co_run": 1.0,
    }  # fmt: skip
    data = plan.to_json()
    assert data["stages"] and all(stage["measured"] == expected for stage in data["stages"])
    assert {"predicted_step_s", "bubble_fraction", "stages"} <= set(data), "existing keys stay"
    assert Plan.from_json(data).stages[0].measured == expected


def test_a_device_given_by_speed_has_no_measured_record() -> None:
    shape: ModelShape = EIGHT_B
    fleet = Fleet(devices=(Device("gpu", 80 << 30, tflops=100.0),))
    data = plan_pipeline(shape, Workload(sequence_len=512), fleet).to_json()
    assert "measured" not in data["stages"][0]
    assert (
        Plan.from_json({"stages": [{"device": "cpu", "layers": [0, 2], "measured": "junk"}]})
        .stages[0]
        .measured
        == {}
    )


def test_measurement_of_a_profile() -> None:
    assert Measurement.of(PROFILE).to_json()["seconds_median"] == 0.01
