"""`finetune --json` (the run's events as JSON lines on stdout) and `finetune --state-dir` (which mesh)."""

from __future__ import annotations

import io
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardpool.agent.local_client import NoLocalAgent, agent_socket_of_state_dir
from shardpool.console import RunEvents
from tests.helpers.local_agent import StubLocalAgent, shared_socket_dir
from tests.helpers.training import REPO_ROOT, base_config, read_metrics, run_cli, write_config

QUICKSTART = yaml.safe_load((REPO_ROOT / "configs" / "quickstart.yaml").read_text())


def _json_lines(stdout: str) -> list[dict[str, Any]]:
    """Every stdout line as a JSON object: --json writes nothing else there."""
    return [json.loads(line) for line in stdout.splitlines()]


def _finetune_in_process(capfd: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``shardpool finetune ARGS`` through the CLI's ``main`` in this process, which has torch
    imported already: its exit status and what reached descriptors 1 and 2 meanwhile, the stage
    processes' output included (they inherit both)."""
    from shardpool.cli import main

    capfd.readouterr()
    code = main(["finetune", *args])
    captured = capfd.readouterr()
    return code, captured.out, captured.err


def test_events_are_one_plain_json_object_a_line() -> None:
    stream = io.StringIO()
    events = RunEvents(stream)
    events.emit("step", step=1, loss=math.nan, learning_rate=0.01, stage_wait_s=[math.inf, 0.5])
    events.emit("checkpoint", step=2, path=Path("out/checkpoints/checkpoint-2"), deleted=[])
    assert _json_lines(stream.getvalue()) == [
        {"event": "step", "step": 1, "loss": None, "learning_rate": 0.01, "stage_wait_s": [None, 0.5]},
        {"event": "checkpoint", "step": 2, "path": "out/checkpoints/checkpoint-2", "deleted": []},
    ]
    RunEvents().emit("step", step=1)  # no stream: nothing written, nothing raised


def test_json_config_problems_are_an_error_event_on_stdout_and_lines_on_stderr(tmp_path: Path) -> None:
    config = write_config(tmp_path / "run.yaml", {**QUICKSTART, "learning_rat": 0.1, "adapter": "qlorra"})
    result = run_cli("finetune", "--json", str(config), timeout=120)
    assert result.returncode == 2
    [event] = _json_lines(result.stdout)
    assert event["event"] == "error"
    assert event["message"].splitlines()[0] == f"{config} has 2 problems; fix them all, then run again:"
    assert result.stderr == f"shardpool: error: {event['message']}\n"


def test_state_dir_is_refused_for_a_local_placement(tmp_path: Path) -> None:
    config = write_config(tmp_path / "run.yaml", QUICKSTART)
    result = run_cli("finetune", "--state-dir", str(tmp_path / "mesh"), str(config), timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"shardpool: error: --state-dir names a mesh, but {config} places its stages on this machine; "
        "set `shardpool: {placement: mesh}` or leave out --state-dir"
    ]


def _state_dir(tmp_path: Path, ready: dict[str, Any] | None) -> Path:
    state = tmp_path / "mesh-state"
    (state / "run").mkdir(parents=True)
    (state / "mesh.json").write_text("{}")
    if ready is not None:
        (state / "run" / "shardpool-agent.json").write_text(json.dumps(ready))
    return state


def test_the_agent_socket_is_read_from_the_state_dir(tmp_path: Path) -> None:
    state = _state_dir(tmp_path, {"pid": 1, "url": "http://198.51.100.1:7412", "socket": "/run/x/agent.sock"})
    assert agent_socket_of_state_dir(state) == "/run/x/agent.sock"


@pytest.mark.parametrize(
    ("ready", "has_mesh", "expected"),
    [
        (None, False, "{state} holds no mesh; pass the --state-dir given to `shardpool mesh init` or `join`"),
        (
            None,
            True,
            "no shardpool agent runs for the mesh in {state}; start it with "
            "`shardpool mesh up --state-dir {state}`",
        ),
        (
            {"pid": 1, "url": "http://198.51.100.1:7412"},
            True,
            "the agent for {state} does not say where its socket is (started by an older shardpool); "
            "restart it with `shardpool mesh down --state-dir {state}` and `mesh up`",
        ),
    ],
)
def test_a_state_dir_without_a_running_agent_is_one_line(
    tmp_path: Path, ready: dict[str, Any] | None, has_mesh: bool, expected: str
) -> None:
    state = _state_dir(tmp_path, ready)
    if not has_mesh:
        (state / "mesh.json").unlink()
    with pytest.raises(NoLocalAgent) as caught:
        agent_socket_of_state_dir(state)
    assert str(caught.value) == expected.format(state=state)


def test_finetune_launches_through_the_agent_of_the_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """--state-dir wins over $SHARDPOOL_AGENT_SOCKET; the agent's answer ends the run (this machine
    is not among the members online), as an error event on stdout with --json."""
    sockets = shared_socket_dir()
    socket_path = sockets / "agent.sock"
    monkeypatch.setenv("SHARDPOOL_AGENT_SOCKET", str(sockets / "not-this-one.sock"))
    state = _state_dir(tmp_path, {"pid": 1, "url": "http://198.51.100.1:7412", "socket": str(socket_path)})
    members = [{"name": "other", "address": "198.51.100.2", "online": True, "is_self": False}]
    config = write_config(
        tmp_path / "run.yaml",
        {**QUICKSTART, "output_dir": str(tmp_path / "out"), "shardpool": {"placement": "mesh"}},
    )
    try:
        with StubLocalAgent(socket_path, members=members):
            code, stdout, stderr = _finetune_in_process(
                capfd, "--json", "--state-dir", str(state), str(config)
            )
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    message = "this machine's mesh interface is down; run `shardpool mesh up` first"
    assert code == 2, stderr
    assert _json_lines(stdout) == [{"event": "error", "message": message}]
    assert stderr.splitlines() == [f"shardpool: error: {message}"]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_real_run_streams_its_events_and_nothing_else_on_stdout(
    tmp_path: Path, tiny_model: Path, completion_data: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    overrides = {"max_steps": 4, "eval_steps": 2, "save_steps": 3, "logging_steps": 2}
    config = write_config(tmp_path / "run.yaml", base_config(tiny_model, completion_data, out, **overrides))
    code, stdout, stderr = _finetune_in_process(capfd, "--json", str(config))
    assert code == 0, stderr
    events = _json_lines(stdout)
    assert [(event["event"], event.get("step")) for event in events] == [
        ("plan", None),
        ("step", 1),
        ("step", 2),
        ("eval", 2),
        ("step", 3),
        ("checkpoint", 3),
        ("step", 4),
        ("eval", 4),
        ("done", None),
    ]
    plan, done = events[0], events[-1]
    assert plan["total_steps"] == 4 and plan["plan"] == json.loads((out / "plan.json").read_text())
    assert (plan["train_rows"], plan["eval_rows"]) == (56, 8)
    steps = [event for event in events if event["event"] == "step"]
    assert all(event["total_steps"] == 4 and event["learning_rate"] >= 0 for event in steps)
    logged = [record for record in read_metrics(out) if "loss" in record]
    assert [(event["step"], event["loss"]) for event in steps[1::2]] == [
        (record["step"], record["loss"]) for record in logged
    ]
    assert events[5]["path"] == str(out / "checkpoints" / "checkpoint-3")
    summary = json.loads((out / "run_summary.json").read_text())
    assert done["eval_loss_after"] == summary["eval_loss_after"] == events[7]["eval_loss"]
    assert done["output_dir"] == str(out) and done["steps"] == 4
    assert "adapter written to" in stderr, "what people read goes to stderr"
