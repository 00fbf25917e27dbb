"""The files a stage process reads from, and writes to, the launching machine.

The launcher owns everything: the base model, the tokenized data, the starting adapter, the
checkpoints and ``output_dir``; it names each file a stage may read in ``job.inputs``
(:func:`job_inputs`). A stage on the launcher's own machine opens those paths directly;
a stage on another mesh member fetches them from the launcher's file server (byte ranges of only
the tensors it owns, checked by size and hash) and sends its results back the same way. The
training loop sees one interface either way, so moving a stage changes nothing in it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from shardpool.config import Config
from shardpool.contract.job import RESUME_PREFIX, Job
from shardpool.contract.names import resolve_inside, safe_relative_name
from shardpool.contract.start import FILES_SECRET_FILE
from shardpool.errors import ShardpoolError
from shardpool.files.client import RemoteFiles
from shardpool.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from shardpool.model.weights import INDEX_FILE, WeightReader, save_tensors

__all__ = [
    "DATA_INPUT",
    "INIT_ADAPTER_PREFIX",
    "MODEL_PREFIX",
    "RunFiles",
    "job_inputs",
    "model_file_names",
    "read_files_secret",
]

DATA_INPUT = "data.safetensors"
MODEL_PREFIX = "model/"
INIT_ADAPTER_PREFIX = "init_adapter/"
_SECRET_CHARS = 64


def read_files_secret(job_dir: Path) -> str:
    """The launcher's file-server secret from ``job_dir/files.secret`` (written 0600 by the agent).

    The secret travels in a file, never on argv or in the environment, so other local users cannot
    read it from ``/proc``. A missing or malformed file is a one-line error naming the file.
    """
    path = Path(job_dir) / FILES_SECRET_FILE
    try:
        with open(path, "rb") as handle:
            text = handle.read(_SECRET_CHARS + 2).decode("ascii").strip()
    except FileNotFoundError:
        raise ShardpoolError(
            f"{path} is missing: a remote stage needs the job's file-server secret; start it through an agent"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ShardpoolError(f"cannot read the file-server secret {path}: {error}") from None
    if len(text) != _SECRET_CHARS or any(char not in "0123456789abcdef" for char in text):
        raise ShardpoolError(f"{path} does not hold 64 lowercase hex digits; the agent wrote it wrongly")
    return text


def job_inputs(config: Config, run_dir: Path, resume_from: Path | None) -> dict[str, str]:
    """Every file a stage may read, by the name it asks for, with its path on the launcher.

    The tokenized data, the base model's files, the starting adapter (``lora_model_dir``) and,
    when resuming, the checkpoint's stage and RNG files.
    """
    model_dir = Path(config.base_model).resolve()
    inputs = {DATA_INPUT: str((run_dir / DATA_INPUT).resolve())}
    inputs.update({MODEL_PREFIX + name: str(model_dir / name) for name in model_file_names(model_dir)})
    if config.lora_model_dir:
        adapter = Path(config.lora_model_dir).resolve()
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            inputs[INIT_ADAPTER_PREFIX + name] = str(adapter / name)
    if resume_from is not None:
        for path in sorted(resume_from.glob("*.safetensors")):
            if path.name.startswith(("stage-", "rng-rank-")):
                inputs[RESUME_PREFIX + path.name] = str(path.resolve())
    return inputs


def model_file_names(model_dir: Path) -> list[str]:
    """The files of a model directory a stage needs: config.json and the safetensors (and index)."""
    names = ["config.json"]
    names += sorted(path.name for path in model_dir.glob("*.safetensors"))
    if (model_dir / INDEX_FILE).is_file():
        names.append(INDEX_FILE)
    return names


class RunFiles:
    """Inputs by name (``job.inputs``: name → path on the launcher) and outputs by relative path.

    ``job_dir`` is the directory of the stage's job file; a remote stage reads the file server's
    secret from ``files.secret`` there.
    """

    def __init__(self, job: Job, *, job_dir: Path | None = None) -> None:
        self.job = job
        self._remote: RemoteFiles | None = None
        self._fetch_dir: Path | None = None
        if job.files_url:
            if job_dir is None:
                raise ShardpoolError(
                    "a stage reading from the launcher's file server needs its job directory"
                )
            self._remote = RemoteFiles(job.files_url, secret=read_files_secret(job_dir))
            self._fetch_dir = Path(tempfile.mkdtemp(prefix="shardpool-run-"))

    @property
    def remote(self) -> bool:
        """Whether this process reads and writes through the launcher's file server."""
        return self._remote is not None

    def path(self, name: str) -> Path:
        """A local path holding input ``name`` (fetched and verified first when remote)."""
        if name not in self.job.inputs:
            raise ShardpoolError(f"the job has no input named {name!r}")
        if self._remote is None:
            return Path(self.job.inputs[name])
        assert self._fetch_dir is not None
        return Path(self._remote.fetch_file(name, self._fetch_dir))

    def has(self, name: str) -> bool:
        """Whether the job provides input ``name``."""
        return name in self.job.inputs

    def model_dir(self) -> Path:
        """A local directory with the model's config.json (for the architecture, never the weights)."""
        return self.path(MODEL_PREFIX + "config.json").parent

    def weight_reader(self) -> WeightReader:
        """A reader of the base model's tensors: the model directory here, or the file server's copy."""
        if self._remote is None:
            return WeightReader(Path(self.job.inputs[MODEL_PREFIX + "config.json"]).parent)
        names = [
            name
            for name in self.job.inputs
            if name.startswith(MODEL_PREFIX) and name.endswith(".safetensors")
        ]
        return WeightReader(self._remote, sorted(names))

    def adapter_dir(self, prefix: str) -> Path:
        """A local directory holding every input under ``prefix`` (e.g. ``init_adapter/``)."""
        names = [name for name in self.job.inputs if name.startswith(prefix)]
        if not names:
            raise ShardpoolError(f"the job has no inputs under {prefix!r}")
        return [self.path(name) for name in names][0].parent

    def close(self) -> None:
        """Delete the files fetched for this run (the content-addressed cache keeps its copies)."""
        if self._fetch_dir is not None:
            shutil.rmtree(self._fetch_dir, ignore_errors=True)
            self._fetch_dir = None
        if self._remote is not None:
            self._remote.close()

    def save_tensors(self, relative: str, tensors: dict[str, torch.Tensor]) -> None:
        """Write a safetensors file at ``output_dir/relative`` on the launcher, atomically."""
        if self._remote is None:
            target = resolve_inside(self.job.output_dir, relative, "output path")
            target.parent.mkdir(parents=True, exist_ok=True)
            save_tensors(target, tensors)
            return
        assert self._fetch_dir is not None
        staging = self._fetch_dir / "outgoing"
        staging.mkdir(parents=True, exist_ok=True)
        name = Path(safe_relative_name(relative, "output path")).name
        # A name of its own per call: the step-boundary copy thread uploads files of the same names
        # (stage-i, rng-rank-r) while the main thread may be sending a checkpoint's.
        fd, staged = tempfile.mkstemp(dir=staging, prefix=f"{name}.", suffix=".out")
        os.close(fd)
        local = Path(staged)
        try:
            save_tensors(local, tensors)
            self._remote.upload(local, relative)
        finally:
            local.unlink(missing_ok=True)

    def close_connection(self) -> None:
        """Close the calling thread's connection to the file server (each thread has its own)."""
        if self._remote is not None:
            self._remote.close()
