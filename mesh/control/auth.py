"""Key-based proof of identity on every request between members, and on every reply.

Two members share a pairwise key that nobody else can compute: HKDF-SHA256 over
``X25519(my WireGuard private key, peer WireGuard public key)``, salted with the mesh id and
bound to a purpose label and both public keys. Only root on a member can read its private key,
so only the root processes (syncd, coordinator, agent) can sign.

A request carries five headers: the sender's public key, a timestamp, a random nonce, SHA-256 of
the body (``BODY_HEADER``), and an HMAC-SHA256 over the method, the path with its query, that
SHA-256, the timestamp, the nonce and both public keys. Because the MAC covers the declared
digest, a receiver checks all of it, the nonce last, before it reads more than a small prefix of a
body, then checks the body against the declared digest once it is in
(:class:`mesh.control.verifier.RequestVerifier`, which asks a directory from
:mod:`mesh.control.directory` who a key belongs to).

A removed member that proves its key is told so in a reply signed with the pairwise key, which
the receiver can still compute from the removed member's stored public key. Every reply carries
an HMAC over its status code, SHA-256 of its body and the request's nonce, so a status flipped
on the wire (200 to 403) is detected and never acted on.

This module holds the pairwise keys, the headers and the MACs: it signs requests and replies and
checks replies. Everything is pure functions over (method, path, headers, body), so it plugs into
any HTTP server or client.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import os
import time
from collections.abc import Mapping
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mesh.control.directory import Member
from mesh.errors import MeshError
from mesh.wireguard.keys import decode_key, public_key, shared_secret

__all__ = [
    "BODY_HEADER",
    "CONTROL_PURPOSE",
    "KEY_HEADER",
    "MAC_HEADER",
    "MAX_CLOCK_SKEW",
    "NONCE_HEADER",
    "REPLY_MAC_HEADER",
    "ROSTER_PURPOSE",
    "TIME_HEADER",
    "AuthError",
    "header_value",
    "pair_key",
    "request_mac",
    "request_mac_of_digest",
    "sign_reply",
    "sign_request",
    "verify_reply",
]

KEY_HEADER = "X-Shardpool-Key"
TIME_HEADER = "X-Shardpool-Time"
NONCE_HEADER = "X-Shardpool-Nonce"
MAC_HEADER = "X-Shardpool-Mac"
BODY_HEADER = "X-Shardpool-Body-Sha256"
"""SHA-256 of the request body in lowercase hex: the MAC covers it, so it is proven before the body."""
REPLY_MAC_HEADER = "X-Shardpool-Reply-Mac"

CONTROL_PURPOSE = b"shardpool control v1"
"""Purpose label of the agents' channel between members."""
ROSTER_PURPOSE = b"shardpool roster v1"
"""Purpose label of the roster service (sync, membership, leave) between a member and the coordinator."""

MAX_CLOCK_SKEW = 120.0


