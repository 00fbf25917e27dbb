"""The job contract is closed, capped and torch-free, and refuses names that would escape a directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardpool.contract.events import StageEvent, parse_stage_event
from shardpool.contract.job import Job
from shardpool.contract.names import ContractError, check_digest, resolve_inside
from shardpool.contract.start import NotAMember, parse_job_start
from tests.helpers.jobs import inference_job_dict, job_dict

REPO = Path(__file__).resolve().parents[2]
MEMBERS = {"198.51.100.1", "198.51.100.2"}


def _start(job: dict, ranks: list[int] | None = None, **extra: object) -> object:
    body = {"job_id": "j1", "job": job, "ranks": ranks or [0], **extra}
    return parse_job_start(body, is_member_address=MEMBERS.__contains__)


def test_the_contract_modules_import_neither_torch_transformers_nor_the_http_stack() -> None:
    heavy = ("torch", "transformers", "aiohttp", "http.server", "shardpool.access", "shardpool.agent.service")
    contract = "shardpool.contract." + ", shardpool.contract.".join(
        ("names", "fields", "job", "events", "start", "inference")
    )
    code = f"import sys, {contract}; print([m for m in {heavy!r} if m in sys.modules])"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    assert result.stdout.strip() == "[]"


def test_a_request_carrying_env_or_any_unknown_field_is_refused() -> None:
    job = job_dict(launcher="198.51.100.1")
    with pytest.raises(ContractError, match="unknown field `env`"):
        _start(job, env={"NCCL_NET_PLUGIN": "/tmp/evil.so"})
    with pytest.raises(ContractError, match="unknown field `job.run_as`"):
        _start({**job, "run_as": "root"})
    assert _start(job).job.files_url == "http://198.51.100.1:41000"


@pytest.mark.parametrize(
    "name", ["../etc/passwd", "/etc/passwd", "a/../../b", "a\0b", ".ssh/id", "a//b", "x" * 513]
)
def test_input_names_that_could_leave_a_directory_are_refused(name: str) -> None:
    with pytest.raises(ContractError, match="input name"):
        _start(job_dict(launcher="198.51.100.1", inputs={name: "/x"}))


def test_counts_and_sizes_are_capped() -> None:
    one_layer_each = [{"start": i, "stop": i + 1, "device": "cpu"} for i in range(513)]
    with pytest.raises(ContractError, match="at most 512"):
        _start({**job_dict(launcher="198.51.100.1"), "stages": one_layer_each})
    with pytest.raises(ContractError, match="at most 256"):
        _start({**job_dict(launcher="198.51.100.1", stages=512), "replicas": 1}, ranks=list(range(257)))
    many = {f"f{i}": "/x" for i in range(10_001)}
    with pytest.raises(ContractError, match="at most 10000"):
        _start(job_dict(launcher="198.51.100.1", inputs=many))
    with pytest.raises(ContractError, match="4096"):
        _start({**job_dict(launcher="198.51.100.1"), "output_dir": "/" + "a" * 5000})


def test_addresses_must_be_current_members() -> None:
    with pytest.raises(NotAMember, match="master_addr 192.0.2.99 is not a current mesh member"):
        _start(job_dict(launcher="198.51.100.1", master_addr="192.0.2.99"))
    with pytest.raises(NotAMember, match="files_url 192.0.2.99"):
        _start(job_dict(launcher="198.51.100.1", files_url="http://192.0.2.99:8000"))
    with pytest.raises(ContractError, match="not like http://"):
        _start(job_dict(launcher="198.51.100.1", files_url="http://198.51.100.1:8000/../x"))
    with pytest.raises(ContractError, match="not an IP address"):
        _start(job_dict(launcher="198.51.100.1", master_addr="evil.example"))


def test_a_job_started_through_an_agent_must_use_the_file_server() -> None:
    with pytest.raises(ContractError, match="needs files_url"):
        _start(job_dict(launcher="198.51.100.1", files_url=None))


@pytest.mark.parametrize("digest", ["../../etc/x", "A" * 64, "a" * 63, "a" * 64 + "\n", "g" * 64, 7])
def test_digests_are_exactly_64_lowercase_hex(digest: object) -> None:
    with pytest.raises(ContractError, match="64 lowercase hex"):
        check_digest(digest)
    assert check_digest("0123456789abcdef" * 4) == "0123456789abcdef" * 4


def test_resolve_inside_refuses_a_symlink_out(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "link").symlink_to(tmp_path)
    with pytest.raises(ContractError, match="escapes"):
        resolve_inside(tmp_path / "run", "link/x")
    assert resolve_inside(tmp_path / "run", "a/b") == (tmp_path / "run" / "a" / "b").resolve()


def test_stage_events_are_closed_and_their_directories_relative() -> None:
    with pytest.raises(ContractError, match="output directory"):
        parse_stage_event({"event": "checkpoint_written", "step": 2, "partial": "../../etc"})
    with pytest.raises(ContractError, match="output directory"):
        parse_stage_event({"event": "final_written", "directory": "/etc"})
    with pytest.raises(ContractError, match="unknown event 'spawn'"):
        parse_stage_event({"event": "spawn", "argv": ["sh"]})
    with pytest.raises(ContractError, match="unknown field"):
        parse_stage_event({"event": "done", "eval_before": 1.0, "eval_after": 0.5, "extra": 1})
    error = parse_stage_event({"event": "error", "rank": 1, "message": "boom\nTraceback ..."})
    assert error.event is StageEvent.ERROR and error.message == "boom"
    assert json.dumps({"event": StageEvent.FINAL_WRITTEN}) == '{"event": "final_written"}'


def test_eval_events_carry_hf_names_and_step_events_no_lr() -> None:
    evaluated = parse_stage_event({"event": "eval", "step": 4, "epoch": 0.5, "eval_loss": 2.5})
    assert evaluated.event is StageEvent.EVAL and (evaluated.step, evaluated.eval_loss) == (4, 2.5)
    with pytest.raises(ContractError, match="epoch"):
        parse_stage_event({"event": "eval", "step": 4, "epoch": -1.0, "eval_loss": 2.5})
    step = {
        "event": "step", "step": 1, "epoch": 0.1, "loss": 2.0, "learning_rate": 1e-3, "grad_norm": 1.0,
        "tokens_per_s": 10.0, "step_seconds": 1.0, "stage_compute_s": [1.0], "stage_wait_s": [0.0],
        "bytes_sent": [0.0],
    }  # fmt: skip
    assert parse_stage_event(step).learning_rate == 1e-3
    with pytest.raises(ContractError, match="unknown field"):
        parse_stage_event({**step, "lr": 1e-3})


def test_job_files_round_trip_and_oversize_files_are_refused(tmp_path: Path) -> None:
    job = Job.model_validate(job_dict(launcher="198.51.100.1"))
    job.write(tmp_path / "job.json")
    assert Job.read(tmp_path / "job.json") == job
    assert Job.model_validate(job.model_dump(mode="json")) == Job.model_validate(
        job_dict(launcher="198.51.100.1")
    )
    (tmp_path / "big.json").write_bytes(b" " * (16 * 2**20 + 1))
    with pytest.raises(ContractError, match="at most 16777216 bytes"):
        Job.read(tmp_path / "big.json")


def _inference_job(**overrides: object) -> dict:
    return inference_job_dict(launcher="198.51.100.1", **overrides)


def test_an_inference_job_is_told_apart_by_its_kind_and_as_closed_as_a_training_job() -> None:
    from shardpool.contract.inference import InferenceJob

    started = _start(_inference_job(), ranks=[0, 1])
    assert isinstance(started.job, InferenceJob) and started.job.num_stages == 2
    assert not isinstance(_start(job_dict(launcher="198.51.100.1")).job, InferenceJob)
    with pytest.raises(ContractError, match="unknown field `job.env`"):
        _start(_inference_job(env={"LD_PRELOAD": "/tmp/evil.so"}))
    with pytest.raises(ContractError, match=r"ranks \[2\] must be distinct and in 0..1"):
        _start(_inference_job(), ranks=[2])
    with pytest.raises(ContractError, match="needs files_url"):
        _start(_inference_job(files_url=None))
    with pytest.raises(ContractError, match="config.json"):
        _start(_inference_job(inputs={"model/model.safetensors": "/m/model.safetensors"}))
    with pytest.raises(ContractError, match="input name"):
        _start(_inference_job(inputs={"model/config.json": "/m/c", "../etc/passwd": "/x"}))


def test_an_inference_job_meets_and_fetches_only_at_member_addresses() -> None:
    with pytest.raises(NotAMember, match="master_addr 192.0.2.99 is not a current mesh member"):
        _start(_inference_job(master_addr="192.0.2.99"))
    with pytest.raises(NotAMember, match="files_url 192.0.2.99"):
        _start(_inference_job(files_url="http://192.0.2.99:8000"))
    body = {"job_id": "j1", "job": _inference_job(), "ranks": [0]}
    with pytest.raises(NotAMember, match="not the mesh address 198.51.100.2"):
        parse_job_start(body, is_member_address=MEMBERS.__contains__, origin_address="198.51.100.2")
