"""The pure parts of scripts/bench_state_copy.py: its copy of shared names and the copy size it reports."""

from __future__ import annotations

from pathlib import Path

from shardpool_dev.bench import state_copy


def test_the_script_names_the_hook_and_the_live_root_as_the_package_does() -> None:
    from shardpool.contract.liveness import LIVE_ROOT
    from shardpool.elastic.rank import KEEP_STATE_HOOK

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


def test_the_direct_cost_is_the_median_share_after_the_warm_up_steps() -> None:
    def line(step: int, blocked: list[float], cpu: list[float], window: list[float]) -> dict:
        return {"step": step, "step_seconds": 2.0, "stage_copy_blocked_s": blocked,
                "stage_copy_cpu_s": cpu, "stage_copy_s": window}  # fmt: skip

    records = [
        line(1, [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]),  # warm-up steps: left out
        line(2, [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]),
        line(3, [0.02, 0.04], [0.01, 0.03], [0.1, 0.2]),
        line(4, [0.06, 0.02], [0.02, 0.02], [0.3, 0.1]),
        line(5, [0.08, 0.01], [0.05, 0.03], [0.2, 0.4]),
        {"step": 5, "eval_loss": 1.0},
    ]
    assert state_copy.direct_cost(records) == {
        "blocked_over_step": 0.03,  # the slowest rank: 0.04, 0.06, 0.08 of 2 s
        "copy_cpu_over_stage_cpu": 0.01,  # (0.04, 0.04, 0.08) over 2 ranks x 2 s
        "window_over_step": 0.15,  # 0.2, 0.3, 0.4 of 2 s
    }
    assert state_copy.direct_cost([{"step": 1, "step_seconds": 1.0}]) is None
