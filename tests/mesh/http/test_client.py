"""mesh.http.client: the one HTTP client and its retry policy, tested over real sockets (TCP and Unix)."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, ClassVar

import pytest

from mesh.http.client import (
    NO_RETRY,
    RETRY_DROPPED,
    HTTPClient,
    ReplyTooLarge,
    RetryPolicy,
    StreamedReply,
    Unreachable,
    error_line,
)
from tests.helpers.http_client import serving
from tests.helpers.local_agent import shared_socket_dir


class _Recorder(BaseHTTPRequestHandler):
    """Answers every request with ``body``, after dropping the first ``drops`` connections unanswered.

    Records each request's path, headers and body, so a test sees what went over the wire.
    """

    protocol_version = "HTTP/1.1"
    body = b"hello"
    drops = 0
    delay_s = 0.0
    seen: ClassVar[list[dict[str, Any]]] = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        sent = self.rfile.read(length) if length else b""
        _Recorder.seen.append({"path": self.path, "headers": dict(self.headers), "body": sent})
        if _Recorder.drops > 0:
            _Recorder.drops -= 1
            self.close_connection = True
            return  # no reply at all: the client sees the connection close
        time.sleep(self.delay_s)
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    do_GET = do_PUT = do_POST = _answer  # noqa: N815 - stdlib naming

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    _Recorder.body, _Recorder.drops, _Recorder.delay_s, _Recorder.seen = b"hello", 0, 0.0, []
    with serving(_Recorder) as url:
        yield url


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _failure(*, dropped: bool = False, timed_out: bool = False) -> Unreachable:
    return Unreachable("x", reason="x", timed_out=timed_out, dropped=dropped, os_error=None, attempts=1)


# ---------------------------------------------------------------------------------------- the policy


def test_only_a_dropped_connection_is_retried_and_only_up_to_the_attempts() -> None:
    policy = RetryPolicy(attempts=3)
    assert policy.retries(_failure(dropped=True), 1) and policy.retries(_failure(dropped=True), 2)
    assert not policy.retries(_failure(dropped=True), 3), "three attempts in all, then give up"
    assert not policy.retries(_failure(timed_out=True), 1), "a slow peer is not asked twice"
    assert not policy.retries(_failure(), 1), "an unreachable address is not asked twice"
    assert not NO_RETRY.retries(_failure(dropped=True), 1)
    assert RETRY_DROPPED.attempts == 2 and RETRY_DROPPED.backoff_s == 0.0


def test_the_backoff_doubles_after_each_retry() -> None:
    policy = RetryPolicy(attempts=4, backoff_s=0.25)
    assert [policy.delay_s(attempt) for attempt in (1, 2, 3)] == [0.25, 0.5, 1.0]
    assert RETRY_DROPPED.delay_s(1) == 0.0, "a dropped kept-alive connection is retried at once"


def test_a_policy_of_no_attempts_or_negative_backoff_is_refused() -> None:
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="backoff"):
        RetryPolicy(backoff_s=-1.0)


def test_an_error_reply_is_one_line_from_its_json_error_field_or_its_text() -> None:
    assert error_line(b'{"error": "no job \'x\' was submitted"}') == "no job 'x' was submitted"
    assert error_line({"error": "refused", "removed": True}) == "refused", "decoded JSON too"
    assert error_line(b"Bad\r\n  gateway\n") == "Bad gateway"
    assert error_line(b"x" * 600) == "x" * 500
    assert error_line(b"\xff not json") == "\ufffd not json"
    assert error_line(b"") == ""


# ---------------------------------------------------------------------------------------- the client


def test_the_path_goes_out_exactly_as_given_with_the_clients_headers_and_no_proxy(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://192.0.2.1:3128")  # a proxy would take the request elsewhere
    monkeypatch.setenv("ALL_PROXY", "http://192.0.2.1:3128")
    path = "/v1/files/model/a%20b.bin?after=0&wait=1.0"
    with HTTPClient(server, headers={"Authorization": "Bearer s"}) as client:
        reply = client.request("POST", path, body=b"payload", headers={"X-Extra": "1"})
    assert (reply.status, reply.body) == (200, b"hello")
    assert reply.headers["content-length"] == "5", "reply headers are read case-insensitively"
    [seen] = _Recorder.seen
    assert seen["path"] == path, "a signed request's MAC covers the path: it must not be re-encoded"
    assert seen["body"] == b"payload"
    assert seen["headers"]["Authorization"] == "Bearer s" and seen["headers"]["X-Extra"] == "1"
    assert "Accept-Encoding" not in seen["headers"], "replies are never compressed: hashes cover raw bytes"


def test_a_dropped_connection_is_retried_by_the_policy_with_the_same_headers(server: str) -> None:
    _Recorder.drops = 1
    with HTTPClient(server, retry=RETRY_DROPPED, headers={"Authorization": "Bearer s"}) as client:
        assert client.request("GET", "/a").body == b"hello"
    assert [seen["headers"]["Authorization"] for seen in _Recorder.seen] == ["Bearer s"] * 2


def test_a_dropped_connection_without_retry_is_one_line_naming_the_request(server: str) -> None:
    _Recorder.drops = 1
    with pytest.raises(Unreachable) as caught, HTTPClient(server) as client:
        client.request("GET", "/v1/manifest?x=1")
    failure = caught.value
    assert failure.dropped and not failure.timed_out and failure.attempts == 1
    assert str(failure).startswith(f"GET /v1/manifest on {server} failed: ")
    assert "\n" not in str(failure) and len(_Recorder.seen) == 1


def test_a_connection_dropped_every_time_fails_after_the_policys_attempts(server: str) -> None:
    _Recorder.drops = 5
    with pytest.raises(Unreachable) as caught, HTTPClient(server, retry=RETRY_DROPPED) as client:
        client.request("GET", "/a")
    assert caught.value.attempts == 2 and len(_Recorder.seen) == 2
    assert str(caught.value).startswith(f"GET /a on {server} failed twice: ")


def test_the_backoff_is_waited_between_attempts(server: str) -> None:
    _Recorder.drops = 2
    started = time.monotonic()
    with HTTPClient(server, retry=RetryPolicy(attempts=3, backoff_s=0.1)) as client:
        assert client.request("GET", "/a").body == b"hello"
    assert time.monotonic() - started >= 0.1 + 0.2
    assert len(_Recorder.seen) == 3


def test_a_refused_connection_counts_as_dropped_and_keeps_its_socket_error() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(Unreachable) as caught, HTTPClient(url, retry=RETRY_DROPPED) as client:
        client.request("GET", "/a")
    assert isinstance(caught.value.os_error, ConnectionRefusedError)
    assert caught.value.dropped and caught.value.attempts == 2


def test_a_slow_peer_times_out_once_with_the_deadline_in_the_message(server: str) -> None:
    _Recorder.delay_s = 3.0
    with pytest.raises(Unreachable) as caught, HTTPClient(server, retry=RETRY_DROPPED) as client:
        client.request("GET", "/slow", timeout=0.5)
    assert caught.value.timed_out and not caught.value.dropped
    assert str(caught.value) == f"GET /slow on {server} timed out after 0.5 s"
    assert len(_Recorder.seen) == 1, "a timeout is not retried"


def test_a_reply_over_the_cap_is_refused_and_one_at_the_cap_is_read(server: str) -> None:
    _Recorder.body = b"x" * 1000
    with HTTPClient(server, max_reply_bytes=1000) as client:
        assert len(client.request("GET", "/a").body) == 1000
    with pytest.raises(ReplyTooLarge) as caught, HTTPClient(server, max_reply_bytes=999) as client:
        client.request("GET", "/a")
    assert str(caught.value) == f"the reply to GET /a from {server} is larger than 999 bytes"


def test_a_streamed_body_arrives_in_chunks_and_a_consumers_error_is_not_retried(server: str) -> None:
    _Recorder.body = bytes(range(256)) * 10

    def chunks(reply: StreamedReply) -> list[int]:
        assert reply.status == 200
        return [len(chunk) for chunk in reply.chunks(1000)]

    with HTTPClient(server, retry=RETRY_DROPPED) as client:
        assert client.stream("GET", "/a", chunks) == [1000, 1000, 560]

        def refuse(reply: StreamedReply) -> None:
            raise LookupError("the bytes do not match")

        with pytest.raises(LookupError):
            client.stream("GET", "/a", refuse)
    assert len(_Recorder.seen) == 2


def test_a_file_body_is_sent_from_disk_again_on_each_attempt(server: str, tmp_path: Path) -> None:
    source = tmp_path / "upload.bin"
    source.write_bytes(b"z" * 200_000)
    _Recorder.drops = 1
    with HTTPClient(server, retry=RETRY_DROPPED) as client:
        reply = client.request("PUT", "/up", body=source, headers={"Content-Length": "200000"})
    assert reply.status == 200
    assert [len(seen["body"]) for seen in _Recorder.seen] == [200_000, 200_000]


class _UnixRefuser(socketserver.StreamRequestHandler):
    """Answers 403 at once, without reading the request body, then closes (as the local agent does)."""

    def handle(self) -> None:
        self.rfile.readline()
        self.wfile.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 7\r\nConnection: close\r\n\r\nnot you")
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_WR)
        time.sleep(0.5)


@pytest.fixture
def unix_refuser() -> Iterator[str]:
    directory = shared_socket_dir()
    path = str(directory / "refuser.sock")
    server = socketserver.ThreadingUnixStreamServer(path, _UnixRefuser)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield path
    server.shutdown()
    server.server_close()
    thread.join()
    Path(path).unlink(missing_ok=True)
    directory.rmdir()


def test_over_a_unix_socket_a_reply_sent_before_the_body_was_read_is_the_answer(unix_refuser: str) -> None:
    with HTTPClient(unix_socket=unix_refuser) as client:
        reply = client.request("POST", "/v1/local/forward", body=b"x" * (8 << 20))
    assert (reply.status, reply.body) == (403, b"not you")


def test_a_unix_socket_nobody_listens_on_is_unreachable_with_the_socket_error(tmp_path: Path) -> None:
    path = str(tmp_path / "none.sock")
    with pytest.raises(Unreachable) as caught, HTTPClient(unix_socket=path, retry=RETRY_DROPPED) as client:
        client.request("GET", "/v1/local/members")
    assert isinstance(caught.value.os_error, FileNotFoundError)
    assert not caught.value.dropped and caught.value.attempts == 1
    assert str(caught.value).startswith(f"GET /v1/local/members on {path} failed: ")