class AuthError(MeshError):
    """A request or reply that fails authentication; ``status`` is the HTTP status to answer with.

    ``removed`` is set when the sender proved its key but is no longer a member: that refusal
    may be signed (see :meth:`RequestVerifier.reply_headers`), so the removed member can trust it.
    """

    def __init__(self, message: str, status: int = 401, removed: Member | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.removed = removed


def pair_key(my_private_key: str, peer_public_key: str, mesh_id: str, purpose: bytes) -> bytes:
    """Derive the 32-byte key only this member and the peer can compute, for one purpose in one mesh.

    Both sides get the same key (X25519 is symmetric and the public keys are bound in sorted
    order); a different purpose or mesh gives an unrelated key, so a MAC for one service is
    worthless to another.
    """
    mine = decode_key(public_key(my_private_key), "own public key")
    theirs = decode_key(peer_public_key, "peer public key")
    low, high = sorted((mine, theirs))
    return HKDF(
        algorithm=hashes.SHA256(), length=32, salt=mesh_id.encode("utf-8"), info=purpose + low + high
    ).derive(shared_secret(my_private_key, peer_public_key))


def _mac(key: bytes, *fields: bytes) -> str:
    message = b"".join(len(field).to_bytes(4, "big") + field for field in fields)
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def request_mac(
    key: bytes, method: str, path: str, body: bytes, timestamp: str, nonce: str, sender: str, receiver: str
) -> str:
    """The MAC of one request (its body as sent): what :func:`sign_request` puts in ``MAC_HEADER``."""
    return request_mac_of_digest(
        key, method, path, hashlib.sha256(body).digest(), timestamp, nonce, sender, receiver
    )


def request_mac_of_digest(
    key: bytes,
    method: str,
    path: str,
    body_digest: bytes,
    timestamp: str,
    nonce: str,
    sender: str,
    receiver: str,
) -> str:
    """:func:`request_mac` for a body known by its SHA-256 digest (hashed while it streamed in)."""
    return _mac(
        key,
        b"shardpool request",
        method.encode("ascii", "replace"),
        path.encode("utf-8", "surrogateescape"),
        body_digest,
        timestamp.encode("ascii"),
        nonce.encode("ascii"),
        sender.encode("ascii"),
        receiver.encode("ascii"),
    )


def _reply_mac(key: bytes, status: int, body: bytes, request_nonce: str) -> str:
    return _mac(
        key,
        b"shardpool reply",
        str(status).encode("ascii"),
        hashlib.sha256(body).digest(),
        request_nonce.encode("ascii", "replace"),
    )


def sign_request(
    key: bytes,
    *,
    sender_public: str,
    receiver_public: str,
    method: str,
    path: str,
    body: bytes,
    now: float | None = None,
) -> dict[str, str]:
    """Return the headers that prove ``sender_public`` sent exactly this request to ``receiver_public``.

    ``path`` is the request target as sent, query included.
    """
    moment = time.time() if now is None else now
    if not math.isfinite(moment) or moment < 0:
        raise MeshError(f"cannot sign a request at time {moment!r}: the clock must be a finite Unix time")
    timestamp = f"{moment:.3f}"
    nonce = base64.b64encode(os.urandom(16)).decode("ascii")
    digest = hashlib.sha256(body).digest()
    return {
        KEY_HEADER: sender_public,
        TIME_HEADER: timestamp,
        NONCE_HEADER: nonce,
        BODY_HEADER: digest.hex(),
        MAC_HEADER: request_mac_of_digest(
            key, method, path, digest, timestamp, nonce, sender_public, receiver_public
        ),
    }


def sign_reply(key: bytes, status: int, body: bytes, request_nonce: str) -> dict[str, str]:
    """Return the header that proves this status and body answer the request with ``request_nonce``."""
    return {REPLY_MAC_HEADER: _reply_mac(key, status, body, request_nonce)}


def header_value(headers: Mapping[str, str] | Any, name: str) -> str | None:
    """The one value of header ``name`` (any case), or ``None`` if it is absent, repeated or not text."""
    wanted = name.lower()
    values = [value for key, value in headers.items() if str(key).lower() == wanted]
    return values[0] if len(values) == 1 and isinstance(values[0], str) else None


def verify_reply(
    key: bytes, status: int, headers: Mapping[str, str] | Any, body: bytes, request_nonce: str
) -> None:
    """Check that a reply (status code included) came from the holder of ``key``; raise :class:`AuthError`.

    A caller must not act on the status or body of a reply that fails this check.
    """
    mac = header_value(headers, REPLY_MAC_HEADER)
    if mac is None or not hmac.compare_digest(_reply_mac(key, status, body, request_nonce), mac):
        raise AuthError(
            f"the {status} reply is not signed by the peer's key (missing or wrong {REPLY_MAC_HEADER}): "
            "not trusting it; the peer is down, or something between us altered the reply",
            status=502,
        )
