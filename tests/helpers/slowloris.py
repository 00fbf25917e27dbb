"""A slowloris attack for tests of mesh.http.server servers: many idle or trickling connections from loopback sources.

Half the connections stay silent after connecting; the other half send the start of a request
head and then one more header byte a second, so they never finish it. The attack connects only
to loopback or to the lab's TEST-NET hosts (network namespaces a test made itself), and binds
only the source addresses it is given.
"""

from __future__ import annotations

import resource
import socket
import threading
from collections.abc import Sequence
from urllib.parse import urlsplit

import pytest

#: Loopback, and the TEST-NET ranges the namespace lab gives its hosts.
_TEST_TARGETS = ("127.", "192.0.2.", "203.0.113.")


def loopback_sources(count: int, first: int = 2) -> list[str]:
    """``count`` loopback source addresses 127.0.0.``first``..., so per-source caps do not hide the attack."""
    if not (0 < first and first + count <= 255):
        raise ValueError(f"cannot take {count} addresses from 127.0.0.{first}")
    return [f"127.0.0.{index}" for index in range(first, first + count)]


def raise_fd_limit(needed: int) -> None:
    """Raise the soft open-file limit to the hard limit, or skip the test if the hard limit is below ``needed``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"needs {needed} open files, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class SlowlorisAttack:
    """``count`` connections to the server at ``url``, spread over ``sources``; half trickle a request head.

    Use as a context manager: connections open on entry (and trickling starts); on exit the
    trickler stops and every socket is closed.
    """

    def __init__(self, url: str, count: int, sources: Sequence[str], head_start: bytes) -> None:
        parts = urlsplit(url)
        if parts.hostname is None or not parts.hostname.startswith(_TEST_TARGETS):
            raise ValueError(f"the slowloris helper attacks loopback or lab hosts only, not {url}")
        self.target = (parts.hostname, parts.port)
        self.count, self.sources, self.head_start = count, list(sources), head_start
        self.sockets: list[socket.socket] = []
        self._stop = threading.Event()
        self._trickler = threading.Thread(target=self._trickle, name="test-trickler", daemon=True)

    def __enter__(self) -> SlowlorisAttack:
        try:
            for index in range(self.count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                self.sockets.append(sock)
                sock.bind((self.sources[index % len(self.sources)], 0))
                sock.settimeout(5.0)
                sock.connect(self.target)
                sock.setblocking(False)
                if index % 2:
                    sock.send(self.head_start)
        except BaseException:
            self.close()
            raise
        self._trickler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _trickle(self) -> None:
        while not self._stop.wait(1.0):
            for sock in self.sockets[1::2]:
                try:
                    sock.send(b"a")
                except OSError:
                    pass  # already cut by the server

    def close(self) -> None:
        """Stop trickling and close every attack socket."""
        self._stop.set()
        if self._trickler.is_alive():
            self._trickler.join()
        for sock in self.sockets:
            sock.close()

    def still_open(self) -> int:
        """How many attack connections the server has not closed yet."""
        return sum(1 for sock in self.sockets if not closed_by_server(sock))


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed this non-blocking socket (without waiting)."""
    try:
        return sock.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
