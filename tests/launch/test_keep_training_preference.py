"""End to end: a DPO run over mesh hosts loses a member and ends as an uninterrupted run does
(issue 43).

Three namespace hosts joined by the real CLI over real wireguard-go, on the NAT lab the modules
of tests/launch share (tests/launch/conftest.py); the launcher is the real ``shardpool finetune``
on host a, with ``rl: dpo`` on ``configs/data/preference_tiny.jsonl`` (copied, with the model,
into the launcher's private tmpfs: the stages get both only over the mesh) and
``on_member_loss: continue`` (the default). ``kill -9`` of every process of host c after a random
early step: the run goes on on a and b by itself (``member_lost`` with no reported step lost,
training again within the bound of test_keep_training) and exits 0. Its result is an
uninterrupted local run's of the same config in one stage (the arithmetic does not depend on the
split): every step logged once, its loss and TRL's reward margin (``rewards/margins``) within
1e-4, TRL's DPO metrics on every step line, and the final adapter within 1e-4. Host c is
started again afterwards (``mesh up``), so the next modules find the whole mesh.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from shardpool_dev.lab import Lab, netns_skip_reason

from shardpool.contract.events import PREFERENCE_METRICS
from shardpool.train.preference import PreferenceObjective
from tests.helpers.mesh_training import (
    Drained,
    MetricsWatch,
    adapter_difference,
    launch,
    local_reference,
    reachable,
    restart_host,
    training_config,
)
from tests.helpers.training import REPO_ROOT, write_config

pytestmark = [pytest.mark.netns, pytest.mark.slow]

SKIP = netns_skip_reason()
if SKIP:
    pytest.skip(SKIP, allow_module_level=True)

MEASURED: dict[str, Any] = {}
#: The shipped 12-pair ``chatml.intel`` dataset of configs/dpo.yaml.
PAIRS = REPO_ROOT / "configs" / "data" / "preference_tiny.jsonl"
#: 6 pairs a step (2 a micro-batch, 3 micro-batches): 2 steps an epoch.
MAX_STEPS = 12
SETTINGS: dict[str, Any] = {
    "rl": "dpo",
    "rl_beta": 0.1,
    "sequence_len": 128,
    "num_epochs": 20,
    "max_steps": MAX_STEPS,
    "val_set_size": 0,
    "save_steps": 1000,
}
#: The loss comes after a random step in this range.
LOSS_AFTER_STEPS = (2, 4)
#: From the loss to the next step trained on a and b (test_keep_training's bound on a busy machine).
TRAINING_AGAIN_S = 60.0
#: Reported figures the mesh run must share with the reference at every step.
TOLERANCE = 1e-4
#: The preference metrics of a DPO step line, TRL's names (ORPO's and SimPO's extra ones are not logged).
DPO_METRICS = set(PreferenceObjective("sigmoid", SETTINGS["rl_beta"]).metrics)


@pytest.fixture(scope="module")
def lab(nat_lab: Lab) -> Iterator[Lab]:
    """The NAT lab of tests/launch/conftest.py; this module's measurements are printed after it."""
    yield nat_lab
    print("\nmeasured:", json.dumps(MEASURED, indent=1))


@pytest.fixture(scope="module")
def mesh3(lab: Lab, nat_mesh3: dict[str, str]) -> dict[str, str]:
    """The package's mesh, every member reachable and its agent answering (again, after an earlier module)."""
    return reachable(lab)


def _datasets(path: Path) -> list[dict[str, str]]:
    return [{"path": str(path), "type": "chatml.intel"}]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted local DPO run of :data:`SETTINGS` in one stage: its output directory."""
    started = time.monotonic()
    made = local_reference(tmp_path_factory.mktemp("reference"), [6], datasets=_datasets(PAIRS), **SETTINGS)
    MEASURED["reference_s"] = round(time.monotonic() - started, 1)
    return made


def _is_step(record: dict[str, Any]) -> bool:
    return "event" not in record and "loss" in record


def _step_lines(out: Path) -> dict[int, dict[str, Any]]:
    """Step -> the step line of a run's metrics.jsonl; each step must be logged once."""
    lines: dict[int, dict[str, Any]] = {}
    for text in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(text)
        if _is_step(record):
            assert record["step"] not in lines, f"step {record['step']} logged twice"
            lines[int(record["step"])] = record
    return lines


