"""Checking signed requests addressed to this member (:class:`RequestVerifier`), and its nonce caches.

The checks run in this order: the headers are well formed; the sender is a current member (an
unknown key is refused with nothing recorded); the timestamp is finite and within
:data:`mesh.control.auth.MAX_CLOCK_SKEW`; the MAC; then the nonce, in a size-bounded cache of that
member's own (:data:`NONCE_CAP`), so one member can never fill another's. Only then may the body
be parsed. The scheme itself (keys, headers, MACs) is :mod:`mesh.control.auth`.

A streamed body is proven in two steps so that nobody without a member's key can make a receiver
read it: :meth:`RequestVerifier.verify_declared` checks all of the above against the body digest
the request declares in ``BODY_HEADER`` (which the MAC covers) before any body byte is read, and
:meth:`RequestVerifier.check_body` compares the streamed body's digest with it at the end.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import heapq
import hmac
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mesh.control.auth import (
    BODY_HEADER,
    CONTROL_PURPOSE,
    KEY_HEADER,
    MAC_HEADER,
    MAX_CLOCK_SKEW,
    NONCE_HEADER,
    TIME_HEADER,
    AuthError,
    header_value,
    pair_key,
    request_mac_of_digest,
    sign_reply,
)
from mesh.control.directory import Directory, Member
from mesh.errors import MeshError
from mesh.wireguard.keys import decode_key, public_key

__all__ = ["NONCE_CAP", "RequestVerifier"]

NONCE_CAP = 4096
"""Nonces remembered per member; about 17 requests a second sustained over the replay window."""

_HEADER_LIMITS = {KEY_HEADER: 44, TIME_HEADER: 24, NONCE_HEADER: 24, MAC_HEADER: 64}
_TIME_TEXT = re.compile(r"[0-9]{1,12}(?:\.[0-9]{1,6})?")
_MAC_TEXT = re.compile(r"[0-9a-f]{64}")
_DIGEST_TEXT = _MAC_TEXT
_SIGN_HINT = "sign requests with mesh.control.auth.sign_request"
_MAX_KEYS = 65536


@dataclass(frozen=True)
class _Proof:
    sender: str
    timestamp_text: str
    timestamp: float
    nonce: str
    mac: str


def _auth_headers(headers: Mapping[str, str] | Any) -> dict[str, str]:
    canonical = {name.lower(): name for name in _HEADER_LIMITS}
    found: dict[str, str] = {}
    for key, value in headers.items():
        name = canonical.get(str(key).lower())
        if name is None:
            continue
        if name in found:
            raise AuthError(f"request has {name} more than once: send it once")
        if not isinstance(value, str) or len(value) > _HEADER_LIMITS[name]:
            raise AuthError(f"request header {name} is longer than {_HEADER_LIMITS[name]} characters")
        found[name] = value
    for name in _HEADER_LIMITS:
        if name not in found:
            raise AuthError(f"request has no {name} header: {_SIGN_HINT}")
    return found


def _parse_proof(headers: Mapping[str, str] | Any) -> _Proof:
    found = _auth_headers(headers)
    sender = found[KEY_HEADER]
    try:
        decode_key(sender, KEY_HEADER)
    except MeshError:
        raise AuthError(f"request header {KEY_HEADER} is not a WireGuard public key") from None
    timestamp_text = found[TIME_HEADER]
    timestamp = float(timestamp_text) if _TIME_TEXT.fullmatch(timestamp_text) else math.nan
    if not math.isfinite(timestamp):
        raise AuthError(f"request header {TIME_HEADER} is not a finite Unix time in seconds")
    nonce = found[NONCE_HEADER]
    try:
        nonce_ok = len(base64.b64decode(nonce, validate=True)) == 16
    except (binascii.Error, ValueError):
        nonce_ok = False
    if not nonce_ok:
        raise AuthError(f"request header {NONCE_HEADER} is not 16 bytes of base64")
    mac = found[MAC_HEADER]
    if not _MAC_TEXT.fullmatch(mac):
        raise AuthError(f"request header {MAC_HEADER} is not 64 lowercase hex digits")
    return _Proof(sender, timestamp_text, timestamp, nonce, mac)


def _declared_digest(headers: Mapping[str, str] | Any) -> bytes | None:
    """The body digest a request declares in ``BODY_HEADER``, or ``None`` when it sends none."""
    values = [value for key, value in headers.items() if str(key).lower() == BODY_HEADER.lower()]
    if not values:
        return None
    if len(values) > 1:
        raise AuthError(f"request has {BODY_HEADER} more than once: send it once")
    if not isinstance(values[0], str) or not _DIGEST_TEXT.fullmatch(values[0]):
        raise AuthError(f"request header {BODY_HEADER} is not 64 lowercase hex digits (SHA-256 of the body)")
    return bytes.fromhex(values[0])


class _NonceWindow:
    """One member's recent nonces, each kept until its request's timestamp is too old to be accepted."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.expiry_by_nonce: dict[str, float] = {}
        self.expiries: list[tuple[float, str]] = []

    def add(self, nonce: str, expires_at: float, now: float) -> str | None:
        """Record ``nonce``; return why it is refused ("replay" or "full"), or ``None``."""
        while self.expiries and self.expiries[0][0] < now:
            _, old = heapq.heappop(self.expiries)
            del self.expiry_by_nonce[old]
        if nonce in self.expiry_by_nonce:
            return "replay"
        if len(self.expiry_by_nonce) >= self.cap:
            return "full"
        self.expiry_by_nonce[nonce] = expires_at
        heapq.heappush(self.expiries, (expires_at, nonce))
        return None


