"""The remote side of the file server: fetch verified byte ranges and files, cache them by content.

A stage on another machine reads the model through
``shardpool.model.weights.WeightReader(RemoteFiles(...), names)``: :class:`RemoteFiles` is its byte
source, so the safetensors headers arrive by range reads and each tensor asked for by one range read
of exactly its bytes. Nothing else crosses the network, and every body is checked against the
server's ``X-Content-SHA256``. This module imports no torch: it moves and verifies bytes only.

Everything fetched lands in a content-addressed cache (``$SHARDPOOL_CACHE`` or ``~/.cache/shardpool``,
under ``blobs/sha256/<hex>``), so a restarted stage (resume) re-reads its tensors from disk without
the network, and a second run on the same model downloads nothing. The cache is shared by every
stage process of the run-as account, so nothing in it is believed: a cached file is used only if
it hashes to the SHA-256 in this job's manifest, and a cached range only if it hashes to the
SHA-256 the file server gives for that range (a ``HEAD`` with ``Range``: no body crosses the
network). The bytes are hashed once, as they are read into memory or copied into the job's own
directory (never hard-linked: a cache writer could change a shared inode after the check). A copy
that does not match is deleted (one log line) and fetched again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar
from urllib.parse import quote, urlsplit

from mesh.constants import cache_root
from mesh.files import AtomicFile
from mesh.http.client import RETRY_DROPPED, HTTPClient, Reply, StreamedReply, Unreachable, error_line
from shardpool.contract.names import ContractError, check_digest, resolve_inside, safe_relative_name
from shardpool.errors import ShardpoolError
from shardpool.files.server import sha256_file

__all__ = ["RemoteFiles", "default_cache_dir"]

log = logging.getLogger("shardpool.files.client")

_CHUNK = 1 << 20
T = TypeVar("T")


def default_cache_dir() -> Path:
    """``$SHARDPOOL_CACHE``, else ``~/.cache/shardpool`` (the profiler's cache root too)."""
    return cache_root()


class RemoteFiles:
    """A client of one :class:`shardpool.files.server.FileServer`, with a content-addressed cache.

    ``secret`` is the job's file-server secret (the stage reads it from ``files.secret`` in its job
    directory); it is sent as ``Authorization: Bearer`` with every request and never logged.
    Counters for tests and logs: ``range_requests`` and ``bytes_fetched`` (network only),
    ``cache_hits`` (ranges or files served from the cache, proven), ``digest_requests`` (the
    bodiless requests that fetch a cached range's SHA-256) and ``cache_discards`` (cached copies
    that did not match and were deleted).
    """

    def __init__(
        self, base_url: str, *, secret: str, cache_dir: Path | None = None, timeout: float = 60
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
            raise ShardpoolError(f"file server URL {base_url!r} is not like http://10.77.0.1:PORT")
        if not isinstance(secret, str) or not secret or not secret.isascii() or not secret.isprintable():
            raise ShardpoolError("the file server secret is empty or not printable ASCII; check files.secret")
        self._authorization = {"Authorization": f"Bearer {secret}"}
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._manifest: dict[str, dict[str, Any]] | None = None
        self._copies: dict[Path, tuple[str, tuple[int, ...]]] = {}
        self.range_requests = 0
        self.bytes_fetched = 0
        self.cache_hits = 0
        self.digest_requests = 0
        self.cache_discards = 0

    # ------------------------------------------------------------------ public API

    def manifest(self, *, refresh: bool = False) -> dict[str, dict[str, Any]]:
        """Every served file as ``{name: {"size": int, "sha256": hex}}`` (fetched once, then kept)."""
        if self._manifest is None or refresh:
            reply = self._request("GET", "/v1/manifest")
            self._check(reply.status, reply.body, "/v1/manifest", expected=200)
            try:
                self._manifest = _checked_manifest(_json(reply.body)["files"])
            except ContractError as error:
                raise ShardpoolError(f"{self.base_url}/v1/manifest is refused: {error}") from None
            except (KeyError, TypeError, ValueError, AttributeError):
                raise ShardpoolError(
                    f"{self.base_url}/v1/manifest is malformed; is that a shardpool file server?"
                ) from None
        return self._manifest

    def info(self, name: str) -> dict[str, Any]:
        """The manifest entry of ``name``, or a one-line error listing what is served."""
        files = self.manifest()
        if name not in files:
            served = ", ".join(sorted(files)) or "nothing"
            raise ShardpoolError(f"the launcher does not serve {name!r} (it serves {served})")
        return files[name]

    @property
    def location(self) -> str:
        """The URL the served files are under (``location/name`` is one file's URL)."""
        return f"{self.base_url}/v1/files"

    def file_sizes(self) -> dict[str, int]:
        """Every served file's size by name, from the manifest (so a WeightReader can read from here)."""
        return {name: info["size"] for name, info in self.manifest().items()}

    def read_range(self, name: str, start: int, stop: int, *, use_cache: bool = True) -> bytes:
        """Bytes ``[start, stop)`` of the served file ``name``, verified; from the cache when proven.

        A cached copy is used only when it hashes to the SHA-256 the server gives for this range
        now (one bodiless request); otherwise it is deleted and the range fetched. Raises
        ShardpoolError (one line) when the server sends the wrong length or bytes that do not match
        its ``X-Content-SHA256``. A dropped connection is retried (``RETRY_DROPPED``).
        """
        if not (isinstance(start, int) and isinstance(stop, int)) or not 0 <= start <= stop:
            raise ShardpoolError(f"bad byte range {start}-{stop} of {name!r}")
        if start == stop:
            return b""
        key_file = None
        if use_cache:
            info = self.info(name)
            if stop > info["size"]:
                raise ShardpoolError(
                    f"byte range {start}-{stop} is past the end of {name!r} ({info['size']} bytes)"
                )
            key_file = self.cache_dir / "ranges" / info["sha256"] / f"{start}-{stop}"
            cached = self._cached_range(name, start, stop, key_file)
            if cached is not None:
                with self._lock:
                    self.cache_hits += 1
                return cached
        path = f"/v1/files/{quote(name)}"
        reply = self._request("GET", path, {"Range": f"bytes={start}-{stop - 1}"})
        self._check(reply.status, reply.body, path, expected=206)
        headers, body = reply.headers, reply.body
        where = f"bytes {start}-{stop} of {name!r} from {self.base_url}"
        if len(body) != stop - start:
            raise ShardpoolError(
                f"{where}: got {len(body)} bytes, expected {stop - start}; the file changed or the link is broken"
            )
        digest = hashlib.sha256(body).hexdigest()
        if digest != (headers.get("X-Content-SHA256") or "").lower():
            raise ShardpoolError(
                f"{where}: SHA-256 mismatch (got {digest[:12]}…, server says {headers.get('X-Content-SHA256')!s:.12}…); the transfer was corrupted"
            )
        with self._lock:
            self.range_requests += 1
            self.bytes_fetched += len(body)
        if key_file is not None:
            self._store_range(key_file, body, digest)
        return body

    def fetch_file(self, name: str, dest_dir: Path) -> Path:
        """Put the whole file ``name``, verified against the manifest, at ``dest_dir/name``.

        From the cache (``blobs/sha256/<hex>``) when the cached copy hashes to the manifest's
        SHA-256 as it is copied, else from the server (stored in the cache on the way). The file at
        ``dest`` is this process's own copy, never a link into the shared cache; asking again for
        a copy this process made and nobody changed since costs one ``stat``.
        """
        dest = resolve_inside(dest_dir, name, "file name")
        info = self.info(name)
        if self._copies.get(dest) == (info["sha256"], _identity(dest)):
            return dest
        blob = self._blob(info["sha256"])
        dest.parent.mkdir(parents=True, exist_ok=True)
        if self._copy_proven(name, blob, dest, info):
            with self._lock:
                self.cache_hits += 1
        else:
            self._download(name, info, blob, dest)
        self._copies[dest] = (info["sha256"], _identity(dest))
        return dest

    def upload(self, local_path: Path, relative_path: str) -> dict[str, Any]:
        """Send a local file to the launcher's upload directory as ``relative_path`` (verified there)."""
        safe_relative_name(relative_path, "upload path")
        local_path = Path(local_path)
        try:
            size = local_path.stat().st_size
        except OSError as error:
            raise ShardpoolError(f"cannot upload {local_path}: {error.strerror}") from None
        digest = sha256_file(local_path)
        path = f"/v1/upload/{quote(relative_path)}"
        headers = {
            "Content-Length": str(size),
            "X-Content-SHA256": digest,
            "Content-Type": "application/octet-stream",
        }
        reply = self._over_http(lambda client: client.request("PUT", path, body=local_path, headers=headers))
        self._check(reply.status, reply.body, path, expected=201)
        return _json(reply.body)

    def close(self) -> None:
        """Close this thread's connection."""
        client = getattr(self._local, "client", None)
        if client is not None:
            client.close()
            self._local.client = None

    def __enter__(self) -> RemoteFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ HTTP

    def _client(self) -> HTTPClient:
        """This thread's client (each thread keeps its own connection); every request bears the secret."""
        client = getattr(self._local, "client", None)
        if client is None:
            client = HTTPClient(
                self.base_url, timeout=self.timeout, retry=RETRY_DROPPED, headers=self._authorization
            )
            self._local.client = client
        return client

    def _over_http(self, send: Callable[[HTTPClient], T]) -> T:
        """``send`` through this thread's client; a server that gives no whole reply is one line."""
        try:
            return send(self._client())
        except Unreachable as error:
            if error.dropped or error.timed_out:  # "... failed twice: ...", "... timed out after N s"
                raise ShardpoolError(str(error)) from None
            reason = (error.os_error.strerror if error.os_error else None) or error.reason
            raise ShardpoolError(f"cannot reach the file server {self.base_url}: {reason}") from None

    def _request(self, method: str, path: str, headers: dict[str, str] | None = None) -> Reply:
        return self._over_http(lambda client: client.request(method, path, headers=headers))

    def _check(self, status: int, body: bytes, path: str, *, expected: int) -> None:
        if status == expected:
            return
        raise ShardpoolError(f"{self.base_url}{path}: HTTP {status}: {error_line(body) or 'no detail'}")

    def _download(self, name: str, info: dict[str, Any], blob: Path, dest: Path) -> None:
        """Stream ``name`` into ``dest`` and the cache at once, hashed once; commit only if it matches."""
        path = f"/v1/files/{quote(name)}"

        def stream(reply: StreamedReply) -> None:
            if reply.status != 200:
                self._check(reply.status, reply.read(), path, expected=200)
            digest = hashlib.sha256()
            received = 0
            cache = _CacheCopy(blob)
            try:
                with AtomicFile(dest, mode=0o444) as out:
                    for chunk in reply.chunks(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        cache.write(chunk)
                        received += len(chunk)
                    if received != info["size"] or digest.hexdigest() != info["sha256"]:
                        raise ShardpoolError(
                            f"{name!r} from {self.base_url} does not match the manifest "
                            f"({received} of {info['size']} bytes, SHA-256 {digest.hexdigest()[:12]}…); it changed or was corrupted"
                        )
                    out.commit()
                cache.commit()
            finally:
                cache.abort()
            with self._lock:
                self.bytes_fetched += received

        self._over_http(lambda client: client.stream("GET", path, stream))

    # ------------------------------------------------------------------ cache

    def _blob(self, sha256: str) -> Path:
        return self.cache_dir / "blobs" / "sha256" / check_digest(sha256)

    def _published_digest(self, name: str, start: int, stop: int) -> str:
        """The SHA-256 the server gives for bytes ``[start, stop)`` of ``name`` (HEAD: no body sent)."""
        path = f"/v1/files/{quote(name)}"
        reply = self._request("HEAD", path, {"Range": f"bytes={start}-{stop - 1}"})
        self._check(reply.status, reply.body, path, expected=206)
        with self._lock:
            self.digest_requests += 1
        try:
            return check_digest((reply.headers.get("X-Content-SHA256") or "").lower(), "X-Content-SHA256")
        except ContractError as error:
            raise ShardpoolError(f"{self.base_url}{path}: {error}") from None

    def _cached_range(self, name: str, start: int, stop: int, key_file: Path) -> bytes | None:
        """The cached bytes of a range if they hash to the server's digest for it, else None.

        The key file only says that the range was cached once (so a cold read costs no extra
        request); what it names is never trusted: the blob is looked up by the server's digest.
        """
        recorded = _open_cached(key_file)
        if recorded is None:
            return None
        with recorded:
            named = recorded.read(65).decode("ascii", "replace").strip()
        published = self._published_digest(name, start, stop)
        if named != published:
            self._discard(None, key_file, f"bytes {start}-{stop} of {name!r} (its key names another blob)")
            return None
        blob = self._blob(published)
        handle = _open_cached(blob)
        if handle is None:
            return None
        with handle:
            data = handle.read(stop - start + 1)
        if len(data) == stop - start and hashlib.sha256(data).hexdigest() == published:
            return data
        self._discard(blob, key_file, f"bytes {start}-{stop} of {name!r}")
        return None

    def _copy_proven(self, name: str, blob: Path, dest: Path, info: dict[str, Any]) -> bool:
        """Copy the cached ``blob`` to ``dest`` if, hashed as it is copied, it matches the manifest."""
        handle = _open_cached(blob)
        if handle is None:
            return False
        digest, copied = hashlib.sha256(), 0
        with handle, AtomicFile(dest, mode=0o444) as out:
            while copied <= info["size"] and (chunk := handle.read(_CHUNK)):
                digest.update(chunk)
                out.write(chunk)
                copied += len(chunk)
            if copied == info["size"] and digest.hexdigest() == info["sha256"]:
                out.commit()
                return True
        self._discard(blob, None, repr(name))
        return False

    def _discard(self, blob: Path | None, key_file: Path | None, what: str) -> None:
        """Delete a cached copy that does not hash to the digest the server published (one log line)."""
        log.warning(
            "the cached copy of %s (%s) does not match the file server's SHA-256; deleted, fetching it again",
            what, blob or key_file,
        )  # fmt: skip
        with self._lock:
            self.cache_discards += 1
        for path in (blob, key_file):
            if path is not None:
                try:
                    path.unlink()
                except OSError:
                    pass

    def _store_range(self, key_file: Path, data: bytes, digest: str) -> None:
        try:
            with AtomicFile(self._blob(digest), mode=0o444) as out:
                out.write(data)
                out.commit()
            with AtomicFile(key_file) as out:
                out.write(digest.encode("ascii"))
                out.commit()
        except OSError as error:  # a full or read-only cache must not fail the read itself
            log.warning("cannot cache %s: %s", key_file, error)


class _CacheCopy:
    """The cache's copy of a download, written beside it; a cache that fails only stops caching."""

    def __init__(self, blob: Path) -> None:
        self.blob = blob
        self._out: AtomicFile | None = None
        try:
            self._out = AtomicFile(blob, mode=0o444)
        except OSError as error:
            log.warning("cannot cache %s: %s", blob, error)

    def write(self, chunk: bytes) -> None:
        """Append ``chunk`` to the cache's copy, or give the copy up."""
        if self._out is None:
            return
        try:
            self._out.write(chunk)
        except OSError as error:
            log.warning("cannot cache %s: %s", self.blob, error)
            self.abort()

    def commit(self) -> None:
        """Publish the cache's copy (call only once the download matched the manifest)."""
        if self._out is None:
            return
        try:
            self._out.commit()
        except OSError as error:
            log.warning("cannot cache %s: %s", self.blob, error)
        self.abort()

    def abort(self) -> None:
        """Drop an unpublished copy."""
        if self._out is not None:
            self._out.abort()
            self._out = None


def _open_cached(path: Path) -> IO[bytes] | None:
    """Open a cached file for reading if it is a regular file, else None.

    The cache is writable by other stage processes, so a planted link, FIFO or device must neither
    be followed nor block the open.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return os.fdopen(fd, "rb")
    except OSError:
        os.close(fd)
        return None


def _identity(path: Path) -> tuple[int, ...]:
    """What changes whenever a file is replaced or written (inode, size, mtime, ctime); () if absent."""
    try:
        info = path.lstat()
    except OSError:
        return ()
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _checked_manifest(files: Any) -> dict[str, dict[str, Any]]:
    """The served files by name, each name a safe relative path and each digest 64 hex digits.

    Names become paths in the fetch directory and digests become paths in the cache, so both are
    checked before either is used.
    """
    if not isinstance(files, dict):
        raise TypeError("files is not an object")
    checked: dict[str, dict[str, Any]] = {}
    for name, info in files.items():
        safe_relative_name(name, "served file name")
        size = info["size"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ContractError(f"the size of {name!r} is not a byte count")
        checked[name] = {"size": size, "sha256": check_digest(info["sha256"], f"SHA-256 of {name!r}")}
    return checked


def _json(body: bytes) -> dict[str, Any]:
    import json

    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ShardpoolError("the server's reply is not JSON") from None
    if not isinstance(value, dict):
        raise ShardpoolError("the server's reply is not a JSON object")
    return value
