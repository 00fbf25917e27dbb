"""The remote side of the file server: fetch verified byte ranges and files, cache them by content.

A stage on another machine reads the model through
``shardpool.model.weights.WeightReader(RemoteFiles(...), names)``: :class:`RemoteFiles` is its byte
source, so the safetensors headers arrive by range reads and each tensor asked for by one range read
of exactly its bytes. Nothing else crosses the network, and every body is checked against the
server's ``X-Content-SHA256``. This module imports no torch: it moves and verifies bytes only.

Everything fetched lands in a content-addressed cache (``$SHARDPOOL_CACHE`` or ``~/.cache/shardpool``,
under ``blobs/sha256/<hex>``). A range is remembered as "bytes a-b of the file whose SHA-256 is F
have SHA-256 T", so a restarted stage (resume) re-reads its tensors from disk without the network,
and a second run on the same model downloads nothing. Cached bytes are re-verified when read.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
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
    ``cache_hits`` (ranges or files served from the cache).
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
        self.range_requests = 0
        self.bytes_fetched = 0
        self.cache_hits = 0

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
        """Bytes ``[start, stop)`` of the served file ``name``, verified; from the cache when known.

        Raises ShardpoolError (one line) when the server sends the wrong length or bytes that do
        not match its ``X-Content-SHA256``. A dropped connection is retried (``RETRY_DROPPED``).
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
            cached = self._cached_range(key_file, stop - start)
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
        """Download the whole file ``name`` (verified against the manifest) to ``dest_dir/name``.

        The bytes are stored once in the cache as ``blobs/sha256/<hex>`` and hard-linked (or copied,
        across file systems) into place, so fetching the same content again uses no network.
        """
        dest = resolve_inside(dest_dir, name, "file name")
        info = self.info(name)
        blob = self._blob(info["sha256"])
        if blob.is_file() and blob.stat().st_size == info["size"]:
            with self._lock:
                self.cache_hits += 1
        else:
            self._download(name, info, blob)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists() and os.path.samefile(dest, blob):
            return dest
        fd, temp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}-", suffix=".link")
        os.close(fd)
        os.unlink(temp)
        try:
            try:
                os.link(blob, temp)
            except OSError:
                shutil.copyfile(blob, temp)
            os.replace(temp, dest)
        finally:
            if os.path.lexists(temp):
                os.unlink(temp)
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

    def _download(self, name: str, info: dict[str, Any], blob: Path) -> None:
        path = f"/v1/files/{quote(name)}"

        def stream(reply: StreamedReply) -> None:
            if reply.status != 200:
                self._check(reply.status, reply.read(), path, expected=200)
            digest = hashlib.sha256()
            received = 0
            with AtomicFile(blob, mode=0o444) as out:
                for chunk in reply.chunks(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    received += len(chunk)
                if received != info["size"] or digest.hexdigest() != info["sha256"]:
                    raise ShardpoolError(
                        f"{name!r} from {self.base_url} does not match the manifest "
                        f"({received} of {info['size']} bytes, SHA-256 {digest.hexdigest()[:12]}…); it changed or was corrupted"
                    )
                out.commit()
            with self._lock:
                self.bytes_fetched += received

        self._over_http(lambda client: client.stream("GET", path, stream))

    # ------------------------------------------------------------------ cache

    def _blob(self, sha256: str) -> Path:
        return self.cache_dir / "blobs" / "sha256" / check_digest(sha256)

    def _cached_range(self, key_file: Path, size: int) -> bytes | None:
        try:
            digest = key_file.read_text(encoding="ascii").strip()
            data = self._blob(digest).read_bytes()
        except (OSError, UnicodeDecodeError, ContractError):
            return None
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            log.warning("cache entry %s is corrupt; fetching it again", key_file)
            return None
        return data

    def _store_range(self, key_file: Path, data: bytes, digest: str) -> None:
        try:
            blob = self._blob(digest)
            if not (blob.is_file() and blob.stat().st_size == len(data)):
                with AtomicFile(blob, mode=0o444) as out:
                    out.write(data)
                    out.commit()
            with AtomicFile(key_file) as out:
                out.write(digest.encode("ascii"))
                out.commit()
        except OSError as error:  # a full or read-only cache must not fail the read itself
            log.warning("cannot cache %s: %s", key_file, error)


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
