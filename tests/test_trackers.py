"""TensorBoard and W&B sinks: the metrics lines reach both, under Hugging Face Trainer's names."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from shardpool import trackers
from shardpool.config import parse_config
from shardpool.errors import ShardpoolError
from shardpool.finetune import finetune
from tests.helpers.training import REPO_ROOT, base_config, completion_rows, write_config, write_jsonl

BASE: dict[str, Any] = {"base_model": "m", "datasets": [{"path": "d.jsonl"}], "lora_target_linear": True}
LINES = [
    {"step": 1, "epoch": 0.5, "loss": 3.0, "learning_rate": 1e-4, "grad_norm": 0.5, "tokens_per_s": 100.0},
    {"step": 2, "epoch": 1.0, "loss": 2.5, "learning_rate": 2e-4, "grad_norm": 0.4, "tokens_per_s": 110.0},
    {"step": 2, "epoch": 1.0, "eval_loss": 2.75},
]


def _tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_lines_take_hugging_face_names() -> None:
    assert trackers.hf_scalars(LINES[0]) == {
        "train/loss": 3.0, "train/learning_rate": 1e-4, "train/grad_norm": 0.5,
        "train/tokens_per_s": 100.0, "train/epoch": 0.5,
    }  # fmt: skip
    assert trackers.hf_scalars(LINES[2]) == {"eval/loss": 2.75}


def test_tensorboard_gets_every_line(tmp_path: Path) -> None:
    sinks = trackers.open_trackers(parse_config({**BASE, "use_tensorboard": True}), tmp_path)
    for line in LINES:
        sinks.log(line)
    sinks.close()
    scalars = _tensorboard_scalars(tmp_path / "runs")
    assert scalars["train/loss"] == [(1, 3.0), (2, 2.5)]
    assert scalars["eval/loss"] == [(2, 2.75)]
    assert [step for step, _ in scalars["train/learning_rate"]] == [1, 2]


@pytest.mark.slow
def test_wandb_offline_run_records_the_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An offline run (WANDB_MODE=offline, synced later) holds the project and every scalar.

    wandb writes it as its binary record log (``run-*.wandb``) and ships no reader for it any more,
    so the test looks for the keys and values in its bytes.
    """
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sinks = trackers.open_trackers(parse_config({**BASE, "wandb_project": "shardpool-test"}), tmp_path)
    for line in LINES:
        sinks.log(line)
    sinks.close()
    (record_log,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    wanted = (b"shardpool-test", b"train/loss", b"train/learning_rate", b"eval/loss", b"2.75")
    # wandb's service process writes the log; on a loaded machine (a CI run under xdist) the file
    # once held only its header when finish() returned: give its writes a few seconds to land.
    deadline = time.monotonic() + 10.0
    data = record_log.read_bytes()
    while not all(expected in data for expected in wanted) and time.monotonic() < deadline:
        time.sleep(0.2)
        data = record_log.read_bytes()
    for expected in wanted:
        assert expected in data, expected


def test_a_tracker_that_is_not_installed_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(
        ShardpoolError, match=r"`wandb_project` needs the wandb package: pip install 'shardpool\[wandb\]'"
    ):
        trackers.check_trackers(parse_config({**BASE, "wandb_project": "p"}))
    trackers.check_trackers(parse_config({**BASE, "wandb_project": "p", "use_wandb": False}))


@pytest.mark.slow
def test_a_finetune_with_use_tensorboard_logs_each_step(tiny_model: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", completion_rows(40))
    config = base_config(tiny_model, data, tmp_path / "out", max_steps=3, use_tensorboard=True)
    output = finetune(parse_config(config), console=Console(quiet=True))
    scalars = _tensorboard_scalars(output / "runs")
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3]


def _without_a_wandb_login(home: Path) -> dict[str, str]:
    """The environment of a machine where nobody ran `wandb login`: no key, no netrc, no settings."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}
    home.mkdir(exist_ok=True)
    return dict(
        env,
        HOME=str(home),
        NETRC=str(home / ".netrc"),
        WANDB_CONFIG_DIR=str(home / ".config" / "wandb"),
        WANDB_DIR=str(home),
        WANDB_SILENT="true",
    )


@pytest.fixture
def no_wandb_login(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process without a W&B login (wandb reads the environment each time it looks for one)."""
    home = tmp_path / "home"
    for key in [key for key in os.environ if key.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    for key, value in _without_a_wandb_login(home).items():
        monkeypatch.setenv(key, value)
    return home


def test_wandb_online_without_a_login_is_refused_in_one_line(no_wandb_login: Path) -> None:
    with pytest.raises(ShardpoolError) as caught:
        trackers.check_trackers(parse_config({**BASE, "wandb_project": "my-proj"}))
    message = str(caught.value)
    assert "\n" not in message
    assert "`wandb login`" in message and "WANDB_MODE=offline" in message


def test_wandb_offline_or_disabled_needs_no_login(
    no_wandb_login: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trackers.check_trackers(parse_config({**BASE, "wandb_project": "p", "wandb_mode": "offline"}))
    trackers.check_trackers(parse_config({**BASE, "wandb_project": "p", "wandb_mode": "disabled"}))
    monkeypatch.setenv("WANDB_MODE", "offline")
    trackers.check_trackers(parse_config({**BASE, "wandb_project": "p"}))


def test_a_wandb_key_or_netrc_login_is_found(no_wandb_login: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found without reaching the server: whether the key is valid is for wandb.init to say."""
    config = parse_config({**BASE, "wandb_project": "p"})
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    trackers.check_trackers(config)
    monkeypatch.delenv("WANDB_API_KEY")
    netrc = no_wandb_login / ".netrc"
    netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {'1' * 40}\n", encoding="utf-8")
    netrc.chmod(0o600)
    trackers.check_trackers(config)


@pytest.mark.slow
def test_finetune_with_wandb_and_no_login_stops_in_one_line_before_training(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The real CLI on a machine without a W&B login: one line, no traceback, nothing trained."""
    data = write_jsonl(tmp_path / "d.jsonl", completion_rows(24))
    output_dir = tmp_path / "out"
    config = write_config(
        tmp_path / "config.yml", base_config(tiny_model, data, output_dir, wandb_project="my-proj")
    )
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "shardpool", "finetune", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO_ROOT),
        env=_without_a_wandb_login(tmp_path / "home"),
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("shardpool: error: ") and "`wandb login`" in line and "WANDB_MODE=offline" in line
    assert not (output_dir / "metrics.jsonl").exists()
    assert time.monotonic() - started < 60