class RequestVerifier:
    """Checks signed requests addressed to this member; thread-safe.

    Holds this member's private key, the mesh id, a :class:`Directory`, the pairwise keys it
    derived, and one size-bounded nonce cache per current member.
    """

    def __init__(
        self,
        private_key: str,
        mesh_id: str,
        directory: Directory,
        *,
        purpose: bytes = CONTROL_PURPOSE,
        nonce_cap: int = NONCE_CAP,
        max_skew: float = MAX_CLOCK_SKEW,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if nonce_cap < 1:
            raise MeshError("nonce_cap must be at least 1")
        self.private_key = private_key
        self.public_key = public_key(private_key)
        self.mesh_id = mesh_id
        self.directory = directory
        self.purpose = purpose
        self.nonce_cap = nonce_cap
        self.max_skew = max_skew
        self.clock = clock
        self._keys: dict[str, bytes] = {}
        self._nonces: dict[str, _NonceWindow] = {}
        self._lock = threading.Lock()

    def key_for(self, peer_public_key: str) -> bytes:
        """Return (and remember) the pairwise key shared with ``peer_public_key`` for this purpose."""
        with self._lock:
            key = self._keys.get(peer_public_key)
        if key is None:
            key = pair_key(self.private_key, peer_public_key, self.mesh_id, self.purpose)
            with self._lock:
                if len(self._keys) >= _MAX_KEYS:
                    self._keys.clear()
                self._keys[peer_public_key] = key
        return key

    def _lookup(self, sender: str) -> Member:
        try:
            member = self.directory.lookup(sender)
        except MeshError as error:
            raise AuthError(f"cannot check the sender's key: {error}") from None
        if member is None:
            raise AuthError(
                f"sender key {sender[:12]}... is not in this mesh: join it with `shardpool mesh join`"
            )
        return member

    def verify(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str] | Any,
        body: bytes,
        now: float | None = None,
    ) -> Member:
        """Return the current member that sent this exact request, or raise :class:`AuthError`.

        Nothing is recorded for a stranger, a removed member, a stale or non-finite time, or a
        wrong MAC; only a proven request from a current member uses a slot in that member's own
        nonce cache.
        """
        return self.verify_digest(method, path, headers, hashlib.sha256(body).digest(), now)

    def precheck(self, headers: Mapping[str, str] | Any, now: float | None = None) -> Member:
        """Who a request says it is from, before anything costly: well-formed proof, known sender,
        fresh time. Records nothing and proves nothing; the request still needs :meth:`verify`
        or :meth:`verify_declared`.

        A removed member passes this check (its refusal is decided, and signed, by the full check).
        """
        proof = _parse_proof(headers)
        member = self._lookup(proof.sender)
        self._check_time(proof, self.clock() if now is None else now)
        return member

    def verify_declared(
        self, method: str, path: str, headers: Mapping[str, str] | Any, now: float | None = None
    ) -> Member:
        """Prove a request before its body is read, against the body digest it declares in ``BODY_HEADER``.

        Everything :meth:`verify` checks is checked here (the MAC covers the declared digest), so a
        request without a current member's key is refused before a single body byte is read. The
        body must then be matched against the declaration with :meth:`check_body` before it is used.
        """
        declared = _declared_digest(headers)
        if declared is None:
            raise AuthError(
                f"request has no {BODY_HEADER} header, needed to prove a request before its body is "
                f"read: {_SIGN_HINT} (update shardpool on the sending member)"
            )
        return self.verify_digest(method, path, headers, declared, now)

    def check_body(self, headers: Mapping[str, str] | Any, body_sha256: bytes) -> None:
        """Check a streamed body's SHA-256 against the digest :meth:`verify_declared` proved."""
        declared = _declared_digest(headers)
        if declared is None or not hmac.compare_digest(declared, body_sha256):
            raise AuthError(
                f"request body does not match the SHA-256 in its signed {BODY_HEADER}: it was changed "
                "on the way; resend it"
            )

    def _check_time(self, proof: _Proof, moment: float) -> None:
        if not math.isfinite(moment):
            raise AuthError("this machine's clock gives a non-finite time: fix the clock", status=500)
        skew = moment - proof.timestamp
        if abs(skew) > self.max_skew:
            raise AuthError(
                f"request time is {skew:+.0f} s off this machine's clock (limit {self.max_skew:.0f} s): "
                "sync both clocks (NTP)"
            )

    def verify_digest(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str] | Any,
        body_sha256: bytes,
        now: float | None = None,
    ) -> Member:
        """:meth:`verify` for a body known by its SHA-256 ``body_sha256``, which the MAC must cover."""
        proof = _parse_proof(headers)
        member = self._lookup(proof.sender)
        moment = self.clock() if now is None else now
        self._check_time(proof, moment)
        try:
            key = self.key_for(proof.sender)
        except MeshError as error:
            raise AuthError(f"cannot derive a key for the sender: {error}") from None
        expected = request_mac_of_digest(
            key, method, path, body_sha256, proof.timestamp_text, proof.nonce, proof.sender, self.public_key
        )
        if not hmac.compare_digest(expected, proof.mac):
            raise AuthError(
                f"request MAC from {member.name} is wrong (tampered, or signed for another receiver or purpose)"
            )
        if not member.current:
            with self._lock:
                self._nonces.pop(proof.sender, None)
            raise AuthError(
                f"{member.name} was removed from the mesh: join again with a new token", 403, removed=member
            )
        self._record(member, proof, moment)
        return member

    def _record(self, member: Member, proof: _Proof, now: float) -> None:
        with self._lock:
            window = self._nonces.get(proof.sender)
            if window is None:
                window = self._nonces[proof.sender] = _NonceWindow(self.nonce_cap)
            refused = window.add(proof.nonce, proof.timestamp + self.max_skew, now)
        if refused == "replay":
            raise AuthError(f"request from {member.name} is a replay (its nonce was already used)")
        if refused == "full":
            raise AuthError(
                f"{member.name} sent more than {self.nonce_cap} requests within {2 * self.max_skew:.0f} s: "
                "slow down and retry"
            )

    def remembered(self, public_key: str) -> int:
        """How many nonces are held for this key (for tests and diagnostics)."""
        with self._lock:
            window = self._nonces.get(public_key)
            return 0 if window is None else len(window.expiry_by_nonce)

    def reply_headers(
        self, peer_public_key: str, status: int, body: bytes, request_headers: Mapping[str, str] | Any
    ) -> dict[str, str]:
        """Sign a reply to a request that :meth:`verify` accepted (or refused as from a removed member)."""
        nonce = header_value(request_headers, NONCE_HEADER)
        if nonce is None:
            raise AuthError(f"request has no single {NONCE_HEADER} header to bind the reply to")
        return sign_reply(self.key_for(peer_public_key), status, body, nonce)
