"""Sockets and connections under :mod:`mesh.http.server`: listening, peer identity, caps and head deadlines.

This is the part of the HTTP foundation that sits below requests: it creates the listening sockets
(one IP, or a Unix socket with a mode and group), learns who is on the other end of each connection
(peer IP, or uid/gid/pid from ``SO_PEERCRED``), refuses connections over the per-source and total
caps at once, and closes connections that stay idle or send their request head too slowly.
"""

from __future__ import annotations

import asyncio
import collections
import grp
import ipaddress
import itertools
import json
import logging
import os
import resource
import socket
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from mesh.errors import MeshError

__all__ = ["BACKLOG", "Limits", "Peer", "listen_tcp", "listen_unix", "raise_open_file_limit"]

log = logging.getLogger("shardpool.mesh.http")

_REFUSAL_LOG_EVERY_S = 10.0
BACKLOG = 1024  # connections the kernel queues before accept; aiohttp would listen with 128


@dataclass(frozen=True)
class Limits:
    """Every bound one server enforces. The defaults suit the agent, file server and coordinator.

    ``handler_threads`` is the number of sync handlers that run at once. A long poll blocks one for
    up to its wait (30 s on the agent), so give a server at least as many threads as it expects
    concurrent long polls plus a few for short requests; requests beyond that wait for a thread
    while holding only their connection.
    """

    head_timeout_s: float = 10.0  # request line + headers, from connect or from the previous response
    keepalive_timeout_s: float = 5.0  # no byte at all after connect or after a response
    body_timeout_s: float = 10.0  # plus the declared length at min_rate_bps, for bodies and replies
    min_rate_bps: float = 256 * 1024
    max_connections: int = 4096
    max_connections_per_source: int = 512  # per peer IP, or per uid on a Unix socket
    handler_threads: int = 16
    max_line_size: int = 8190  # request line and each header line, in bytes
    max_field_size: int = 8190
    max_headers: int = 64

    def transfer_s(self, nbytes: int) -> float:
        """Seconds allowed to move a body of ``nbytes`` (in either direction)."""
        return self.body_timeout_s + nbytes / self.min_rate_bps


@dataclass(frozen=True)
class Peer:
    """Who is connected: ``ip`` for TCP; ``uid``/``gid``/``pid`` (kernel-checked) for a Unix socket."""

    ip: str | None = None
    uid: int | None = None
    gid: int | None = None
    pid: int | None = None

    @property
    def source(self) -> str:
        """The key connection caps count by."""
        return f"ip:{self.ip}" if self.uid is None else f"uid:{self.uid}"


def raise_open_file_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (each connection holds one fd)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as error:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, wanted, error)
    return soft


def listen_tcp(host: str, port: int, *, allow_wildcard: bool = False) -> socket.socket:
    """A listening TCP socket on one IP address (IPv4 or IPv6; never a wildcard unless allowed)."""
    try:
        parsed = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        raise MeshError(
            f"listen address {host!r} is not an IP address; give this machine's address"
        ) from None
    if parsed.is_unspecified and not allow_wildcard:
        raise MeshError(f"refusing to listen on {host}: give the one address this service must listen on")
    family = socket.AF_INET6 if parsed.version == 6 else socket.AF_INET
    address = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)[0][4]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as error:
        sock.close()
        raise MeshError(
            f"cannot listen on {host} port {port} ({error.strerror or error}); is the address up and the port free?"
        ) from None
    sock.setblocking(False)
    return sock


def listen_unix(path: Path, *, mode: int = 0o660, group: str | None = None) -> socket.socket:
    """A listening Unix socket at ``path`` with ``mode`` and (optionally) group ``group``.

    A stale socket file left by a dead server is replaced; a live one, or any other file, is not.
    Mode and group are set before ``listen``, so nobody can connect under looser permissions.
    """
    gid = -1
    if group is not None:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise MeshError(
                f"group {group!r} does not exist; create it (groupadd {group}) or name another"
            ) from None
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, mode)
        if gid >= 0:
            os.chown(path, -1, gid)
        sock.listen(BACKLOG)
    except OSError as error:
        sock.close()
        raise MeshError(
            f"cannot listen on {path} ({error.strerror or error}); run as root or fix the directory"
        ) from None
    sock.setblocking(False)
    return sock


