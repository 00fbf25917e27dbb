"""The job contract: the one closed schema of what crosses between a launcher, an agent and a stage.

Everything here is plain pydantic over JSON, with every size and count capped and no field left
free-form: an unknown key is refused (``extra="forbid"``), and there is no environment to pass,
because the agent sets the few variables a stage needs itself. The same module holds the
confinement checks every side uses before a name from a job or a manifest becomes a path:
:func:`safe_relative_name`, :func:`resolve_inside` and :func:`check_digest`.

It imports neither torch, transformers nor the HTTP stack, so the agent (which must start in well
under a second) and the launcher can validate a job without loading a model.
"""

from __future__ import annotations

import enum
import ipaddress
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, Union
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from shardpool.config import Config, parse_config
from shardpool.errors import ShardpoolError

__all__ = [
    "EVENT_PREFIX",
    "RESUME_PREFIX",
    "FILES_SECRET_FILE",
    "MAX_STAGES",
    "MAX_REPLICAS",
    "MAX_WORLD_SIZE",
    "MAX_RANKS",
    "MAX_INPUTS",
    "MAX_NAME_CHARS",
    "MAX_PATH_CHARS",
    "MAX_JOB_JSON_BYTES",
    "ContractError",
    "NotAMember",
    "StageEvent",
    "StagePlacement",
    "JobSpec",
    "JobStartRequest",
    "ReadyEvent",
    "StepEvent",
    "CheckpointWrittenEvent",
    "FinalWrittenEvent",
    "StageDoneEvent",
    "DoneEvent",
    "ErrorEvent",
    "StageEventModel",
    "safe_relative_name",
    "resolve_inside",
    "check_digest",
    "parse_job_start",
    "check_member_addresses",
    "parse_stage_event",
    "read_job_json",
    "describe_validation_error",
]

#: Stdout lines of a stage process that start with this carry one JSON event.
EVENT_PREFIX = "@shardpool "
#: Inputs under this prefix are the checkpoint a resumed run starts from.
RESUME_PREFIX = "resume/"
# the job file-server secret's file in a stage's job directory (0600, written by the agent)
FILES_SECRET_FILE = "files.secret"

MAX_STAGES = 512
MAX_REPLICAS = 256
MAX_WORLD_SIZE = 4096
MAX_RANKS = 256
MAX_INPUTS = 10_000
MAX_NAME_CHARS = 512
MAX_PATH_CHARS = 4096
MAX_TEXT_CHARS = 256
MAX_MESSAGE_CHARS = 2000
MAX_JOB_JSON_BYTES = 16 * 2**20
MAX_STEPS = 10**9

_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_USER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,31}\$?")
_SECRET = re.compile(r"[0-9a-f]{64}")
_DEVICE = re.compile(r"(cpu|cuda|mps|xpu)(:[0-9]{1,4})?")


class ContractError(ShardpoolError, ValueError):
    """A job, request, manifest or event breaks the contract; the message says which field and why.

    It is a ValueError too, so pydantic validators can raise it and report it as a field error.
    """


class NotAMember(ContractError):
    """A job names an address that is not a current mesh member's (the agent answers 403)."""


# ---------------------------------------------------------------------------- confinement


def safe_relative_name(text: object, what: str = "name") -> str:
    """Return ``text`` if it is a safe relative path (``model/a.safetensors``), else raise ContractError.

    Segments are letters, digits and ``._-`` and never start with a dot, so ``..``, hidden files,
    absolute paths, backslashes, NUL and empty segments are all refused; at most 512 characters.
    """
    if (
        not isinstance(text, str)
        or not text
        or len(text) > MAX_NAME_CHARS
        or not all(_SEGMENT.fullmatch(part) for part in text.split("/"))
    ):
        shown = repr(text)[:80]
        raise ContractError(
            f"{what} {shown} is not a safe relative path; use segments of letters, digits, '._-' "
            f"joined by '/' (at most {MAX_NAME_CHARS} characters)"
        )
    return text


