"""A stage cannot poison another stage's fetch cache (docs/security.md, issue 39 finding 5).

Every stage process of a member runs as the same account and may write the shared cache, so a
compromised stage can plant blobs and range keys there. A planted copy must be found out by the
digest the launcher's file server publishes for this job, deleted in one log line, and fetched
again; the bytes used are always the served ones.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardpool.files.client import RemoteFiles
from shardpool.files.server import FileServer

SECRET = secrets.token_hex(32)
CONTENT = os.urandom(3000)
WEIGHTS = hashlib.sha256(CONTENT).hexdigest()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[FileServer]:
    (tmp_path / "weights.bin").write_bytes(CONTENT)
    files = {"weights.bin": tmp_path / "weights.bin"}
    with FileServer("127.0.0.1", files=files, upload_root=tmp_path / "out", secret=SECRET) as served:
        yield served


def _client(server: FileServer, cache: Path) -> RemoteFiles:
    return RemoteFiles(server.url, cache_dir=cache, secret=SECRET)


def _plant(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.chmod(0o644)
    path.write_bytes(data)


def test_a_planted_whole_blob_of_the_right_size_is_found_out_and_fetched_again(
    server: FileServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    _plant(cache / "blobs" / "sha256" / WEIGHTS, b"\xee" * len(CONTENT))  # another stage's doing
    files = _client(server, cache)
    with caplog.at_level(logging.WARNING, logger="shardpool.files.client"):
        fetched = files.fetch_file("weights.bin", tmp_path / "job")
    assert fetched.read_bytes() == CONTENT, "the served bytes are used, not the planted ones"
    assert (files.cache_hits, files.cache_discards, files.bytes_fetched) == (0, 1, len(CONTENT))
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "does not match the file server's SHA-256" in warnings[0]
    assert "\n" not in warnings[0]
    assert (cache / "blobs" / "sha256" / WEIGHTS).read_bytes() == CONTENT, "the cache is healed"


def test_a_proven_cached_blob_is_a_private_copy_that_a_cache_writer_cannot_change(
    server: FileServer, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    _client(server, cache).fetch_file("weights.bin", tmp_path / "first")
    files = _client(server, cache)
    fetched = files.fetch_file("weights.bin", tmp_path / "job")
    assert (files.cache_hits, files.bytes_fetched) == (1, 0), "served from the cache, proven"
    _plant(cache / "blobs" / "sha256" / WEIGHTS, b"\xee" * len(CONTENT))  # after the check
    assert fetched.read_bytes() == CONTENT


def test_a_planted_range_with_a_matching_fake_key_is_found_out(
    server: FileServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    fake = b"\xee" * 1000
    fake_digest = hashlib.sha256(fake).hexdigest()
    _plant(cache / "blobs" / "sha256" / fake_digest, fake)
    _plant(cache / "ranges" / WEIGHTS / "1000-2000", fake_digest.encode("ascii"))
    files = _client(server, cache)
    with caplog.at_level(logging.WARNING, logger="shardpool.files.client"):
        assert files.read_range("weights.bin", 1000, 2000) == CONTENT[1000:2000]
    assert (files.cache_hits, files.range_requests, files.cache_discards) == (0, 1, 1)
    assert sum("does not match the file server's SHA-256" in r.getMessage() for r in caplog.records) == 1
    again = _client(server, cache)
    assert again.read_range("weights.bin", 1000, 2000) == CONTENT[1000:2000]
    assert (again.cache_hits, again.range_requests, again.digest_requests) == (1, 0, 1), (
        "the healed entry is proven by one bodiless request"
    )


def test_a_planted_range_blob_under_the_true_digest_is_found_out(server: FileServer, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    real = hashlib.sha256(CONTENT[0:500]).hexdigest()
    _plant(cache / "ranges" / WEIGHTS / "0-500", real.encode("ascii"))
    _plant(cache / "blobs" / "sha256" / real, b"\xee" * 500)
    files = _client(server, cache)
    assert files.read_range("weights.bin", 0, 500) == CONTENT[0:500]
    assert (files.cache_hits, files.range_requests, files.cache_discards) == (0, 1, 1)


def test_a_planted_fifo_neither_blocks_nor_is_believed(server: FileServer, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    real = hashlib.sha256(CONTENT[0:500]).hexdigest()
    _plant(cache / "ranges" / WEIGHTS / "0-500", real.encode("ascii"))
    (cache / "blobs" / "sha256").mkdir(parents=True)
    for digest in (real, WEIGHTS):
        os.mkfifo(cache / "blobs" / "sha256" / digest)  # opening one for reading waits for a writer
    files = _client(server, cache)
    results: list[bytes] = []
    reader = threading.Thread(
        target=lambda: results.extend(
            [
                files.read_range("weights.bin", 0, 500),
                files.fetch_file("weights.bin", tmp_path / "job").read_bytes(),
            ]
        ),
        daemon=True,
    )
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "a planted FIFO blocked the read"
    assert results == [CONTENT[0:500], CONTENT]
