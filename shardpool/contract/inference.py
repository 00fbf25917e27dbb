"""The inference job: what every stage of a generating ring receives, as plain JSON.

Written by the driver (``shardpool generate`` / ``serve``) into a private file for local stages, or
sent to each member's agent with ``POST /v1/jobs`` for stages on the mesh, where the agent starts
``python -m shardpool.infer.stage_process`` instead of a training rank. Like a training
:class:`~shardpool.contract.job.Job` it names its inputs (the base model's ``model/*`` files and the
adapter's ``adapter/*``) with their paths on the driver's machine: a local stage opens the paths,
a mesh stage fetches them by name from ``files_url``. A closed schema: an unknown key is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, model_validator

from mesh.files import write_json
from shardpool.contract.fields import (
    MAX_INPUTS,
    MAX_STAGES,
    Closed,
    FilesURL,
    InputName,
    IPText,
    LauncherPath,
    describe_validation_error,
)
from shardpool.contract.job import StagePlacement
from shardpool.errors import ShardpoolError

__all__ = ["ADAPTER_PREFIX", "INFERENCE_KIND", "MODEL_PREFIX", "InferenceJob"]

#: The ``kind`` that tells an inference job from a training job in ``POST /v1/jobs``.
INFERENCE_KIND = "inference"
#: Inputs under this prefix are the base model's files (config.json, *.safetensors).
MODEL_PREFIX = "model/"
#: Inputs under this prefix are the adapter's files (adapter_config.json, adapter_model.safetensors).
ADAPTER_PREFIX = "adapter/"


class InferenceJob(Closed):
    """One inference ring: S stages (ranks 0..S-1, each on its placement's host) and the driver
    (rank S, on the machine that hosts the rendezvous store at ``master_addr:master_port``)."""

    kind: Literal["inference"]
    inputs: dict[InputName, LauncherPath] = Field(max_length=MAX_INPUTS)
    files_url: FilesURL | None = None
    lora_r: int = Field(default=8, ge=1, le=65536)
    lora_alpha: float = Field(default=16.0, gt=0, allow_inf_nan=False)
    lora_targets: list[str] = Field(default_factory=list, max_length=256)
    stages: list[StagePlacement] = Field(min_length=1, max_length=MAX_STAGES)
    master_addr: IPText
    master_port: int = Field(ge=1, le=65535)
    threads_per_process: int = Field(ge=1, le=4096)
    timeout_s: float = Field(default=300.0, gt=0, le=7 * 86400, allow_inf_nan=False)

    @model_validator(mode="after")
    def _model_given(self) -> InferenceJob:
        if MODEL_PREFIX + "config.json" not in self.inputs:
            raise ValueError(f"inputs must name the base model's {MODEL_PREFIX}config.json")
        return self

    @property
    def num_stages(self) -> int:
        """How many stage processes the ring has."""
        return len(self.stages)

    @property
    def driver_rank(self) -> int:
        """The driver's rank: the one after the last stage."""
        return len(self.stages)

    @property
    def world_size(self) -> int:
        """The ranks an agent may be asked to start: the stages (the driver is not one of them)."""
        return len(self.stages)

    @property
    def has_adapter(self) -> bool:
        """Whether the ring loads an adapter (else it generates with the base model alone)."""
        return any(name.startswith(ADAPTER_PREFIX) for name in self.inputs)

    @property
    def files_host(self) -> str | None:
        """The address of the driver's file server, when stages fetch their files from it."""
        return urlsplit(self.files_url).hostname if self.files_url else None

    def placement(self, rank: int) -> StagePlacement:
        """Where stage ``rank`` runs."""
        return self.stages[rank]

    def stage_index(self, rank: int) -> int:
        """The stage a rank runs: the rank itself (one stage per rank)."""
        return rank

    def write(self, path: Path) -> None:
        """Write the job atomically, readable by its owner only."""
        write_json(path, self.model_dump(mode="json"), mode=0o600)

    @classmethod
    def read(cls, path: Path) -> InferenceJob:
        """The job at ``path``; one line when it is missing or malformed."""
        try:
            return cls.model_validate_json(Path(path).read_bytes(), strict=False)
        except OSError as error:
            raise ShardpoolError(f"cannot read the inference job {path}: {error.strerror}") from None
        except ValidationError as error:
            raise ShardpoolError(describe_validation_error(error, str(path))) from None
        except json.JSONDecodeError as error:
            raise ShardpoolError(f"{path} is not JSON: {error}") from None
