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

__all__ = ["icmp_checksum", "ping", "probe_all"]


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


def _icmp(address: str, timeout: float, kind: int) -> bool:
    raw = kind == socket.SOCK_RAW
    identifier = (os.getpid() ^ int.from_bytes(os.urandom(2), "big")) & 0xFFFF
    sequence = int.from_bytes(os.urandom(2), "big")
    with socket.socket(socket.AF_INET, kind, socket.IPPROTO_ICMP) as sock:
        sock.setblocking(False)
        try:
            sock.sendto(_echo(identifier, sequence), (address, 0))
        except OSError as error:
            if error.errno in (errno.EPERM, errno.EACCES):
                raise
            return False
        return _wait_reply(
            sock, address, sequence, identifier if raw else None, raw, time.monotonic() + timeout
        )


def _tcp(address: str, timeout: float) -> bool:
    try:
        with socket.create_connection((address, 9), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def ping(address: str, timeout: float = 1.0) -> bool:
    """Tell whether ``address`` answers within ``timeout`` seconds."""
    for kind in (socket.SOCK_RAW, socket.SOCK_DGRAM):
        try:
            return _icmp(address, timeout, kind)
        except PermissionError:
            continue
        except OSError as error:
            if error.errno not in (errno.EPERM, errno.EACCES, errno.EPROTONOSUPPORT):
                return False
    return _tcp(address, timeout)


def probe_all(addresses: list[str], timeout: float = 1.0, attempts: int = 2) -> dict[str, bool]:
    """Ping every address in parallel, retrying a silent one; return address -> reachable."""
    if not addresses:
        return {}
    per_try = timeout / attempts

    def one(address: str) -> bool:
        return any(ping(address, per_try) for _ in range(attempts))

    with ThreadPoolExecutor(max_workers=min(32, len(addresses))) as pool:
        return dict(zip(addresses, pool.map(one, addresses), strict=True))
