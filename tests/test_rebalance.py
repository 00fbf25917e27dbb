"""Re-balancing a running fine-tune end to end: a forced in-place re-shard trains exactly as a run
that keeps its plan, and a stage SIGKILLed during the hand-over stops the run cleanly; ``--resume``
then continues from the last checkpoint to the adapter of an uninterrupted run (this is also the
suite's kill-and-resume exactness test). The run that keeps its plan is that uninterrupted run
too: the same config, trained once and compared twice."""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from safetensors.torch import load_file

from shardpool.cli import main
from shardpool.config import parse_config
from shardpool.contract.rebalance import FORCE_ENV, KILL_ENV, ROOM_ENV
from shardpool.finetune import finetune
from shardpool.launch.run import RUN_DIR_NAME
from tests.helpers.training import base_config, read_metrics, stage_pids, write_config

pytestmark = pytest.mark.slow  # each test trains the tiny model on three stages


def _overrides(rebalance: str = "auto", **extra: Any) -> dict[str, Any]:
    return {
        "max_steps": 5,
        "val_set_size": 0,
        "shardpool": {"layers": [2, 2, 2], "rebalance": rebalance},
        **extra,
    }


def _step_losses(output_dir: Path) -> dict[int, float]:
    return {line["step"]: line["loss"] for line in read_metrics(output_dir) if "loss" in line}


