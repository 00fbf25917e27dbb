"""A stage's side of keeping a run alive: the beat, the step-boundary copies, and what they cost a run."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rich.console import Console
from safetensors.torch import load_file

from shardpool.config import parse_config
from shardpool.contract.liveness import LIVE_ROOT, live_dir
from shardpool.contract.rebalance import FORCE_ENV
from shardpool.elastic.messages import ControlStore, control_key, live_key, read_beat
from shardpool.elastic.rank import KEEP_STATE_HOOK
from shardpool.elastic.rank_liveness import StateCopier, start_beat, store_client
from shardpool.finetune import finetune
from shardpool.train.rendezvous import rendezvous_store
from shardpool.train.runfiles import RunFiles
from tests.helpers.shared_runs import CHECKPOINTED_TWO_STAGES, trained_once
from tests.helpers.training import base_config, read_metrics


def _count(store: Any, key: str) -> int:
    return int(store.add(key, 0))


def _sealing(port: int, *, timeout_s: float) -> Callable[[], ControlStore]:
    """A factory of sealing clients of the store at ``port`` (what a rank's beat thread gets)."""
    connect = store_client("127.0.0.1", port, timeout_s=timeout_s)
    key = control_key("s" * 32, addr="127.0.0.1", port=port)
    return lambda: ControlStore(connect(), key)


def _beat(store: Any, rank: int) -> int:
    """``rank``'s beat number as the launcher reads it (its sealed value, 0 when there is none)."""
    return read_beat(ControlStore(store, control_key("s" * 32, addr="127.0.0.1", port=store.port)), rank)


def _wait_for(condition: Callable[[], bool], *, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# ----- the beat -----------------------------------------------------------------------------------


def test_the_beat_counts_on_its_own_client_until_told_to_stop() -> None:
    store = rendezvous_store("127.0.0.1", timeout_s=5.0)
    thread, stop = start_beat(_sealing(store.port, timeout_s=5.0), 3, interval_s=0.02)
    assert thread.daemon
    _wait_for(lambda: _beat(store, 3) >= 3)
    stop.set()
    thread.join(timeout=5.0)
    assert not thread.is_alive()
    stopped_at = _beat(store, 3)
    time.sleep(0.1)
    assert _beat(store, 3) == stopped_at


def test_a_beat_without_a_store_ends_quietly() -> None:
    port = _free_port()
    thread, _ = start_beat(_sealing(port, timeout_s=0.5), 0, interval_s=0.02)
    thread.join(timeout=15.0)
    assert not thread.is_alive()


def test_a_beat_whose_store_goes_away_ends_quietly() -> None:
    launcher = [rendezvous_store("127.0.0.1", timeout_s=5.0)]
    thread, _ = start_beat(_sealing(launcher[0].port, timeout_s=1.0), 1, interval_s=0.02)
    _wait_for(lambda: _beat(launcher[0], 1) >= 2)
    launcher.clear()  # the launcher's store (the server) is gone
    thread.join(timeout=15.0)
    assert not thread.is_alive()


# ----- the copier ---------------------------------------------------------------------------------


def _files(output_dir: Path) -> RunFiles:
    return RunFiles(SimpleNamespace(files_url=None, output_dir=str(output_dir), inputs={}))  # type: ignore[arg-type]


def test_a_copy_writes_its_files_then_counts_and_a_failed_copy_only_logs(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    store = rendezvous_store("127.0.0.1", timeout_s=5.0)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
    copier = StateCopier(_files(tmp_path), store_client("127.0.0.1", store.port), rank=1)
    copier.submit(1, {"rng-rank-1.safetensors": {"cpu": torch.arange(4)}})
    copier.wait()
    assert _count(client, live_key(1)) == 1
    assert torch.equal(
        load_file(str(tmp_path / live_dir(1) / "rng-rank-1.safetensors"))["cpu"], torch.arange(4)
    )
    assert copier.bytes_copied == 4 * 8
    assert 0.0 < copier.copy_seconds < 5.0

    (tmp_path / live_dir(2)).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / live_dir(2)).write_text("not a directory")  # an unwritable target
    copier.submit(2, {"rng-rank-1.safetensors": {"cpu": torch.arange(4)}})
    copier.submit(3, {"rng-rank-1.safetensors": {"cpu": torch.arange(3)}})  # waits for copy 2 first
    copier.close()
    assert copier.failures == 1
    assert _count(client, live_key(2)) == 0
    assert _count(client, live_key(3)) == 1
    assert "step-boundary copy after step 2 failed" in capfd.readouterr().err


# ----- a whole run --------------------------------------------------------------------------------


def _train(config: dict[str, Any]) -> Path:
    return finetune(parse_config(config), console=Console(quiet=True))


def _config(tiny_model: Path, data: Path, output_dir: Path) -> dict[str, Any]:
    return base_config(
        tiny_model, data, output_dir, max_steps=3, save_steps=1, val_set_size=0,
        shardpool={"stages": 2, "threads_per_stage": 1},
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(
    tiny_model: Path, completion_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The same 2-stage local run of 4 steps, a checkpoint after each, without and with keep_state
    (the bench hook). The run without is tests/test_finetune.py's and tests/test_keep_training.py's
    (trained once a session): it is only read here."""
    plain = trained_once(tmp_path_factory, tiny_model, completion_data, **CHECKPOINTED_TWO_STAGES)
    root = tmp_path_factory.mktemp("keep-state")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(KEEP_STATE_HOOK, "1")
        kept = _train(base_config(tiny_model, completion_data, root / "kept", **CHECKPOINTED_TWO_STAGES))
    return {"plain": plain, "kept": kept}


@pytest.mark.slow
def test_keep_state_leaves_a_complete_copy_after_every_step(runs: dict[str, Path]) -> None:
    live = runs["kept"] / LIVE_ROOT
    assert sorted(path.name for path in live.iterdir()) == ["step-1", "step-2", "step-3", "step-4"]
    for step in (1, 2, 3, 4):
        names = sorted(path.name for path in (runs["kept"] / live_dir(step)).iterdir())
        assert names == [
            "rng-rank-0.safetensors", "rng-rank-1.safetensors", "stage-0.safetensors", "stage-1.safetensors",
        ]  # fmt: skip
    assert not (runs["plain"] / LIVE_ROOT).exists()
    logs = "".join(path.read_text() for path in (runs["kept"] / ".shardpool" / "logs").glob("rank-*.log"))
    assert "copy after step" not in logs and "stopped beating" not in logs


@pytest.mark.slow
def test_a_copy_equals_the_checkpoint_of_its_step_tensor_for_tensor(runs: dict[str, Path]) -> None:
    for step in (1, 2, 3):  # no checkpoint after the last step: the adapter is written instead
        checkpoint = runs["kept"] / "checkpoints" / f"checkpoint-{step}"
        state_files = [
            path
            for path in sorted(checkpoint.glob("*.safetensors"))
            if path.name.startswith(("stage-", "rng-rank-"))
        ]
        assert len(state_files) == 4
        for path in state_files:
            copied = load_file(str(runs["kept"] / live_dir(step) / path.name))
            saved = load_file(str(path))
            assert sorted(copied) == sorted(saved)
            assert all(torch.equal(copied[name], saved[name]) for name in saved), path.name


@pytest.mark.slow
def test_each_step_line_says_how_long_every_rank_s_last_copy_took_and_what_it_cost(
    runs: dict[str, Path],
) -> None:
    kept, plain = read_metrics(runs["kept"]), read_metrics(runs["plain"])
    figures = ("stage_copy_s", "stage_copy_blocked_s", "stage_copy_cpu_s")
    assert all(figure not in record for record in plain for figure in figures)
    for figure in figures:  # no copy has been handed over or finished before the first step ends
        assert kept[0][figure] == [0.0, 0.0], figure
    for record in kept[1:]:  # the copy after the step before (or the one before that, if in flight)
        bound = record["step_seconds"] * 50
        assert len(record["stage_copy_s"]) == 2 and all(0.0 < s < bound for s in record["stage_copy_s"])
        # handing over (the clones) happens between steps; the thread's CPU is within its window
        assert all(0.0 < s < bound for s in record["stage_copy_blocked_s"]), record
        assert all(
            0.0 < cpu <= window + 0.05
            for cpu, window in zip(record["stage_copy_cpu_s"], record["stage_copy_s"], strict=True)
        ), record


@pytest.mark.slow
def test_keep_state_changes_no_loss_and_no_adapter(runs: dict[str, Path]) -> None:
    assert [r["loss"] for r in read_metrics(runs["kept"])] == [r["loss"] for r in read_metrics(runs["plain"])]
    kept = load_file(str(runs["kept"] / "adapter_model.safetensors"))
    plain = load_file(str(runs["plain"] / "adapter_model.safetensors"))
    assert all(torch.equal(kept[name], plain[name]) for name in plain)


@pytest.mark.slow
def test_a_failing_copy_does_not_stop_training(
    tiny_model: Path, completion_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEEP_STATE_HOOK, "1")
    output_dir = tmp_path / "out"
    (output_dir / LIVE_ROOT).parent.mkdir(parents=True)
    (output_dir / LIVE_ROOT).write_text("a file where the copies would go")
    config = _config(tiny_model, completion_data, output_dir)
    config.update(max_steps=2, save_steps=None)
    finished = _train(config)
    assert len(read_metrics(finished)) == 2
    assert (finished / "adapter_model.safetensors").is_file()
    logs = "".join(path.read_text() for path in (finished / ".shardpool" / "logs").glob("rank-*.log"))
    assert "step-boundary copy after step 1 failed" in logs


def _layers(path: Path) -> list[int]:
    return sorted(
        {int(name.split(".layers.")[1].split(".")[0]) for name in load_file(str(path)) if ".layers." in name}
    )


@pytest.mark.slow
def test_the_copy_after_a_reshard_holds_the_layers_of_the_next_step(
    tiny_model: Path, completion_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEEP_STATE_HOOK, "1")
    monkeypatch.setenv(FORCE_ENV, "2:0-2,2-6")
    config = base_config(
        tiny_model, completion_data, tmp_path / "out", max_steps=3, val_set_size=0,
        shardpool={"layers": [3, 3], "rebalance": "auto", "threads_per_stage": 1},
    )  # fmt: skip
    output_dir = _train(config)
    assert _layers(output_dir / live_dir(1) / "stage-0.safetensors") == [0, 1, 2]
    assert _layers(output_dir / live_dir(2) / "stage-0.safetensors") == [0, 1]
    assert _layers(output_dir / live_dir(2) / "stage-1.safetensors") == [2, 3, 4, 5]