def resolve_inside(root: str | Path, name: str, what: str = "name") -> Path:
    """The resolved path of ``root/name``, refused unless it stays inside ``root`` (symlinks followed).

    Checks :func:`safe_relative_name` first, so the only way out left is a symlink; resolving
    catches that one too.
    """
    safe_relative_name(name, what)
    base = Path(root).resolve()
    target = (base / name).resolve()
    if target == base or not target.is_relative_to(base):
        raise ContractError(f"{what} {name!r} escapes {base} through a symlink; remove the link")
    return target


def check_digest(value: object, what: str = "SHA-256 digest") -> str:
    """Return ``value`` if it is exactly 64 lowercase hex digits, else raise ContractError.

    Digests name cache files, so anything else (``../../etc/x``) must never reach a path.
    """
    if not isinstance(value, str) or not _DIGEST.fullmatch(value):
        shown = repr(value)[:80]
        raise ContractError(f"{what} {shown} is not 64 lowercase hex digits; the sender is broken or hostile")
    return value


def _no_nul(text: str) -> str:
    if "\0" in text:
        raise ValueError("must not contain NUL")
    return text


def _ip_literal(text: str) -> str:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise ValueError(f"{text[:80]!r} is not an IP address; give the launcher's mesh address") from None
    return text


def _pattern(regex: re.Pattern[str], hint: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        if not regex.fullmatch(text):
            raise ValueError(f"{text[:80]!r} is not valid; {hint}")
        return text

    return check


def _files_url(text: str) -> str:
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = None
    if (
        parts.scheme != "http"
        or not parts.hostname
        or port is None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or parts.username is not None
    ):
        raise ValueError(
            f"{text[:80]!r} is not like http://10.77.0.1:PORT (an IP address and a port, no path)"
        )
    _ip_literal(parts.hostname)
    return text


def _first_line(text: Any) -> Any:
    if isinstance(text, str):
        line = text.splitlines()[0] if text.strip() else text
        return line[:MAX_MESSAGE_CHARS]
    return text


InputName = Annotated[str, AfterValidator(lambda text: safe_relative_name(text, "input name"))]
LauncherPath = Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS), AfterValidator(_no_nul)]
IPText = Annotated[str, Field(max_length=64), AfterValidator(_ip_literal)]
FilesURL = Annotated[str, Field(max_length=MAX_TEXT_CHARS), AfterValidator(_files_url)]
DeviceName = Annotated[
    str, Field(max_length=16), AfterValidator(_pattern(_DEVICE, "use cpu, cuda:N, mps or xpu:N"))
]
HostName = Annotated[
    str, Field(max_length=64), AfterValidator(_pattern(_HOST_NAME, "use a mesh member's name or localhost"))
]
JobId = Annotated[
    str,
    Field(max_length=64),
    AfterValidator(
        _pattern(_JOB_ID, "job_id must be 1-64 letters, digits, '._-', starting with a letter or digit")
    ),
]
UserName = Annotated[
    str,
    Field(max_length=33),
    AfterValidator(_pattern(_USER_NAME, "a local user name is 1-32 letters, digits, '._-' (or a uid)")),
]
FilesSecret = Annotated[
    str,
    Field(max_length=64),
    AfterValidator(_pattern(_SECRET, "files_secret must be 64 lowercase hex digits")),
]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
Steps = Annotated[int, Field(ge=0, le=MAX_STEPS)]


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# ---------------------------------------------------------------------------- the job


class StagePlacement(_Closed):
    """Where one stage runs and which layers ``[start, stop)`` it owns."""

    start: int = Field(ge=0, le=1_000_000)
    stop: int = Field(ge=1, le=1_000_000)
    device: DeviceName
    host: HostName = "localhost"

    @model_validator(mode="after")
    def _layers_in_order(self) -> StagePlacement:
        if self.stop <= self.start:
            raise ValueError(f"stage layers [{self.start}, {self.stop}) are empty; stop must exceed start")
        return self


