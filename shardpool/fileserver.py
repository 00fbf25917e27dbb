"""The launcher's file server: remote stages fetch the model and data from it and upload results.

Remote stages read only the tensors they own, so the server answers byte ranges (``Range: bytes=a-b``)
and sends ``X-Content-SHA256`` with every body, so a receiver can verify exactly what it got. The
manifest gives every served file's size and SHA-256, which are also the keys of the receivers'
content-addressed caches. Uploads (checkpoint pieces, adapter pieces, eval logits) are verified
against the sender's hash and written atomically under one root directory.

The server speaks JSON and raw bytes only, listens on one address (the mesh address), and answers
only current mesh members (see :mod:`shardpool.access`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from types import TracebackType
from urllib.parse import unquote, urlsplit

from shardpool.access import GuardedHandler, GuardedHTTPServer, HTTPError, MemberAllowlist, start_in_thread
from shardpool.contract import ContractError, check_digest, resolve_inside
from shardpool.contract import safe_relative_name as check_relative_name
from shardpool.errors import ShardpoolError

__all__ = [
    "MAX_UPLOAD_BYTES",
    "AtomicFile",
    "FileServer",
    "check_relative_name",
    "parse_range",
    "sha256_file",
]

log = logging.getLogger("shardpool.fileserver")

MAX_UPLOAD_BYTES = 2 * 2**30
_CHUNK = 1 << 20
_IN_MEMORY_RANGE = 64 * 2**20


def sha256_file(path: Path) -> str:
    """SHA-256 of a whole file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class AtomicFile:
    """A file written in pieces and published with one rename, so readers never see half of it.

    The temporary file lives beside the target; :meth:`commit` fsyncs it, renames it over the target
    and fsyncs the directory. Leaving the ``with`` block by an exception discards it. Used for
    streamed uploads and cache blobs, which are too big for ``shardpool.atomic.write_bytes_atomic``.
    """

    def __init__(self, path: Path, mode: int = 0o644) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._temp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}-", suffix=".part")
        os.fchmod(fd, mode)
        self._handle = os.fdopen(fd, "wb")
        self._done = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes."""
        self._handle.write(data)

    def commit(self) -> None:
        """Make the written bytes the content of ``path``, durably."""
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        os.replace(self._temp, self.path)
        self._done = True
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def abort(self) -> None:
        """Discard the temporary file (no-op after :meth:`commit`)."""
        if self._done:
            return
        self._done = True
        self._handle.close()
        try:
            os.unlink(self._temp)
        except FileNotFoundError:
            pass

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if kind is not None or not self._done:
            self.abort()


def parse_range(header: str, size: int) -> tuple[int, int]:
    """Parse one ``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` range into ``[start, stop)`` of a ``size``-byte file.

    Raises ValueError for anything unsatisfiable or malformed (multiple ranges included).
    """
    unit, _, spec = header.strip().partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        raise ValueError(f"unsupported Range {header!r}; send one 'bytes=START-END' range")
    first, dash, last = spec.strip().partition("-")
    if not dash or not (first.isdigit() or last.isdigit()) or (first and not first.isdigit()):
        raise ValueError(f"malformed Range {header!r}")
    if last and not last.isdigit():
        raise ValueError(f"malformed Range {header!r}")
    if not first:
        count = int(last)
        if count == 0 or size == 0:
            raise ValueError(f"Range {header!r} selects no bytes of a {size}-byte file")
        return max(0, size - count), size
    start = int(first)
    stop = size if not last else min(size, int(last) + 1)
    if start >= size or (last and int(last) < start):
        raise ValueError(f"Range {header!r} is outside the {size}-byte file")
    return start, stop


@dataclass
class _Served:
    path: Path
    size: int
    mtime_ns: int
    sha256: str | None = None


class FileServer:
    """Serve ``files`` (name → local path) by byte range, and accept verified uploads under ``upload_root``.

    ``GET /v1/manifest``, ``GET /v1/files/{name}`` (optionally ``Range``) and
    ``PUT /v1/upload/{relative/path}`` (``X-Content-SHA256`` required, at most ``max_upload_bytes``).
    Hashes are computed once, in a background thread started by :meth:`start`; the manifest waits
    for them. A served file that changes on disk afterwards is refused with 409 rather than served
    with a stale hash. ``bytes_served`` and ``range_requests`` count what went out (for tests).
    """

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        files: dict[str, Path],
        upload_root: Path,
        allowlist: MemberAllowlist,
        max_upload_bytes: int = MAX_UPLOAD_BYTES,
    ) -> None:
        self._files: dict[str, _Served] = {}
        for name, path in files.items():
            check_relative_name(name, "served file name")
            try:
                stat = Path(path).stat()
            except OSError as error:
                raise ShardpoolError(f"cannot serve {name!r} from {path}: {error.strerror}") from None
            if not Path(path).is_file():
                raise ShardpoolError(f"cannot serve {name!r}: {path} is not a regular file")
            self._files[name] = _Served(Path(path), stat.st_size, stat.st_mtime_ns)
        self.upload_root = Path(upload_root)
        self.upload_root.mkdir(parents=True, exist_ok=True)
        self.max_upload_bytes = max_upload_bytes
        self._lock = threading.Lock()
        self._hashed = threading.Event()
        self._hash_error: str | None = None
        self.bytes_served = 0
        self.range_requests = 0
        self.uploads = 0
        self._server = GuardedHTTPServer(host, port, _FileHandler, allowlist)
        self._server.owner = self  # type: ignore[attr-defined]
        self._thread: threading.Thread | None = None
        self._hasher: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://10.77.0.1:41234``."""
        return self._server.url

    def start(self) -> FileServer:
        """Start hashing the files and serving requests; returns self."""
        if self._thread is None:
            self._hasher = threading.Thread(target=self._hash_all, name="fileserver-hash", daemon=True)
            self._hasher.start()
            self._thread = start_in_thread(self._server, "fileserver")
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> FileServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def manifest(self, timeout: float | None = None) -> dict[str, dict[str, dict[str, int | str]]]:
        """``{"files": {name: {"size", "sha256"}}}``, waiting for hashing to finish."""
        if not self._hashed.wait(timeout):
            raise ShardpoolError("the file server is still hashing its files; try again shortly")
        if self._hash_error:
            raise ShardpoolError(self._hash_error)
        return {
            "files": {name: {"size": f.size, "sha256": f.sha256 or ""} for name, f in self._files.items()}
        }

    def count(self, nbytes: int, *, ranged: bool) -> None:
        """Record bytes sent (called by the handler)."""
        with self._lock:
            self.bytes_served += nbytes
            self.range_requests += int(ranged)

    def served(self, name: str) -> _Served:
        """The served file called ``name``, checked unchanged since it was hashed; else HTTPError."""
        entry = self._files.get(name)
        if entry is None:
            raise HTTPError(HTTPStatus.NOT_FOUND, f"no file named {name!r} is served; see /v1/manifest")
        try:
            stat = entry.path.stat()
        except OSError as error:
            raise HTTPError(HTTPStatus.GONE, f"{name!r} is no longer readable ({error.strerror})") from None
        if (stat.st_size, stat.st_mtime_ns) != (entry.size, entry.mtime_ns):
            raise HTTPError(
                HTTPStatus.CONFLICT, f"{name!r} changed on the launcher after it was hashed; restart the run"
            )
        return entry

    def _hash_all(self) -> None:
        try:
            for name, entry in self._files.items():
                entry.sha256 = sha256_file(entry.path)
                stat = entry.path.stat()
                if (stat.st_size, stat.st_mtime_ns) != (entry.size, entry.mtime_ns):
                    self._hash_error = f"{name!r} ({entry.path}) changed while it was being hashed; restart"
                    break
        except OSError as error:
            self._hash_error = f"cannot hash served files: {error}"
        finally:
            self._hashed.set()


class _FileHandler(GuardedHandler):
    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        self.dispatch(self._get)

    def do_PUT(self) -> None:  # noqa: N802 - stdlib naming
        self.dispatch(self._put)

    @property
    def owner(self) -> FileServer:
        return self.server.owner  # type: ignore[attr-defined,no-any-return]

    def _get(self) -> None:
        path = urlsplit(self.path).path
        if path == "/v1/manifest":
            try:
                manifest = self.owner.manifest(timeout=600)
            except ShardpoolError as error:
                raise HTTPError(HTTPStatus.SERVICE_UNAVAILABLE, str(error)) from None
            self.send_json(HTTPStatus.OK, manifest)
            return
        if not path.startswith("/v1/files/"):
            raise HTTPError(HTTPStatus.NOT_FOUND, f"unknown path {path!r}")
        name = unquote(path[len("/v1/files/") :])
        entry = self.owner.served(name)
        header = self.headers.get("Range")
        if header is None:
            if not self.owner._hashed.wait(600) or entry.sha256 is None:
                raise HTTPError(HTTPStatus.SERVICE_UNAVAILABLE, "the file server could not hash its files")
            self._send_file(entry, 0, entry.size, HTTPStatus.OK, entry.sha256)
            return
        try:
            start, stop = parse_range(header, entry.size)
        except ValueError as error:
            self.send_json(
                HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE,
                {"error": str(error)},
                {"Content-Range": f"bytes */{entry.size}"},
            )
            return
        self._send_file(entry, start, stop, HTTPStatus.PARTIAL_CONTENT, None)

    def _send_file(self, entry: _Served, start: int, stop: int, status: int, sha256: str | None) -> None:
        length = stop - start
        with open(entry.path, "rb", buffering=0) as handle:
            fd = handle.fileno()
            data: bytes | None = None
            if sha256 is None:
                if length <= _IN_MEMORY_RANGE:
                    data = os.pread(fd, length, start)
                    if len(data) != length:
                        raise HTTPError(
                            HTTPStatus.CONFLICT, "the file shrank while it was read; restart the run"
                        )
                    sha256 = hashlib.sha256(data).hexdigest()
                else:
                    sha256 = _hash_range(fd, start, stop)
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(length))
            self.send_header("X-Content-SHA256", sha256)
            if status == HTTPStatus.PARTIAL_CONTENT:
                self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{entry.size}")
            self.end_headers()
            self.owner.count(length, ranged=status == HTTPStatus.PARTIAL_CONTENT)
            if data is not None:
                self.wfile.write(data)
            else:
                offset = start
                while offset < stop:
                    chunk = os.pread(fd, min(_CHUNK, stop - offset), offset)
                    if not chunk:
                        self.close_connection = True  # the length promised can no longer be kept
                        return
                    self.wfile.write(chunk)
                    offset += len(chunk)

    def _put(self) -> None:
        path = urlsplit(self.path).path
        if not path.startswith("/v1/upload/"):
            raise HTTPError(HTTPStatus.NOT_FOUND, f"unknown path {path!r}")
        self.close_connection = True  # a refused upload leaves its body unread
        relative = unquote(path[len("/v1/upload/") :])
        try:
            target = resolve_inside(self.owner.upload_root, relative, "upload path")
        except ContractError as error:
            raise HTTPError(HTTPStatus.BAD_REQUEST, str(error)) from None
        if target.is_dir():
            raise HTTPError(HTTPStatus.CONFLICT, f"upload path {relative!r} is a directory on the launcher")
        expected = (self.headers.get("X-Content-SHA256") or "").strip().lower()
        try:
            check_digest(expected, "X-Content-SHA256")
        except ContractError:
            raise HTTPError(
                HTTPStatus.BAD_REQUEST, "the upload needs an X-Content-SHA256 header (64 hex digits)"
            ) from None
        length = self.content_length(self.owner.max_upload_bytes)
        digest = hashlib.sha256()
        with AtomicFile(target) as out:
            remaining = length
            while remaining:
                chunk = self.rfile.read(min(_CHUNK, remaining))
                if not chunk:
                    raise HTTPError(
                        HTTPStatus.BAD_REQUEST,
                        f"the upload ended after {length - remaining} of {length} bytes",
                    )
                digest.update(chunk)
                out.write(chunk)
                remaining -= len(chunk)
            if digest.hexdigest() != expected:
                raise HTTPError(
                    HTTPStatus.BAD_REQUEST,
                    f"upload of {relative!r} does not match its X-Content-SHA256; nothing was written",
                )
            out.commit()
        self.close_connection = False
        with self.owner._lock:
            self.owner.uploads += 1
        self.send_json(HTTPStatus.CREATED, {"path": relative, "size": length, "sha256": expected})


def _hash_range(fd: int, start: int, stop: int) -> str:
    digest = hashlib.sha256()
    offset = start
    while offset < stop:
        chunk = os.pread(fd, min(_CHUNK, stop - offset), offset)
        if not chunk:
            raise HTTPError(HTTPStatus.CONFLICT, "the file shrank while it was read; restart the run")
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()
