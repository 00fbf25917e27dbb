"""Fleet files: the seed fleet loads; bad files give one clear line through the real CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardpool.errors import ShardpoolError
from shardpool.plan.fleet import DEFAULT_LINK, GIB, fleet_from_dict, load_fleet

ROOT = Path(__file__).resolve().parents[2]


def test_example_fleets_load() -> None:
    for path in sorted((ROOT / "configs").glob("fleet-*.yaml")):
        fleet = load_fleet(path)
        assert fleet.devices, path
    seed = load_fleet(ROOT / "configs/fleet-seed.yaml")
    assert [d.name for d in seed.devices] == ["rtx3090", "rtx4090", "v100", "m40"]
    assert seed.device("v100").memory_bytes == 16 * GIB
    assert seed.link("alpha", "beta").bandwidth == pytest.approx(10e9 / 8)
    assert seed.link("gamma", "gamma") == seed.loopback


def test_list_form_defaults_host_to_name_and_unlisted_links_to_default() -> None:
    fleet = fleet_from_dict(
        [{"name": "a", "memory_gib": 8, "tflops": 10}, {"name": "b", "memory_gib": 8, "tflops": 10}]
    )
    assert [d.host for d in fleet.devices] == ["a", "b"]
    assert fleet.link("a", "b") == DEFAULT_LINK


BAD_FLEETS = {
    "zero devices": ("devices: []\n", "zero devices"),
    "empty file": ("", "zero devices"),
    "negative memory": ("- {name: a, memory_gib: -4, tflops: 10}\n", "memory_gib"),
    "no speed": ("- {name: a, memory_gib: 4}\n", "tflops"),
    "duplicate name": (
        "- {name: a, memory_gib: 4, tflops: 1}\n- {name: a, memory_gib: 4, tflops: 1}\n",
        "more than once",
    ),
    "unknown link host": (
        "devices:\n- {name: a, memory_gib: 4, tflops: 1}\nlinks:\n- {hosts: [a, zz], bandwidth_gbps: 1, latency_ms: 1}\n",
        "'zz' has no device",
    ),
    "self link": (
        "devices:\n- {name: a, memory_gib: 4, tflops: 1}\nlinks:\n- {hosts: [a, a], bandwidth_gbps: 1, latency_ms: 1}\n",
        "to itself",
    ),
    "duplicate link": (
        "devices:\n- {name: a, memory_gib: 4, tflops: 1}\n- {name: b, memory_gib: 4, tflops: 1}\n"
        "links:\n- {hosts: [a, b], bandwidth_gbps: 1, latency_ms: 1}\n- {hosts: [b, a], bandwidth_gbps: 9, latency_ms: 1}\n",
        "listed twice",
    ),
    "zero bandwidth": (
        "devices:\n- {name: a, memory_gib: 4, tflops: 1}\n- {name: b, memory_gib: 4, tflops: 1}\n"
        "links:\n- {hosts: [a, b], bandwidth_gbps: 0, latency_ms: 1}\n",
        "bandwidth_gbps",
    ),
    "unknown key": ("- {name: a, memory_gib: 4, tflops: 1, vram: 3}\n", "vram"),
    "broken yaml": ("- {name: a, memory_gib: 4\n", "cannot read fleet file"),
}


@pytest.mark.parametrize("case", sorted(BAD_FLEETS))
def test_bad_fleet_files_in_process(tmp_path: Path, case: str) -> None:
    text, expected = BAD_FLEETS[case]
    path = tmp_path / "fleet-bad.yaml"
    path.write_text(text)
    with pytest.raises(ShardpoolError, match=expected) as error:
        load_fleet(path)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("case", ["zero devices", "negative memory", "unknown link host", "duplicate link"])
def test_bad_fleet_files_through_cli(tmp_path: Path, case: str) -> None:
    text, expected = BAD_FLEETS[case]
    path = tmp_path / "fleet-bad.yaml"
    path.write_text(text)
    result = subprocess.run(
        [sys.executable, "-m", "shardpool", "plan", "configs/quickstart.yaml", "--fleet", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0] and lines[0].startswith("shardpool: error:")
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_missing_fleet_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ShardpoolError, match="does not exist"):
        load_fleet(tmp_path / "nope.yaml")
