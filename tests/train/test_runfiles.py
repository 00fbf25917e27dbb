"""shardpool.train.runfiles: a remote stage reads its file-server secret from the job directory and uses it."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from shardpool.contract.job import Job
from shardpool.contract.start import FILES_SECRET_FILE
from shardpool.errors import ShardpoolError
from shardpool.files.server import FileServer
from shardpool.train.runfiles import RunFiles, read_files_secret
from tests.helpers.jobs import job_dict


def _job(files_url: str | None, inputs: dict[str, str]) -> Job:
    return Job.model_validate(job_dict(inputs=inputs, files_url=files_url))


def test_a_remote_stage_fetches_with_the_secret_from_its_job_dir(tmp_path: Path) -> None:
    source = tmp_path / "data.safetensors"
    source.write_bytes(b"tokens" * 100)
    secret = secrets.token_hex(32)
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / FILES_SECRET_FILE).write_text(secret + "\n")
    files = {"data.safetensors": source}
    with FileServer("127.0.0.1", files=files, upload_root=tmp_path / "out", secret=secret) as server:
        job = _job(server.url, {"data.safetensors": "/elsewhere/data.safetensors"})
        run_files = RunFiles(job, job_dir=job_dir)
        try:
            assert run_files.remote
            assert run_files.path("data.safetensors").read_bytes() == source.read_bytes()
        finally:
            run_files.close()
        (job_dir / FILES_SECRET_FILE).write_text(secrets.token_hex(32))
        wrong = RunFiles(job, job_dir=job_dir)
        try:
            with pytest.raises(ShardpoolError, match="HTTP 401"):
                wrong.path("data.safetensors")
        finally:
            wrong.close()


def test_a_local_stage_opens_paths_directly_without_a_secret(tmp_path: Path) -> None:
    source = tmp_path / "data.safetensors"
    source.write_bytes(b"x")
    run_files = RunFiles(_job(None, {"data.safetensors": str(source)}))
    assert not run_files.remote and run_files.path("data.safetensors") == source


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "is missing"),
        ("abc", "64 lowercase hex"),
        ("G" * 64, "64 lowercase hex"),
        ("a" * 65, "64 lowercase"),
    ],
)
def test_a_missing_or_malformed_secret_file_is_one_line(
    tmp_path: Path, content: str | None, message: str
) -> None:
    if content is not None:
        (tmp_path / FILES_SECRET_FILE).write_text(content)
    with pytest.raises(ShardpoolError, match=message) as caught:
        read_files_secret(tmp_path)
    assert "\n" not in str(caught.value)
    with pytest.raises(ShardpoolError, match=message):
        RunFiles(_job("http://127.0.0.1:41000", {"data.safetensors": "/x"}), job_dir=tmp_path)


def test_two_threads_upload_files_of_the_same_name_through_one_run_files(tmp_path: Path) -> None:
    """The step-boundary copy thread and the main thread both send ``stage-0.safetensors`` files."""
    import threading

    import torch
    from safetensors.torch import load_file

    from shardpool.contract.liveness import live_dir

    secret = secrets.token_hex(32)
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / FILES_SECRET_FILE).write_text(secret)
    out = tmp_path / "out"
    with FileServer("127.0.0.1", files={}, upload_root=out, secret=secret) as server:
        run_files = RunFiles(_job(server.url, {}), job_dir=job_dir)

        def send(directory: str, value: float) -> None:
            for _ in range(20):
                run_files.save_tensors(f"{directory}/stage-0.safetensors", {"w": torch.full((256,), value)})
            run_files.close_connection()

        try:
            copy = threading.Thread(target=send, args=(live_dir(4), 1.0))
            copy.start()
            send("checkpoints/checkpoint-4.partial", 2.0)
            copy.join()
        finally:
            run_files.close()
    assert torch.equal(
        load_file(str(out / live_dir(4) / "stage-0.safetensors"))["w"], torch.full((256,), 1.0)
    )
    saved = load_file(str(out / "checkpoints/checkpoint-4.partial/stage-0.safetensors"))["w"]
    assert torch.equal(saved, torch.full((256,), 2.0))
