"""The join exchange: keys, sealing and replay checks.

Join (one request, one reply, over the coordinator's underlay endpoint):

* The joiner makes an ephemeral X25519 key and computes ``X25519(ephemeral, coordinator_key)``
  with the coordinator key pinned in the token.
* HKDF-SHA256 turns that shared secret into two ChaCha20-Poly1305 keys (request, reply), salted
  with the hash of the token secret and bound to the token id and both public keys. Only a
  holder of the token *and* the coordinator's private key can derive them.
* The request carries the name, public key, endpoint, the token secret itself (so the
  coordinator can check it against its stored hash), a random 16-byte nonce and a timestamp.
  The coordinator refuses timestamps off by more than :data:`MAX_CLOCK_SKEW` and nonces seen
  before, so a recorded request cannot be replayed.
* The reply is sealed with the reply key and bound to the request nonce; a joiner that cannot
  open it is talking to someone other than the pinned coordinator and refuses to join.

Requests between members (roster sync, membership, leave) are authenticated by :mod:`mesh.control.auth`.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mesh.control.auth import MAX_CLOCK_SKEW
from mesh.control.model import check_name
from mesh.control.token import JoinToken, secret_hash
from mesh.errors import MeshError
from mesh.wireguard.keys import decode_key, encode_key, public_key, shared_secret

__all__ = [
    "MAX_CLOCK_SKEW",
    "JoinContext",
    "JoinRequest",
    "ProtocolError",
    "b64d",
    "b64e",
    "open_join_request",
    "open_join_response",
    "seal_join_request",
    "seal_join_response",
]

VERSION = 1
_JOIN_INFO = b"shardpool mesh join v1"


class ProtocolError(MeshError):
    """A request or reply that fails a format, authentication or freshness check."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def b64e(data: bytes) -> str:
    """Standard base64 text of ``data``."""
    return base64.b64encode(data).decode("ascii")


def b64d(value: Any, what: str, size: int | None = None, max_size: int = 8192) -> bytes:
    """Decode a base64 field from untrusted JSON, checking its type and length."""
    if not isinstance(value, str) or len(value) > max_size * 2:
        raise ProtocolError(f"field {what} must be base64 text")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(f"field {what} is not valid base64") from None
    if size is not None and len(data) != size:
        raise ProtocolError(f"field {what} must decode to {size} bytes, not {len(data)}")
    return data


@dataclass(frozen=True)
class JoinRequest:
    """What a joiner asks for, as the coordinator sees it after decryption."""

    token_id: bytes
    secret: bytes
    name: str
    public_key: str
    endpoint: str | None
    nonce: bytes
    timestamp: float


@dataclass(frozen=True)
class JoinContext:
    """Keys and binding of one join exchange, kept to seal or open its reply."""

    reply_key: bytes
    request_nonce: bytes


def _derive(
    shared: bytes, hashed_secret: bytes, token_id: bytes, ephemeral: bytes, coordinator: bytes
) -> tuple[bytes, bytes]:
    material = HKDF(
        algorithm=hashes.SHA256(),
        length=64,
        salt=hashed_secret,
        info=_JOIN_INFO + token_id + ephemeral + coordinator,
    ).derive(shared)
    return material[:32], material[32:]


def _aad(token_id: bytes, coordinator: bytes, ephemeral: bytes) -> bytes:
    return b"shardpool-join-request|" + bytes([VERSION]) + token_id + coordinator + ephemeral


def seal_join_request(
    token: JoinToken, name: str, member_key: str, endpoint: str | None, now: float | None = None
) -> tuple[dict[str, Any], JoinContext]:
    """Encrypt a join request for the coordinator pinned in ``token``; keep the context for the reply."""
    ephemeral = X25519PrivateKey.generate()
    ephemeral_public = ephemeral.public_key().public_bytes_raw()
    coordinator = decode_key(token.coordinator_key, "coordinator key")
    shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(coordinator))
    request_key, reply_key = _derive(
        shared, secret_hash(token.secret), token.token_id, ephemeral_public, coordinator
    )
    nonce = os.urandom(16)
    payload = {
        "name": name,
        "public_key": member_key,
        "endpoint": endpoint,
        "secret": b64e(token.secret),
        "nonce": b64e(nonce),
        "ts": time.time() if now is None else now,
    }
    aead_nonce = os.urandom(12)
    ciphertext = ChaCha20Poly1305(request_key).encrypt(
        aead_nonce, json.dumps(payload).encode("utf-8"), _aad(token.token_id, coordinator, ephemeral_public)
    )
    envelope = {
        "v": VERSION,
        "token_id": b64e(token.token_id),
        "coordinator_key": b64e(coordinator),
        "ephemeral": b64e(ephemeral_public),
        "aead_nonce": b64e(aead_nonce),
        "ciphertext": b64e(ciphertext),
    }
    return envelope, JoinContext(reply_key=reply_key, request_nonce=nonce)


def _coordinator_hash(
    envelope: dict[str, Any], lookup_hash: Any, coordinator_private: str
) -> tuple[bytes, bytes, bytes, bytes]:
    version = envelope.get("v") if isinstance(envelope, dict) else None
    if type(version) is not int or version != VERSION:
        raise ProtocolError(
            f"join request must be a JSON object with v={VERSION}: upgrade shardpool on the joining machine"
        )
    token_id = b64d(envelope.get("token_id"), "token_id", 8)
    coordinator = b64d(envelope.get("coordinator_key"), "coordinator_key", 32)
    ephemeral = b64d(envelope.get("ephemeral"), "ephemeral", 32)
    own = decode_key(public_key(coordinator_private))
    if not hmac.compare_digest(coordinator, own):
        raise ProtocolError(
            f"the token was made for coordinator key {encode_key(coordinator)[:12]}..., not this coordinator "
            f"({encode_key(own)[:12]}...): ask this mesh's coordinator for a token with `shardpool mesh invite`",
            403,
        )
    hashed = lookup_hash(token_id)
    if hashed is None:
        raise ProtocolError(
            "unknown join token (this coordinator never issued it): ask for a new one with `shardpool mesh invite`",
            403,
        )
    return token_id, coordinator, ephemeral, hashed


