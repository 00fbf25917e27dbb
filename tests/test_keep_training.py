"""A supervised run goes on by itself after a lost member: the finetune loop end to end, with
local processes standing in for the members (no mesh, no agent)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

import shardpool.finetune as finetune_module
from shardpool.config import Config, parse_config
from shardpool.contract.job import Job
from shardpool.finetune import finetune
from shardpool.launch.local_launcher import LocalLauncher
from shardpool.launch.mesh_launcher import MemberLost, MeshLauncher
from shardpool.launch.mesh_members import MeshMember
from shardpool.plan.profiler import TorchProbe
from shardpool.plan.result import Plan
from tests.helpers.shared_runs import CHECKPOINTED_TWO_STAGES, trained_once
from tests.helpers.training import base_config, read_metrics

pytestmark = pytest.mark.slow  # three tiny runs' worth of training (about 40 s on a quiet machine)


class _LocalMesh(MeshLauncher):
    """Members 'a' and 'b' (and 'c' in the first attempt) whose stages are local processes; the
    first attempt loses 'c' after step 2."""

    attempts = 0

    @contextmanager
    def serving(self, inputs: dict[str, str], output_dir: Path) -> Iterator[str | None]:
        yield None

    def plan(self, config: Config) -> Plan:
        return LocalLauncher(probe=TorchProbe()).plan(config)

    def start(self, job: Job, job_file: Path, on_event: Callable[[dict[str, Any]], None]) -> None:
        type(self).attempts += 1
        first = type(self).attempts == 1

        def relay(event: dict[str, Any]) -> None:
            on_event(event)
            if first and event.get("event") == "step" and event["step"] == 2:
                raise MemberLost(
                    "member 'c' was lost at step 2: killed by signal 9", rank=1, stage=1, member="c", step=2
                )

        LocalLauncher(probe=TorchProbe()).start(job, job_file, relay)


class _Agent:
    url = "http://fake"


def _members(*names: str) -> list[MeshMember]:
    return [MeshMember(name, "127.0.0.1", index == 0, _Agent()) for index, name in enumerate(names)]  # type: ignore[arg-type]


@pytest.fixture
def plain(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, completion_data: Path) -> Path:
    """The uninterrupted run (tests/test_finetune.py resumes from its checkpoints: trained once)."""
    return trained_once(tmp_path_factory, tiny_model, completion_data, **CHECKPOINTED_TWO_STAGES)


def test_a_lost_member_is_survived_with_the_same_adapter_as_an_uninterrupted_run(
    tmp_path: Path, plain: Path, tiny_model: Path, completion_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides: dict[str, Any] = CHECKPOINTED_TWO_STAGES

    said: list[str] = []
    launcher = _LocalMesh(_members("a", "b", "c"), say=said.append)
    monkeypatch.setattr(finetune_module, "launcher_for", lambda config, **kwargs: launcher)
    mesh = dict(overrides, shardpool={"stages": 2, "placement": "mesh"})
    out = finetune(parse_config(base_config(tiny_model, completion_data, tmp_path / "kept", **mesh)),
                   console=Console(quiet=True))  # fmt: skip

    assert _LocalMesh.attempts == 2
    history = [line for line in read_metrics(out) if "event" in line]
    assert [line["event"] for line in history] == ["member_lost", "replan"]
    lost, replan = history
    assert (lost["member"], lost["step"]) == ("c", 2)
    # step 2 is trained again only when its copy was still in flight: then it was never reported
    assert lost["steps_lost"] == 0 and replan["step"] in (1, 2)
    assert lost["unreported_steps_redone"] == 2 - replan["step"]
    assert [line["step"] for line in read_metrics(out) if "loss" in line] == [1, 2, 3, 4]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["source"] == "replan" and plan["history"][0]["ended_at_step"] == 2
    kept, expected = (
        load_file(str(out / "adapter_model.safetensors")),
        load_file(str(plain / "adapter_model.safetensors")),
    )
    assert kept.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(kept[key], expected[key], atol=1e-5, rtol=0)


class _LocalReplicas(_LocalMesh):
    """As :class:`_LocalMesh`, but every plan trains two whole-model replicas on shares 2 / 1 of
    the step (``data_parallel``) as two local processes; 'c' holds the second replica."""

    attempts = 0

    def plan(self, config: Config) -> Plan:
        local = config.shardpool.model_copy(
            update={"placement": "local", "devices": ["cpu", "cpu"], "shares": [2, 1], "stages": None}
        )
        return LocalLauncher(probe=TorchProbe()).plan(config.model_copy(update={"shardpool": local}))


def test_a_lost_replica_is_survived_with_the_same_adapter_as_an_uninterrupted_run(
    tmp_path: Path, plain: Path, tiny_model: Path, completion_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replicas on shares of the step restart from the last step copy after a loss (their shares
    are re-planned, not moved in place), and the adapter still equals the uninterrupted pipeline's."""
    said: list[str] = []
    launcher = _LocalReplicas(_members("a", "b", "c"), say=said.append)
    monkeypatch.setattr(finetune_module, "launcher_for", lambda config, **kwargs: launcher)
    mesh = dict(CHECKPOINTED_TWO_STAGES, shardpool={"placement": "mesh", "data_parallel": "on"})
    out = finetune(parse_config(base_config(tiny_model, completion_data, tmp_path / "kept", **mesh)),
                   console=Console(quiet=True))  # fmt: skip

    assert _LocalReplicas.attempts == 2
    history = [line for line in read_metrics(out) if "event" in line]
    assert [line["event"] for line in history] == ["member_lost", "replan"]
    assert (history[0]["member"], history[0]["step"]) == ("c", 2)
    steps = [line for line in read_metrics(out) if "loss" in line]
    assert [line["step"] for line in steps] == [1, 2, 3, 4]
    assert all(len(line["stage_compute_s"]) == 2 for line in steps)  # one rank per replica, before and after
    plan = json.loads((out / "plan.json").read_text())
    assert plan["source"] == "replan" and plan["shares"] == [2, 1]
    kept, expected = (
        load_file(str(out / "adapter_model.safetensors")),
        load_file(str(plain / "adapter_model.safetensors")),
    )
    assert kept.keys() == expected.keys()
    for key in expected:  # replicas sum their gradients in another order than the pipeline's stages
        torch.testing.assert_close(kept[key], expected[key], atol=1e-4, rtol=0)
