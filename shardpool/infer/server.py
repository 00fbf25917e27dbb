"""``shardpool serve``: an OpenAI-compatible HTTP API on the pipelined engine.

Routes: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions`` and
``POST /v1/chat/completions``, whole or streamed as server-sent events (``data: {...}`` chunks,
ending ``data: [DONE]``) as OpenAI sends them. Errors use OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, with a one-line message.

The bounds follow :mod:`mesh.http.server` and reuse its transport: one listening address
(127.0.0.1 unless told), per-connection idle and request-head deadlines, connection caps, a body
cap (413 before any body byte is read; chunked bodies 411), a deadline for the body and for each
reply write. At most ``max_concurrent`` requests generate at once (the engine's sequence slots);
up to ``max_queued`` more wait, in order, for a slot; beyond that a request is answered 429 with
``Retry-After`` at once (the OpenAI clients retry 429 with backoff).

The engine is synchronous: each request's tokens are read by a thread of a pool sized for every
admitted request, turned into text there (:class:`shardpool.infer.text.TextStream`) and handed to
the event loop. A client that goes away (a failed write, or a closed connection noticed while
waiting) cancels its generation. A failed engine answers 503 with its one line while its stages start again (the engine restarts the ring), then serves again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import ipaddress
import json
import logging
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from mesh.errors import MeshError
from mesh.http.server import HTTPError, json_object, run_server_loop
from mesh.http.transport import (
    BACKLOG,
    Connection,
    ConnectionGuard,
    GuardedServer,
    Limits,
    listen_tcp,
    raise_open_file_limit,
)
from shardpool.contract.job import StagePlacement
from shardpool.errors import ShardpoolError
from shardpool.infer.engine import EngineFailed, GenerationRequest, PipelineEngine, Stream
from shardpool.infer.rings import LocalStages, Stages
from shardpool.infer.sampling import Sampling
from shardpool.infer.text import TextStream, chat_prompt_ids, prompt_ids, stop_ids, stop_strings

__all__ = ["OpenAIServer", "ServerOptions", "serve"]

log = logging.getLogger("shardpool.infer.server")

_CHAT_ROLES = ("system", "user", "assistant")
#: OpenAI fields this server does not implement, with the values that mean "not used".
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
}
_WAIT_CHECK_S = 0.5  # how often a waiting request looks whether its client is still there


@dataclass(frozen=True)
class ServerOptions:
    """The server's bounds and defaults."""

    api_key: str | None = None  # requests must send `Authorization: Bearer KEY`; None: no key asked
    max_concurrent: int = 8  # requests generating at once (the engine's slots)
    max_queued: int = 32  # requests waiting for a slot; more are answered 429
    max_body: int = 1 << 20  # bytes of a request body; more are answered 413
    chat_max_tokens: int = (
        1024  # a chat request without max_tokens gets the rest of the context, at most this
    )
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if self.max_concurrent < 1 or self.max_queued < 0:
            raise ShardpoolError("--max-concurrent must be at least 1 and --max-queued at least 0")
        if self.chat_max_tokens < 1:
            raise ShardpoolError(f"--chat-max-tokens {self.chat_max_tokens} must be at least 1")


