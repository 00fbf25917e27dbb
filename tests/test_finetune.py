"""shardpool.finetune and the CLI: bad input fails fast and cleanly, failures stop every stage,
and a killed run resumes to the same adapter as an uninterrupted one."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file, save_file

from shardpool.cli import main
from shardpool.config import parse_config
from shardpool.finetune import finetune
from shardpool.launch.run import RUN_DIR_NAME
from tests.helpers.shared_runs import CHECKPOINTED_TWO_STAGES, trained_once
from tests.helpers.training import base_config, read_metrics, run_cli, stage_pids, write_config, write_jsonl


def _bad_case(name: str, tmp: Path, model: Path, data: Path) -> tuple[Path, str]:
    """Build one malformed config (and its files); return (config path, text the error must contain)."""
    out = tmp / "out"
    config = base_config(model, data, out)
    expected = ""
    if name == "unknown key":
        config["foo_bar"] = 1
        expected = "unknown key `foo_bar`"
    elif name == "misspelled key":
        config["lerning_rate"] = config.pop("learning_rate")
        expected = "did you mean `learning_rate`"
    elif name == "wrong type":
        config["micro_batch_size"] = "two"
        expected = "`micro_batch_size`"
    elif name == "missing base_model directory":
        config["base_model"] = str(tmp / "no-such-model")
        expected = "does not exist"
    elif name == "unsupported architecture":
        other = tmp / "gpt2"
        other.mkdir()
        (other / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
        save_file({"wte.weight": torch.zeros(2, 2)}, str(other / "model.safetensors"))
        config["base_model"] = str(other)
        expected = "unsupported architecture 'gpt2'"
    elif name == "more stages than layers":
        config["shardpool"] = {"stages": 8}
        expected = "only 6 decoder layers"
    elif name == "empty dataset":
        config["datasets"] = [{"path": str(write_jsonl(tmp / "empty.jsonl", [])), "type": "completion"}]
        expected = "empty"
    elif name == "row without its field":
        rows = [{"text": "fine row"}, {"body": "no text here"}]
        config["datasets"] = [{"path": str(write_jsonl(tmp / "nofield.jsonl", rows)), "type": "completion"}]
        expected = "text"
    elif name == "sequence_len <= 0":
        config["sequence_len"] = 0
        expected = "`sequence_len`"
    elif name == "targets match nothing":
        config["lora_target_linear"] = False
        config["lora_target_modules"] = ["foo_proj"]
        expected = "foo_proj"
    elif name == "layers do not add up":
        config["shardpool"] = {"layers": [2, 2]}
        expected = "sums to 4"
    elif name == "invalid JSON line":
        rows = [{"text": "fine row"}, "{not json"]
        config["datasets"] = [{"path": str(write_jsonl(tmp / "broken.jsonl", rows)), "type": "completion"}]
        expected = "broken.jsonl:2: invalid JSON"
    elif name == "unsupported axolotl key":
        config["deepspeed"] = "zero3.json"
        expected = "`deepspeed` is not supported"
    elif name == "missing dataset file":
        config["datasets"] = [{"path": str(tmp / "absent.jsonl"), "type": "completion"}]
        expected = "absent.jsonl"
    elif name == "devices and stages disagree":
        config["shardpool"] = {"stages": 3, "devices": ["cpu", "cpu"]}
        expected = "stage counts disagree"
    return write_config(tmp / "config.yaml", config), expected


BAD_CASES = [
    "unknown key",
    "misspelled key",
    "wrong type",
    "missing base_model directory",
    "unsupported architecture",
    "more stages than layers",
    "empty dataset",
    "row without its field",
    "sequence_len <= 0",
    "targets match nothing",
    "layers do not add up",
    "invalid JSON line",
    "unsupported axolotl key",
    "missing dataset file",
    "devices and stages disagree",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_fails_with_one_line_and_writes_nothing(
    case: str, tmp_path: Path, tiny_model: Path, completion_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path, expected = _bad_case(case, tmp_path, tiny_model, completion_data)
    started = time.monotonic()
    code = main(["finetune", str(config_path)])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("shardpool: error: ")
    assert expected in lines[0], lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert not (tmp_path / "out").exists(), "nothing may be written to output_dir"
    assert time.monotonic() - started < 10


def test_real_cli_prints_one_line_without_traceback(
    tmp_path: Path, tiny_model: Path, completion_data: Path
) -> None:
    config_path, _ = _bad_case("misspelled key", tmp_path, tiny_model, completion_data)
    result = run_cli("finetune", str(config_path), timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"shardpool: error: unknown key `lerning_rate` in {config_path}; did you mean `learning_rate`?"
    ]
    assert not (tmp_path / "out").exists()


def test_missing_config_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["finetune", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.fixture(scope="module")
def cli_run(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, completion_data: Path
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One real CLI run whose stdout is a pipe, from a working directory of its own with the model
    and output_dir given relative to it: (the finished process, its output_dir). Two tests read it."""
    root = tmp_path_factory.mktemp("cli-run")
    workdir = root / "work"
    (workdir / "models").mkdir(parents=True)
    (workdir / "models" / "tiny").symlink_to(tiny_model)
    config = base_config(Path("models/tiny"), completion_data, Path("out"), max_steps=3, logging_steps=2)
    result = run_cli("finetune", str(write_config(root / "c.yaml", config)), timeout=180, cwd=workdir)
    assert result.returncode == 0, result.stderr
    return result, workdir / "out"