def _worst(lines: dict[int, dict[str, Any]], expected: dict[int, dict[str, Any]], key: str) -> float:
    return max(abs(float(lines[step][key]) - float(expected[step][key])) for step in expected)


def _start(lab: Lab, tmp_path: Path) -> tuple[Path, Drained]:
    """Launch the DPO run on host a over the mesh, in the background: its output directory and launcher."""
    private = tmp_path / "private"
    private.mkdir()
    out = tmp_path / "out"
    config = training_config(
        out,
        private,
        shardpool={"placement": "mesh", "stages": 3},
        datasets=_datasets(private / PAIRS.name),
        **SETTINGS,
    )
    config_path = write_config(tmp_path / "run.yaml", config)
    process = launch(lab, lab.hosts["a"], private, config_path, background=True, files=[PAIRS])
    return out, Drained(process)


def test_a_dpo_run_survives_a_killed_member_and_ends_as_an_uninterrupted_run(
    lab: Lab, mesh3: dict[str, str], reference: Path, tmp_path: Path
) -> None:
    kill_after = random.randint(*LOSS_AFTER_STEPS)
    MEASURED["kill_after_step"] = kill_after
    out, launcher = _start(lab, tmp_path)
    killed = False
    try:
        with MetricsWatch(out / "metrics.jsonl") as watch:
            alive = lambda: launcher.poll() is None  # noqa: E731
            # the launcher logs a step once every rank's step-boundary copy of it is complete
            _, settled = watch.wait(lambda r: _is_step(r) and r["step"] >= kill_after, 400, alive=alive)
            killed_at = time.monotonic()
            killed = bool(lab.kill_host(lab.hosts["c"]))
            assert killed, "host c ran processes"
            lost_seen, lost = watch.wait(lambda r: r.get("event") == "member_lost", 120, alive=alive)
            again_at, _ = watch.wait(
                lambda r: _is_step(r) and r["step"] > lost["step"], 180, after=lost_seen, alive=alive
            )
            MEASURED["loss_detected_s"] = round(lost_seen - killed_at, 1)
            MEASURED["loss_to_training_again_s"] = round(again_at - killed_at, 1)
            stdout, stderr = launcher.finish(600)
    finally:
        launcher.kill()
        if killed:  # the next modules want the whole mesh
            MEASURED["host_restart_s"] = round(restart_host(lab, lab.hosts["c"]), 1)
    assert launcher.returncode == 0, f"stdout: {stdout[-3000:]}\nstderr: {stderr}"
    MEASURED["killed_after_step"] = settled["step"]
    MEASURED["lost"] = {key: lost[key] for key in ("step", "steps_lost", "unreported_steps_redone")}
    assert lost["member"] == "c" and lost["step"] >= settled["step"] and lost["steps_lost"] == 0, lost
    assert "lost member 'c'" in stdout + stderr, (stdout + stderr)[-3000:]
    assert MEASURED["loss_to_training_again_s"] < TRAINING_AGAIN_S
    plan = json.loads((out / "plan.json").read_text())
    assert {stage["host"] for stage in plan["stages"]} == {"a", "b"}, plan["stages"]

    lines, expected = _step_lines(out), _step_lines(reference)
    assert sorted(expected) == list(range(1, MAX_STEPS + 1)), sorted(expected)
    assert sorted(lines) == sorted(expected), sorted(set(expected) ^ set(lines))
    for run, steps in (("mesh", lines), ("reference", expected)):
        for step, line in steps.items():
            assert set(line) & set(PREFERENCE_METRICS) == DPO_METRICS, (run, step, sorted(line))
    margins = [abs(float(line["rewards/margins"])) for line in expected.values()]
    assert max(margins) > 10 * TOLERANCE, f"the reference's margins stay near 0: {margins}"
    MEASURED["worst_step_loss_diff"] = _worst(lines, expected, "loss")
    MEASURED["worst_step_margin_diff"] = _worst(lines, expected, "rewards/margins")
    MEASURED["max_adapter_abs_diff"] = adapter_difference(out, reference)
    assert MEASURED["worst_step_loss_diff"] < TOLERANCE
    assert MEASURED["worst_step_margin_diff"] < TOLERANCE
    assert MEASURED["max_adapter_abs_diff"] < TOLERANCE
