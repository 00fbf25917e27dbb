"""The capped field types every contract model is built from, and one-line validation errors.

Every size and count in a job, a start request or a stage event is capped here, and every
free-text field is pinned to a pattern (an IP literal, a device name, a job id, a user name, a
64-hex secret), so a model built from these types has no field left free-form. Models derive
from :class:`Closed`: an unknown key is refused and a validated value never changes.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from shardpool.contract.names import safe_relative_name

__all__ = [
    "MAX_STAGES",
    "MAX_REPLICAS",
    "MAX_WORLD_SIZE",
    "MAX_RANKS",
    "MAX_INPUTS",
    "MAX_PATH_CHARS",
    "MAX_STEPS",
    "Closed",
    "InputName",
    "LauncherPath",
    "IPText",
    "FilesURL",
    "DeviceName",
    "HostName",
    "JobId",
    "UserName",
    "FilesSecret",
    "FiniteFloat",
    "Steps",
    "describe_validation_error",
]

MAX_STAGES = 512
MAX_REPLICAS = 256
MAX_WORLD_SIZE = 4096
MAX_RANKS = 256
MAX_INPUTS = 10_000
MAX_PATH_CHARS = 4096
MAX_TEXT_CHARS = 256
MAX_STEPS = 10**9

_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_USER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,31}\$?")
_SECRET = re.compile(r"[0-9a-f]{64}")
_DEVICE = re.compile(r"(cpu|cuda|mps|xpu)(:[0-9]{1,4})?")


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
        or not 1 <= port <= 65535
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or parts.username is not None
    ):
        raise ValueError(
            f"{text[:80]!r} is not like http://10.77.0.1:PORT (an IP address and a port 1-65535, no path)"
        )
    _ip_literal(parts.hostname)
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


class Closed(BaseModel):
    """A contract model: unknown keys refused, no type coercion, immutable once validated."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def describe_validation_error(error: ValidationError, source: str) -> str:
    """One line naming the first bad field of ``source`` and what is wrong with it."""
    first = error.errors()[0]
    key = ".".join(str(part) for part in first["loc"] if part != "[key]")
    kind = first["type"]
    if kind == "extra_forbidden":
        return f"{source}: unknown field `{key}`; the contract is closed, remove it"
    if kind == "missing":
        return f"{source}: missing field `{key}`; add it"
    message = str(first["msg"]).splitlines()[0]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    return f"{source}: `{key}`: {message}" if key else f"{source}: {message}"
