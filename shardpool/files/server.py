"""The launcher's file server: remote stages fetch the model and data from it and upload results.

Remote stages read only the tensors they own, so the server answers byte ranges (``Range: bytes=a-b``)
and sends ``X-Content-SHA256`` with every body, so a receiver can verify exactly what it got. The
manifest gives every served file's size and SHA-256, which are also the keys of the receivers'
content-addressed caches. Uploads (checkpoint pieces, adapter pieces, eval logits) are verified
against the sender's hash and written atomically under one root directory, bounded in number of
files and in total bytes per run, so a stage cannot fill the launcher's disk.

The server speaks JSON and raw bytes only, runs on :mod:`mesh.http.server` (deadlines, size caps, bounded
handler threads), listens on one address (the launcher's mesh address), and answers only requests
that carry the job's secret (``Authorization: Bearer``), which the launcher hands to each stage
through its agent in a 0600 ``files.secret`` file: being on the mesh is not enough to read the
model or write into the run's output.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from mesh.errors import MeshError
from mesh.files import AtomicFile
from mesh.http.server import (
    FileChunks,
    HTTPError,
    HTTPServer,
    Limits,
    Reply,
    Request,
    Route,
    error_reply,
    json_reply,
    stream_reply,
)
from shardpool.contract.names import ContractError, check_digest, resolve_inside, safe_relative_name
from shardpool.errors import ShardpoolError

__all__ = [
    "MAX_UPLOAD_BYTES",
    "MAX_UPLOAD_FILES",
    "MAX_UPLOAD_TOTAL_BYTES",
    "FileServer",
    "parse_range",
    "sha256_file",
]

log = logging.getLogger("shardpool.files.server")

MAX_UPLOAD_BYTES = 2 * 2**30
#: Files one run may upload (a path uploaded again counts once): its checkpoints, adapter and logits.
MAX_UPLOAD_FILES = 4096
#: Bytes one run's uploads may hold in all (the latest upload of each path counts).
MAX_UPLOAD_TOTAL_BYTES = 64 * 2**30
_CHUNK = 1 << 20
_HASH_WAIT_S = 600.0  # a request for a file waits this long for the first hashing to finish
_SECRET = re.compile(r"[0-9a-f]{64}")


def sha256_file(path: Path) -> str:
    """SHA-256 of a whole file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


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

    ``GET /v1/manifest``, ``GET``/``HEAD /v1/files/{name}`` (optionally ``Range``) and
    ``PUT /v1/upload/{relative/path}`` (``X-Content-SHA256`` required, at most ``max_upload_bytes``,
    streamed to a temporary file and renamed into place). A run's uploads hold at most
    ``max_upload_files`` paths (429 beyond) and ``max_upload_total_bytes`` bytes (413 beyond),
    counting the latest upload of each path and those in flight, checked before the body is read. Every request must carry
    ``Authorization: Bearer <secret>``, the job's secret (64 hex digits), checked in constant time
    before any route runs; anything else gets 401. The server listens on ``host`` only (the
    launcher's mesh address; a wildcard is refused).

    Hashes are computed once, in a background thread started by :meth:`start`; the manifest waits
    for them. A served file that changes on disk afterwards is refused with 409 rather than served
    with a stale hash. ``bytes_served``, ``range_requests`` and ``uploads`` count what went through
    (for tests).
    """

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        files: dict[str, Path],
        upload_root: Path,
        secret: str,
        max_upload_bytes: int = MAX_UPLOAD_BYTES,
        max_upload_files: int = MAX_UPLOAD_FILES,
        max_upload_total_bytes: int = MAX_UPLOAD_TOTAL_BYTES,
        limits: Limits | None = None,
    ) -> None:
        self._secret = _checked_secret(secret)
        self._files = {name: _served_entry(name, Path(path)) for name, path in files.items()}
        self.upload_root = Path(upload_root)
        self.upload_root.mkdir(parents=True, exist_ok=True)
        self.max_upload_bytes = max_upload_bytes
        self.max_upload_files = max_upload_files
        self.max_upload_total_bytes = max_upload_total_bytes
        self._stored: dict[str, int] = {}  # upload path -> size of its latest upload
        self._stored_bytes = 0
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._in_flight_bytes = 0
        self._lock = threading.Lock()
        self._hashed = threading.Event()
        self._hash_error: str | None = None
        self.bytes_served = 0
        self.range_requests = 0
        self.uploads = 0
        routes = [
            Route("GET", "/v1/manifest", self._get_manifest, max_body=0),
            Route("GET", "/v1/files/{name:path}", self._get_file, max_body=0),
            Route(
                "PUT",
                "/v1/upload/{relative:path}",
                self._put_upload,
                max_body=max_upload_bytes,
                stream_body=True,
            ),
        ]
        self._server = HTTPServer(
            routes,
            host=host,
            port=port,
            limits=limits,
            authenticate=self._authenticate,
            client_errors=(ContractError,),
            name="fileserver",
        )
        self._hasher: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL once started, e.g. ``http://10.77.0.1:41234``."""
        return self._server.url

    def start(self) -> FileServer:
        """Start hashing the files and serving requests; returns self. A second call does nothing."""
        if self._hasher is None:
            self._hasher = threading.Thread(target=self._hash_all, name="fileserver-hash", daemon=True)
            self._hasher.start()
        try:
            self._server.start()
        except MeshError as error:
            raise ShardpoolError(f"the file server cannot start: {error}") from None
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket (waits for requests in flight)."""
        self._server.stop()

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

    # ------------------------------------------------------------------ request handling

    def _authenticate(self, request: Request) -> str:
        """Admit only requests bearing this job's secret; runs before any route (401 otherwise)."""
        scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
        offered = token.strip().encode("utf-8", "replace")
        if scheme.lower() != "bearer" or not hmac.compare_digest(offered, self._secret):
            raise HTTPError(
                401,
                "this file server needs the job's secret: send Authorization: Bearer <files.secret>",
                {"WWW-Authenticate": 'Bearer realm="shardpool files"'},
            )
        return "job"

    def _get_manifest(self, request: Request) -> Reply:
        try:
            return json_reply(self.manifest(timeout=_HASH_WAIT_S))
        except ShardpoolError as error:
            raise HTTPError(503, str(error)) from None

    def _get_file(self, request: Request) -> Reply:
        name = request.params["name"]
        entry = self._files.get(name)
        if entry is None:
            raise HTTPError(404, f"no file named {name[:200]!r} is served; see /v1/manifest")
        header = request.headers.get("Range")
        if header is None and (not self._hashed.wait(_HASH_WAIT_S) or entry.sha256 is None):
            raise HTTPError(503, self._hash_error or "the file server could not hash its files")
        chunks = _OpenRange.of(entry, name)
        try:
            if header is None:
                return self._send(request, chunks, 0, entry.size, 200, entry.sha256 or "")
            try:
                start, stop = parse_range(header, entry.size)
            except ValueError as error:
                chunks.close()
                return error_reply(416, str(error), {"Content-Range": f"bytes */{entry.size}"})
            headers = {"Content-Range": f"bytes {start}-{stop - 1}/{entry.size}"}
            return self._send(request, chunks, start, stop, 206, chunks.sha256(start, stop), headers)
        except BaseException:
            chunks.close()
            raise

    def _send(
        self,
        request: Request,
        chunks: _OpenRange,
        start: int,
        stop: int,
        status: int,
        sha256: str,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        if request.method == "GET":
            with self._lock:
                self.bytes_served += stop - start
                self.range_requests += int(status == 206)
        chunks.seek(start, stop)
        return stream_reply(
            chunks, stop - start, status, headers={**(headers or {}), "X-Content-SHA256": sha256}
        )

    def _put_upload(self, request: Request) -> Reply:
        relative = request.params["relative"]
        target = resolve_inside(self.upload_root, relative, "upload path")
        if target.is_dir():
            raise HTTPError(409, f"upload path {relative!r} is a directory on the launcher")
        expected = (request.headers.get("X-Content-SHA256") or "").strip().lower()
        try:
            check_digest(expected, "X-Content-SHA256")
        except ContractError:
            raise HTTPError(400, "the upload needs an X-Content-SHA256 header (64 hex digits)") from None
        key = str(target)
        self._reserve(key, request.length)
        try:
            received = self._receive(request, target, relative, expected)
            with self._lock:
                self._stored_bytes += received - self._stored.get(key, 0)
                self._stored[key] = received
                self.uploads += 1
        finally:
            with self._lock:
                self._in_flight[key] -= 1
                if not self._in_flight[key]:
                    del self._in_flight[key]
                self._in_flight_bytes -= request.length
        return json_reply({"path": relative, "size": received, "sha256": expected}, 201)

    def _reserve(self, key: str, length: int) -> None:
        """Count an upload of ``length`` bytes to ``key`` against the run's bounds, or refuse it (429/413)."""
        with self._lock:
            if len(self._stored.keys() | self._in_flight.keys() | {key}) > self.max_upload_files:
                raise HTTPError(
                    429,
                    f"this run has uploaded the most files it may ({self.max_upload_files}); "
                    "nothing more is accepted",
                )
            total = self._stored_bytes + self._in_flight_bytes + length - self._stored.get(key, 0)
            if total > self.max_upload_total_bytes:
                raise HTTPError(
                    413,
                    f"this upload would bring the run's uploads to {total} bytes, over its bound of "
                    f"{self.max_upload_total_bytes}; nothing was written",
                )
            self._in_flight[key] += 1
            self._in_flight_bytes += length

    def _receive(self, request: Request, target: Path, relative: str, expected: str) -> int:
        """Stream the body into ``target`` atomically if it matches ``expected``; the bytes received."""
        digest, received = hashlib.sha256(), 0
        with AtomicFile(target) as out:
            while chunk := request.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
                received += len(chunk)
            if received != request.length:
                raise HTTPError(400, f"the upload ended after {received} of {request.length} bytes")
            if digest.hexdigest() != expected:
                raise HTTPError(
                    400, f"upload of {relative!r} does not match its X-Content-SHA256; nothing was written"
                )
            out.commit()
        return received

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


def _checked_secret(secret: str) -> bytes:
    if not isinstance(secret, str) or not _SECRET.fullmatch(secret):
        raise ShardpoolError(
            "the file server's secret must be 64 lowercase hex digits; make one with secrets.token_hex(32)"
        )
    return secret.encode("ascii")


def _served_entry(name: str, path: Path) -> _Served:
    safe_relative_name(name, "served file name")
    try:
        stat = path.stat()
    except OSError as error:
        raise ShardpoolError(f"cannot serve {name!r} from {path}: {error.strerror}") from None
    if not path.is_file():
        raise ShardpoolError(f"cannot serve {name!r}: {path} is not a regular file")
    return _Served(path, stat.st_size, stat.st_mtime_ns)


class _OpenRange(FileChunks):
    """One opened served file, checked unchanged, read 1 MiB at a time while it is sent.

    The hash and the bytes sent come from the same open file, so a file renamed over on the
    launcher mid-request cannot make them disagree. ``close`` may come from another thread.
    """

    @classmethod
    def of(cls, entry: _Served, name: str) -> _OpenRange:
        """Open ``entry``; 410 if it is gone, 409 if it changed since it was hashed."""
        try:
            fd = os.open(entry.path, os.O_RDONLY)
        except OSError as error:
            raise HTTPError(410, f"{name!r} is no longer readable ({error.strerror})") from None
        opened = cls(fd, 0, 0)
        stat = os.fstat(fd)
        if (stat.st_size, stat.st_mtime_ns) != (entry.size, entry.mtime_ns):
            opened.close()
            raise HTTPError(409, f"{name!r} changed on the launcher after it was hashed; restart the run")
        return opened

    def sha256(self, start: int, stop: int) -> str:
        """SHA-256 of bytes ``[start, stop)``, read in chunks (a large range is never held whole)."""
        digest, offset = hashlib.sha256(), start
        while offset < stop:
            chunk = os.pread(self._fd, min(_CHUNK, stop - offset), offset)
            if not chunk:
                raise HTTPError(409, "the file shrank while it was read; restart the run")
            digest.update(chunk)
            offset += len(chunk)
        return digest.hexdigest()
