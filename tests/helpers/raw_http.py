"""One raw HTTP exchange for fuzz tests: bytes in, the final status and body out, whatever comes back."""

from __future__ import annotations

import socket

REPLY_TIMEOUT_S = 15.0


def exchange(address: str | tuple[str, int], data: bytes) -> tuple[int, bytes]:
    """Send ``data`` to a Unix socket path or a (host, port), half-close, read until the server
    closes; return the final status (0 if there is no valid status line) and the body."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(REPLY_TIMEOUT_S)
        sock.connect(address)
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before all was sent; the reply (if any) is still readable
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except ConnectionResetError:
            pass
    while reply.startswith(b"HTTP/1.1 100 "):
        reply = reply.partition(b"\r\n\r\n")[2]
    status_line, _, rest = reply.partition(b"\r\n")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return 0, b""
    return int(parts[1]), rest.partition(b"\r\n\r\n")[2]
