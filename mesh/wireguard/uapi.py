"""WireGuard's cross-platform UAPI: the text protocol on ``/var/run/wireguard/IFNAME.sock``.

A request is ``get=1`` or ``set=1`` followed by ``key=value`` lines and a blank line; keys are
lowercase hex. A ``set`` reply is ``errno=N``; a ``get`` reply lists the device and then each
peer (a ``public_key=`` line starts a peer) and ends with ``errno=N``.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterable
from pathlib import Path

from mesh.errors import MeshError
from mesh.wireguard.backend import DeviceStatus, PeerConfig, PeerStatus
from mesh.wireguard.keys import key_from_hex, key_to_hex, public_key

__all__ = [
    "SOCKET_DIR",
    "UapiClient",
    "encode_get",
    "encode_set",
    "parse_errno",
    "parse_get",
    "socket_path",
]

SOCKET_DIR = Path("/var/run/wireguard")
_MAX_REPLY = 16 * 1024 * 1024
_REPLY_END = re.compile(rb"(?:^|\n)errno=-?[0-9]+\n\n\Z")


def socket_path(ifname: str) -> Path:
    """Return the UAPI socket path of interface ``ifname``."""
    return SOCKET_DIR / f"{ifname}.sock"


def encode_get() -> bytes:
    """Build a ``get`` request."""
    return b"get=1\n\n"


def _encode_peer(peer: PeerConfig) -> list[str]:
    lines = [f"public_key={key_to_hex(peer.public_key)}"]
    if peer.remove:
        return lines + ["remove=true"]
    if peer.endpoint is not None:
        lines.append(f"endpoint={peer.endpoint}")
    if peer.persistent_keepalive is not None:
        lines.append(f"persistent_keepalive_interval={peer.persistent_keepalive}")
    lines.append("replace_allowed_ips=true")
    lines.extend(f"allowed_ip={cidr}" for cidr in peer.allowed_ips)
    return lines


def encode_set(
    private_key: str | None = None,
    listen_port: int | None = None,
    replace_peers: bool = False,
    peers: Iterable[PeerConfig] = (),
) -> bytes:
    """Build a ``set`` request: optional device settings, then one block per peer change."""
    lines = ["set=1"]
    if private_key is not None:
        lines.append(f"private_key={key_to_hex(private_key)}")
    if listen_port is not None:
        lines.append(f"listen_port={listen_port}")
    if replace_peers:
        lines.append("replace_peers=true")
    for peer in peers:
        lines.extend(_encode_peer(peer))
    return ("\n".join(lines) + "\n\n").encode("ascii")


def parse_errno(reply: str) -> int:
    """Return the ``errno`` of a reply; a reply without one is a protocol error."""
    for line in reply.splitlines():
        if line.startswith("errno="):
            value = line[len("errno=") :]
            if value.lstrip("-").isdigit():
                return int(value)
    raise MeshError(f"WireGuard UAPI reply has no errno line: {reply[:80]!r}")


def _finish_peer(fields: dict[str, str], allowed: list[str]) -> PeerStatus:
    seconds = int(fields.get("last_handshake_time_sec", "0"))
    nanos = int(fields.get("last_handshake_time_nsec", "0"))
    endpoint = fields.get("endpoint")
    return PeerStatus(
        public_key=key_from_hex(fields["public_key"]),
        endpoint=endpoint if endpoint and endpoint not in ("(none)", "") else None,
        allowed_ips=tuple(allowed),
        last_handshake=(seconds + nanos / 1e9) if seconds else None,
        rx_bytes=int(fields.get("rx_bytes", "0")),
        tx_bytes=int(fields.get("tx_bytes", "0")),
        persistent_keepalive=int(fields.get("persistent_keepalive_interval", "0")),
    )


def parse_get(reply: str) -> DeviceStatus:
    """Parse a ``get`` reply into a :class:`DeviceStatus`, failing on a non-zero errno."""
    errno = parse_errno(reply)
    if errno != 0:
        raise MeshError(f"WireGuard UAPI get failed with errno={errno}")
    device: dict[str, str] = {}
    peers: list[PeerStatus] = []
    current: dict[str, str] | None = None
    allowed: list[str] = []
    try:
        for line in reply.splitlines():
            if not line or line.startswith("errno="):
                continue
            key, sep, value = line.partition("=")
            if not sep:
                raise MeshError(f"WireGuard UAPI line {line[:60]!r} has no '='")
            if key == "public_key":
                if current is not None:
                    peers.append(_finish_peer(current, allowed))
                current, allowed = {"public_key": value}, []
            elif current is None:
                device[key] = value
            elif key == "allowed_ip":
                allowed.append(value)
            else:
                current[key] = value
        if current is not None:
            peers.append(_finish_peer(current, allowed))
        private_hex = device.get("private_key")
        return DeviceStatus(
            public_key=public_key(key_from_hex(private_hex)) if private_hex else None,
            listen_port=int(device.get("listen_port", "0")),
            peers=tuple(peers),
        )
    except ValueError as error:
        raise MeshError(f"WireGuard UAPI reply is malformed: {error}") from None


class UapiClient:
    """Talks to one wireguard-go device over its UAPI unix socket."""

    def __init__(self, path: Path, timeout: float = 5.0) -> None:
        self.path = path
        self.timeout = timeout

    def _exchange(self, request: bytes) -> str:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.timeout)
                sock.connect(str(self.path))
                sock.sendall(request)
                buffer = b""
                while not _REPLY_END.search(buffer):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    buffer += chunk
                    if len(buffer) > _MAX_REPLY:
                        raise MeshError(
                            f"WireGuard UAPI reply on {self.path} is larger than {_MAX_REPLY} bytes"
                        )
        except (FileNotFoundError, ConnectionRefusedError):
            raise MeshError(
                f"WireGuard interface socket {self.path} is not there: run `shardpool mesh up`"
            ) from None
        except OSError as error:
            raise MeshError(f"cannot talk to WireGuard on {self.path}: {error.strerror or error}") from None
        return buffer.decode("ascii", errors="replace")

    def get(self) -> DeviceStatus:
        """Read the device and all of its peers."""
        return parse_get(self._exchange(encode_get()))

    def set(self, request: bytes) -> None:
        """Send a ``set`` request built by :func:`encode_set`; a non-zero errno becomes a MeshError."""
        errno = parse_errno(self._exchange(request))
        if errno != 0:
            raise MeshError(
                f"WireGuard refused the configuration on {self.path} (errno={errno}): {_errno_hint(errno)}"
            )


def _errno_hint(errno: int) -> str:
    """Explain a UAPI errno; wireguard-go reports them negated (``errno=-98``)."""
    code = abs(errno)
    if code == 98:
        return "the UDP listen port is already in use, pick another with --listen-port"
    return os.strerror(code) if code else "unknown error"
