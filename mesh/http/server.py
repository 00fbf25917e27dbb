"""The project's one HTTP server: the agent, the launcher's file server and the coordinator use it.

What it owns: listening (one IP address, never a wildcard unless asked; and/or a Unix socket with a
mode and group), peer identity (IP, or uid/gid/pid from ``SO_PEERCRED``), every bound a server
needs (deadlines, body and header caps, connection caps, a bounded handler pool), routing, the
``authenticate``/``sign_reply`` hooks, one-line JSON errors, and replies that are JSON, bytes, or
streamed in chunks (a large file range never sits in memory whole). Handlers are plain sync
functions ``handler(Request) -> Reply``; they run in a thread pool of ``Limits.handler_threads``.

Why aiohttp: one well-kept library gives an HTTP/1.1 server, Unix sockets whose peer credentials we
can read, and asyncio, where an idle or trickling connection costs a few kilobytes and no thread,
so two thousand slowloris connections do not starve honest clients the way a thread per
connection does.

How the deadlines work (see :class:`Limits`): when a connection opens, and again when a response
has been sent on it, two timers start. The idle timer (``keepalive_timeout_s``) closes it if not a
single byte arrives; the head timer (``head_timeout_s``) closes it unless the whole request line
and headers have arrived, however they trickle in. The body must then arrive within
``body_timeout_s`` plus its declared length at ``min_rate_bps`` (408 otherwise), and a reply must
be taken by the client within the same allowance for its own length. Handler time is not bounded
here: a long poll is the handler's business.

A request goes: head parsed -> route looked up (only to know its body cap: 413 before any body
byte is read, 411 for chunked bodies) -> body read (or left to the handler on ``stream_body``
routes) -> ``authenticate(request)`` -> handler, or 404/405 -> ``sign_reply`` -> reply. Replies
before ``authenticate`` (413, 411, 408, 401/403 from the hook itself) are not signed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from aiohttp import web

from mesh.errors import MeshError
from mesh.http.messages import (
    CHUNK,
    FileChunks,
    HTTPError,
    Reply,
    Request,
    Route,
    Router,
    bytes_reply,
    close_chunks,
    error_reply,
    file_reply,
    json_object,
    json_reply,
    stream_reply,
    text_reply,
)
from mesh.http.transport import (
    BACKLOG,
    ConnectionGuard,
    GuardedServer,
    Limits,
    Peer,
    listen_tcp,
    listen_unix,
    raise_open_file_limit,
)

__all__ = [
    "FileChunks",
    "CHUNK",
    "HTTPError",
    "HTTPServer",
    "Limits",
    "Peer",
    "Reply",
    "Request",
    "Route",
    "bytes_reply",
    "error_reply",
    "file_reply",
    "json_object",
    "json_reply",
    "run_server_loop",
    "stream_reply",
    "text_reply",
]

log = logging.getLogger("shardpool.mesh.http")

_UNROUTED_MAX_BODY = 64 * 1024  # body read for authentication before a 404/405
Authenticate = Callable[[Request], Any]
SignReply = Callable[[Request, Any, int, "bytes | None"], Mapping[str, str]]


class HTTPServer:
    """An aiohttp server on its own event loop thread, serving ``routes`` with sync handlers.

    Listens on ``host:port`` (port 0 picks a free one; see :attr:`url`) and/or ``unix_path``.
    ``authenticate(request)`` returns the principal (kept as ``request.principal``) or raises
    :class:`HTTPError` (401/403). ``sign_reply(request, principal, status, body)`` returns headers
    added to every reply after authentication (404s and 500s included); ``body`` is None for
    streamed replies. Exceptions of the ``client_errors`` types become 400 with their first line;
    any other exception in a handler is logged with its traceback and answered 500.
    """

    def __init__(
        self,
        routes: Iterable[Route],
        *,
        host: str | None = None,
        port: int = 0,
        unix_path: str | os.PathLike[str] | None = None,
        unix_mode: int = 0o660,
        unix_group: str | None = None,
        allow_wildcard: bool = False,
        limits: Limits | None = None,
        authenticate: Authenticate | None = None,
        sign_reply: SignReply | None = None,
        client_errors: tuple[type[Exception], ...] = (),
        name: str = "http",
    ) -> None:
        if host is None and unix_path is None:
            raise MeshError("an HTTP server needs a host address or a unix_path to listen on")
        self._router = Router(routes)
        self._host, self._port, self._allow_wildcard = host, port, allow_wildcard
        self.unix_path = Path(unix_path) if unix_path is not None else None
        self._unix_mode, self._unix_group = unix_mode, unix_group
        self.limits = limits or Limits()
        self._authenticate, self._sign_reply, self._client_errors = authenticate, sign_reply, client_errors
        self.name = name
        self._lifecycle = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._guard: ConnectionGuard | None = None
        self._sockets: list[Any] = []
        self._unix_inode: tuple[int, int] | None = None
        self.url = ""

    @property
    def open_connections(self) -> int:
        """Connections open right now (for tests and status)."""
        return self._guard.total if self._guard is not None else 0

    def start(self) -> HTTPServer:
        """Listen and serve from a background thread; returns self. A second call does nothing."""
        with self._lifecycle:
            if self._thread is not None:
                return self
            raise_open_file_limit()
            self._listen()
            self._guard = ConnectionGuard(self.limits)
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.limits.handler_threads, thread_name_prefix=f"{self.name}-handler"
            )
            self._loop = asyncio.new_event_loop()
            started: concurrent.futures.Future[None] = concurrent.futures.Future()
            self._thread = threading.Thread(
                target=self._run, args=(started,), name=f"{self.name}-loop", daemon=True
            )
            self._thread.start()
        try:
            started.result()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop listening, close connections, wait for running handlers, join every thread. Idempotent."""
        with self._lifecycle:
            if self._thread is None:
                return
            assert self._loop is not None and self._pool is not None
            try:
                self._loop.call_soon_threadsafe(self._loop.stop)
            except RuntimeError:
                pass  # the loop already ended (its start failed)
            self._thread.join()
            self._pool.shutdown(wait=True, cancel_futures=True)
            for sock in self._sockets:
                sock.close()
            if self.unix_path is not None and self._unix_inode is not None:
                try:
                    info = self.unix_path.lstat()
                    if (info.st_dev, info.st_ino) == self._unix_inode:
                        self.unix_path.unlink()
                except FileNotFoundError:
                    pass
            self._thread = self._loop = self._pool = None
            self._sockets, self._unix_inode = [], None

    def __enter__(self) -> HTTPServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _listen(self) -> None:
        if self._host is not None:
            tcp = listen_tcp(self._host, self._port, allow_wildcard=self._allow_wildcard)
            self._sockets.append(tcp)
            shown = f"[{self._host.replace('%', '%25')}]" if ":" in self._host else self._host
            self.url = f"http://{shown}:{tcp.getsockname()[1]}"
        if self.unix_path is not None:
            try:
                unix = listen_unix(self.unix_path, mode=self._unix_mode, group=self._unix_group)
            except BaseException:
                for sock in self._sockets:
                    sock.close()
                self._sockets = []
                raise
            self._sockets.append(unix)
            info = self.unix_path.lstat()
            self._unix_inode = (info.st_dev, info.st_ino)

    def _run(self, started: concurrent.futures.Future[None]) -> None:
        assert self._loop is not None
        run_server_loop(self._loop, self._open, started)

    async def _open(self) -> web.ServerRunner:
        limits = self.limits
        server = GuardedServer(
            self._serve,
            guard=self._guard,
            access_log=None,
            # aiohttp's own idle timer, a backstop far behind ours (see Connection)
            keepalive_timeout=2 * (limits.head_timeout_s + limits.keepalive_timeout_s),
            lingering_time=0,  # an unread body closes the connection instead of being drained
            max_line_size=limits.max_line_size,
            max_field_size=limits.max_field_size,
            max_headers=limits.max_headers,
        )
        runner = web.ServerRunner(server, shutdown_timeout=1.0)
        await runner.setup()
        for sock in self._sockets:
            await web.SockSite(runner, sock, backlog=BACKLOG).start()
        return runner

    # ------------------------------------------------------------------ one request (event loop)

    async def _serve(self, raw: web.BaseRequest) -> web.StreamResponse:
        connection = raw.protocol
        connection.head_complete()
        response = await self._respond(raw, connection.peer)
        connection.request_answered()
        if connection.transport is not None:
            connection.await_next_head()
        return response

    async def _respond(self, raw: web.BaseRequest, peer: Peer) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        path, _, query = raw.raw_path.partition("?")
        route, params, miss = self._router.find(raw.method, path)
        cap = route.max_body if route is not None else _UNROUTED_MAX_BODY
        length = raw.content_length or 0
        if "Transfer-Encoding" in raw.headers:
            return await self._send(
                raw, error_reply(411, "chunked bodies are not accepted; send Content-Length"), True
            )
        if length > cap:
            message = f"a body of {length} bytes exceeds this endpoint's limit of {cap} bytes"
            return await self._send(raw, error_reply(413, message), True)
        if length and raw.headers.get("Expect", "").lower() == "100-continue" and raw.version >= (1, 1):
            await raw.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # the body is within its cap
            raw.writer.output_size = 0  # the reply itself has not started
        deadline = loop.time() + self.limits.transfer_s(length)
        request = Request(raw.method, path, raw.raw_path, parse_qs(query), raw.headers, peer, params, length)
        if route is not None and route.stream_body:
            request._read = self._body_reader(raw, deadline)
        else:
            try:
                request.body = await asyncio.wait_for(_read_exactly(raw, length), deadline - loop.time())
            except asyncio.TimeoutError:
                return await self._send(
                    raw, error_reply(408, "the request body did not arrive in time"), True
                )
            except (asyncio.IncompleteReadError, ConnectionError):
                return await self._send(raw, error_reply(400, "the request body ended early"), True)
        reply = await loop.run_in_executor(self._pool, self._handle, request, route, miss)
        return await self._send(raw, reply, not raw.content.at_eof())

    def _body_reader(self, raw: web.BaseRequest, deadline: float) -> Callable[[int], bytes]:
        loop = asyncio.get_running_loop()

        async def read(size: int) -> bytes:
            return await asyncio.wait_for(raw.content.read(size), deadline - loop.time())

        def read_from_thread(size: int) -> bytes:
            future = asyncio.run_coroutine_threadsafe(read(size), loop)
            try:
                return future.result(timeout=max(0.0, deadline - loop.time()) + 5)
            except (asyncio.TimeoutError, concurrent.futures.TimeoutError):
                raise HTTPError(408, "the request body did not arrive in time") from None
            except (ConnectionError, asyncio.IncompleteReadError, RuntimeError):
                raise HTTPError(400, "the request body ended early") from None

        return read_from_thread

    async def _send(self, raw: web.BaseRequest, reply: Reply, close: bool) -> web.StreamResponse:
        headers = {"Server": "shardpool", **reply.headers, "Content-Type": reply.content_type}
        if reply.chunks is None:
            response: web.StreamResponse = web.Response(status=reply.status, body=reply.body, headers=headers)
        else:
            response = web.StreamResponse(status=reply.status, headers=headers)
            response.content_length = reply.length
        if close:
            response.force_close()
        try:
            allowance = self.limits.transfer_s(max(reply.length, len(reply.body)))
            await asyncio.wait_for(self._write(raw, response, reply), allowance)
        except (asyncio.TimeoutError, ConnectionError) as error:
            log.debug("dropping the reply to %s %s: %r", raw.method, raw.path[:100], error)
            raw.protocol.force_close()
        except Exception:  # noqa: BLE001 - a failing stream: the promised length cannot be kept
            log.exception("streaming the reply to %s %s failed", raw.method, raw.path[:100])
            raw.protocol.force_close()
        finally:
            if reply.chunks is not None:
                self._pool.submit(close_chunks, reply)  # after a chunk still being read, if any
        return response

    async def _write(self, raw: web.BaseRequest, response: web.StreamResponse, reply: Reply) -> None:
        await response.prepare(raw)
        if reply.chunks is not None and raw.method != "HEAD":
            loop, sent = asyncio.get_running_loop(), 0
            while (chunk := await loop.run_in_executor(self._pool, next, reply.chunks, None)) is not None:
                sent += len(chunk)
                if sent > reply.length:
                    raise ValueError(f"the stream yielded more than its declared {reply.length} bytes")
                await response.write(chunk)
            if sent != reply.length:
                raise ValueError(f"the stream ended after {sent} of its declared {reply.length} bytes")
        await response.write_eof()

    # ------------------------------------------------------------------ one request (handler thread)

    def _handle(self, request: Request, route: Route | None, miss: HTTPError | None) -> Reply:
        if self._authenticate is not None:
            try:
                request.principal = self._authenticate(request)
            except HTTPError as error:
                return error_reply(error.status, error.message, error.headers)
            except Exception:  # noqa: BLE001 - a hook bug must not drop the connection
                log.exception("authenticating %s %s failed", request.method, request.path[:100])
                return error_reply(500, "internal error while authenticating; see the server log")
        reply = self._run_handler(request, route, miss)
        if self._sign_reply is None:
            return reply
        try:
            body = reply.body if reply.chunks is None else None
            extra = self._sign_reply(request, request.principal, reply.status, body)
        except Exception:  # noqa: BLE001 - an unsigned reply would be refused anyway
            log.exception("signing the reply to %s %s failed", request.method, request.path[:100])
            close_chunks(reply)
            return error_reply(500, "internal error while signing the reply; see the server log")
        return replace(reply, headers={**reply.headers, **extra})

    def _run_handler(self, request: Request, route: Route | None, miss: HTTPError | None) -> Reply:
        try:
            if route is None:
                raise miss or HTTPError(404, "no such endpoint")
            reply = route.handler(request)
            if not isinstance(reply, Reply):
                raise TypeError(f"the handler returned {type(reply).__name__}, not a Reply")
            return reply
        except HTTPError as error:
            return error_reply(error.status, error.message, error.headers)
        except self._client_errors as error:
            return error_reply(400, str(error))
        except Exception as error:  # noqa: BLE001 - a server answers, never drops the connection
            log.exception("%s %s failed", request.method, request.path[:100])
            return error_reply(500, f"internal error ({type(error).__name__}); see the server log")


async def _read_exactly(raw: web.BaseRequest, length: int) -> bytes:
    return await raw.content.readexactly(length) if length else b""


def run_server_loop(
    loop: asyncio.AbstractEventLoop,
    open_runner: Callable[[], Coroutine[Any, Any, web.BaseRunner]],
    started: concurrent.futures.Future[None],
) -> None:
    """Run a server's event loop in the calling thread: open its runner, say so on ``started``
    (or hand it the error), serve until the loop is stopped, then clean up and close the loop."""
    asyncio.set_event_loop(loop)
    runner = None
    try:
        runner = loop.run_until_complete(open_runner())
        started.set_result(None)
        loop.run_forever()
    except BaseException as error:  # noqa: BLE001 - handed to the starter
        if not started.done():
            started.set_exception(error)
    finally:
        if runner is not None:
            loop.run_until_complete(runner.cleanup())
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()
