"""mesh.http.server: the one HTTP server foundation, tested over real sockets (TCP, IPv6, Unix)."""

from __future__ import annotations

import grp
import hashlib
import json
import logging
import os
import socket
import stat
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from mesh.errors import MeshError
from mesh.http.server import (
    HTTPError,
    HTTPServer,
    Limits,
    Reply,
    Request,
    Route,
    file_reply,
    json_reply,
    stream_reply,
    text_reply,
)
from tests.helpers.http_client import (
    UnixHTTPConnection,
    call,
    closed_by_peer,
    connect,
    error_of,
    fetch,
    open_socket,
    read_hashed,
    read_response,
)


def whoami(request: Request) -> Reply:
    peer = request.peer
    return json_reply(
        {"ip": peer.ip, "uid": peer.uid, "gid": peer.gid, "pid": peer.pid, "params": request.params}
    )


def echo_length(request: Request) -> Reply:
    assert request.body is not None
    return json_reply({"length": len(request.body), "sha256": hashlib.sha256(request.body).hexdigest()})


ROUTES = [
    Route("GET", "/v1/who", whoami),
    Route("GET", "/v1/items/{name}/parts/{rest:path}", whoami),
    Route("POST", "/v1/echo", echo_length, max_body=1000),
]


@pytest.fixture
def server() -> Iterator[HTTPServer]:
    with HTTPServer(ROUTES, host="127.0.0.1") as running:
        yield running


# ---------------------------------------------------------------------------- listening


def test_tcp_port_zero_reports_the_chosen_port_and_the_peer_ip(server: HTTPServer) -> None:
    port = int(server.url.rsplit(":", 1)[1])
    assert server.url == f"http://127.0.0.1:{port}" and port > 0
    status, _, body = fetch(server.url, path="/v1/items/a%2Fb/parts/x/y%20z")
    assert status == 200
    assert json.loads(body) == {
        "ip": "127.0.0.1",
        "uid": None,
        "gid": None,
        "pid": None,
        "params": {"name": "a/b", "rest": "x/y z"},
    }


def test_ipv6_loopback() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this kernel")
    try:
        probe = socket.socket(socket.AF_INET6)
        probe.bind(("::1", 0))
        probe.close()
    except OSError:
        pytest.skip("::1 is not configured")
    with HTTPServer(ROUTES, host="::1") as server:
        assert server.url.startswith("http://[::1]:")
        status, _, body = fetch(server.url, path="/v1/who")
    assert status == 200 and json.loads(body)["ip"] == "::1"


def test_wildcard_and_names_are_refused_unless_the_wildcard_is_allowed() -> None:
    for host in ("0.0.0.0", "::"):
        with pytest.raises(MeshError, match="refusing to listen"):
            HTTPServer(ROUTES, host=host).start()
    with pytest.raises(MeshError, match="not an IP address"):
        HTTPServer(ROUTES, host="localhost").start()
    with HTTPServer(ROUTES, host="0.0.0.0", allow_wildcard=True) as server:
        port = server.url.rsplit(":", 1)[1]
        assert fetch(f"http://127.0.0.1:{port}", path="/v1/who")[0] == 200


def test_port_in_use_is_a_one_line_error(server: HTTPServer) -> None:
    port = int(server.url.rsplit(":", 1)[1])
    with pytest.raises(MeshError, match=f"cannot listen on 127.0.0.1 port {port}"):
        HTTPServer(ROUTES, host="127.0.0.1", port=port).start()


