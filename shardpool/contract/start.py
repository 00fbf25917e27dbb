"""The agent's start request: ``POST /v1/jobs`` asks a member's agent to start some ranks of a job.

:func:`parse_job_start` validates a request body into :class:`JobStartRequest` and then checks
that every address the job names (rendezvous, file server) is a current mesh member's, so a job
can never aim stage processes outside the mesh. :data:`FILES_SECRET_FILE` is where the agent
hands the request's file-server secret to the stages.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any

from pydantic import Field, ValidationError, model_validator

from shardpool.contract.fields import (
    MAX_RANKS,
    Closed,
    FilesSecret,
    HostName,
    JobId,
    UserName,
    describe_validation_error,
)
from shardpool.contract.inference import INFERENCE_KIND, InferenceJob
from shardpool.contract.job import Job
from shardpool.contract.names import ContractError

__all__ = [
    "FILES_SECRET_FILE",
    "NotAMember",
    "NotTheOrigin",
    "JobStartRequest",
    "parse_job_start",
    "check_member_addresses",
    "check_origin_addresses",
    "canonical_ip",
]

#: The job file-server secret's file in a stage's job directory (0600, written by the agent).
FILES_SECRET_FILE = "files.secret"


class NotAMember(ContractError):
    """A job names an address that is not a current mesh member's (the agent answers 403)."""


class NotTheOrigin(NotAMember):
    """A job's rendezvous or file server is not at the mesh address of the member that sent it (403)."""


class JobStartRequest(Closed):
    """``POST /v1/jobs``: start ``ranks`` of ``job`` on this member, as job ``job_id``.

    ``job`` is a training :class:`~shardpool.contract.job.Job`; :class:`InferenceStartRequest`'s
    is an :class:`~shardpool.contract.inference.InferenceJob` (the stages of a generating ring).

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
    job: Job | InferenceJob
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


class InferenceStartRequest(JobStartRequest):
    """``POST /v1/jobs`` for an inference ring's stages (a job with ``kind: inference``)."""

    job: InferenceJob


class TrainingStartRequest(JobStartRequest):
    """``POST /v1/jobs`` for a training job's ranks."""

    job: Job


def parse_job_start(
    body: Any, *, is_member_address: Callable[[str], bool], origin_address: str | None = None
) -> JobStartRequest:
    """Validate a ``POST /v1/jobs`` body, then check that every address it names is a member's.

    ``origin_address`` is the mesh address of the member whose key signed the request: the
    launcher, whose rendezvous store and file server are the only ones its stages may reach.
    Raises ContractError (bad shape: 400) or NotAMember (an address outside the mesh, or not the
    origin's: 403).
    """
    job = body.get("job") if isinstance(body, dict) else None
    kind = (
        InferenceStartRequest
        if isinstance(job, dict) and job.get("kind") == INFERENCE_KIND
        else TrainingStartRequest
    )
    try:
        request: JobStartRequest = kind.model_validate(body)
    except ValidationError as error:
        raise ContractError(describe_validation_error(error, "job request")) from None
    check_member_addresses(request.job, is_member_address)
    if origin_address is not None:
        check_origin_addresses(request.job, origin_address)
    return request


def check_member_addresses(job: Job | InferenceJob, is_member_address: Callable[[str], bool]) -> None:
    """Refuse a job whose rendezvous or file server is not at a current mesh member's address.

    Otherwise a job could aim stage processes at any host: their downloads, uploads and
    rendezvous traffic must stay inside the mesh.
    """
    for field_name, address in _named_addresses(job):
        if not is_member_address(address):
            raise NotAMember(
                f"job {field_name} {address} is not a current mesh member's address; "
                "launch from a member and use its mesh address"
            )


def check_origin_addresses(job: Job | InferenceJob, origin_address: str) -> None:
    """Refuse a job whose rendezvous or file server is not at ``origin_address``.

    The launcher serves both on its own mesh address, so a job that names another member's
    (whose store or server the sender does not run) is forged or broken: its stages would hand
    their rendezvous, their downloads and the job's file secret to a service the sender chose.
    """
    for field_name, address in _named_addresses(job):
        if canonical_ip(address) != canonical_ip(origin_address):
            raise NotTheOrigin(
                f"job {field_name} {address} is not the mesh address {origin_address} of the member that "
                "sent it; a launcher serves its rendezvous and files on its own mesh address"
            )


def _named_addresses(job: Job | InferenceJob) -> list[tuple[str, str]]:
    named = [("master_addr", job.master_addr)]
    if job.files_host is not None:
        named.append(("files_url", job.files_host))
    return named


def canonical_ip(text: str) -> str:
    """``text`` as one spelling per host (scope id dropped, IPv4-mapped IPv6 unmapped), so that two
    spellings of one address compare equal; text that is no IP address is returned as it is."""
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return text
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)
