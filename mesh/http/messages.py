"""The request and reply types of :mod:`mesh.http.server`, and its router.

Handlers see a :class:`Request` (plain data, safe in the handler's thread) and return a
:class:`Reply`: JSON, bytes, text, or a stream of chunks (a file range is read 1 MiB at a time
while it is sent). :class:`HTTPError` is how a handler or the ``authenticate`` hook answers with a
status and a one-line JSON error.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from mesh.http.transport import Peer

__all__ = [
    "CHUNK",
    "FileChunks",
    "HTTPError",
    "Reply",
    "Request",
    "Route",
    "Router",
    "bytes_reply",
    "close_chunks",
    "error_reply",
    "file_reply",
    "json_object",
    "json_reply",
    "stream_reply",
    "text_reply",
]

log = logging.getLogger("shardpool.mesh.http")

CHUNK = 1 << 20


class HTTPError(Exception):
    """Raised by a handler or the ``authenticate`` hook to answer ``status`` with a one-line JSON error."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


@dataclass(frozen=True)
class Reply:
    """What a handler returns: a whole ``body``, or ``chunks`` (an iterator) of exactly ``length`` bytes."""

    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)
    chunks: Iterator[bytes] | None = None
    length: int = 0


def json_reply(value: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Reply:
    """A JSON reply (one line plus a newline)."""
    return Reply(status, (json.dumps(value) + "\n").encode("utf-8"), "application/json", dict(headers or {}))


def error_reply(status: int, message: str, headers: Mapping[str, str] | None = None) -> Reply:
    """``{"error": message}`` with the message cut to its first line."""
    return json_reply({"error": (message.splitlines() or [""])[0][:500]}, status, headers)


def bytes_reply(
    data: bytes,
    status: int = 200,
    content_type: str = "application/octet-stream",
    headers: Mapping[str, str] | None = None,
) -> Reply:
    """A reply of raw bytes."""
    return Reply(status, bytes(data), content_type, dict(headers or {}))


def text_reply(text: str, status: int = 200, headers: Mapping[str, str] | None = None) -> Reply:
    """A UTF-8 plain-text reply."""
    return bytes_reply(text.encode("utf-8"), status, "text/plain; charset=utf-8", headers)


def stream_reply(
    chunks: Iterator[bytes],
    length: int,
    status: int = 200,
    content_type: str = "application/octet-stream",
    headers: Mapping[str, str] | None = None,
) -> Reply:
    """A reply sent chunk by chunk; ``chunks`` must yield exactly ``length`` bytes (else the
    connection is dropped) and is closed (``close()``, if it has one) whatever happens."""
    return Reply(status, b"", content_type, dict(headers or {}), iter(chunks), length)


def file_reply(
    path: str | os.PathLike[str],
    start: int = 0,
    stop: int | None = None,
    status: int = 200,
    content_type: str = "application/octet-stream",
    headers: Mapping[str, str] | None = None,
) -> Reply:
    """Bytes ``[start, stop)`` of a file, read 1 MiB at a time while they are sent.

    The file is opened here, in the handler, so a missing file is the handler's error.
    """
    chunks = FileChunks(os.open(path, os.O_RDONLY), start, stop)
    return stream_reply(chunks, chunks.stop - start, status, content_type, headers)


class FileChunks:
    """An iterator over bytes ``[start, stop)`` of an open file that it owns, 1 MiB at a time;
    ``close`` may come from another thread."""

    def __init__(self, fd: int, start: int = 0, stop: int | None = None) -> None:
        self._fd, self._offset = fd, start
        self.stop = os.fstat(fd).st_size if stop is None else stop
        self._lock = threading.Lock()

    def seek(self, start: int, stop: int) -> None:
        """Make the iterator yield bytes ``[start, stop)``."""
        self._offset, self.stop = start, stop

    def __iter__(self) -> FileChunks:
        return self

    def __next__(self) -> bytes:
        with self._lock:
            if self._offset >= self.stop or self._fd < 0:
                raise StopIteration
            chunk = os.pread(self._fd, min(CHUNK, self.stop - self._offset), self._offset)
            if not chunk:
                raise OSError(f"the file ended at byte {self._offset}, before byte {self.stop}")
            self._offset += len(chunk)
            return chunk

    def close(self) -> None:
        """Close the file (idempotent)."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


@dataclass
class Request:
    """One request as a handler sees it (plain data, safe to use from the handler's thread).

    ``path`` is the raw (still percent-encoded) path and ``target`` the request target as sent,
    path and query, which is what a request MAC covers. ``params`` are the route's ``{name}``
    parts, percent-decoded. ``body`` is None on ``stream_body`` routes: call :meth:`read` there.
    """

    method: str
    path: str
    target: str
    query: dict[str, list[str]]
    headers: Mapping[str, str]
    peer: Peer
    params: dict[str, str]
    length: int
    body: bytes | None = None
    principal: Any = None
    _read: Callable[[int], bytes] | None = field(default=None, repr=False)

    def read(self, size: int = CHUNK) -> bytes:
        """Up to ``size`` bytes of a streamed body, b"" at its end (408 once its deadline passes)."""
        if self._read is None:
            raise RuntimeError("this route buffers its body: use request.body")
        return self._read(size)

    def json(self) -> dict[str, Any]:
        """The body parsed as a JSON object, or a 400 HTTPError saying what is wrong with it."""
        return json_object(self.body or b"")


def json_object(data: bytes) -> dict[str, Any]:
    """``data`` parsed as a JSON object, or a 400 HTTPError saying what is wrong with it."""
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as error:
        raise HTTPError(400, f"the body is not JSON ({error})") from None
    if not isinstance(value, dict):
        raise HTTPError(400, "the body must be a JSON object")
    return value


Handler = Callable[[Request], Reply]


@dataclass(frozen=True)
class Route:
    """``method`` + ``pattern`` -> ``handler``. Patterns are literal segments, ``{name}`` (one
    segment) and a final ``{name:path}`` (the rest). A GET route also answers HEAD (body dropped).
    ``max_body`` caps the declared body; ``stream_body`` leaves the body for ``Request.read``."""

    method: str
    pattern: str
    handler: Handler
    max_body: int = 64 * 1024
    stream_body: bool = False


def _compile(pattern: str) -> re.Pattern[str]:
    parts = []
    for piece in re.split(r"(\{[A-Za-z_]\w*(?::path)?\})", pattern):
        if piece.startswith("{"):
            name, _, kind = piece[1:-1].partition(":")
            parts.append(f"(?P<{name}>.+)" if kind else f"(?P<{name}>[^/]+)")
        else:
            parts.append(re.escape(piece))
    return re.compile("".join(parts))


class Router:
    """Finds the route for a method and path (HEAD uses GET routes)."""

    def __init__(self, routes: Iterable[Route]) -> None:
        self._table = [(route, _compile(route.pattern)) for route in routes]

    def find(self, method: str, path: str) -> tuple[Route | None, dict[str, str], HTTPError | None]:
        """The route for ``method path`` and its decoded params, or the 404/405 error to answer."""
        allowed = []
        for route, regex in self._table:
            match = regex.fullmatch(path)
            if match is None:
                continue
            if route.method == method or (method == "HEAD" and route.method == "GET"):
                return route, {k: unquote(v) for k, v in match.groupdict().items()}, None
            allowed.append(route.method)
        if allowed:
            methods = ", ".join(sorted(set(allowed)))
            return (
                None,
                {},
                HTTPError(
                    405, f"{method[:10]} is not allowed on {path[:100]}; use {methods}", {"Allow": methods}
                ),
            )
        return None, {}, HTTPError(404, f"no endpoint {path[:100]}")


def close_chunks(reply: Reply) -> None:
    """Close a streamed reply's iterator (``close()``, if it has one); best effort."""
    close = getattr(reply.chunks, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # noqa: BLE001 - closing is best effort
            log.debug("closing a reply stream failed", exc_info=True)
