"""The pure parts of scripts/bench_state_copy.py: its copy of shared names and the copy size it reports."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

_SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(_SCRIPTS))
state_copy = importlib.import_module("bench_state_copy")


def test_the_script_names_the_hook_and_the_live_root_as_the_package_does() -> None:
    from shardpool.contract.liveness import LIVE_ROOT
    from shardpool.train.worker import KEEP_STATE_HOOK

    assert state_copy.LIVE_ROOT == LIVE_ROOT
    assert state_copy.KEEP_STATE_HOOK == KEEP_STATE_HOOK


def test_copy_bytes_per_step_is_the_median_step_summed_over_its_files(tmp_path: Path) -> None:
    assert state_copy.copy_bytes_per_step(tmp_path) == 0
    for step, sizes in ((1, (10, 20)), (2, (10, 30)), (3, (10, 40))):
        directory = tmp_path / state_copy.LIVE_ROOT / f"step-{step}"
        directory.mkdir(parents=True)
        for index, size in enumerate(sizes):
            (directory / f"f{index}").write_bytes(b"x" * size)
    assert state_copy.copy_bytes_per_step(tmp_path) == 40
