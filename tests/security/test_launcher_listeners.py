"""The launcher's listeners for remote stages: the file server answers only its own job's secret,
only for its manifest and upload root, and the rendezvous store listens on one address only.

Each test failed on the old code, where any mesh address passed the file server's allowlist and
torch's TCPStore master listened on every interface.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardpool.files.server import FileServer
from tests.helpers.http_client import connect

PAYLOAD = b"launcher-only model bytes " * 4000


def _server(tmp_path: Path, job: str, secret: str) -> FileServer:
    root = tmp_path / job
    (root / "src").mkdir(parents=True)
    (root / "src" / "model.bin").write_bytes(PAYLOAD + job.encode())
    (root / "private.txt").write_text("not in the manifest")
    files = {"model/model.bin": root / "src" / "model.bin"}
    return FileServer("127.0.0.1", files=files, upload_root=root / "out", secret=secret)


@pytest.fixture
def two_jobs(tmp_path: Path) -> Iterator[tuple[dict[str, FileServer], dict[str, str], Path]]:
    secrets_by_job = {"a": secrets.token_hex(32), "b": secrets.token_hex(32)}
    servers = {job: _server(tmp_path, job, secret).start() for job, secret in secrets_by_job.items()}
    try:
        yield servers, secrets_by_job, tmp_path
    finally:
        for server in servers.values():
            server.stop()


def _call(server: FileServer, method: str, path: str, headers: dict[str, str], body: bytes | None = None):
    connection = connect(server.url, timeout=10)
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


REQUESTS = [
    ("GET", "/v1/manifest", None),
    ("GET", "/v1/files/model/model.bin", None),
    ("GET", "/v1/files/model%2Fmodel.bin", None),
    ("PUT", "/v1/upload/planted.bin", b"planted"),
]


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Bearer " + "0" * 64,
        "Basic " + "0" * 64,
        "Bearer {secret}x",
        "{secret}",
    ],
)
def test_no_or_wrong_secret_gets_401_and_no_bytes(two_jobs, authorization: str | None) -> None:
    servers, secrets_by_job, tmp_path = two_jobs
    server = servers["a"]
    for method, path, body in REQUESTS:
        headers = {"X-Content-SHA256": hashlib.sha256(body or b"").hexdigest(), "Range": "bytes=0-99"}
        if authorization is not None:
            headers["Authorization"] = authorization.format(secret=secrets_by_job["a"])
        status, reply = _call(server, method, path, headers, body)
        assert status == 401, (method, path, authorization)
        assert PAYLOAD[:100] not in reply and b"sha256" not in reply
        assert len(json.loads(reply)["error"].splitlines()) == 1
    assert server.bytes_served == 0 and server.uploads == 0
    assert not (tmp_path / "a" / "out" / "planted.bin").exists()


def test_job_a_secret_does_not_open_job_b_server(two_jobs) -> None:
    servers, secrets_by_job, tmp_path = two_jobs
    own = {"Authorization": f"Bearer {secrets_by_job['b']}"}
    status, body = _call(servers["b"], "GET", "/v1/files/model/model.bin", own)
    assert (status, body) == (200, PAYLOAD + b"b"), "job b's own secret reads its own file"
    servers["b"].bytes_served = 0
    other = {
        "Authorization": f"Bearer {secrets_by_job['a']}",
        "X-Content-SHA256": hashlib.sha256(b"x").hexdigest(),
    }
    for method, path, body in (*REQUESTS[:3], ("PUT", "/v1/upload/planted.bin", b"x")):
        status, reply = _call(servers["b"], method, path, other, body)
        assert status == 401 and PAYLOAD[:100] not in reply
    assert servers["b"].bytes_served == 0
    assert not (tmp_path / "b" / "out" / "planted.bin").exists()


@pytest.mark.parametrize(
    "path",
    [
        "/v1/files/private.txt",
        "/v1/files/../private.txt",
        "/v1/files/%2e%2e/%2e%2e/private.txt",
        "/v1/files/%2Fetc%2Fpasswd",
        "/v1/files//etc/passwd",
        "/v1/files/model",
        "/v1/files/model/",
        "/v1/files/model/model.bin/..",
    ],
)
def test_a_name_outside_the_manifest_is_404_even_with_the_secret(two_jobs, path: str) -> None:
    servers, secrets_by_job, _ = two_jobs
    status, reply = _call(servers["a"], "GET", path, {"Authorization": f"Bearer {secrets_by_job['a']}"})
    assert status == 404
    assert b"not in the manifest" not in reply and b"root:" not in reply


@pytest.mark.parametrize(
    "relative",
    ["../planted", "%2e%2e/planted", "sub/../../planted", "%2Ftmp%2Fplanted", "link/planted", ".hidden"],
)
def test_an_upload_escaping_the_upload_root_is_refused(two_jobs, relative: str) -> None:
    servers, secrets_by_job, tmp_path = two_jobs
    root = tmp_path / "a"
    (root / "out" / "link").symlink_to(root)
    headers = {
        "Authorization": f"Bearer {secrets_by_job['a']}",
        "X-Content-SHA256": hashlib.sha256(b"planted").hexdigest(),
    }
    status, reply = _call(servers["a"], "PUT", f"/v1/upload/{relative}", headers, b"planted")
    assert status in (400, 404), reply
    assert not (root / "planted").exists() and not (tmp_path / "planted").exists()
    assert [path.name for path in (root / "out").iterdir()] == ["link"]
    assert servers["a"].uploads == 0


def _listening_addresses(port: int) -> list[str]:
    """Local addresses with a socket listening on ``port`` (IPv4), from /proc/net/tcp."""
    found = []
    with open("/proc/net/tcp", encoding="ascii") as table:
        next(table)
        for line in table:
            fields = line.split()
            local, state = fields[1], fields[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                found.append(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def test_the_rendezvous_store_does_not_listen_on_every_interface() -> None:
    from shardpool.train.rendezvous import rendezvous_store

    store = rendezvous_store("127.0.0.1", timeout_s=10)
    try:
        assert _listening_addresses(store.port) == ["127.0.0.1"]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", store.port), timeout=5).close()
    finally:
        del store
