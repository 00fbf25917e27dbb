"""Reachability of mesh addresses: one ICMP echo each, sent in parallel, with a short timeout.

WireGuard's handshake time alone cannot tell a live peer from a dead one for up to two minutes
(sessions are only renewed every 120 s), so ``mesh status`` and :func:`mesh.node.api.members` ask the
peer directly. A raw ICMP socket is used as root, an unprivileged ICMP socket otherwise, and a
TCP connection attempt (a refusal also proves the host is there) as the last resort.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor

__all__ = ["icmp_checksum", "ping", "probe_all", "probe_rtts", "round_trip"]


def icmp_checksum(data: bytes) -> int:
    """RFC 1071 internet checksum."""
    if len(data) % 2:
        data += b"\x00"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def _echo(identifier: int, sequence: int) -> bytes:
    payload = b"shardpool-mesh-probe"
    header = struct.pack("!BBHHH", 8, 0, 0, identifier, sequence)
    checksum = icmp_checksum(header + payload)
    return struct.pack("!BBHHH", 8, 0, checksum, identifier, sequence) + payload


def _wait_reply(
    sock: socket.socket, address: str, sequence: int, identifier: int | None, raw: bool, deadline: float
) -> bool:
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        ready, _, _ = select.select([sock], [], [], remaining)
        if not ready:
            return False
        data, source = sock.recvfrom(2048)
        if source[0] != address:
            continue
        if raw:
            data = data[(data[0] & 0x0F) * 4 :]
        if len(data) < 8:
            continue
        kind, _, _, reply_id, reply_seq = struct.unpack("!BBHHH", data[:8])
        if kind == 0 and reply_seq == sequence and (identifier is None or reply_id == identifier):
            return True


def _icmp(address: str, timeout: float, kind: int) -> float | None:
    raw = kind == socket.SOCK_RAW
    identifier = (os.getpid() ^ int.from_bytes(os.urandom(2), "big")) & 0xFFFF
    sequence = int.from_bytes(os.urandom(2), "big")
    with socket.socket(socket.AF_INET, kind, socket.IPPROTO_ICMP) as sock:
        sock.setblocking(False)
        sent = time.monotonic()
        try:
            sock.sendto(_echo(identifier, sequence), (address, 0))
        except OSError as error:
            if error.errno in (errno.EPERM, errno.EACCES):
                raise
            return None
        answered = _wait_reply(sock, address, sequence, identifier if raw else None, raw, sent + timeout)
        return time.monotonic() - sent if answered else None


def _tcp(address: str, timeout: float) -> float | None:
    started = time.monotonic()
    try:
        with socket.create_connection((address, 9), timeout=timeout):
            pass
    except ConnectionRefusedError:
        pass
    except OSError:
        return None
    return time.monotonic() - started


def round_trip(address: str, timeout: float = 1.0) -> float | None:
    """Seconds ``address`` took to answer one echo (or TCP attempt), or ``None`` without an answer in ``timeout``."""
    for kind in (socket.SOCK_RAW, socket.SOCK_DGRAM):
        try:
            return _icmp(address, timeout, kind)
        except PermissionError:
            continue
        except OSError as error:
            if error.errno not in (errno.EPERM, errno.EACCES, errno.EPROTONOSUPPORT):
                return None
    return _tcp(address, timeout)


def ping(address: str, timeout: float = 1.0) -> bool:
    """Tell whether ``address`` answers within ``timeout`` seconds."""
    return round_trip(address, timeout) is not None


def probe_rtts(addresses: list[str], timeout: float = 1.0, attempts: int = 2) -> dict[str, float | None]:
    """Ping every address in parallel, retrying a silent one; return address -> round trip (s) or ``None``.

    The echo goes over the mesh address, so it measures whichever path (LAN, direct, relay) is in use.
    """
    if not addresses:
        return {}
    per_try = timeout / attempts

    def one(address: str) -> float | None:
        for _ in range(attempts):
            seconds = round_trip(address, per_try)
            if seconds is not None:
                return seconds
        return None

    with ThreadPoolExecutor(max_workers=min(32, len(addresses))) as pool:
        return dict(zip(addresses, pool.map(one, addresses), strict=True))


def probe_all(addresses: list[str], timeout: float = 1.0, attempts: int = 2) -> dict[str, bool]:
    """Ping every address in parallel, retrying a silent one; return address -> reachable."""
    return {address: rtt is not None for address, rtt in probe_rtts(addresses, timeout, attempts).items()}
