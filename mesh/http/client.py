"""The project's one HTTP client: every caller's requests, deadlines, reply caps and retry policy.

Agents, the launcher's local-agent client, the coordinator protocol and the file client all send
their requests through :class:`HTTPClient`, built on httpx's synchronous client (the callers are
threads, not coroutines): TCP to ``http://host:port``, or HTTP over a Unix socket (the local
agent's). It sends the path exactly as given (a signed request's MAC covers it), never takes a proxy
from the environment (mesh traffic must stay on the mesh), never asks for compressed replies (hashes
cover the bytes as served), and reads at most ``max_reply_bytes`` of a reply.

Whatever goes wrong on the way is one exception, :class:`Unreachable`, that says whether the peer
timed out or dropped the connection and keeps the socket error; :class:`RetryPolicy` is the one
rule for sending a request again. A reply, whatever its status, is never retried.
"""

from __future__ import annotations

import contextlib
import json
import ssl
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

import httpx

from mesh.errors import MeshError

__all__ = [
    "NO_RETRY",
    "RETRY_DROPPED",
    "HTTPClient",
    "Reply",
    "ReplyTooLarge",
    "RetryPolicy",
    "StreamedReply",
    "Unreachable",
    "error_line",
]

T = TypeVar("T")

_READ_CHUNK = 1 << 16
# Only plain http is spoken. Handing httpx a context spares it loading CA certificates per client
# (4 ms each), so a client per call costs nothing.
_NO_TLS = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


class Unreachable(MeshError):
    """The peer gave no whole reply: it could not be reached, timed out, or dropped the connection.

    ``reason`` is the underlying error's text, ``os_error`` the socket error where there was one (a
    caller tells "nothing listens" from "not allowed" by it), ``attempts`` how many were made.
    """

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        timed_out: bool,
        dropped: bool,
        os_error: OSError | None,
        attempts: int,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.timed_out = timed_out
        self.dropped = dropped
        self.os_error = os_error
        self.attempts = attempts


class ReplyTooLarge(MeshError):
    """The reply's body is larger than the client reads."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often a request is sent when its connection drops, and how long to wait before each retry.

    Only a dropped connection is retried: refused, reset, or closed before a whole reply arrived,
    most often a kept-alive connection the server closed while it was idle. A timeout is not (the
    peer is slow; asking again doubles the wait), nor any other error, nor any reply. A request is
    sent again with the same headers, so a signed one (whose nonce the receiver accepts once) must
    not be retried.
    """

    attempts: int = 1  # in all, the first one included
    backoff_s: float = 0.0  # before the first retry; doubled before each further one

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"a retry policy's attempts must be >= 1, not {self.attempts}")
        if self.backoff_s < 0:
            raise ValueError(f"a retry policy's backoff must be >= 0 s, not {self.backoff_s}")

    def retries(self, failure: Unreachable, attempt: int) -> bool:
        """Whether to send again after ``failure`` ended attempt number ``attempt`` (from 1)."""
        return failure.dropped and attempt < self.attempts

    def delay_s(self, attempt: int) -> float:
        """Seconds to wait after attempt number ``attempt`` failed, before the next one."""
        return self.backoff_s * 2 ** (attempt - 1)


#: Send once; what callers that never retried use.
NO_RETRY = RetryPolicy()
#: The one retrying policy (the file client's): a dropped connection is sent again once, at once,
#: on a fresh connection, which is what fixes a kept-alive connection the server had closed.
RETRY_DROPPED = RetryPolicy(attempts=2)


@dataclass(frozen=True)
class Reply:
    """A whole reply: status, headers (looked up case-insensitively) and body."""

    status: int
    headers: Mapping[str, str]
    body: bytes


