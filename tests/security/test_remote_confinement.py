"""A stage's client of the launcher's file server never turns a hostile name or digest into a path."""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from shardpool.errors import ShardpoolError
from shardpool.files.client import RemoteFiles
from shardpool.files.server import FileServer


class _HostileManifest(BaseHTTPRequestHandler):
    """A file server whose manifest names a cache path outside the cache."""

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        body = json.dumps({"files": {"x.bin": {"size": 4, "sha256": "../../etc/x"}}}).encode()
        if self.path != "/v1/manifest":
            body = b"evil"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hostile_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HostileManifest)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_a_manifest_digest_that_is_not_64_hex_is_refused(hostile_url: str, tmp_path: Path) -> None:
    files = RemoteFiles(hostile_url, cache_dir=tmp_path / "cache", secret="s")
    with pytest.raises(ShardpoolError, match="64 lowercase hex"):
        files.manifest()
    with pytest.raises(ShardpoolError, match="64 lowercase hex"):
        files.fetch_file("x.bin", tmp_path / "fetched")
    assert not (tmp_path / "etc").exists() and not (tmp_path / "cache").exists()


def test_a_fetched_file_cannot_land_outside_its_directory_through_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "served.bin").write_bytes(b"payload")
    (tmp_path / "fetched").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "fetched" / "sub").symlink_to(tmp_path / "outside")
    secret = secrets.token_hex(32)
    served = {"sub/file.bin": tmp_path / "served.bin"}
    with FileServer("127.0.0.1", files=served, upload_root=tmp_path / "up", secret=secret) as server:
        files = RemoteFiles(server.url, cache_dir=tmp_path / "cache", secret=secret)
        with pytest.raises(ShardpoolError, match="escapes"):
            files.fetch_file("sub/file.bin", tmp_path / "fetched")
        files.close()
    assert list((tmp_path / "outside").iterdir()) == []