def test_unix_socket_mode_group_and_peer_credentials(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    group = grp.getgrgid(os.getgid()).gr_name
    with HTTPServer(ROUTES, unix_path=path, unix_group=group) as server:
        info = path.stat()
        assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o660
        assert info.st_gid == os.getgid()
        connection = UnixHTTPConnection(str(path))
        status, _, body = call(connection, "GET", "/v1/who")
        connection.close()
        assert server.url == ""
    assert status == 200
    assert json.loads(body) == {
        "ip": None,
        "uid": os.getuid(),
        "gid": os.getgid(),
        "pid": os.getpid(),
        "params": {},
    }
    assert not path.exists(), "stop() removes its socket file"


def test_unix_socket_custom_mode_and_tcp_together(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    with HTTPServer(ROUTES, host="127.0.0.1", unix_path=path, unix_mode=0o600) as server:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert fetch(server.url, path="/v1/who")[0] == 200
        assert call(UnixHTTPConnection(str(path)), "GET", "/v1/who")[0] == 200


def test_unix_socket_refuses_unknown_group_live_socket_and_other_files(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    with pytest.raises(MeshError, match="group 'no-such-group-xyz' does not exist"):
        HTTPServer(ROUTES, unix_path=path, unix_group="no-such-group-xyz").start()
    with HTTPServer(ROUTES, unix_path=path):
        with pytest.raises(MeshError, match="another server already listens"):
            HTTPServer(ROUTES, unix_path=path).start()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))  # a socket file nobody listens on, as a killed server leaves it
    stale.close()
    with HTTPServer(ROUTES, unix_path=path):
        assert call(UnixHTTPConnection(str(path)), "GET", "/v1/who")[0] == 200
    regular = tmp_path / "file"
    regular.write_text("keep me")
    with pytest.raises(MeshError, match="is not a socket"):
        HTTPServer(ROUTES, unix_path=regular).start()
    assert regular.read_text() == "keep me"


# ---------------------------------------------------------------------------- deadlines


def _trickle_until_closed(sock: socket.socket, data: bytes, every_s: float, give_up_s: float) -> float:
    """Send ``data`` one byte every ``every_s``; return seconds until the server closed the connection."""
    start = time.monotonic()
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - start
        if closed_by_peer(sock, every_s):
            return time.monotonic() - start
        if time.monotonic() - start > give_up_s:
            break
    raise AssertionError(f"the server kept a trickling connection open for {time.monotonic() - start:.1f} s")


SLOW_HEAD = b"GET /v1/who HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 200 + b"\r\n\r\n"


def test_a_head_trickled_one_byte_a_second_is_cut_at_the_head_deadline() -> None:
    limits = Limits(head_timeout_s=2.0, keepalive_timeout_s=30.0)
    with HTTPServer(ROUTES, host="127.0.0.1", limits=limits) as server:
        sock = open_socket(server.url)
        elapsed = _trickle_until_closed(sock, SLOW_HEAD, every_s=1.0, give_up_s=8.0)
        sock.close()
    assert 1.8 <= elapsed <= 3.0, elapsed


def test_the_head_deadline_restarts_after_each_response_on_a_kept_alive_connection() -> None:
    limits = Limits(head_timeout_s=1.5, keepalive_timeout_s=30.0)
    with HTTPServer(ROUTES, host="127.0.0.1", limits=limits) as server:
        sock = open_socket(server.url)
        time.sleep(1.0)  # most of the first head's allowance goes by before the request
        sock.sendall(b"GET /v1/who HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, _ = read_response(sock)
        assert status == 200 and headers.get("connection", "keep-alive") != "close"
        time.sleep(1.0)  # 2 s after connecting, 1 s after the response: still allowed
        sock.sendall(b"GET /v1/who HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock)[0] == 200
        elapsed = _trickle_until_closed(sock, SLOW_HEAD, every_s=0.25, give_up_s=6.0)
        sock.close()
    assert 1.3 <= elapsed <= 2.6, elapsed


def test_a_silent_connection_is_closed_after_the_keepalive_timeout() -> None:
    limits = Limits(head_timeout_s=30.0, keepalive_timeout_s=1.0)
    with HTTPServer(ROUTES, host="127.0.0.1", limits=limits) as server:
        start = time.monotonic()
        sock = open_socket(server.url)
        assert closed_by_peer(sock, 5.0)
        assert 0.8 <= time.monotonic() - start <= 2.5
        sock.close()
        sock = open_socket(server.url)
        sock.sendall(b"GET /v1/who HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock)[0] == 200
        start = time.monotonic()
        assert closed_by_peer(sock, 5.0)
        assert 0.8 <= time.monotonic() - start <= 2.5
        sock.close()


def test_a_stalled_body_gets_408_at_the_body_deadline() -> None:
    limits = Limits(body_timeout_s=1.0, min_rate_bps=1e9)
    with HTTPServer(ROUTES, host="127.0.0.1", limits=limits) as server:
        sock = open_socket(server.url)
        start = time.monotonic()
        sock.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
        status, headers, body = read_response(sock)
        elapsed = time.monotonic() - start
        assert status == 408 and "did not arrive in time" in error_of(body)
        assert headers["connection"] == "close" and closed_by_peer(sock, 2.0)
        sock.close()
    assert 0.8 <= elapsed <= 2.5, elapsed


def test_a_client_that_half_closes_gets_its_answer_and_a_body_cut_by_eof_fails_at_once() -> None:
    limits = Limits(body_timeout_s=20.0, keepalive_timeout_s=20.0, head_timeout_s=20.0)
    with HTTPServer(ROUTES, host="127.0.0.1", limits=limits) as server:
        sock = open_socket(server.url)  # HTTP/1.1 keep-alive, then no more input: answer, then close
        sock.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        sock.shutdown(socket.SHUT_WR)
        status, _, body = read_response(sock)
        assert status == 200 and json.loads(body)["length"] == 3
        assert closed_by_peer(sock, 2.0)
        sock.close()

        sock = open_socket(server.url)
        start = time.monotonic()
        sock.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
        sock.shutdown(socket.SHUT_WR)
        status, _, body = read_response(sock)
        assert status == 400 and "ended early" in error_of(body)
        assert time.monotonic() - start < 5.0, "the body's EOF must not wait for the 20 s body deadline"
        sock.close()

        sock = open_socket(server.url)  # half a head, then EOF: nothing to answer, closed at once
        sock.sendall(b"GET /v1/who HTTP/1.1\r\nHost: ")
        sock.shutdown(socket.SHUT_WR)
        assert closed_by_peer(sock, 2.0)
        sock.close()
        assert fetch(server.url, path="/v1/who")[0] == 200


def test_the_body_deadline_grows_with_the_declared_size() -> None:
    limits = Limits(body_timeout_s=0.5, min_rate_bps=500)  # 1000 bytes: 0.5 s + 2 s
    with HTTPServer(ROUTES, host="127.0.0.1", limits=limits) as server:
        sock = open_socket(server.url)
        sock.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        for _ in range(4):  # 1.6 s: past body_timeout_s, within the allowance for 1000 bytes
            time.sleep(0.4)
            sock.sendall(b"y" * 250)
        status, _, body = read_response(sock)
        sock.close()
    assert status == 200 and json.loads(body)["length"] == 1000


# ---------------------------------------------------------------------------- caps


def test_a_body_over_the_route_cap_is_refused_before_it_is_sent(server: HTTPServer) -> None:
    sock = open_socket(server.url, timeout=5.0)
    sock.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1001\r\n\r\n")
    status, headers, body = read_response(sock)  # no body byte was sent: the server must not wait
    assert status == 413 and "1001 bytes exceeds this endpoint's limit of 1000" in error_of(body)
    assert headers["connection"] == "close"
    sock.close()
    status, _, body = fetch(server.url, "POST", "/v1/echo", body=b"z" * 1000)
    assert status == 200 and json.loads(body)["length"] == 1000


def test_expect_100_continue_is_answered_only_within_the_cap(server: HTTPServer) -> None:
    sock = open_socket(server.url, timeout=5.0)
    sock.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
    assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
    sock.sendall(b"hello")
    status, _, body = read_response(sock)
    assert status == 200 and json.loads(body)["length"] == 5
    sock.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n")
    assert read_response(sock)[0] == 413
    sock.close()


def test_chunked_bodies_are_refused(server: HTTPServer) -> None:
    sock = open_socket(server.url, timeout=5.0)
    sock.sendall(
        b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    )
    status, _, body = read_response(sock)
    sock.close()
    assert status == 411 and "Content-Length" in error_of(body)


def test_oversized_headers_get_a_one_line_json_error() -> None:
    with HTTPServer(ROUTES, host="127.0.0.1", limits=Limits(max_field_size=1024)) as server:
        status, _, body = fetch(server.url, path="/v1/who", headers={"X-Big": "b" * 2000})
        assert status in (400, 431) and error_of(body).startswith("malformed request")
        assert fetch(server.url, path="/v1/who", headers={"X-Small": "b" * 500})[0] == 200


def test_connections_over_the_per_source_and_total_caps_are_closed_at_once() -> None:
    limits = Limits(
        max_connections=5, max_connections_per_source=3, keepalive_timeout_s=30, head_timeout_s=30
    )
    with HTTPServer(ROUTES, host="127.0.0.1", limits=limits) as server:
        held = [open_socket(server.url, "127.0.0.1") for _ in range(3)]
        _wait_for(lambda: server.open_connections == 3)
        extra = open_socket(server.url, "127.0.0.1")
        assert closed_by_peer(extra, 1.0), "a 4th connection from one source must be closed at once"
        held += [open_socket(server.url, "127.0.0.2") for _ in range(2)]
        _wait_for(lambda: server.open_connections == 5)
        over_total = open_socket(server.url, "127.0.0.3")
        assert closed_by_peer(over_total, 1.0), "a 6th connection in total must be closed at once"
        assert server.open_connections == 5
        held.pop(0).close()
        _wait_for(lambda: server.open_connections == 4)
        sock = open_socket(server.url, "127.0.0.1")
        sock.sendall(b"GET /v1/who HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock)[0] == 200
        for item in [*held, extra, over_total, sock]:
            item.close()


def _wait_for(condition, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.02)


def test_the_handler_pool_runs_at_most_its_size_at_once() -> None:
    lock, active, peak = threading.Lock(), [0], [0]

    def slow(request: Request) -> Reply:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.4)
        with lock:
            active[0] -= 1
        return json_reply({"ok": True})

    statuses: list[int] = []
    with HTTPServer(
        [Route("GET", "/slow", slow)], host="127.0.0.1", limits=Limits(handler_threads=3)
    ) as server:
        clients = [
            threading.Thread(target=lambda: statuses.append(fetch(server.url, path="/slow")[0]))
            for _ in range(8)
        ]
        for client in clients:
            client.start()
        for client in clients:
            client.join()
    assert statuses == [200] * 8
    assert peak[0] == 3


# ---------------------------------------------------------------------------- hooks and errors


def _key_check(request: Request) -> str:
    if request.headers.get("X-Key") != "good":
        raise HTTPError(401, "unknown key; sign the request\nsecond line never sent")
    return "alice"


def _signature(status: int, body: bytes | None) -> str:
    return f"{status}:{hashlib.sha256(body or b'').hexdigest()}"


def test_authenticate_runs_before_routing_and_sign_reply_covers_status_and_body() -> None:
    seen: list[str] = []

    def hello(request: Request) -> Reply:
        seen.append(request.principal)
        return json_reply({"hello": request.principal})

    def conflict(request: Request) -> Reply:
        raise HTTPError(409, "busy")

    def broken(request: Request) -> Reply:
        raise RuntimeError("bug")

    routes = [
        Route("GET", "/hello", hello),
        Route("GET", "/conflict", conflict),
        Route("GET", "/broken", broken),
    ]
    server = HTTPServer(
        routes,
        host="127.0.0.1",
        authenticate=_key_check,
        sign_reply=lambda request, principal, status, body: {
            "X-Sig": f"{principal}|{_signature(status, body)}"
        },
    )
    with server:
        for path in ("/hello", "/no-such-path"):
            status, headers, body = fetch(server.url, path=path, headers={"X-Key": "bad"})
            assert status == 401 and error_of(body) == "unknown key; sign the request"
            assert "X-Sig" not in headers
        assert seen == []
        good = {"X-Key": "good"}
        for path, expected in (("/hello", 200), ("/conflict", 409), ("/broken", 500), ("/no-such-path", 404)):
            status, headers, body = fetch(server.url, path=path, headers=good)
            assert status == expected
            assert headers["X-Sig"] == f"alice|{_signature(status, body)}"
        assert seen == ["alice"]


def test_a_handler_exception_is_a_one_line_500_and_the_connection_survives(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(request: Request) -> Reply:
        raise ValueError("secret internals")

    def not_a_reply(request: Request) -> Reply:
        return {"oops": 1}  # type: ignore[return-value]

    routes = [Route("GET", "/broken", broken), Route("GET", "/dict", not_a_reply), *ROUTES]
    with HTTPServer(routes, host="127.0.0.1") as server, caplog.at_level(logging.ERROR):
        connection = connect(server.url)
        status, _, body = call(connection, "GET", "/broken")
        assert status == 500 and error_of(body) == "internal error (ValueError); see the server log"
        assert call(connection, "GET", "/dict")[0] == 500
        assert call(connection, "GET", "/v1/who")[0] == 200  # same keep-alive connection
        connection.close()
    assert "secret internals" in caplog.text and "Traceback" in caplog.text


def test_client_errors_become_400_and_unknown_paths_404_and_wrong_methods_405() -> None:
    class DomainError(Exception):
        pass

    def refuse(request: Request) -> Reply:
        raise DomainError("job id 'x y' is invalid; use letters\nmore")

    routes = [Route("POST", "/jobs", refuse), *ROUTES]
    with HTTPServer(routes, host="127.0.0.1", client_errors=(DomainError,)) as server:
        status, _, body = fetch(server.url, "POST", "/jobs", body=b"{}")
        assert status == 400 and error_of(body) == "job id 'x y' is invalid; use letters"
        status, _, body = fetch(server.url, path="/nothing/here")
        assert status == 404 and error_of(body) == "no endpoint /nothing/here"
        status, headers, body = fetch(server.url, "DELETE", "/jobs")
        assert status == 405 and headers["Allow"] == "POST"


# ---------------------------------------------------------------------------- bodies and replies


class _CountingChunks:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks, self.pulled, self.closed = list(chunks), 0, False

    def __iter__(self) -> _CountingChunks:
        return self

    def __next__(self) -> bytes:
        if not self.chunks:
            raise StopIteration
        self.pulled += 1
        return self.chunks.pop(0)

    def close(self) -> None:
        self.closed = True


def test_head_answers_the_get_route_without_a_body() -> None:
    streams: list[_CountingChunks] = []

    def stream(request: Request) -> Reply:
        streams.append(_CountingChunks([b"abc", b"defg"]))
        return stream_reply(streams[-1], 7)

    routes = [
        Route("GET", "/text", lambda request: text_reply("hello there")),
        Route("GET", "/stream", stream),
    ]
    with HTTPServer(routes, host="127.0.0.1") as server:
        connection = connect(server.url)
        status, headers, body = call(connection, "HEAD", "/text")
        assert (status, headers["Content-Length"], body) == (200, "11", b"")
        status, headers, body = call(connection, "HEAD", "/stream")
        assert (status, headers["Content-Length"], body) == (200, "7", b"")
        assert call(connection, "GET", "/stream")[2] == b"abcdefg"
        connection.close()
        _wait_for(lambda: all(s.closed for s in streams))
    assert [s.pulled for s in streams] == [0, 2]


def test_a_stream_shorter_than_promised_drops_the_connection() -> None:
    route = Route("GET", "/short", lambda request: stream_reply(iter([b"12345"]), 10))
    with HTTPServer([route], host="127.0.0.1") as server:
        sock = open_socket(server.url, timeout=5.0)
        sock.sendall(b"GET /short HTTP/1.1\r\nHost: x\r\n\r\n")
        with pytest.raises(ConnectionError, match="inside the response body"):
            read_response(sock)
        sock.close()


def test_a_large_file_range_is_streamed_not_read_whole(tmp_path: Path) -> None:
    block = os.urandom(1 << 20 | 13)
    path = tmp_path / "weights.bin"
    with open(path, "wb") as handle:
        for _ in range(96):
            handle.write(block)
    start, stop = 5_000_001, 95 * len(block) + 17
    expected = hashlib.sha256(path.read_bytes()[start:stop]).hexdigest()

    def ranged(request: Request) -> Reply:
        return file_reply(path, start, stop, status=206)

    with HTTPServer([Route("GET", "/file", ranged)], host="127.0.0.1") as server:
        connection = connect(server.url)
        tracemalloc.start()
        try:
            connection.request("GET", "/file")
            response = connection.getresponse()
            sha256, received = read_hashed(response)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        connection.close()
    assert response.status == 206 and int(response.headers["Content-Length"]) == stop - start
    assert received == stop - start and sha256 == expected
    assert peak < 24 * 2**20, f"peak {peak / 2**20:.0f} MiB while sending a {received / 2**20:.0f} MiB range"


def test_a_streamed_upload_goes_to_a_file_and_an_early_refusal_closes_the_connection(tmp_path: Path) -> None:
    def upload(request: Request) -> Reply:
        if "X-Content-SHA256" not in request.headers:
            raise HTTPError(400, "the upload needs an X-Content-SHA256 header")
        digest, target = hashlib.sha256(), tmp_path / request.params["name"]
        with open(target, "wb") as out:
            while chunk := request.read():
                digest.update(chunk)
                out.write(chunk)
        matches = digest.hexdigest() == request.headers["X-Content-SHA256"]
        return json_reply({"size": target.stat().st_size, "ok": matches}, 201)

    data = os.urandom(5 * 2**20 + 1)
    route = Route("PUT", "/upload/{name}", upload, max_body=8 * 2**20, stream_body=True)
    with HTTPServer([route], host="127.0.0.1") as server:
        status, _, body = fetch(
            server.url,
            "PUT",
            "/upload/blob",
            body=data,
            headers={"X-Content-SHA256": hashlib.sha256(data).hexdigest()},
        )
        assert status == 201 and json.loads(body) == {"size": len(data), "ok": True}
        assert (tmp_path / "blob").read_bytes() == data
        sock = open_socket(server.url, timeout=5.0)
        sock.sendall(b"PUT /upload/other HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
        status, headers, body = read_response(sock)
        assert status == 400 and headers["connection"] == "close" and closed_by_peer(sock, 2.0)
        sock.close()
        sock = open_socket(server.url, timeout=5.0)
        sock.sendall(b"PUT /upload/big HTTP/1.1\r\nHost: x\r\nContent-Length: 8388609\r\n\r\n")
        assert read_response(sock)[0] == 413
        sock.close()
    assert not (tmp_path / "big").exists() and not (tmp_path / "other").exists()


def test_start_and_stop_are_idempotent_and_leave_no_threads() -> None:
    before = set(threading.enumerate())
    server = HTTPServer(ROUTES, host="127.0.0.1", limits=Limits(handler_threads=4))
    server.start()
    first_url = server.url
    assert server.start() is server and server.url == first_url
    clients = [
        threading.Thread(target=fetch, args=(server.url,), kwargs={"path": "/v1/who"}) for _ in range(6)
    ]
    for client in clients:
        client.start()
    for client in clients:
        client.join()
    assert len(set(threading.enumerate()) - before) >= 2  # the loop thread and some handler threads
    server.stop()
    server.stop()
    assert set(threading.enumerate()) == before
    server.start()  # a stopped server starts again
    assert fetch(server.url, path="/v1/who")[0] == 200
    server.stop()
    assert set(threading.enumerate()) == before


def test_the_http_foundation_imports_neither_torch_nor_shardpool() -> None:
    code = "import sys, mesh.http.server; print([m for m in sys.modules if m.split('.')[0] in ('torch', 'shardpool')])"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[4])),
        check=True,
    )
    assert result.stdout.strip() == "[]"
