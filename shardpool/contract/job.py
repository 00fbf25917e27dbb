"""The job: the one description of a run that every stage process receives, as plain JSON.

:class:`Job` holds where each stage runs (:class:`StagePlacement`), the run config, every input a
stage may read by name, and the rendezvous and file-server addresses; :meth:`Job.write` and
:meth:`Job.read` are its file, and :func:`read_job_json` parses its JSON text under a size cap.
Moving a stage to another machine changes only its ``device``, its ``host`` and the rendezvous
address here; nothing else a stage process reads depends on where it runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, field_validator, model_validator

from mesh.files import write_json
from shardpool.config import Config, parse_config
from shardpool.config.schema import MAX_SAMPLE_PROMPTS
from shardpool.contract.events import TokenId
from shardpool.contract.fields import (
    MAX_INPUTS,
    MAX_REPLICAS,
    MAX_STAGES,
    MAX_WORLD_SIZE,
    Closed,
    DeviceName,
    FilesURL,
    FiniteFloat,
    HostName,
    InputName,
    IPText,
    LauncherPath,
    Steps,
    describe_validation_error,
)
from shardpool.contract.names import ContractError
from shardpool.contract.schedule import MAX_LEAD
from shardpool.errors import ShardpoolError

__all__ = [
    "CONTROL_SECRET_ENV",
    "RESUME_PREFIX",
    "MAX_JOB_JSON_BYTES",
    "StagePlacement",
    "Job",
    "read_job_json",
]

#: The environment variable a local launcher hands its stages the job's control secret in: the key
#: that seals the rendezvous store's values (:mod:`shardpool.elastic.messages`) is derived from it.
#: A mesh stage derives it from its ``files.secret`` instead. Never in the job: the job is no secret.
CONTROL_SECRET_ENV = "SHARDPOOL_CONTROL_SECRET"

#: Inputs under this prefix are the checkpoint a resumed run starts from.
RESUME_PREFIX = "resume/"
MAX_JOB_JSON_BYTES = 16 * 2**20
#: The most tokens of one sample prompt (``shardpool.sample_prompts``, at most 4,000 characters).
MAX_SAMPLE_PROMPT_TOKENS = 8192


class StagePlacement(Closed):
    """Where one stage runs, which layers ``[start, stop)`` it owns, the dtype it computes in
    (``dtype``, chosen per device by the planner; None: the config's ``bf16``/``fp16``) and how it
    computes with NF4 weights (``nf4_backend``, chosen per device by the planner; None:
    bitsandbytes)."""

    start: int = Field(ge=0, le=1_000_000)
    stop: int = Field(ge=1, le=1_000_000)
    device: DeviceName
    host: HostName = "localhost"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    nf4_backend: Literal["bitsandbytes", "torch"] | None = None

    @model_validator(mode="after")
    def _layers_in_order(self) -> StagePlacement:
        if self.stop <= self.start:
            raise ValueError(f"stage layers [{self.start}, {self.stop}) are empty; stop must exceed start")
        return self


class Job(Closed):
    """Everything a stage process needs to build its stage and train it.

    ``inputs`` names every file a stage may read (``data.safetensors``, ``model/config.json``,
    ``model/*.safetensors``, ``init_adapter/*``, ``resume/*``) with its path on the launching
    machine. A stage on that machine opens the paths; a stage elsewhere fetches them by name from
    ``files_url`` and sends its results there too, so ``output_dir`` and the input paths mean
    nothing on another member. ``master_addr:master_port`` is the launcher's torch.distributed
    TCPStore. ``rebalance_at`` is the step after which every rank waits there for the launcher's
    re-balance decision (:mod:`shardpool.contract.rebalance`).
    """

    config: dict[str, Any]
    stages: list[StagePlacement] = Field(min_length=1, max_length=MAX_STAGES)
    replicas: int = Field(ge=1, le=MAX_REPLICAS)
    inputs: dict[InputName, LauncherPath] = Field(max_length=MAX_INPUTS)
    output_dir: LauncherPath
    master_addr: IPText
    master_port: int = Field(ge=1, le=65535)
    total_steps: Steps
    threads_per_process: int = Field(ge=1, le=4096)
    resume_step: Steps = 0
    eval_before: FiniteFloat | None = None
    files_url: FilesURL | None = None
    timeout_s: float = Field(default=300.0, gt=0, le=7 * 86400, allow_inf_nan=False)
    #: The step after which every rank waits for the launcher's re-balance decision (None: never).
    rebalance_at: Steps | None = None
    #: Whether the stages beat and copy their step-boundary state (:mod:`shardpool.contract.liveness`).
    keep_state: bool = False
    #: The job's process-group generation: 0 as started, one more each time it grows in place
    #: (:mod:`shardpool.elastic.growth`).
    generation: Steps = 0
    #: Set on the ranks started to join a running job: they build their stage, wait for the step
    #: the running ranks move to this generation after, and take their state from them.
    joining: bool = False
    #: A data-parallel job's replicas on their own devices: where each replica's one stage runs
    #: (``replica_places[r]``, the whole model) and how many of the step's micro-batches it trains
    #: (``shares[r]``, in order). None: every replica runs ``stages`` and takes ``M`` micro-batches.
    replica_places: list[StagePlacement] | None = Field(default=None, max_length=MAX_REPLICAS)
    shares: list[int] | None = Field(default=None, max_length=MAX_REPLICAS)
    #: The 1F1B warm-up depth every stage runs (:func:`~shardpool.contract.schedule.warmup_forwards`):
    #: the plan's, so the stages meet their neighbours' sends in the order the planner simulated.
    warmup_lead: int = Field(default=1, ge=1, le=MAX_LEAD)
    #: ``shardpool.sample_prompts`` as the launcher's tokenizer encodes them: replica 0's stages
    #: complete each greedily at every eval and at the end (:mod:`shardpool.train.samples`), so
    #: no stage needs the tokenizer.
    sample_prompt_ids: list[
        Annotated[list[TokenId], Field(min_length=1, max_length=MAX_SAMPLE_PROMPT_TOKENS)]
    ] = Field(default_factory=list, max_length=MAX_SAMPLE_PROMPTS)
    #: The tokens a sample stops at: the model's generation config's end-of-sequence ids (as ``generate``'s).
    eos_token_ids: list[TokenId] = Field(default_factory=list, max_length=16)

    @field_validator("config")
    @classmethod
    def _valid_run_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        try:
            parse_config(config, source="job config")
        except ShardpoolError as error:
            raise ValueError(str(error)) from None
        return config

    @model_validator(mode="after")
    def _contiguous_layers(self) -> Job:
        expected = 0
        for index, stage in enumerate(self.stages):
            if stage.start != expected:
                raise ValueError(f"stage {index} starts at layer {stage.start}, expected {expected}")
            expected = stage.stop
        if self.world_size > MAX_WORLD_SIZE:
            raise ValueError(f"{self.world_size} stage processes in all; at most {MAX_WORLD_SIZE}")
        self._check_shares()
        return self

    def _check_shares(self) -> None:
        if (self.replica_places is None) != (self.shares is None):
            raise ValueError("replica_places and shares go together; give both or neither")
        if self.replica_places is None or self.shares is None:
            return
        if self.num_stages != 1:
            raise ValueError(f"a data-parallel job has one stage per replica, not {self.num_stages}")
        if len(self.replica_places) != self.replicas or len(self.shares) != self.replicas:
            raise ValueError(
                f"{len(self.replica_places)} replica places and {len(self.shares)} shares for "
                f"{self.replicas} replicas; give one each"
            )
        if min(self.shares) < 1:
            raise ValueError(f"shares {self.shares} give a replica no micro-batch; at least 1 each")
        whole = (self.stages[0].start, self.stages[0].stop)
        if any((place.start, place.stop) != whole for place in self.replica_places):
            raise ValueError("every replica of a data-parallel job holds the stage's layers")
        config = self.parsed_config()
        step = config.gradient_accumulation_steps * config.shardpool.replicas
        if sum(self.shares) != step:
            raise ValueError(
                f"shares {self.shares} add up to {sum(self.shares)}, not the step's {step} micro-batches"
            )

    @property
    def num_stages(self) -> int:
        """Stages per pipeline."""
        return len(self.stages)

    @property
    def world_size(self) -> int:
        """Stage processes in all: stages × replicas."""
        return self.num_stages * self.replicas

    @property
    def files_host(self) -> str | None:
        """The address of the launcher's file server, when stages fetch their files from it."""
        return urlsplit(self.files_url).hostname if self.files_url else None

    def parsed_config(self) -> Config:
        """The validated run config."""
        return parse_config(self.config, source="job config")

    def stage_index(self, rank: int) -> int:
        """The stage a global rank runs (ranks are replica-major: rank = replica × S + stage)."""
        return rank % self.num_stages

    def replica_index(self, rank: int) -> int:
        """The replica (pipeline copy) a global rank belongs to."""
        return rank // self.num_stages

    def placement(self, rank: int) -> StagePlacement:
        """Where a global rank runs and which layers it holds: its replica's place in a
        data-parallel job, else its stage's (replicas of a stage share its device)."""
        if self.replica_places is not None:
            return self.replica_places[self.replica_index(rank)]
        return self.stages[self.stage_index(rank)]

    def rank_dtype(self, rank: int) -> str:
        """The dtype a global rank computes in: its placement's, else the config's."""
        return self.placement(rank).dtype or self.parsed_config().compute_dtype_name

    def rank_nf4_backend(self, rank: int) -> Literal["bitsandbytes", "torch"]:
        """How a global rank computes with NF4 weights: its placement's choice, else bitsandbytes."""
        return self.placement(rank).nf4_backend or "bitsandbytes"

    def stage_dtype(self, index: int) -> str:
        """The dtype stage ``index`` computes in: its placement's, else the config's."""
        return self.stages[index].dtype or self.parsed_config().compute_dtype_name

    @property
    def scales_loss(self) -> bool:
        """Whether any rank computes in fp16, so every rank shares a dynamic loss scale."""
        default = self.parsed_config().compute_dtype_name
        places = self.replica_places or self.stages
        return any((place.dtype or default) == "float16" for place in places)

    def microbatch_range(self, replica: int, per_replica: int) -> tuple[int, int]:
        """Which of a step's micro-batches ``[start, stop)`` a replica trains: its share, after the
        shares of the replicas before it, else its ``per_replica`` block."""
        if self.shares is None:
            return replica * per_replica, (replica + 1) * per_replica
        start = sum(self.shares[:replica])
        return start, start + self.shares[replica]

    def rank_of(self, *, replica: int, stage: int) -> int:
        """The global rank of a stage in a replica."""
        return replica * self.num_stages + stage

    def write(self, path: str | Path) -> None:
        """Save as JSON, atomically."""
        write_json(path, self.model_dump(mode="json"))

    @classmethod
    def read(cls, path: str | Path) -> Job:
        """Load and validate a job written by :meth:`write` (at most 16 MiB)."""
        path = Path(path)
        with open(path, "rb") as handle:
            data = handle.read(MAX_JOB_JSON_BYTES + 1)
        raw = read_job_json(data, source=str(path))
        try:
            return cls.model_validate(raw)
        except ValidationError as error:
            raise ContractError(describe_validation_error(error, str(path))) from None


def read_job_json(data: bytes | str, *, source: str = "job") -> dict[str, Any]:
    """Parse a job's JSON text (at most 16 MiB) into a mapping, or raise ContractError in one line."""
    size = len(data.encode("utf-8") if isinstance(data, str) else data)
    if size > MAX_JOB_JSON_BYTES:
        raise ContractError(f"{source} is {size} bytes; a job is at most {MAX_JOB_JSON_BYTES} bytes of JSON")
    try:
        raw = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ContractError(f"{source} is not valid JSON ({error}); rewrite it") from None
    if not isinstance(raw, dict):
        raise ContractError(f"{source} must be a JSON object")
    return raw
