"""Join tokens: what a new machine needs to find and trust the coordinator, in one line of text.

A token holds the coordinator's underlay endpoint, its pinned WireGuard public key, an expiry,
a random token id and a 256-bit secret. The coordinator stores only a hash of the secret.

Binary layout (then URL-safe base64 without padding, after the ``spm1.`` prefix)::

    version(1) | token_id(8) | secret(32) | coordinator_key(32) | expires_at(8, big endian)
    | endpoint_len(1) | endpoint(utf-8) | crc32(4) of everything before it
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import secrets
import struct
import time
import zlib
from dataclasses import dataclass

from mesh.addresses import parse_endpoint
from mesh.errors import MeshError
from mesh.wireguard.keys import decode_key, encode_key

__all__ = ["TOKEN_PREFIX", "JoinToken", "find_token_text", "new_token", "parse_token", "secret_hash"]

TOKEN_PREFIX = "spm1."
_VERSION = 1
_HEAD = struct.Struct(">B8s32s32sQB")
_MAX_EXPIRY = 2**64 - 1  # the field is an unsigned 64-bit integer
_FIX = "copy the whole last line printed by `shardpool mesh init` or `shardpool mesh invite`"


@dataclass(frozen=True)
class JoinToken:
    """A decoded join token."""

    token_id: bytes
    secret: bytes
    coordinator_key: str
    endpoint: str
    expires_at: int

    def __post_init__(self) -> None:
        if type(self.expires_at) is not int or not 0 <= self.expires_at <= _MAX_EXPIRY:
            raise MeshError(
                f"join token expiry {self.expires_at!r} is not a whole number of seconds since 1970: {_FIX}"
            )

    def encode(self) -> str:
        """Serialise the token to its one-line text form."""
        endpoint = self.endpoint.encode("utf-8")
        body = _HEAD.pack(
            _VERSION,
            self.token_id,
            self.secret,
            decode_key(self.coordinator_key, "coordinator key"),
            self.expires_at,
            len(endpoint),
        )
        body += endpoint
        body += struct.pack(">I", zlib.crc32(body))
        return TOKEN_PREFIX + base64.urlsafe_b64encode(body).decode("ascii").rstrip("=")

    def check_not_expired(self, now: float | None = None) -> None:
        """Refuse a token whose expiry has passed, before contacting anybody.

        A non-finite ``now`` is refused too: every comparison with NaN is false, so it would make
        any token look unexpired.
        """
        now = time.time() if now is None else now
        if not math.isfinite(now):
            raise MeshError(f"cannot check the join token's expiry against the time {now!r}: fix the clock")
        if now >= self.expires_at:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.expires_at))
            raise MeshError(
                f"join token expired at {stamp}: ask the coordinator for a new one with `shardpool mesh invite`"
            )


def secret_hash(secret: bytes) -> bytes:
    """Hash a token secret for storage; the coordinator keeps only this, never the secret."""
    return hashlib.sha256(b"shardpool token secret v1\x00" + secret).digest()


def new_token(coordinator_key: str, endpoint: str, ttl_seconds: int, now: float | None = None) -> JoinToken:
    """Make a fresh token with a random id and a 256-bit random secret."""
    parse_endpoint(endpoint)
    now = time.time() if now is None else now
    if not math.isfinite(now) or not math.isfinite(ttl_seconds):
        raise MeshError(f"join token lifetime must be finite: got now={now!r}, ttl={ttl_seconds!r}")
    return JoinToken(
        token_id=secrets.token_bytes(8),
        secret=secrets.token_bytes(32),
        coordinator_key=coordinator_key,
        endpoint=endpoint,
        expires_at=int(now) + ttl_seconds,
    )


def parse_token(text: str) -> JoinToken:
    """Decode and check a token's text, refusing truncated, garbled or unknown-version tokens."""
    cleaned = "".join(text.split())
    if not cleaned.startswith(TOKEN_PREFIX):
        raise MeshError(f"this is not a shardpool join token (it must start with {TOKEN_PREFIX!r}): {_FIX}")
    payload = cleaned[len(TOKEN_PREFIX) :]
    try:
        body = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
    except (binascii.Error, ValueError):
        raise MeshError(f"join token is truncated or garbled (not valid base64): {_FIX}") from None
    if len(body) < _HEAD.size + 4:
        raise MeshError(f"join token is truncated ({len(body)} bytes): {_FIX}")
    content, checksum = body[:-4], struct.unpack(">I", body[-4:])[0]
    if zlib.crc32(content) != checksum:
        raise MeshError(f"join token is truncated or garbled (checksum mismatch): {_FIX}")
    version, token_id, secret, key, expires_at, length = _HEAD.unpack_from(content)
    if version != _VERSION:
        raise MeshError(
            f"join token has version {version}, this shardpool understands {_VERSION}: upgrade shardpool"
        )
    endpoint_bytes = content[_HEAD.size :]
    if len(endpoint_bytes) != length:
        raise MeshError(f"join token is truncated or garbled (endpoint length): {_FIX}")
    try:
        endpoint = endpoint_bytes.decode("utf-8")
        parse_endpoint(endpoint, "token endpoint")
    except (UnicodeDecodeError, MeshError):
        raise MeshError(f"join token carries an invalid coordinator endpoint: {_FIX}") from None
    return JoinToken(token_id, secret, encode_key(key), endpoint, expires_at)


def find_token_text(text: str) -> str:
    """Pick the token out of pasted text: from the last ``spm1.`` to the end, else all of it.

    So the whole output of ``mesh init``/``mesh invite`` (token alone on its last line) works as
    a token file, and a token wrapped over several lines still parses.
    """
    start = text.rfind(TOKEN_PREFIX)
    return text[start:] if start >= 0 else text