class JobSpec(_Closed):
    """Everything a stage process needs to build its stage and train it.

    ``inputs`` names every file a stage may read (``data.safetensors``, ``model/config.json``,
    ``model/*.safetensors``, ``init_adapter/*``, ``resume/*``) with its path on the launching
    machine. A stage on that machine opens the paths; a stage elsewhere fetches them by name from
    ``files_url`` and sends its results there too, so ``output_dir`` and the input paths mean
    nothing on another member. ``master_addr:master_port`` is the launcher's torch.distributed
    TCPStore.
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

    @field_validator("config")
    @classmethod
    def _valid_run_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        try:
            parse_config(config, source="job config")
        except ShardpoolError as error:
            raise ValueError(str(error)) from None
        return config

    @model_validator(mode="after")
    def _contiguous_layers(self) -> JobSpec:
        expected = 0
        for index, stage in enumerate(self.stages):
            if stage.start != expected:
                raise ValueError(f"stage {index} starts at layer {stage.start}, expected {expected}")
            expected = stage.stop
        if self.world_size > MAX_WORLD_SIZE:
            raise ValueError(f"{self.world_size} stage processes in all; at most {MAX_WORLD_SIZE}")
        return self

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

    def rank_of(self, *, replica: int, stage: int) -> int:
        """The global rank of a stage in a replica."""
        return replica * self.num_stages + stage


class JobStartRequest(_Closed):
    """``POST /v1/jobs``: start ``ranks`` of ``job`` on this member, as job ``job_id``.

    A stage started by an agent always reads and writes through the launcher's file server, so
    ``files_url`` is required: the launcher's paths (``inputs`` values, ``output_dir``) are never
    opened on the member.

    ``submitter`` is the local user who asked for the job on the launching member; that member's
    agent stamps it from the kernel-reported uid of its socket peer, overriding anything the user
    sent. ``origin`` is the launching member's name; the receiving agent overwrites it with the
    member whose key signed the request. ``files_secret`` (32 random bytes as hex) is the bearer
    secret of the launcher's file server; the agent hands it to the stages in a 0600 file.
    """

    job_id: JobId
    job: JobSpec
    ranks: list[int] = Field(min_length=1, max_length=MAX_RANKS)
    submitter: UserName | None = None
    origin: HostName | None = None
    files_secret: FilesSecret | None = None

    @model_validator(mode="after")
    def _ranks_of_this_job(self) -> JobStartRequest:
        world = self.job.world_size
        if len(set(self.ranks)) != len(self.ranks) or not all(0 <= r < world for r in self.ranks):
            raise ValueError(f"ranks {self.ranks[:16]} must be distinct and in 0..{world - 1}")
        if self.job.files_url is None:
            raise ValueError(
                "a job started through an agent needs files_url: its stages read and write only "
                "through the launcher's file server"
            )
        return self


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


def parse_job_start(body: Any, *, is_member_address: Callable[[str], bool]) -> JobStartRequest:
    """Validate a ``POST /v1/jobs`` body, then check that every address it names is a member's.

    Raises ContractError (bad shape: 400) or NotAMember (an address outside the mesh: 403).
    """
    try:
        request = JobStartRequest.model_validate(body)
    except ValidationError as error:
        raise ContractError(describe_validation_error(error, "job request")) from None
    check_member_addresses(request.job, is_member_address)
    return request


def check_member_addresses(job: JobSpec, is_member_address: Callable[[str], bool]) -> None:
    """Refuse a job whose rendezvous or file server is not at a current mesh member's address.

    Otherwise a job could aim stage processes at any host: their downloads, uploads and
    rendezvous traffic must stay inside the mesh.
    """
    named = [("master_addr", job.master_addr)]
    if job.files_host is not None:
        named.append(("files_url", job.files_host))
    for field_name, address in named:
        if not is_member_address(address):
            raise NotAMember(
                f"job {field_name} {address} is not a current mesh member's address; "
                "launch from a member and use its mesh address"
            )


# ---------------------------------------------------------------------------- stage events


class StageEvent(str, enum.Enum):
    """The name of every event a stage process reports (the ``event`` key of its JSON lines)."""

    READY = "ready"
    STEP = "step"
    CHECKPOINT_WRITTEN = "checkpoint_written"
    FINAL_WRITTEN = "final_written"
    STAGE_DONE = "stage_done"
    DONE = "done"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


OptionalLoss = float | None
Timings = Annotated[list[float], Field(max_length=MAX_WORLD_SIZE)]
RelativeOutput = Annotated[str, AfterValidator(lambda text: safe_relative_name(text, "output directory"))]


class ReadyEvent(_Event):
    """Rank 0 built its stage and is about to train."""

    event: Literal[StageEvent.READY]
    total_steps: Steps
    first_step: Steps


class StepEvent(_Event):
    """One optimizer step finished (rank 0); losses may be NaN or infinite when training diverges."""

    event: Literal[StageEvent.STEP]
    step: int = Field(ge=1, le=MAX_STEPS)
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    step_seconds: float
    stage_compute_s: Timings
    stage_wait_s: Timings
    bytes_sent: Timings


class CheckpointWrittenEvent(_Event):
    """Every stage's part of a checkpoint reached the launcher under ``partial`` (relative to output_dir)."""

    event: Literal[StageEvent.CHECKPOINT_WRITTEN]
    step: int = Field(ge=1, le=MAX_STEPS)
    partial: RelativeOutput
    eval_before: OptionalLoss = None


