"""Shared pieces of the relay tests: WireGuard-shaped datagrams, member sockets on loopback, and
waiting for the relay's counters."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable


def wireguard_data(payload: int = 64) -> bytes:
    """A datagram shaped as a WireGuard transport message (type 4) with ``payload`` bytes inside."""
    return b"\x04\0\0\0" + os.urandom(12 + payload + 16)


def udp_socket(ip: str) -> socket.socket:
    """A UDP socket bound to ``ip`` (a loopback address standing for one member), 2 s timeout."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((ip, 0))
    sock.settimeout(2.0)
    return sock


def wait_until(condition: Callable[[], bool], timeout: float = 2.0) -> bool:
    """Whether ``condition`` holds within ``timeout`` seconds (the relay counts on its own thread)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()