def _remove_stale_socket(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise MeshError(f"{path} exists and is not a socket; move it away or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink(missing_ok=True)  # nobody listens: left behind by a server that died
        return
    finally:
        probe.close()
    raise MeshError(f"another server already listens on {path}; stop it first")


def peer_of(transport: asyncio.BaseTransport) -> Peer:
    """The peer of a connection: SO_PEERCRED on a Unix socket, the IP address on TCP."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", creds)
        return Peer(uid=uid, gid=gid, pid=pid)
    peername = transport.get_extra_info("peername") or ("?",)
    return Peer(ip=str(peername[0]).split("%", 1)[0])


class ConnectionGuard:
    """Counts open connections per source and in total. Used on the event loop thread only."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.total = 0
        self.refused = 0
        self._per_source: dict[str, int] = {}
        self._refusals_logged_at = -_REFUSAL_LOG_EVERY_S

    def admit(self, source: str) -> bool:
        """Count a new connection, or return False if it would exceed a cap."""
        count = self._per_source.get(source, 0)
        if self.total >= self.limits.max_connections or count >= self.limits.max_connections_per_source:
            self._note_refusal(source)
            return False
        self._per_source[source] = count + 1
        self.total += 1
        return True

    def _note_refusal(self, source: str) -> None:
        # one warning per interval: a flood of refused connections must not flood the log too
        self.refused += 1
        now = time.monotonic()
        if now - self._refusals_logged_at >= _REFUSAL_LOG_EVERY_S:
            self._refusals_logged_at = now
            log.warning(
                "refusing connections over the caps (%d open, latest from %s; %d refused so far)",
                self.total,
                source,
                self.refused,
            )

    def release(self, source: str) -> None:
        """Forget a closed connection."""
        self.total -= 1
        left = self._per_source[source] - 1
        if left:
            self._per_source[source] = left
        else:
            del self._per_source[source]


class Connection(RequestHandler):
    """aiohttp's HTTP/1.1 protocol plus caps, peer identity, and the idle and head deadlines.

    Both deadlines are armed when the connection opens and again when a response has been sent:
    the idle timer is cancelled by the first byte that arrives, the head timer only by
    :meth:`head_complete` (called when aiohttp hands over a parsed request). A client trickling a
    header byte now and then therefore still loses the connection at the head deadline.
    """

    __slots__ = ("guard", "peer", "_counted", "_idle_timer", "_head_timer", "_unanswered")

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.guard = guard
        self.peer = Peer()
        self._counted = False
        self._idle_timer: asyncio.TimerHandle | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._unanswered: collections.deque[Any] = (
            collections.deque()
        )  # bodies of parsed, unanswered requests

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.peer = peer_of(transport)
        if not self.guard.admit(self.peer.source):
            self.force_close()
            return
        self._counted = True
        self.await_next_head()

    def data_received(self, data: bytes) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        queued = len(self._messages)
        super().data_received(data)
        self._unanswered.extend(payload for _, payload in itertools.islice(self._messages, queued, None))

    def eof_received(self) -> bool | None:
        """The client shut down its sending side: answer the requests it completed, then close.

        aiohttp closes at once on EOF, so a client that sends a request and then half-closes
        (as HTTP/1.0 tools do) would get no answer. A body cut short by the EOF fails at once
        (400, not a wait for its deadline); with no whole request head there is nothing to
        answer and the connection closes.
        """
        if not self._unanswered:
            return None
        for payload in self._unanswered:
            if not payload.is_eof():
                payload.feed_eof()
        self.close()
        return True

    def request_answered(self) -> None:
        """Note that the oldest parsed request has had its response (pipelined ones are answered in order)."""
        if self._unanswered:
            self._unanswered.popleft()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.head_complete()
        if self._counted:
            self._counted = False
            self.guard.release(self.peer.source)
        super().connection_lost(exc)

    def await_next_head(self) -> None:
        """Arm the idle and head deadlines (at connect, and after each response)."""
        self.head_complete()
        loop, limits = asyncio.get_running_loop(), self.guard.limits
        self._idle_timer = loop.call_later(limits.keepalive_timeout_s, self._expire, "idle")
        self._head_timer = loop.call_later(limits.head_timeout_s, self._expire, "request head")

    def head_complete(self) -> None:
        """Disarm both deadlines: a whole request head has arrived (or the connection is gone)."""
        for timer in (self._idle_timer, self._head_timer):
            if timer is not None:
                timer.cancel()
        self._idle_timer = self._head_timer = None

    def _expire(self, what: str) -> None:
        log.debug("closing a connection from %s: %s deadline passed", self.peer.source, what)
        self.head_complete()
        self.force_close()

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """Errors aiohttp finds while parsing (bad request line, oversized headers) as one-line JSON."""
        log.debug("bad request from %s: %s", self.peer.source, message or exc)
        if request.writer.output_size > 0:
            raise ConnectionError("the response was partly sent; the connection is dropped")
        text = (message or str(exc) or "bad request").splitlines()[0][:300]
        body = (json.dumps({"error": f"malformed request: {text}"}) + "\n").encode()
        reply = web.Response(status=status, body=body, content_type="application/json")
        reply.force_close()
        return reply


class GuardedServer(web.Server):
    """aiohttp's low-level server, making :class:`Connection` protocols that share one guard."""

    def __init__(self, handler: Any, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.guard = guard

    def __call__(self) -> Connection:
        return Connection(self, loop=self._loop, guard=self.guard, **self._kwargs)