class FinalWrittenEvent(_Event):
    """Every stage's final LoRA tensors reached the launcher under ``directory`` (relative to output_dir)."""

    event: Literal[StageEvent.FINAL_WRITTEN]
    directory: RelativeOutput


class StageDoneEvent(_Event):
    """One stage process finished, with its peak memory."""

    event: Literal[StageEvent.STAGE_DONE]
    rank: int = Field(ge=0, lt=MAX_WORLD_SIZE)
    stage: int = Field(ge=0, lt=MAX_STAGES)
    peak_rss_bytes: int = Field(ge=0)
    peak_device_bytes: int | None = Field(default=None, ge=0)


class DoneEvent(_Event):
    """The run finished (rank 0), with the eval loss before and after training."""

    event: Literal[StageEvent.DONE]
    eval_before: OptionalLoss = None
    eval_after: OptionalLoss = None


class ErrorEvent(_Event):
    """A stage failed; ``message`` is one line (cut to 2,000 characters), the traceback is in its log."""

    event: Literal[StageEvent.ERROR]
    rank: int = Field(ge=0, lt=MAX_WORLD_SIZE)
    message: Annotated[str, BeforeValidator(_first_line)]


StageEventModel = Annotated[
    Union[  # noqa: UP007 - a discriminated union needs the Union spelling for older pydantic
        ReadyEvent,
        StepEvent,
        CheckpointWrittenEvent,
        FinalWrittenEvent,
        StageDoneEvent,
        DoneEvent,
        ErrorEvent,
    ],
    Field(discriminator="event"),
]
_EVENTS: TypeAdapter[Any] = TypeAdapter(StageEventModel)


def parse_stage_event(raw: Any) -> Any:
    """Validate one event a stage reported (a JSON object) into its model, or raise ContractError."""
    try:
        return _EVENTS.validate_python(raw)
    except ValidationError as error:
        raise ContractError(describe_validation_error(error, "stage event")) from None


# ---------------------------------------------------------------------------- errors


def describe_validation_error(error: ValidationError, source: str) -> str:
    """One line naming the first bad field of ``source`` and what is wrong with it."""
    first = error.errors()[0]
    key = ".".join(str(part) for part in first["loc"] if part != "[key]")
    kind = first["type"]
    if kind == "extra_forbidden":
        return f"{source}: unknown field `{key}`; the contract is closed, remove it"
    if kind == "missing":
        return f"{source}: missing field `{key}`; add it"
    if kind == "union_tag_invalid":
        known = ", ".join(event.value for event in StageEvent)
        return f"{source}: unknown event {str(first['input'].get('event'))[:40]!r}; known: {known}"
    message = str(first["msg"]).splitlines()[0]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    return f"{source}: `{key}`: {message}" if key else f"{source}: {message}"