def open_join_request(
    envelope: Any, coordinator_private: str, lookup_hash: Any, now: float | None = None
) -> tuple[JoinRequest, JoinContext]:
    """Decrypt and check a join request; ``lookup_hash(token_id)`` returns the stored secret hash.

    Raises :class:`ProtocolError` for anything malformed, unauthenticated or stale. Nonce reuse
    is checked later, inside the roster transaction.
    """
    token_id, coordinator, ephemeral, hashed = _coordinator_hash(envelope, lookup_hash, coordinator_private)
    aead_nonce = b64d(envelope.get("aead_nonce"), "aead_nonce", 12)
    ciphertext = b64d(envelope.get("ciphertext"), "ciphertext")
    shared = shared_secret(coordinator_private, encode_key(ephemeral))
    request_key, reply_key = _derive(shared, hashed, token_id, ephemeral, coordinator)
    try:
        plaintext = ChaCha20Poly1305(request_key).decrypt(
            aead_nonce, ciphertext, _aad(token_id, coordinator, ephemeral)
        )
    except InvalidTag:
        raise ProtocolError(
            "join request failed authentication (wrong token secret, or tampered in transit): "
            "check the token or ask for a new one with `shardpool mesh invite`",
            403,
        ) from None
    request = _parse_payload(plaintext, token_id)
    now = time.time() if now is None else now
    if not math.isfinite(now) or abs(now - request.timestamp) > MAX_CLOCK_SKEW:
        raise ProtocolError(
            f"join request timestamp is {now - request.timestamp:+.0f} s off this coordinator's clock "
            f"(limit {MAX_CLOCK_SKEW:.0f} s): sync both clocks (NTP) and retry",
            403,
        )
    return request, JoinContext(reply_key=reply_key, request_nonce=request.nonce)


def _parse_payload(plaintext: bytes, token_id: bytes) -> JoinRequest:
    try:
        payload = json.loads(plaintext)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError("join request payload is not JSON") from None
    if not isinstance(payload, dict):
        raise ProtocolError("join request payload is not an object")
    name = check_name(payload.get("name"))  # type: ignore[arg-type]
    key = payload.get("public_key")
    if not isinstance(key, str):
        raise ProtocolError("join request has no public_key")
    decode_key(key, "joiner public key")
    endpoint = payload.get("endpoint")
    if endpoint is not None:
        from mesh.addresses import parse_endpoint

        if not isinstance(endpoint, str):
            raise ProtocolError("join request endpoint is not text")
        parse_endpoint(endpoint, "joiner endpoint")
    timestamp = _finite_timestamp(payload.get("ts"))
    return JoinRequest(
        token_id=token_id,
        secret=b64d(payload.get("secret"), "secret", 32),
        name=name,
        public_key=key,
        endpoint=endpoint,
        nonce=b64d(payload.get("nonce"), "nonce", 16),
        timestamp=timestamp,
    )


def _finite_timestamp(value: Any) -> float:
    """The join request's time as a finite float; NaN would pass every freshness comparison."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ProtocolError("join request has no timestamp")
    try:
        timestamp = float(value)
    except OverflowError:  # an integer with hundreds of digits
        timestamp = math.inf
    if not math.isfinite(timestamp):
        raise ProtocolError("join request timestamp is not a finite number: use `shardpool mesh join`")
    return timestamp


def _reply_aad(context: JoinContext) -> bytes:
    return b"shardpool-join-reply|" + bytes([VERSION]) + context.request_nonce


def seal_join_response(context: JoinContext, payload: dict[str, Any]) -> dict[str, Any]:
    """Encrypt the coordinator's reply so only this joiner can read it and know it is genuine."""
    aead_nonce = os.urandom(12)
    ciphertext = ChaCha20Poly1305(context.reply_key).encrypt(
        aead_nonce, json.dumps(payload).encode("utf-8"), _reply_aad(context)
    )
    return {"v": VERSION, "aead_nonce": b64e(aead_nonce), "ciphertext": b64e(ciphertext)}


def open_join_response(context: JoinContext, envelope: Any) -> dict[str, Any]:
    """Decrypt the reply; failure means the other side does not hold the pinned coordinator key."""
    fail = (
        "the coordinator's reply failed authentication: whoever answered does not hold the coordinator key "
        "pinned in the token; refusing to join (check the endpoint, or get a fresh token)"
    )
    if not isinstance(envelope, dict):
        raise ProtocolError(fail)
    try:
        aead_nonce = b64d(envelope.get("aead_nonce"), "aead_nonce", 12)
        ciphertext = b64d(envelope.get("ciphertext"), "ciphertext", max_size=4 * 1024 * 1024)
        plaintext = ChaCha20Poly1305(context.reply_key).decrypt(aead_nonce, ciphertext, _reply_aad(context))
        payload = json.loads(plaintext)
    except (ProtocolError, InvalidTag, ValueError):
        raise ProtocolError(fail) from None
    if not isinstance(payload, dict):
        raise ProtocolError(fail)
    return payload
