"""Tests of shardpool/files/server.py over loopback: manifest, exact byte ranges, verified atomic uploads.

Every refusal is checked for its status code and for leaving nothing behind.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import secrets
import socket
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardpool.errors import ShardpoolError
from shardpool.files.server import FileServer, parse_range
from tests.helpers.http_client import read_hashed

SECRET = secrets.token_hex(32)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[FileServer, dict[str, bytes], Path]]:
    contents = {"model/weights.bin": os.urandom(300_000), "data.jsonl": b'{"text": "hello"}\n', "empty": b""}
    files = {}
    for name, data in contents.items():
        path = tmp_path / "src" / name.replace("/", "_")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files[name] = path
    (tmp_path / "secret.txt").write_text("do not serve")
    with FileServer(
        "127.0.0.1", files=files, upload_root=tmp_path / "out", secret=SECRET, max_upload_bytes=1 << 20
    ) as server:
        yield server, contents, tmp_path


def _request(
    server: FileServer,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    secret: str = SECRET,
):
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request(
            method, path, body=body, headers={"Authorization": f"Bearer {secret}", **(headers or {})}
        )
        response = connection.getresponse()
        return response.status, dict(response.headers), response.read()
    finally:
        connection.close()


def test_manifest_lists_sizes_and_sha256(served) -> None:
    server, contents, _ = served
    status, _, body = _request(server, "GET", "/v1/manifest")
    assert status == 200
    assert json.loads(body) == {
        "files": {
            name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            for name, data in contents.items()
        }
    }


@pytest.mark.parametrize(
    ("spec", "start", "stop"),
    [
        ("0-0", 0, 1),
        ("100-199", 100, 200),
        ("299990-", 299990, 300000),
        ("-7", 299993, 300000),
        ("299000-999999", 299000, 300000),
    ],
)
def test_ranges_return_exactly_those_bytes_with_their_hash(served, spec: str, start: int, stop: int) -> None:
    server, contents, _ = served
    before = server.bytes_served
    status, headers, body = _request(
        server, "GET", "/v1/files/model/weights.bin", headers={"Range": f"bytes={spec}"}
    )
    expected = contents["model/weights.bin"][start:stop]
    assert status == 206
    assert body == expected
    assert headers["X-Content-SHA256"] == hashlib.sha256(expected).hexdigest()
    assert headers["Content-Range"] == f"bytes {start}-{stop - 1}/300000"
    assert server.bytes_served - before == len(expected)


def test_whole_file_without_range(served) -> None:
    server, contents, _ = served
    status, headers, body = _request(server, "GET", "/v1/files/data.jsonl")
    assert (status, body) == (200, contents["data.jsonl"])
    assert headers["X-Content-SHA256"] == hashlib.sha256(contents["data.jsonl"]).hexdigest()


@pytest.mark.parametrize(
    "spec",
    ["bytes=300000-300010", "bytes=10-5", "bytes=0-1,5-6", "items=0-5", "bytes=abc", "bytes=-0", "bytes=-"],
)
def test_bad_ranges_are_416(served, spec: str) -> None:
    server, _, _ = served
    status, headers, body = _request(server, "GET", "/v1/files/model/weights.bin", headers={"Range": spec})
    assert status == 416
    assert headers["Content-Range"] == "bytes */300000"
    assert json.loads(body)["error"]


def test_a_range_of_an_empty_file_is_416(served) -> None:
    server, _, _ = served
    assert _request(server, "GET", "/v1/files/empty", headers={"Range": "bytes=0-0"})[0] == 416


@pytest.mark.parametrize(
    "path",
    [
        "/v1/files/../secret.txt",
        "/v1/files/%2e%2e/secret.txt",
        "/v1/files/secret.txt",
        "/v1/files//etc/passwd",
        "/v1/files/model",
        "/v1/other",
    ],
)
def test_only_listed_names_are_served(served, path: str) -> None:
    server, _, _ = served
    status, _, body = _request(server, "GET", path)
    assert status == 404
    assert b"do not serve" not in body and b"root:" not in body


def test_a_file_changed_after_hashing_is_refused(served) -> None:
    server, _, tmp_path = served
    server.manifest(timeout=10)
    target = tmp_path / "src" / "data.jsonl"
    target.write_bytes(b'{"text": "changed!"}\n')
    status, _, body = _request(server, "GET", "/v1/files/data.jsonl", headers={"Range": "bytes=0-3"})
    assert status == 409 and "changed" in json.loads(body)["error"]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_upload_is_verified_and_written_atomically(served) -> None:
    server, _, tmp_path = served
    data = os.urandom(200_000)
    status, _, body = _request(
        server, "PUT", "/v1/upload/checkpoint-3/stage-1.safetensors", data, {"X-Content-SHA256": _sha(data)}
    )
    assert status == 201, body
    assert json.loads(body) == {
        "path": "checkpoint-3/stage-1.safetensors",
        "size": 200_000,
        "sha256": _sha(data),
    }
    assert (tmp_path / "out" / "checkpoint-3" / "stage-1.safetensors").read_bytes() == data
    # a corrupted upload leaves the previous file untouched and no temporary file behind
    status, _, body = _request(
        server,
        "PUT",
        "/v1/upload/checkpoint-3/stage-1.safetensors",
        b"x" * 10,
        {"X-Content-SHA256": _sha(b"y" * 10)},
    )
    assert status == 400 and "does not match" in json.loads(body)["error"]
    assert (tmp_path / "out" / "checkpoint-3" / "stage-1.safetensors").read_bytes() == data
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoint-3").iterdir()) == ["stage-1.safetensors"]


@pytest.mark.parametrize(
    "relative", ["../escape", "a/../../escape", "%2e%2e/escape", "/abs", "a//b", ".hidden", "a\\b", ""]
)
def test_upload_paths_escaping_the_root_are_refused(served, relative: str) -> None:
    server, _, tmp_path = served
    status, _, body = _request(
        server, "PUT", f"/v1/upload/{relative}", b"x", {"X-Content-SHA256": _sha(b"x")}
    )
    assert status in (400, 404), body
    assert not (tmp_path / "escape").exists()
    assert list((tmp_path / "out").iterdir()) == []


def test_upload_through_a_symlink_out_of_the_root_is_refused(served) -> None:
    server, _, tmp_path = served
    (tmp_path / "out" / "link").symlink_to(tmp_path)
    status, _, body = _request(
        server, "PUT", "/v1/upload/link/escape", b"x", {"X-Content-SHA256": _sha(b"x")}
    )
    assert status == 400 and "escapes" in json.loads(body)["error"]
    assert not (tmp_path / "escape").exists()


def test_oversize_and_unhashed_uploads_are_refused(served) -> None:
    server, _, tmp_path = served
    # The server refuses on the declared length alone, before any body byte; sending only the head
    # keeps the client from racing the server's close with a megabyte still in flight.
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(
            f"PUT /v1/upload/big.bin HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n"
            f"X-Content-SHA256: {'0' * 64}\r\nContent-Length: {(1 << 20) + 1}\r\n\r\n".encode()
        )
        response = http.client.HTTPResponse(raw)
        response.begin()
        status, body = response.status, response.read()
    assert status == 413 and "limit" in json.loads(body)["error"]
    status, _, body = _request(server, "PUT", "/v1/upload/nohash.bin", b"abc")
    assert status == 400 and "X-Content-SHA256" in json.loads(body)["error"]
    assert list((tmp_path / "out").iterdir()) == []


def test_a_request_without_the_secret_gets_401_and_nothing_else(served) -> None:
    server, _, tmp_path = served
    for method, path, body in (
        ("GET", "/v1/manifest", None),
        ("GET", "/v1/files/data.jsonl", None),
        ("HEAD", "/v1/files/data.jsonl", None),
        ("PUT", "/v1/upload/x", b"x"),
        ("GET", "/v1/no-such-route", None),
    ):
        status, headers, reply = _request(server, method, path, body, {"X-Content-SHA256": _sha(b"x")}, "")
        assert status == 401, (method, path)
        assert headers["WWW-Authenticate"].startswith("Bearer")
        if method != "HEAD":
            assert "Authorization: Bearer" in json.loads(reply)["error"]
    assert server.bytes_served == 0 and server.uploads == 0
    assert not (tmp_path / "out" / "x").exists()


def test_head_gives_size_and_hash_without_the_body(served) -> None:
    server, contents, _ = served
    data = contents["model/weights.bin"]
    status, headers, body = _request(server, "HEAD", "/v1/files/model/weights.bin")
    assert (status, body) == (200, b"")
    assert int(headers["Content-Length"]) == len(data)
    assert headers["X-Content-SHA256"] == _sha(data)
    status, headers, body = _request(
        server, "HEAD", "/v1/files/model/weights.bin", headers={"Range": "bytes=10-19"}
    )
    assert (status, body) == (206, b"")
    assert (
        headers["X-Content-SHA256"] == _sha(data[10:20]) and headers["Content-Range"] == "bytes 10-19/300000"
    )
    assert server.bytes_served == 0


def test_a_large_range_is_streamed_not_held_in_memory(tmp_path: Path) -> None:
    block = os.urandom(1 << 20)
    path = tmp_path / "big.bin"
    with open(path, "wb") as handle:
        for _ in range(48):
            handle.write(block)
    start, stop = 3, 46 * len(block) + 5
    with FileServer("127.0.0.1", files={"big": path}, upload_root=tmp_path / "out", secret=SECRET) as server:
        host, port = server.url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        tracemalloc.start()
        try:
            headers = {"Authorization": f"Bearer {SECRET}", "Range": f"bytes={start}-{stop - 1}"}
            connection.request("GET", "/v1/files/big", headers=headers)
            response = connection.getresponse()
            sha256, received = read_hashed(response)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            connection.close()
    assert response.status == 206 and received == stop - start
    assert sha256 == response.headers["X-Content-SHA256"]
    assert peak < 16 * 2**20, f"peak {peak / 2**20:.0f} MiB while serving a {received / 2**20:.0f} MiB range"


def test_malformed_requests_get_an_answer_and_the_server_keeps_serving(served) -> None:
    import socket

    server, contents, _ = served
    host, port = server.url.removeprefix("http://").split(":")
    for garbage in (
        b"GARBAGE\r\n\r\n",
        b"GET /v1/manifest HTTP/1.1\r\nContent-Length: x\r\n" + b"X: " + b"a" * 70000 + b"\r\n\r\n",
        b"\x00\xff\r\n\r\n",
    ):
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(garbage)
            assert raw.recv(100).startswith(b"HTTP/1.")
    assert _request(server, "GET", "/v1/files/data.jsonl")[2] == contents["data.jsonl"]


def test_construction_refuses_bad_names_and_missing_files(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(ShardpoolError, match="safe relative path"):
        FileServer("127.0.0.1", files={"../f": tmp_path / "f"}, upload_root=tmp_path / "o", secret=SECRET)
    with pytest.raises(ShardpoolError, match="cannot serve"):
        FileServer("127.0.0.1", files={"g": tmp_path / "missing"}, upload_root=tmp_path / "o", secret=SECRET)
    for bad in ("", "short", SECRET.upper(), SECRET + "0"):
        with pytest.raises(ShardpoolError, match="64 lowercase hex"):
            FileServer("127.0.0.1", files={}, upload_root=tmp_path / "o", secret=bad)
    with pytest.raises(ShardpoolError, match="refusing to listen on 0.0.0.0"):
        FileServer("0.0.0.0", files={}, upload_root=tmp_path / "o", secret=SECRET).start()


def test_parse_range_edges() -> None:
    assert parse_range("bytes=0-", 5) == (0, 5)
    assert parse_range("bytes=4-4", 5) == (4, 5)
    assert parse_range("bytes=-10", 5) == (0, 5)
    for bad in ("bytes=5-", "bytes=", "bytes=1-2-3", "bytes= -", "bytes=-1x"):
        with pytest.raises(ValueError):
            parse_range(bad, 5)
