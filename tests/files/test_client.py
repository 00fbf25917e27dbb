"""Tests of shardpool/files/client.py against a real file server on loopback.

A remote stage must fetch exactly the bytes of the tensors it owns (plus the file headers), verify
every body, and serve a restart from its content-addressed cache without touching the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardpool.errors import ShardpoolError
from shardpool.files.client import RemoteFiles
from shardpool.files.server import FileServer
from shardpool.model.weights import WeightReader

SECRET = secrets.token_hex(32)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sharded_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model split into two safetensors files with an index, as big checkpoints are."""
    tensors = load_file(tiny_model / "model.safetensors")
    names = sorted(tensors)
    out = tmp_path_factory.mktemp("sharded")
    halves = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    weight_map = {}
    for file, part in halves.items():
        save_file({name: tensors[name] for name in part}, out / file)
        weight_map.update({name: file for name in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


def _header_bytes(path: Path) -> int:
    with open(path, "rb") as handle:
        return 8 + struct.unpack("<Q", handle.read(8))[0]


@pytest.fixture
def model_server(sharded_model: Path, tmp_path: Path) -> Iterator[tuple[FileServer, list[str]]]:
    names = sorted(p.name for p in sharded_model.glob("*.safetensors"))
    files = {f"model/{name}": sharded_model / name for name in names}
    with FileServer("127.0.0.1", files=files, upload_root=tmp_path / "out", secret=SECRET) as server:
        yield server, [f"model/{name}" for name in names]


def test_remote_reader_fetches_exactly_the_owned_tensors_then_serves_a_restart_from_cache(
    model_server, sharded_model: Path, tmp_path: Path
) -> None:
    server, names = model_server
    local = WeightReader(sharded_model)
    owned = [name for name in local.names() if name.startswith(("model.layers.2.", "model.layers.3."))]
    assert len(owned) > 10
    with WeightReader(RemoteFiles(server.url, cache_dir=tmp_path / "cache", secret=SECRET), names) as remote:
        assert sorted(remote.names()) == sorted(local.names())
        assert all(remote.shape(n) == local.shape(n) and remote.has(n) for n in local.names())
        assert server.bytes_served == sum(
            _header_bytes(sharded_model / n.removeprefix("model/")) for n in names
        )
        for name in owned:
            assert torch.equal(remote.read(name), local.read(name)), name
        owned_bytes = sum(local.entries[n].stop - local.entries[n].start for n in owned)
        assert remote.names_read == owned
        assert remote.bytes_read == owned_bytes == local.bytes_read
    headers = sum(_header_bytes(sharded_model / n.removeprefix("model/")) for n in names)
    assert server.bytes_served == headers + owned_bytes, "only headers and owned tensors cross the network"
    assert server.range_requests == 2 * len(names) + len(owned), "one range read per tensor"

    served, requests = server.bytes_served, server.range_requests
    restarted_files = RemoteFiles(
        server.url, cache_dir=tmp_path / "cache", secret=SECRET
    )  # a resumed stage process
    with WeightReader(restarted_files, names) as restarted:
        for name in owned:
            assert torch.equal(restarted.read(name), local.read(name))
    assert (server.bytes_served, server.range_requests) == (served, requests), (
        "the restart used no range reads"
    )
    assert restarted_files.cache_hits == 2 * len(names) + len(owned)
    assert restarted_files.bytes_fetched == 0


def test_a_corrupted_cache_entry_is_fetched_again(model_server, tmp_path: Path) -> None:
    server, names = model_server
    files = RemoteFiles(server.url, cache_dir=tmp_path / "cache", secret=SECRET)
    data = files.read_range(names[0], 100, 200)
    digest = hashlib.sha256(data).hexdigest()
    blob = tmp_path / "cache" / "blobs" / "sha256" / digest
    os.chmod(blob, 0o644)
    blob.write_bytes(b"\0" * 100)
    again = RemoteFiles(server.url, cache_dir=tmp_path / "cache", secret=SECRET)
    assert again.read_range(names[0], 100, 200) == data
    assert again.range_requests == 1 and again.cache_hits == 0


def test_fetch_file_verifies_and_copies_from_the_cache(
    model_server, sharded_model: Path, tmp_path: Path
) -> None:
    server, names = model_server
    files = RemoteFiles(server.url, cache_dir=tmp_path / "cache", secret=SECRET)
    first = files.fetch_file(names[1], tmp_path / "run1")
    assert first == tmp_path / "run1" / names[1]
    original = (sharded_model / names[1].removeprefix("model/")).read_bytes()
    assert first.read_bytes() == original
    served = server.bytes_served
    assert served == len(original)
    second = RemoteFiles(server.url, cache_dir=tmp_path / "cache", secret=SECRET).fetch_file(
        names[1], tmp_path / "run2"
    )
    assert second.read_bytes() == original
    assert server.bytes_served == served, "the second fetch came from the cache"
    blob = tmp_path / "cache" / "blobs" / "sha256" / hashlib.sha256(original).hexdigest()
    assert blob.read_bytes() == original
    assert not os.path.samefile(second, blob), (
        "a private copy: a cache writer cannot change it after the check"
    )


def test_upload_lands_verified_in_the_upload_root(model_server, tmp_path: Path) -> None:
    server, _ = model_server
    source = tmp_path / "adapter.safetensors"
    source.write_bytes(os.urandom(50_000))
    reply = RemoteFiles(server.url, secret=SECRET).upload(source, "checkpoint-2/stage-0.safetensors")
    assert reply["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert (tmp_path / "out" / "checkpoint-2" / "stage-0.safetensors").read_bytes() == source.read_bytes()
    with pytest.raises(ShardpoolError, match="safe relative path"):
        RemoteFiles(server.url, secret=SECRET).upload(source, "../outside")


class _Liar(BaseHTTPRequestHandler):
    """A file server that lies: wrong hash, wrong length, or a dropped first connection.

    It records the Authorization header of every request it gets, to show the client sends it.
    """

    protocol_version = "HTTP/1.1"
    data = bytes(range(256)) * 4
    mode = "hash"
    dropped = 0
    authorizations: list[str | None] = []

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        _Liar.authorizations.append(self.headers.get("Authorization"))
        if self.path == "/v1/manifest":
            digest = hashlib.sha256(self.data).hexdigest()
            self._send(
                200, json.dumps({"files": {"f.bin": {"size": len(self.data), "sha256": digest}}}).encode()
            )
            return
        if self.mode == "drop" and _Liar.dropped == 0:
            _Liar.dropped += 1
            self.close_connection = True
            return  # no response at all: the client sees the connection close
        body = self.data[:100]
        digest = hashlib.sha256(body).hexdigest()
        if self.mode == "hash":
            body = b"\xff" + body[1:]
        elif self.mode == "short":
            body = body[:99]
            digest = hashlib.sha256(body).hexdigest()
        elif self.mode == "whole":
            body = b"\xff" + self.data[1:]
            digest = hashlib.sha256(body).hexdigest()
        self._send(206 if "Range" in self.headers else 200, body, digest)

    def _send(self, status: int, body: bytes, digest: str | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        if digest is not None:
            self.send_header("X-Content-SHA256", digest)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def liar() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Liar)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Liar.authorizations = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.parametrize(
    ("mode", "message"), [("hash", "SHA-256 mismatch"), ("short", "got 99 bytes, expected 100")]
)
def test_corrupted_ranges_raise_one_line_errors(liar: str, tmp_path: Path, mode: str, message: str) -> None:
    _Liar.mode = mode
    with pytest.raises(ShardpoolError, match=message) as caught:
        RemoteFiles(liar, cache_dir=tmp_path, secret=SECRET).read_range("f.bin", 0, 100)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "blobs").exists() or not any((tmp_path / "blobs").rglob("*")), (
        "nothing bad was cached"
    )


def test_a_whole_file_not_matching_the_manifest_is_refused(liar: str, tmp_path: Path) -> None:
    _Liar.mode = "whole"
    with pytest.raises(ShardpoolError, match="does not match the manifest"):
        RemoteFiles(liar, cache_dir=tmp_path / "cache", secret=SECRET).fetch_file("f.bin", tmp_path / "dest")
    assert not (tmp_path / "dest" / "f.bin").exists()
    assert list((tmp_path / "cache" / "blobs" / "sha256").iterdir()) == []


def test_a_dropped_connection_is_retried_once(liar: str, tmp_path: Path) -> None:
    _Liar.mode, _Liar.dropped = "drop", 0
    files = RemoteFiles(liar, cache_dir=tmp_path, secret=SECRET)
    assert files.read_range("f.bin", 0, 100) == _Liar.data[:100]
    assert _Liar.dropped == 1
    assert _Liar.authorizations == [f"Bearer {SECRET}"] * 3, (
        "every request, the retry too, carries the secret"
    )


def test_changed_file_on_the_launcher_and_unreachable_server_are_one_line_errors(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"a" * 1000)
    with FileServer(
        "127.0.0.1", files={"f": tmp_path / "f"}, upload_root=tmp_path / "o", secret=SECRET
    ) as server:
        files = RemoteFiles(server.url, cache_dir=tmp_path / "cache", secret=SECRET)
        files.manifest()
        (tmp_path / "f").write_bytes(b"b" * 1000)
        with pytest.raises(ShardpoolError, match="HTTP 409: 'f' changed on the launcher"):
            files.read_range("f", 0, 10)
        url = server.url
    with pytest.raises(ShardpoolError, match="cannot reach the file server|failed twice") as caught:
        RemoteFiles(url, timeout=2, secret=SECRET).read_range("f", 0, 10, use_cache=False)
    assert "\n" not in str(caught.value)
    with pytest.raises(ShardpoolError, match="not like http"):
        RemoteFiles("ftp://198.51.100.1/x", secret=SECRET)


def test_the_file_server_and_its_client_import_no_torch() -> None:
    code = "import sys, shardpool.files.client, shardpool.files.server; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    assert result.stdout.strip() == "False"
