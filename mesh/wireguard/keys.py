"""WireGuard keys: X25519 key pairs in WireGuard's base64 form, made and kept on this machine.

A private key is generated here, written once with mode 0600 and never leaves the machine;
only its public half goes into join requests and rosters.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from mesh.errors import MeshError
from mesh.files import atomic_write

__all__ = [
    "KEY_LEN",
    "clamp",
    "decode_key",
    "encode_key",
    "generate_private_key",
    "key_from_hex",
    "key_to_hex",
    "public_key",
    "read_private_key",
    "shared_secret",
    "write_private_key",
]

KEY_LEN = 32


def clamp(raw: bytes) -> bytes:
    """Clamp a 32-byte scalar the way Curve25519 (and ``wg genkey``) does, so stored keys are canonical."""
    if len(raw) != KEY_LEN:
        raise MeshError(f"a WireGuard key has {KEY_LEN} bytes, got {len(raw)}: use a key made by `wg genkey`")
    data = bytearray(raw)
    data[0] &= 248
    data[31] &= 127
    data[31] |= 64
    return bytes(data)


def encode_key(raw: bytes) -> str:
    """Encode 32 key bytes as WireGuard's 44-character base64 text."""
    if len(raw) != KEY_LEN:
        raise MeshError(f"a WireGuard key has {KEY_LEN} bytes, got {len(raw)}")
    return base64.b64encode(raw).decode("ascii")


def decode_key(text: str, what: str = "key") -> bytes:
    """Decode WireGuard base64 key text into 32 bytes, refusing anything else with a clear message."""
    cleaned = text.strip()
    try:
        raw = base64.b64decode(cleaned, validate=True)
    except (binascii.Error, ValueError):
        raise MeshError(
            f"{what} is not valid base64: expected 44 characters like the output of `wg pubkey`"
        ) from None
    if len(raw) != KEY_LEN or len(cleaned) != 44:
        raise MeshError(f"{what} decodes to {len(raw)} bytes, not {KEY_LEN}: expected a WireGuard key")
    return raw


def generate_private_key() -> str:
    """Make a new clamped X25519 private key with ``cryptography`` and return it as base64."""
    raw = X25519PrivateKey.generate().private_bytes_raw()
    return encode_key(clamp(raw))


def public_key(private_key: str) -> str:
    """Derive the base64 public key of a base64 private key, exactly as ``wg pubkey`` does."""
    raw = decode_key(private_key, "private key")
    public = X25519PrivateKey.from_private_bytes(raw).public_key().public_bytes_raw()
    return encode_key(public)


def shared_secret(private_key: str, peer_public_key: str) -> bytes:
    """Compute the X25519 shared secret of our private key and a peer's public key.

    A low-order peer key would give an all-zero secret; it is refused so no key is derived from it.
    """
    ours = X25519PrivateKey.from_private_bytes(decode_key(private_key, "private key"))
    theirs = X25519PublicKey.from_public_bytes(decode_key(peer_public_key, "public key"))
    try:
        return ours.exchange(theirs)
    except ValueError:
        raise MeshError("peer public key is a low-order point: refusing to derive keys from it") from None


def key_to_hex(key: str) -> str:
    """Turn a base64 key into the lowercase hex form the WireGuard UAPI uses."""
    return decode_key(key).hex()


def key_from_hex(text: str) -> str:
    """Turn a UAPI hex key back into base64."""
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise MeshError(f"UAPI key {text[:16]!r}... is not hex") from None
    return encode_key(raw)


def write_private_key(path: Path, private_key: str) -> None:
    """Write a private key atomically with mode 0600 (the file never exists with looser permissions)."""
    decode_key(private_key, "private key")
    atomic_write(path, (private_key + "\n").encode("ascii"), mode=0o600)


def read_private_key(path: Path) -> str:
    """Read this machine's private key, refusing a file that group or others can read."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise MeshError(
            f"private key {path} is missing: this state directory is incomplete, run `shardpool mesh join` again"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise MeshError(f"private key {path} is readable by other users: run `chmod 600 {path}`")
    text = path.read_text(encoding="ascii", errors="replace").strip()
    decode_key(text, f"private key in {path}")
    return text