class StreamedReply:
    """A reply whose body is read as it arrives (see :meth:`HTTPClient.stream`)."""

    def __init__(self, response: httpx.Response, what: str, where: str) -> None:
        self._response = response
        self._what = what
        self._where = where
        self.status: int = response.status_code
        self.headers: Mapping[str, str] = response.headers

    def chunks(self, size: int) -> Iterator[bytes]:
        """The body in chunks of ``size`` bytes (the last one shorter), as sent: never decompressed."""
        return self._response.iter_raw(size)

    def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body; :class:`ReplyTooLarge` as soon as it passes ``max_bytes``."""
        parts, total = [], 0
        for chunk in self.chunks(_READ_CHUNK):
            total += len(chunk)
            if max_bytes is not None and total > max_bytes:
                raise ReplyTooLarge(
                    f"the reply to {self._what} from {self._where} is larger than {max_bytes} bytes"
                )
            parts.append(chunk)
        return b"".join(parts)


class HTTPClient:
    """Requests to one server: ``base_url`` (``http://host:port``) over TCP, or ``unix_socket``.

    ``timeout`` (seconds, per request unless a call gives its own) bounds the connect and every
    read and write; ``headers`` go with every request (retries too); ``max_reply_bytes`` caps what
    :meth:`request` reads. Connections are kept alive for the next request until :meth:`close`;
    safe to share between threads.
    """

    def __init__(
        self,
        base_url: str = "http://localhost",
        *,
        unix_socket: str | None = None,
        timeout: float = 10.0,
        retry: RetryPolicy = NO_RETRY,
        max_reply_bytes: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.base_url = httpx.URL(base_url)
        self.where = unix_socket or base_url.rstrip("/")
        self.timeout = timeout
        self.retry = retry
        self.max_reply_bytes = max_reply_bytes
        transport = httpx.HTTPTransport(uds=unix_socket, verify=_NO_TLS)
        self._client = httpx.Client(transport=transport, trust_env=False, headers=headers)
        del self._client.headers["Accept-Encoding"]
        self._client.headers["User-Agent"] = "shardpool"

    def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes | Path = b"",
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Reply:
        """Send one request and read its whole reply (at most ``max_reply_bytes``).

        ``body`` is bytes, or a file sent from disk (opened again for each attempt). Raises
        :class:`Unreachable` when no whole reply came (after the retry policy's attempts) and
        :class:`ReplyTooLarge`; any status is a reply.
        """

        def whole(reply: StreamedReply) -> Reply:
            return Reply(reply.status, reply.headers, reply.read(self.max_reply_bytes))

        return self.stream(method, path, whole, body=body, headers=headers, timeout=timeout)

    def stream(
        self,
        method: str,
        path: str,
        consume: Callable[[StreamedReply], T],
        *,
        body: bytes | Path = b"",
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> T:
        """Send one request and return what ``consume`` makes of its reply, read as it arrives.

        A connection that drops while ``consume`` reads is retried as a whole, under the retry
        policy, so ``consume`` must start afresh each time; its own exceptions pass through.
        """
        what = f"{method} {path.split('?')[0]}"
        seconds = self.timeout if timeout is None else timeout
        url = self.base_url.copy_with(raw_path=path.encode("ascii"))
        attempt = 1
        while True:
            try:
                with (
                    _opened(body) as content,
                    self._client.stream(
                        method, url, content=content, headers=headers, timeout=seconds
                    ) as response,
                ):
                    return consume(StreamedReply(response, what, self.where))
            except httpx.TransportError as error:
                failure = _unreachable(error, f"{what} on {self.where}", seconds, attempt)
            if not self.retry.retries(failure, attempt):
                raise failure
            time.sleep(self.retry.delay_s(attempt))
            attempt += 1

    def close(self) -> None:
        """Close the kept-alive connections; the client is not used again."""
        self._client.close()

    def __enter__(self) -> HTTPClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def error_line(body: object) -> str:
    """The error a reply body carries, as one line: its JSON ``error`` field, else its text.

    The servers here answer an error with ``{"error": "one line"}``; anything else is shown as
    sent, white space folded, at most 500 characters. ``body`` is raw bytes or decoded JSON.
    """
    if isinstance(body, bytes):
        try:
            body = json.loads(body)
        except ValueError:
            body = body.decode("utf-8", errors="replace")
    if isinstance(body, dict):
        body = body.get("error", body)
    return " ".join(str(body).split())[:500]


@contextlib.contextmanager
def _opened(body: bytes | Path) -> Iterator[bytes | IO[bytes] | None]:
    """The body to send: bytes as they are, a file opened for this attempt (and closed after)."""
    if isinstance(body, Path):
        with open(body, "rb") as handle:
            yield handle
    else:
        yield body or None


def _unreachable(error: httpx.TransportError, doing: str, timeout: float, attempts: int) -> Unreachable:
    """One line for what went wrong, and whether the retry policy may send again."""
    os_error = _os_error_of(error)
    timed_out = isinstance(error, httpx.TimeoutException) or isinstance(os_error, TimeoutError)
    dropped = not timed_out and (
        isinstance(os_error, ConnectionError) or isinstance(error, httpx.RemoteProtocolError)
    )
    reason = str(error) or type(error).__name__
    if timed_out:
        message = f"{doing} timed out after {timeout:g} s"
    else:
        times = {1: "", 2: " twice"}.get(attempts, f" {attempts} times")
        message = f"{doing} failed{times}: {reason}"
    return Unreachable(
        message, reason=reason, timed_out=timed_out, dropped=dropped, os_error=os_error, attempts=attempts
    )


def _os_error_of(error: BaseException) -> OSError | None:
    """The socket error under httpx's and httpcore's wrappers, if there is one."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
