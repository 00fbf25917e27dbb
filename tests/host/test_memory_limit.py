"""A CPU device's memory honours the cgroup memory limit of the process (v1 and v2, any ancestor):
the parsers fed sample file contents, the reader over a fake cgroup tree, and the device report."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardpool.host import memory_limit
from shardpool.host.memory_limit import (
    CgroupMemory,
    capped_memory,
    cgroup_memory,
    cpu_room_bytes,
    memory_cgroup_paths,
    memory_stat,
    parse_memory_limit,
    parse_resident_memory,
    resident_memory,
    room_after_peak,
)
from shardpool.plan import devices

GIB = 1 << 30
V1_CGROUP = """12:pids:/user.slice
4:cpu,cpuacct:/slow.slice/job
3:memory:/slurm/uid_1000/job_42
1:name=systemd:/user.slice
"""
V2_CGROUP = "0::/system.slice/member.service\n"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_memory_cgroup_paths_finds_the_v1_memory_controller_and_the_v2_path() -> None:
    assert memory_cgroup_paths(V1_CGROUP) == ("/slurm/uid_1000/job_42", None)
    assert memory_cgroup_paths(V2_CGROUP) == (None, "/system.slice/member.service")
    assert memory_cgroup_paths("garbage\n7:memory:relative\n") == (None, None)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("max\n", None), ("1073741824\n", GIB), ("9223372036854771712\n", None), ("", None), ("-1", None)],
)
def test_parse_memory_limit(text: str, expected: int | None) -> None:
    assert parse_memory_limit(text) == expected


def test_v2_takes_the_cgroup_that_leaves_the_least_up_to_the_root(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text(V2_CGROUP)
    root = tmp_path / "fs"
    _write(root / "system.slice/member.service/memory.max", "max\n")
    _write(root / "system.slice/member.service/memory.current", str(GIB))
    assert cgroup_memory(proc_self_cgroup=proc, root=root) is None
    _write(root / "system.slice/memory.max", str(8 * GIB))
    _write(root / "system.slice/memory.current", str(5 * GIB))  # its siblings use memory too
    assert cgroup_memory(proc_self_cgroup=proc, root=root) == CgroupMemory(8 * GIB, 3 * GIB)
    _write(root / "system.slice/member.service/memory.max", str(4 * GIB))
    _write(root / "system.slice/member.service/memory.current", str(GIB // 2))
    # the own cgroup has a smaller limit but leaves more (3.5 GiB) than the parent: the parent counts
    assert cgroup_memory(proc_self_cgroup=proc, root=root) == CgroupMemory(8 * GIB, 3 * GIB)
    _write(root / "system.slice/member.service/memory.current", str(3 * GIB + GIB // 2))
    assert cgroup_memory(proc_self_cgroup=proc, root=root) == CgroupMemory(4 * GIB, GIB // 2)


def test_v1_reads_limit_in_bytes_and_usage_in_bytes(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text(V1_CGROUP)
    root = tmp_path / "fs"
    job = root / "memory/slurm/uid_1000/job_42"
    _write(job / "memory.limit_in_bytes", "9223372036854771712\n")
    _write(job / "memory.usage_in_bytes", str(GIB))
    assert cgroup_memory(proc_self_cgroup=proc, root=root) is None
    _write(job / "memory.limit_in_bytes", str(2 * GIB))
    assert cgroup_memory(proc_self_cgroup=proc, root=root) == CgroupMemory(2 * GIB, GIB)
    _write(job / "memory.usage_in_bytes", str(3 * GIB))  # over the limit (reclaimable cache): 0 left
    assert cgroup_memory(proc_self_cgroup=proc, root=root) == CgroupMemory(2 * GIB, 0)
    assert cgroup_memory(proc_self_cgroup=tmp_path / "missing", root=root) is None


def test_a_container_that_sees_its_cgroup_as_the_root_reads_the_mount_itself(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    root = tmp_path / "fs"
    _write(root / "memory.max", str(6 * GIB))
    _write(root / "memory.current", str(GIB))
    assert cgroup_memory(proc_self_cgroup=proc, root=root) == CgroupMemory(6 * GIB, 5 * GIB)


def test_capped_memory_is_the_smaller_of_the_machine_and_the_cgroup() -> None:
    assert capped_memory(32 * GIB, 20 * GIB, None) == (32 * GIB, 20 * GIB)
    assert capped_memory(32 * GIB, 20 * GIB, CgroupMemory(4 * GIB, 3 * GIB)) == (4 * GIB, 3 * GIB)
    assert capped_memory(32 * GIB, 2 * GIB, CgroupMemory(4 * GIB, 3 * GIB)) == (4 * GIB, 2 * GIB)
    assert capped_memory(8 * GIB, 6 * GIB, CgroupMemory(64 * GIB, 60 * GIB)) == (8 * GIB, 6 * GIB)


def test_the_cpu_device_reports_the_cgroup_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    monkeypatch.setattr(
        memory_limit.psutil, "virtual_memory", lambda: SimpleNamespace(total=32 * GIB, available=20 * GIB)
    )
    monkeypatch.setattr(memory_limit, "cgroup_memory", lambda: CgroupMemory(3 * GIB, GIB))
    info = devices.device_info("cpu", nf4=False)
    assert (info.total_bytes, info.free_bytes) == (3 * GIB, GIB)
    monkeypatch.setattr(memory_limit, "cgroup_memory", lambda: None)
    info = devices.device_info("cpu", nf4=False)
    assert (info.total_bytes, info.free_bytes) == (32 * GIB, 20 * GIB)


def test_the_inactive_file_cache_is_not_counted_as_used(tmp_path: Path) -> None:
    """Page cache the kernel drops before it refuses memory leaves room: usage is the working set."""
    proc = tmp_path / "cgroup"
    proc.write_text(V1_CGROUP)
    root = tmp_path / "fs"
    job = root / "memory/slurm/uid_1000/job_42"
    _write(job / "memory.limit_in_bytes", str(4 * GIB))
    _write(job / "memory.usage_in_bytes", str(3 * GIB))
    _write(job / "memory.stat", f"cache 123\ninactive_file 7\ntotal_inactive_file {2 * GIB}\nbad line here\n")
    assert cgroup_memory(proc_self_cgroup=proc, root=root) == CgroupMemory(4 * GIB, 3 * GIB)
    v2 = tmp_path / "cgroup2"
    v2.write_text(V2_CGROUP)
    service = tmp_path / "fs2/system.slice/member.service"
    _write(service / "memory.max", str(2 * GIB))
    _write(service / "memory.current", str(2 * GIB))
    _write(service / "memory.stat", f"anon {GIB}\ninactive_file {GIB // 2}\n")
    assert cgroup_memory(proc_self_cgroup=v2, root=tmp_path / "fs2") == CgroupMemory(2 * GIB, GIB // 2)
    assert memory_stat("a 1\nb x\nc 2 3\n") == {"a": 1}


STATUS = """Name:\tpython3
VmPeak:\t 4000000 kB
VmHWM:\t  900000 kB
VmRSS:\t  600000 kB
Threads:\t4
"""


def test_resident_memory_is_read_from_proc_status() -> None:
    assert parse_resident_memory(STATUS) == (600000 * 1024, 900000 * 1024)
    assert parse_resident_memory("Name:\tpython3\nVmRSS:\t 10 kB\n") is None, "no VmHWM: not guessed"
    here = resident_memory()
    assert here is not None and 0 < here.current_bytes <= here.peak_bytes


def test_the_room_is_what_is_free_less_the_peak_above_what_is_held_now() -> None:
    # 4 GiB free; the peak of each step took 1 GiB above what the process holds between steps.
    assert room_after_peak(4 * GIB, peak_bytes=3 * GIB, in_use_bytes=2 * GIB) == 3 * GIB
    assert room_after_peak(4 * GIB, peak_bytes=2 * GIB, in_use_bytes=2 * GIB) == 4 * GIB
    assert room_after_peak(GIB, peak_bytes=5 * GIB, in_use_bytes=2 * GIB) == 0, "never below 0"


def test_the_cpu_room_is_cut_by_the_cgroup_cap_and_the_processs_own_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    monkeypatch.setattr(
        memory_limit.psutil, "virtual_memory", lambda: SimpleNamespace(total=32 * GIB, available=20 * GIB)
    )
    monkeypatch.setattr(memory_limit, "cgroup_memory", lambda: CgroupMemory(8 * GIB, 3 * GIB))
    monkeypatch.setattr(memory_limit, "resident_memory", lambda: parse_resident_memory(STATUS))
    assert cpu_room_bytes() == 3 * GIB - 300000 * 1024
    monkeypatch.setattr(memory_limit, "cgroup_memory", lambda: None)
    assert cpu_room_bytes() == 20 * GIB - 300000 * 1024