@pytest.mark.slow
def test_output_that_is_not_a_terminal_gets_a_log_line_per_logged_step(
    cli_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    result, out = cli_run
    lines = result.stdout.splitlines()
    step_lines = [line for line in lines if line.startswith("step ")]
    shape = r"step \d/3  loss \S+  lr \d\.\d\de[-+]\d\d  \d+ tok/s  eta \d+:\d\d:\d\d"
    assert [re.fullmatch(shape, line) is not None for line in step_lines] == [True, True], result.stdout
    metrics = read_metrics(out)
    assert [record["step"] for record in metrics] == [2, 3]
    for line, record in zip(step_lines, metrics, strict=True):
        assert line.startswith(f"step {record['step']}/3  loss {record['loss']:.4f}  lr ")
    assert step_lines[-1].endswith("eta 0:00:00")
    assert not any(line.startswith("training") for line in lines), (
        "no progress bar where stdout is not a terminal"
    )
    placement = next(index for index, line in enumerate(lines) if "placement of" in line)
    result_line = next(index for index, line in enumerate(lines) if line.startswith("eval loss: "))
    assert placement < lines.index(step_lines[0]) < lines.index(step_lines[-1]) < result_line
    assert any(line.startswith("adapter written to ") for line in lines[result_line:])


@pytest.mark.slow
def test_exception_in_one_stage_stops_the_whole_run(
    tmp_path: Path, tiny_model: Path, completion_data: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for item in tiny_model.iterdir():
        if item.suffix != ".safetensors":
            (broken / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(tiny_model / "model.safetensors"))
    save_file(
        {k: v for k, v in tensors.items() if not k.startswith("model.layers.4.")},
        str(broken / "model.safetensors"),
    )
    out = tmp_path / "out"
    config = write_config(
        tmp_path / "c.yaml", base_config(broken, completion_data, out, shardpool={"layers": [3, 3]})
    )
    # Measure this host first (cached for the run, as a user's earlier `shardpool plan` does): the
    # bound is on how fast a stage's failure ends the run, not on a cold profile and co-run
    # measurement, which start processes of their own.
    assert main(["plan", str(config)]) == 0
    capfd.readouterr()
    started = time.monotonic()
    code = main(["finetune", str(config)])  # in-process; the stages are processes of their own
    elapsed = time.monotonic() - started
    stderr = capfd.readouterr().err  # this process's and the stages' (they inherit descriptor 2)
    assert code == 2
    assert elapsed < 30, f"the run took {elapsed:.1f}s to fail"
    error = stderr.strip().splitlines()[-1]
    assert error.startswith("shardpool: error: stage 1 (rank 1) failed:"), error
    assert "model.layers.4." in error and "missing" in error
    assert "Traceback" not in stderr
    assert stage_pids(out / RUN_DIR_NAME / "job.json") == {}, "no stage process may outlive the run"


def test_resume_without_checkpoint_and_rerun_over_checkpoints_are_refused(
    tmp_path: Path, tiny_model: Path, completion_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.yaml", base_config(tiny_model, completion_data, out))
    assert main(["finetune", str(config), "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    (out / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoints" / "checkpoint-2" / "checkpoint.json").write_text('{"step": 2}')
    assert main(["finetune", str(config)]) == 2
    assert "pass --resume" in capsys.readouterr().err


_LOAD_OUTPUT_DIR = """
import json, sys
import torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer
model = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tokenizer("alpha beta gamma", return_tensors="pt").input_ids
with torch.no_grad():
    logits = model(ids).logits
print(json.dumps({"base": model.peft_config["default"].base_model_name_or_path, "shape": list(logits.shape)}))
"""


@pytest.mark.slow
def test_output_dir_loads_by_itself_from_any_directory(
    cli_run: tuple[subprocess.CompletedProcess[str], Path], tiny_model: Path, tmp_path: Path
) -> None:
    _, out = cli_run
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(tiny_model.resolve())
    assert (out / "tokenizer_config.json").is_file() and (out / "tokenizer.json").is_file()
    assert not list((out / RUN_DIR_NAME).glob("tokenizer-*")), "the tokenizer's scratch directory is removed"
    card = (out / "README.md").read_text()
    assert card.startswith(f"---\nbase_model: {tiny_model.resolve()}\nlibrary_name: peft\n")
    summary = json.loads((out / "run_summary.json").read_text())
    assert f"| final train loss | {summary['final_train_loss']:.4f} |" in card
    assert f"| eval loss after training | {summary['eval_loss_after']:.4f} |" in card

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    loaded = subprocess.run(
        [sys.executable, "-c", _LOAD_OUTPUT_DIR, str(out)],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr
    result = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert result["base"] == str(tiny_model.resolve())
    vocab_size = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    assert result["shape"][0] == 1 and result["shape"][2] == vocab_size


@pytest.mark.slow
def test_resume_from_a_step_n_checkpoint_of_an_earlier_version_or_a_named_one(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, completion_data: Path
) -> None:
    # The first run is tests/test_keep_training.py's uninterrupted one (trained once a session);
    # each resume below trains its last step only, from its last checkpoint.
    overrides = CHECKPOINTED_TWO_STAGES
    first = trained_once(tmp_path_factory, tiny_model, completion_data, **overrides)
    assert sorted(path.name for path in (first / "checkpoints").iterdir()) == [
        "checkpoint-1", "checkpoint-2", "checkpoint-3",
    ]  # fmt: skip
    old = tmp_path / "old"
    old.mkdir()
    shutil.copytree(first / "checkpoints" / "checkpoint-3", old / "checkpoints" / "step-3")
    shutil.copy(first / "metrics.jsonl", old / "metrics.jsonl")
    config = write_config(tmp_path / "c.yaml", base_config(tiny_model, completion_data, old, **overrides))
    assert main(["finetune", str(config), "--resume"]) == 0
    assert [record["step"] for record in read_metrics(old)] == [1, 2, 3, 4]
    resumed_adapter = load_file(str(old / "adapter_model.safetensors"))
    first_adapter = load_file(str(first / "adapter_model.safetensors"))
    assert resumed_adapter.keys() == first_adapter.keys()
    assert max(float((resumed_adapter[k] - first_adapter[k]).abs().max()) for k in first_adapter) < 1e-6
    # axolotl's `resume_from_checkpoint:` continues from a named checkpoint, into a new output_dir too.
    named = finetune(
        parse_config(
            base_config(
                tiny_model, completion_data, tmp_path / "named", **overrides,
                resume_from_checkpoint=str(first / "checkpoints" / "checkpoint-3"),
            )
        ),
        console=Console(quiet=True),
    )  # fmt: skip
    assert [record["step"] for record in read_metrics(named)] == [4]
    named_adapter = load_file(str(named / "adapter_model.safetensors"))
    assert max(float((named_adapter[k] - first_adapter[k]).abs().max()) for k in first_adapter) < 1e-6


def test_rendezvous_store_serves_on_its_host_only(tmp_path: Path) -> None:
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from shardpool.errors import ShardpoolError
    from shardpool.train.rendezvous import rendezvous_store

    store = rendezvous_store("127.0.0.1", timeout_s=10)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    client.set("rank-1", "ready")
    assert store.get("rank-1") == b"ready"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", store.port), timeout=5).close()
    with pytest.raises(ShardpoolError, match="refusing to listen on 0.0.0.0"):
        rendezvous_store("0.0.0.0")
    with pytest.raises(ShardpoolError, match=f"port {store.port}"):
        rendezvous_store("127.0.0.1", port=store.port)
    port = store.port
    del client, store
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the store closed the socket it was handed
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except ConnectionRefusedError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"port {port} still accepts connections after the store was freed")


@pytest.mark.slow
def test_periodic_eval_and_save_total_limit(tmp_path: Path, tiny_model: Path, completion_data: Path) -> None:
    """eval_steps writes HF's eval_loss lines at its steps; save_total_limit keeps the newest checkpoints.

    56 training rows at 6 a step make 9.33 steps an epoch: saves_per_epoch 5 saves every 2 steps
    (2 and 4; the last step writes the adapter), eval_steps 0.5 of 6 steps evaluates at 3 and 6.
    """
    out = tmp_path / "out"
    overrides: dict[str, Any] = {
        "max_steps": 6,
        "eval_steps": 0.5,
        "saves_per_epoch": 5,
        "save_total_limit": 1,
        "shardpool": {"stages": 2},
    }
    finetune(
        parse_config(base_config(tiny_model, completion_data, out, **overrides)), console=Console(quiet=True)
    )
    metrics = read_metrics(out)
    steps = [record for record in metrics if "loss" in record]
    evals = [record for record in metrics if "eval_loss" in record]
    assert [record["step"] for record in steps] == [1, 2, 3, 4, 5, 6]
    assert all("learning_rate" in record and "lr" not in record for record in steps)
    assert [record["epoch"] for record in steps] == [round(step * 6 / 56, 4) for step in range(1, 7)]
    assert [(record["step"], record["epoch"]) for record in evals] == [(3, 0.3214), (6, 0.6429)]
    summary = json.loads((out / "run_summary.json").read_text())
    assert evals[-1]["eval_loss"] == summary["eval_loss_after"]
    assert evals[0]["eval_loss"] != summary["eval_loss_before"]
    assert [path.name for path in (out / "checkpoints").iterdir()] == ["checkpoint-4"]