@pytest.fixture(scope="module")
def kept(tiny_model: Path, completion_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The baseline: the same 3 stages and 5 steps, keeping its plan whatever calibration would make
    of its steps, with neither test hook set. Both tests compare with it and neither writes to it."""
    assert not {FORCE_ENV, KILL_ENV, ROOM_ENV} & set(os.environ)
    return finetune(
        parse_config(
            base_config(
                tiny_model, completion_data, tmp_path_factory.mktemp("kept") / "out", **_overrides("off")
            )
        ),
        console=Console(quiet=True),
    )


def _finetune_in_process(capfd: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``shardpool finetune ARGS`` through the CLI's ``main`` in this process, which has torch
    imported already (a fresh interpreter would only add its imports): its exit status and what
    reached descriptors 2 and 1 meanwhile, the stage processes' output included (they inherit it)."""
    capfd.readouterr()
    code = main(["finetune", *args])
    captured = capfd.readouterr()
    return code, captured.err, captured.out


def test_forced_reshard_trains_exactly_as_the_kept_plan(
    tmp_path: Path, kept: Path, tiny_model: Path, completion_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FORCE_ENV, "3:0-1,1-3,3-6")
    shown = io.StringIO()
    config = parse_config(
        base_config(tiny_model, completion_data, tmp_path / "moved", **_overrides(save_steps=2))
    )
    moved = finetune(config, console=Console(file=shown, width=200))
    assert "re-balanced after step 3: layers now [0, 1) [1, 3) [3, 6) (forced by" in shown.getvalue()

    kept_losses, moved_losses = _step_losses(kept), _step_losses(moved)
    assert sorted(moved_losses) == [1, 2, 3, 4, 5]
    assert max(abs(kept_losses[step] - moved_losses[step]) for step in kept_losses) < 1e-5
    kept_adapter = load_file(str(kept / "adapter_model.safetensors"))
    moved_adapter = load_file(str(moved / "adapter_model.safetensors"))
    assert moved_adapter.keys() == kept_adapter.keys()
    assert max(float((moved_adapter[k] - kept_adapter[k]).abs().max()) for k in kept_adapter) < 1e-4

    events = [line for line in read_metrics(moved) if line.get("event") == "rebalance"]
    assert events == [
        {
            "event": "rebalance",
            "step": 3,
            "from": [[0, 2], [2, 4], [4, 6]],
            "to": [[0, 1], [1, 3], [3, 6]],
            "predicted_step_s": events[0]["predicted_step_s"],
            "current_step_s": events[0]["current_step_s"],
            "reason": f"forced by {FORCE_ENV}",
        }
    ]
    plan = json.loads((moved / "plan.json").read_text())
    assert [stage["layers"] for stage in plan["stages"]] == [[0, 1], [1, 3], [3, 6]]
    assert plan["source"] == "rebalance"
    assert [entry["ended_at_step"] for entry in plan["history"]] == [3]
    assert [stage["layers"] for stage in plan["history"][0]["stages"]] == [[0, 2], [2, 4], [4, 6]]
    assert not any(line.get("event") == "rebalance" for line in read_metrics(kept))
    card = (moved / "README.md").read_text()
    assert "3 pipeline stages × 1 replica, schedule 1f1b, at the end of training:" in card
    assert re.search(
        r"\| 0 \| cpu \| \S+ \| \[0, 1\) \| 1 \|\n\| 1 \| cpu \| \S+ \| \[1, 3\) \| 2 \|", card
    ), card
    assert re.search(r"- \[0, 2\) on \S+, \[2, 4\) on \S+, \[4, 6\) on \S+ \(manual\), until step 3", card), (
        card
    )
    logs = moved / RUN_DIR_NAME / "logs"
    assert "re-sharded layers [2, 4) -> [1, 3)" in (logs / "rank-1.log").read_text()
    assert "re-sharded layers [4, 6) -> [3, 6)" in (logs / "rank-2.log").read_text()

    # Resumed from checkpoint-4, which the re-balanced split trained: the resume goes on with that
    # split rather than the config's 2/2/2, and trains step 5 to the same adapter.
    monkeypatch.delenv(FORCE_ENV)
    shown = io.StringIO()
    finetune(config, resume=True, console=Console(file=shown, width=200))
    assert re.search(
        r"resuming with the interrupted run's re-balanced split: \S+\[0, 1\) \S+\[1, 3\) \S+\[3, 6\)",
        shown.getvalue(),
    )
    plan = json.loads((moved / "plan.json").read_text())
    assert plan["source"] == "resume" and [stage["layers"] for stage in plan["stages"]] == [
        [0, 1],
        [1, 3],
        [3, 6],
    ]
    assert [entry.get("resumed_from_step") for entry in plan["history"]] == [None, 4]
    resumed_adapter = load_file(str(moved / "adapter_model.safetensors"))
    assert max(float((resumed_adapter[k] - kept_adapter[k]).abs().max()) for k in kept_adapter) < 1e-4


def test_a_split_beyond_a_stages_measured_room_is_held_back_and_the_run_trains_on(
    tmp_path: Path, kept: Path, tiny_model: Path, completion_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage 2 would gain layer 3, but its rank reports 1000 bytes of room at the check: the plan
    is kept, said once on the console and in metrics.jsonl, and the run trains as the kept run."""
    monkeypatch.setenv(FORCE_ENV, "3:0-1,1-3,3-6")
    monkeypatch.setenv(ROOM_ENV, "2:1000")
    shown = io.StringIO()
    config = parse_config(base_config(tiny_model, completion_data, tmp_path / "held", **_overrides()))
    held = finetune(config, console=Console(file=shown, width=300))
    assert re.search(
        r"re-balance after step 3 held back, keeping the plan: layers \[0, 1\) \[1, 3\) \[3, 6\) would "
        r"predict [0-9.]+ s/step \(measured [0-9.]+\), but stage 2 \(\S+\) needs [0-9.]+ MiB more for "
        r"3 layers and has 0\.0 MiB of room",
        shown.getvalue(),
    ), shown.getvalue()
    lines = read_metrics(held)
    assert [line["event"] for line in lines if "event" in line] == ["rebalance_held"]
    rooms = {line["step"]: line.get("stage_room_bytes") for line in lines if "loss" in line}
    assert [step for step, room in rooms.items() if room is not None] == [3], "measured at the check only"
    assert rooms[3][2] == 1000 and all(0 < room < 2**50 for room in rooms[3][:2]), rooms[3]
    kept_losses, held_losses = _step_losses(kept), _step_losses(held)
    assert max(abs(kept_losses[step] - held_losses[step]) for step in kept_losses) < 1e-6
    plan = json.loads((held / "plan.json").read_text())
    assert [stage["layers"] for stage in plan["stages"]] == [[0, 2], [2, 4], [4, 6]] and "history" not in plan
    logs = held / RUN_DIR_NAME / "logs"
    assert "re-sharded" not in (logs / "rank-2.log").read_text()


def test_stage_killed_during_the_handover_stops_the_run_and_resume_matches_uninterrupted(
    tmp_path: Path,
    kept: Path,
    tiny_model: Path,
    completion_data: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "out"
    config = write_config(
        tmp_path / "c.yaml", base_config(tiny_model, completion_data, out, **_overrides(save_steps=2))
    )
    monkeypatch.setenv(FORCE_ENV, "3:0-1,1-3,3-6")
    monkeypatch.setenv(KILL_ENV, "1")
    code, stderr, _ = _finetune_in_process(capfd, str(config))
    assert code == 2
    error = stderr.strip().splitlines()[-1]
    assert error.startswith("shardpool: error: stage 1 (rank 1) failed: killed by signal 9"), error
    assert "Traceback" not in stderr
    assert stage_pids(out / RUN_DIR_NAME / "job.json") == {}
    assert not (out / "adapter_model.safetensors").exists()

    monkeypatch.delenv(KILL_ENV)
    code, stderr, stdout = _finetune_in_process(capfd, str(config), "--resume")
    assert code == 0, stderr
    assert [line["step"] for line in read_metrics(out) if "loss" in line] == [1, 2, 3, 4, 5], (
        "metrics continue from the checkpoint without gaps or repeats"
    )
    resumed = [
        entry
        for entry in json.loads((out / "plan.json").read_text())["history"]
        if "resumed_from_step" in entry
    ]
    assert [entry["resumed_from_step"] for entry in resumed] == [2], (
        "the interrupted run's plan stays in the history"
    )
    assert resumed[0]["source"] == "rebalance", "the run was interrupted after its decision was recorded"
    history = json.loads((out / "plan.json").read_text())["history"]
    started = history[history.index(resumed[0]) + 1]  # the resumed run's own first plan
    assert started["source"] == "manual" and [stage["layers"] for stage in started["stages"]] == [
        [0, 2],
        [2, 4],
        [4, 6],
    ], "a split that never trained a step (stopped in its hand-over) is not carried into the resume"
    assert "re-balanced split" not in stdout

    resumed_adapter = load_file(str(out / "adapter_model.safetensors"))
    clean_adapter = load_file(str(kept / "adapter_model.safetensors"))  # the uninterrupted run
    assert resumed_adapter.keys() == clean_adapter.keys()
    assert max(float((resumed_adapter[k] - clean_adapter[k]).abs().max()) for k in clean_adapter) < 1e-6