class APIError(Exception):
    """A request answered with ``status`` and OpenAI's error JSON (one line)."""

    def __init__(
        self, status: int, message: str, *, kind: str = "invalid_request_error", code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code

    def body(self) -> dict[str, Any]:
        """``{"error": {...}}`` as OpenAI writes it."""
        line = (self.message.splitlines() or [""])[0][:500]
        return {"error": {"message": line, "type": self.kind, "param": None, "code": self.code}}


@dataclass(frozen=True)
class _Job:
    """One parsed generation request."""

    chat: bool
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


@dataclass
class _Result:
    text: list[str] = field(default_factory=list)
    finish_reason: str = "length"
    completion_tokens: int = 0


class _Connection(Connection):
    """The house connection, noting when the client closes its side: a generation nobody waits
    for is cancelled (a client that half-closes and still waits is taken as gone, too)."""

    __slots__ = ("client_closed",)

    def __init__(self, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.client_closed = False

    def eof_received(self) -> bool | None:
        self.client_closed = True
        return super().eof_received()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.client_closed = True
        super().connection_lost(exc)


class _Server(GuardedServer):
    def __call__(self) -> _Connection:
        return _Connection(self, loop=self._loop, guard=self.guard, **self._kwargs)


class OpenAIServer:
    """The HTTP side of ``shardpool serve`` on an engine that is already running.

    It listens on ``host:port`` (port 0 picks a free one; see :attr:`url`) from its own event
    loop thread between :meth:`start` and :meth:`stop`; the engine stays the caller's.
    """

    def __init__(
        self,
        engine: PipelineEngine,
        tokenizer: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        options: ServerOptions | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.options = options or ServerOptions()
        self.model_name = engine.target.name
        self._host, self._port = host, port
        self._stop_ids = stop_ids(tokenizer, engine.target.model_dir)
        self._tokenizer_lock = threading.Lock()  # a fast tokenizer is not safe to share across threads
        self._created = int(time.time())
        self._admitted = 0  # requests generating or queued (event loop thread only)
        self._streams: dict[int, Stream] = {}  # by id(): a Stream is not hashable
        self._failure_logged = ""
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._socket: Any = None
        self.url = ""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> OpenAIServer:
        """Listen and serve from a background thread; returns self."""
        raise_open_file_limit()
        self._socket = listen_tcp(self._host, self._port, allow_wildcard=True)
        shown = f"[{self._host}]" if ":" in self._host else self._host
        self.url = f"http://{shown}:{self._socket.getsockname()[1]}"
        if self.options.api_key is None and not ipaddress.ip_address(self._host.split("%", 1)[0]).is_loopback:
            log.warning(
                "serving on %s without --api-key: anyone who can reach it can use the model", self._host
            )
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.options.max_concurrent + self.options.max_queued, thread_name_prefix="shardpool-serve"
        )
        self._loop = asyncio.new_event_loop()
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="shardpool-serve-loop", daemon=True
        )
        self._thread.start()
        try:
            started.result()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Cancel every generation, close the connections, stop the loop. Idempotent."""
        if self._thread is None or self._loop is None:
            return
        for stream in list(self._streams.values()):
            stream.cancel()
        try:
            self._loop.call_soon_threadsafe(self._loop.stop)
        except RuntimeError:
            pass  # the loop already ended
        self._thread.join()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)  # the readers end with their streams
        self._socket.close()
        self._thread = self._loop = self._pool = None

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self, started: concurrent.futures.Future[None]) -> None:
        assert self._loop is not None
        run_server_loop(self._loop, self._open, started)

    async def _open(self) -> web.ServerRunner:
        limits = self.options.limits
        server = _Server(
            self._serve,
            guard=ConnectionGuard(limits),
            access_log=None,
            keepalive_timeout=2 * (limits.head_timeout_s + limits.keepalive_timeout_s),
            lingering_time=0,
            max_line_size=limits.max_line_size,
            max_field_size=limits.max_field_size,
            max_headers=limits.max_headers,
        )
        runner = web.ServerRunner(server, shutdown_timeout=1.0)
        await runner.setup()
        await web.SockSite(runner, self._socket, backlog=BACKLOG).start()
        return runner

    # ------------------------------------------------------------------ one request

    async def _serve(self, raw: web.BaseRequest) -> web.StreamResponse:
        connection = raw.protocol
        connection.head_complete()
        try:
            response = await self._respond(raw)
        except APIError as error:
            response = await self._send_json(raw, error.body(), error.status, close=not raw.content.at_eof())
        except Exception as error:  # noqa: BLE001 - a server answers, never drops the connection
            log.exception("%s %s failed", raw.method, raw.path[:100])
            failed = APIError(
                500, f"internal error ({type(error).__name__}); see the server log", kind="server_error"
            )
            response = await self._send_json(raw, failed.body(), 500, close=True)
        connection.request_answered()
        if connection.transport is not None:
            connection.await_next_head()
        return response

    async def _respond(self, raw: web.BaseRequest) -> web.StreamResponse:
        chat = self._route(raw.method, raw.path)
        self._authenticate(raw)
        if raw.method == "GET":
            return await self._send_json(raw, self._models(raw.path), 200)
        self._admit()  # before the body is read, so a full server spends nothing on it ...
        body = await self._read_json(raw)
        self._admit()  # ... and again: others may have come while it arrived
        self._admitted += 1
        try:
            job = await asyncio.get_running_loop().run_in_executor(self._pool, self._parse, body, chat)
        except BaseException:
            self._admitted -= 1
            raise
        return await self._generate(raw, job)

    def _admit(self) -> None:
        """Refuse a generation when the engine failed (503) or every slot and queue place is taken (429)."""
        if self.engine.failure is not None:
            raise self._engine_failed(self.engine.failure)
        if self._admitted >= self.options.max_concurrent + self.options.max_queued:
            raise APIError(
                429,
                "the server is busy: every generation slot and queue place is taken; retry shortly",
                kind="rate_limit_error",
                code="too_many_requests",
            )

    def _route(self, method: str, path: str) -> bool:
        """Check the method and path; True for the chat route."""
        if path in ("/v1/completions", "/v1/chat/completions"):
            if method != "POST":
                raise APIError(405, f"{method[:10]} is not allowed on {path}; use POST")
            return path == "/v1/chat/completions"
        if path == "/v1/models" or path.startswith("/v1/models/"):
            if method != "GET":
                raise APIError(405, f"{method[:10]} is not allowed on {path[:100]}; use GET")
            return False
        raise APIError(
            404,
            f"no endpoint {path[:100]}; this server has /v1/models, /v1/completions and /v1/chat/completions",
            code="not_found",
        )

    def _models(self, path: str) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": self._created, "owned_by": "shardpool"}
        if path == "/v1/models":
            return {"object": "list", "data": [card]}
        if path.removeprefix("/v1/models/") != self.model_name:
            raise APIError(
                404,
                f"the model `{path.removeprefix('/v1/models/')[:100]}` does not exist; this server serves `{self.model_name}`",
                code="model_not_found",
            )
        return card

    def _authenticate(self, raw: web.BaseRequest) -> None:
        key = self.options.api_key
        if key is None:
            return
        given = raw.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(
                401, "missing or wrong API key; send `Authorization: Bearer KEY`", code="invalid_api_key"
            )

    async def _read_json(self, raw: web.BaseRequest) -> dict[str, Any]:
        if "Transfer-Encoding" in raw.headers:
            raise APIError(411, "chunked bodies are not accepted; send Content-Length")
        length = raw.content_length or 0
        if length > self.options.max_body:
            raise APIError(
                413,
                f"a body of {length} bytes exceeds the limit of {self.options.max_body} bytes",
                code="request_too_large",
            )
        try:
            data = await asyncio.wait_for(
                raw.content.readexactly(length), self.options.limits.transfer_s(length)
            )
        except asyncio.TimeoutError:
            raise APIError(408, "the request body did not arrive in time") from None
        except (asyncio.IncompleteReadError, ConnectionError):
            raise APIError(400, "the request body ended early") from None
        try:
            return json_object(data)
        except HTTPError as error:  # in OpenAI's error shape
            raise APIError(error.status, error.message) from None

    def _parse(self, body: dict[str, Any], chat: bool) -> _Job:
        """The request as a job (in a pool thread: the chat template and the tokenizer run here)."""
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model `{str(model)[:100]}` does not exist; this server serves `{self.model_name}`",
                code="model_not_found",
            )
        try:
            return self._job(body, chat)
        except ShardpoolError as error:
            raise APIError(400, str(error)) from None

    def _job(self, body: dict[str, Any], chat: bool) -> _Job:
        for name, neutral in _UNSUPPORTED.items():
            if body.get(name) not in neutral:
                raise ShardpoolError(f"`{name}` is not supported by this server; leave it out")
        if body.get("n") not in (None, 1):
            raise ShardpoolError("only n=1 is supported; send one request per completion")
        with self._tokenizer_lock:
            ids = (
                chat_prompt_ids(self.tokenizer, _messages(body))
                if chat
                else prompt_ids(self.tokenizer, _prompt(body))
            )
        room = self.engine.max_context - len(ids)
        if room < 1:
            raise ShardpoolError(
                f"the prompt is {len(ids)} tokens; the context holds {self.engine.max_context}"
            )
        given = body.get("max_completion_tokens", body.get("max_tokens"))
        if given is None:
            max_tokens = min(room, self.options.chat_max_tokens) if chat else 16
        else:
            max_tokens = _integer(given, "max_tokens", low=1)
        temperature = _number(body.get("temperature"), "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body.get("top_p"), "top_p", 1.0, 0.0, 1.0)
        top_k = body.get("top_k")
        seed = body.get("seed")
        sampling = Sampling(
            temperature=temperature,
            top_p=top_p,
            top_k=0 if top_k in (None, -1) else _integer(top_k, "top_k", low=0),
            seed=secrets.randbelow(2**31) if seed is None else _integer(seed, "seed", low=0),
        )
        stream = body.get("stream") or False
        options = body.get("stream_options") or {}
        if not isinstance(stream, bool) or not isinstance(options, dict):
            raise ShardpoolError("`stream` must be true or false, and `stream_options` an object")
        return _Job(
            chat=chat,
            prompt_ids=tuple(ids),
            max_tokens=max_tokens,
            sampling=sampling,
            stop=stop_strings(body.get("stop")),
            stream=stream,
            include_usage=bool(options.get("include_usage")),
        )

    # ------------------------------------------------------------------ generating

    async def _generate(self, raw: web.BaseRequest, job: _Job) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        try:
            stream = self.engine.submit(
                GenerationRequest(job.prompt_ids, job.max_tokens, job.sampling, self._stop_ids)
            )
        except EngineFailed as error:
            self._admitted -= 1
            raise self._engine_failed(str(error)) from None
        except ShardpoolError as error:
            self._admitted -= 1
            raise APIError(400, str(error)) from None
        self._streams[id(stream)] = stream

        def emit(kind: str, value: Any) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, value))
            except RuntimeError:  # the loop is closed: the server stopped
                stream.cancel()

        def done(_: object) -> None:
            self._admitted -= 1
            self._streams.pop(id(stream), None)

        reader = loop.run_in_executor(self._pool, self._read_stream, stream, job, emit)
        reader.add_done_callback(done)
        try:
            if job.stream:
                return await self._send_events(raw, job, events)
            return await self._send_whole(raw, job, events)
        finally:
            stream.cancel()  # a no-op once the stream has ended

    def _read_stream(self, stream: Stream, job: _Job, emit: Callable[[str, Any], None]) -> None:
        """Read the engine's tokens (in a pool thread) and emit ("text", piece) ... ("end", result)."""
        text = TextStream(self.tokenizer, stop=job.stop, context=job.prompt_ids)
        result = _Result()
        try:
            for token in stream:
                if text.stopped:
                    continue
                result.completion_tokens += 1
                with self._tokenizer_lock:
                    piece = text.push(token)
                if piece:
                    emit("text", piece)
                if text.stopped:
                    stream.cancel()
            if not text.stopped:
                with self._tokenizer_lock:
                    piece = text.finish()
                if piece:
                    emit("text", piece)
            result.finish_reason = "stop" if text.stopped or stream.finish_reason == "stop" else "length"
            emit("end", result)
        except EngineFailed as error:
            emit("error", str(error))
        except Exception as error:  # noqa: BLE001 - the client gets a 500, the log the traceback
            log.exception("reading a generation failed")
            emit("error-internal", f"internal error ({type(error).__name__}); see the server log")

    async def _next_event(
        self, raw: web.BaseRequest, events: asyncio.Queue[tuple[str, Any]]
    ) -> tuple[str, Any]:
        """The next event, or ("gone", None) once the client has closed its connection."""
        while True:
            transport = raw.transport
            if transport is None or transport.is_closing() or raw.protocol.client_closed:
                return "gone", None
            try:
                return await asyncio.wait_for(events.get(), _WAIT_CHECK_S)
            except asyncio.TimeoutError:
                continue

    def _fail(self, kind: str, value: Any) -> APIError:
        if kind == "error":
            return self._engine_failed(str(value))
        return APIError(500, str(value), kind="server_error")

    def _engine_failed(self, message: str) -> APIError:
        if self._failure_logged != message:
            self._failure_logged = message
            restarting = " (the stages are starting again)" if self.engine.restart else ""
            log.error("the engine failed%s, generations are answered 503 until it is back: %s", restarting, message)
        return APIError(503, message, kind="server_error", code="engine_failed")

    async def _send_whole(
        self, raw: web.BaseRequest, job: _Job, events: asyncio.Queue[tuple[str, Any]]
    ) -> web.StreamResponse:
        pieces: list[str] = []
        while True:
            kind, value = await self._next_event(raw, events)
            if kind == "text":
                pieces.append(value)
            elif kind == "end":
                break
            elif kind == "gone":
                raw.protocol.force_close()
                return web.Response(status=499)
            else:
                raise self._fail(kind, value)
        result: _Result = value
        text = "".join(pieces)
        if job.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=result.finish_reason)
        body = {**self._head(job), "choices": [choice], "usage": _usage(job, result)}
        return await self._send_json(raw, body, 200)

    async def _send_events(
        self, raw: web.BaseRequest, job: _Job, events: asyncio.Queue[tuple[str, Any]]
    ) -> web.StreamResponse:
        head = self._head(job)
        kind, value = await self._next_event(raw, events)
        if kind == "gone":
            raw.protocol.force_close()
            return web.Response(status=499)
        if kind not in ("text", "end"):
            raise self._fail(kind, value)  # nothing sent yet: a plain error reply
        response = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Server": "shardpool"},
        )
        response.enable_chunked_encoding()
        limits = self.options.limits

        async def send(data: dict[str, Any] | str) -> None:
            line = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
            chunk = f"data: {line}\n\n".encode()
            await asyncio.wait_for(response.write(chunk), limits.transfer_s(len(chunk)))

        def chunk(delta: str | None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
            if job.chat:
                body: dict[str, Any] = (
                    {"role": "assistant", "content": ""}
                    if role
                    else ({} if delta is None else {"content": delta})
                )
                choice: dict[str, Any] = {"index": 0, "delta": body}
            else:
                choice = {"index": 0, "text": delta or ""}
            choice.update(logprobs=None, finish_reason=finish)
            out = {**head, "choices": [choice]}
            if job.include_usage:
                out["usage"] = None
            return out

        try:
            await asyncio.wait_for(response.prepare(raw), limits.transfer_s(0))
            if job.chat:
                await send(chunk(None, role=True))
            while True:
                if kind == "text":
                    await send(chunk(value))
                elif kind == "end":
                    result: _Result = value
                    await send(chunk(None, finish=result.finish_reason))
                    if job.include_usage:
                        await send({**head, "choices": [], "usage": _usage(job, result)})
                    await send("[DONE]")
                    break
                elif kind == "gone":
                    raw.protocol.force_close()
                    break
                else:
                    await send(self._fail(kind, value).body())
                    break
                kind, value = await self._next_event(raw, events)
            await asyncio.wait_for(response.write_eof(), limits.transfer_s(0))
        except (asyncio.TimeoutError, ConnectionError) as error:
            log.debug("dropping the event stream of %s: %r", raw.path, error)
            raw.protocol.force_close()
        return response

    def _head(self, job: _Job) -> dict[str, Any]:
        prefix, kind = ("chatcmpl", "chat.completion") if job.chat else ("cmpl", "text_completion")
        if job.chat and job.stream:
            kind = "chat.completion.chunk"
        return {
            "id": f"{prefix}-{secrets.token_hex(12)}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
        }

    async def _send_json(
        self, raw: web.BaseRequest, value: Mapping[str, Any], status: int, *, close: bool = False
    ) -> web.StreamResponse:
        headers = {"Server": "shardpool"}
        if status == 429:
            headers["Retry-After"] = "1"
        response = web.Response(
            status=status,
            body=(json.dumps(value) + "\n").encode(),
            content_type="application/json",
            headers=headers,
        )
        if close:
            response.force_close()
        try:
            await asyncio.wait_for(response.prepare(raw), self.options.limits.transfer_s(len(response.body)))
            await asyncio.wait_for(response.write_eof(), self.options.limits.transfer_s(len(response.body)))
        except (asyncio.TimeoutError, ConnectionError) as error:
            log.debug("dropping the reply to %s: %r", raw.path[:100], error)
            raw.protocol.force_close()
        return response


def _usage(job: _Job, result: _Result) -> dict[str, int]:
    prompt = len(job.prompt_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": result.completion_tokens,
        "total_tokens": prompt + result.completion_tokens,
    }


def _prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ShardpoolError(
            "`prompt` must be a string (or a list of one string); token ids and batches are not supported"
        )
    return prompt


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ShardpoolError("`messages` must be a non-empty list of {role, content} objects")
    out = []
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in _CHAT_ROLES:
            raise ShardpoolError(f"messages[{index}]: role must be one of {', '.join(_CHAT_ROLES)}")
        out.append({"role": role, "content": _content(message.get("content"), index)})
    return out


def _content(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return "\n".join(part["text"] for part in content)
    raise ShardpoolError(
        f'messages[{index}]: content must be a string or a list of {{"type": "text", "text": ...}} parts'
    )


def _integer(value: Any, name: str, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ShardpoolError(f"`{name}` must be an integer of at least {low}")
    return value


def _number(value: Any, name: str, default: float, low: float, high: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ShardpoolError(f"`{name}` must be a number from {low:g} to {high:g}")
    return float(value)


def serve(
    target_path: str,
    stages: Sequence[StagePlacement] | Stages,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    options: ServerOptions | None = None,
    max_context: int = 4096,
    on_ready: Callable[[OpenAIServer], None] | None = None,
) -> None:
    """Start the engine on ``stages`` (places on this machine, or a :class:`~shardpool.infer.rings.Stages`:
    the mesh's), and the server; print one line when ready, serve until SIGINT or SIGTERM, then
    stop the server and the engine (no stage process is left)."""
    from shardpool.data.tokenizing import load_tokenizer
    from shardpool.infer.target import resolve_target

    options = options or ServerOptions()
    target = resolve_target(target_path)
    tokenizer = load_tokenizer(target.tokenizer_dir)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="shardpool serve: %(message)s", stream=sys.stderr)
    stop = threading.Event()
    ring = LocalStages(stages) if isinstance(stages, Sequence) else stages
    with PipelineEngine(
        target, stages=ring, max_slots=options.max_concurrent, max_context=max_context, restart=True
    ) as engine:
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            server = OpenAIServer(engine, tokenizer, host=host, port=port, options=options)
            try:
                server.start()
            except MeshError as error:
                raise ShardpoolError(str(error)) from None
            try:
                stages = f"{engine.num_stages} stage" + ("s" if engine.num_stages > 1 else "")
                print(f"serving {server.model_name} on {server.url}/v1 ({stages})", flush=True)
                if on_ready is not None:
                    on_ready(server)
                while not stop.wait(0.5):
                    pass
                log.info("stopping: closing the server and the engine")
            finally:
                server.stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
