"""Key-based proof of identity on every request between members, and on every reply.

Two members share a pairwise key that nobody else can compute: HKDF-SHA256 over
``X25519(my WireGuard private key, peer WireGuard public key)``, salted with the mesh id and
bound to a purpose label and both public keys. Only root on a member can read its private key,
so only the root processes (syncd, coordinator, agent) can sign.

A request carries four headers: the sender's public key, a timestamp, a random nonce, and an
HMAC-SHA256 over the method, the path with its query, SHA-256 of the body, the timestamp, the
nonce and both public keys. The receiver checks, in this order: the headers are well formed;
the sender is a current member (an unknown key is refused with nothing recorded); the timestamp
is finite and within :data:`MAX_CLOCK_SKEW`; the MAC; then the nonce, in a size-bounded cache
of that member's own, so one member can never fill another's. Only then may the body be parsed.

A removed member that proves its key is told so in a reply signed with the pairwise key, which
the receiver can still compute from the removed member's stored public key. Every reply carries
an HMAC over its status code, SHA-256 of its body and the request's nonce, so a status flipped
on the wire (200 to 403) is detected and never acted on.

Everything here is pure functions over (method, path, headers, body) plus small classes, so it
plugs into any HTTP server or client.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import heapq
import hmac
import math
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mesh.control.model import Roster
from mesh.control.roster import RosterStore
from mesh.errors import MeshError
from mesh.state import read_json
from mesh.wireguard.keys import decode_key, public_key, shared_secret

__all__ = [
    "CONTROL_PURPOSE",
    "KEY_HEADER",
    "MAC_HEADER",
    "MAX_CLOCK_SKEW",
    "NONCE_CAP",
    "NONCE_HEADER",
    "REPLY_MAC_HEADER",
    "ROSTER_PURPOSE",
    "TIME_HEADER",
    "AuthError",
    "CachedRosterDirectory",
    "Directory",
    "FixedDirectory",
    "Member",
    "RequestVerifier",
    "RosterStoreDirectory",
    "pair_key",
    "sign_reply",
    "sign_request",
    "verify_reply",
]

KEY_HEADER = "X-Shardpool-Key"
TIME_HEADER = "X-Shardpool-Time"
NONCE_HEADER = "X-Shardpool-Nonce"
MAC_HEADER = "X-Shardpool-Mac"
REPLY_MAC_HEADER = "X-Shardpool-Reply-Mac"

CONTROL_PURPOSE = b"shardpool control v1"
"""Purpose label of the agents' channel between members."""
ROSTER_PURPOSE = b"shardpool roster v1"
"""Purpose label of the roster service (sync, membership, leave) between a member and the coordinator."""

MAX_CLOCK_SKEW = 120.0
NONCE_CAP = 4096
"""Nonces remembered per member; about 17 requests a second sustained over the replay window."""

_HEADER_LIMITS = {KEY_HEADER: 44, TIME_HEADER: 24, NONCE_HEADER: 24, MAC_HEADER: 64}
_TIME_TEXT = re.compile(r"[0-9]{1,12}(?:\.[0-9]{1,6})?")
_MAC_TEXT = re.compile(r"[0-9a-f]{64}")
_SIGN_HINT = "sign requests with mesh.control.auth.sign_request"
_MAX_KEYS = 65536


class AuthError(MeshError):
    """A request or reply that fails authentication; ``status`` is the HTTP status to answer with.

    ``removed`` is set when the sender proved its key but is no longer a member: that refusal
    may be signed (see :meth:`RequestVerifier.reply_headers`), so the removed member can trust it.
    """

    def __init__(self, message: str, status: int = 401, removed: Member | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.removed = removed


@dataclass(frozen=True)
class Member:
    """What a directory knows about one key: who it is, its mesh address, and whether it is current."""

    name: str
    address: str
    public_key: str
    current: bool


class Directory(Protocol):
    """Answers whether a public key belongs to a member; raises :class:`MeshError` when it cannot tell."""

    def lookup(self, public_key: str) -> Member | None:
        """Return the member with this key (current or removed), or ``None`` for a stranger."""
        ...


class FixedDirectory:
    """A directory over a fixed list of members, for tests and tools."""

    def __init__(self, members: Iterable[Member]) -> None:
        self._members = {member.public_key: member for member in members}

    def lookup(self, public_key: str) -> Member | None:
        """Return the listed member with this key, if any."""
        return self._members.get(public_key)


class RosterStoreDirectory:
    """The coordinator's directory: its SQLite roster, which also remembers removed members."""

    def __init__(self, store: RosterStore) -> None:
        self.store = store

    def lookup(self, public_key: str) -> Member | None:
        """Return the newest member row with this key; fail closed if the database cannot be read."""
        try:
            found = self.store.lookup_key(public_key)
        except sqlite3.Error as error:
            raise MeshError(f"cannot read the coordinator database {self.store.path}: {error}") from None
        if found is None:
            return None
        entry, revoked = found
        return Member(entry.name, entry.address, entry.public_key, current=not revoked)


class CachedRosterDirectory:
    """A member's directory: its cached roster file, re-read whenever the file changes.

    A missing, corrupt or foreign roster refuses every key (fails closed).
    """

    def __init__(self, roster_path: Path, mesh_id: str) -> None:
        self.roster_path = roster_path
        self.mesh_id = mesh_id
        self._stamp: tuple[int, int, int] | None = None
        self._roster: Roster | None = None
        self._lock = threading.Lock()

    def _current_roster(self) -> Roster:
        try:
            info = os.stat(self.roster_path)
        except OSError as error:
            raise MeshError(
                f"cannot read the roster {self.roster_path} ({error.strerror}): refusing every request until "
                "the sync daemon writes it (see `shardpool mesh status`)"
            ) from None
        stamp = (info.st_ino, info.st_mtime_ns, info.st_size)
        # A file changed within the filesystem's timestamp granularity may keep its stamp: re-read it.
        recent = time.time() - info.st_mtime < 2.0
        with self._lock:
            if stamp != self._stamp or self._roster is None or recent:
                roster = Roster.from_json(read_json(self.roster_path))
                if roster.mesh_id != self.mesh_id:
                    raise MeshError(
                        f"roster {self.roster_path} is for mesh {roster.mesh_id}, not {self.mesh_id}: "
                        "refusing every request"
                    )
                self._roster, self._stamp = roster, stamp
            return self._roster

    def lookup(self, public_key: str) -> Member | None:
        """Return the roster member with this key; the roster only lists current members."""
        entry = self._current_roster().by_key(public_key)
        if entry is None:
            return None
        return Member(entry.name, entry.address, entry.public_key, current=True)


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


def _request_mac(
    key: bytes, method: str, path: str, body: bytes, timestamp: str, nonce: str, sender: str, receiver: str
) -> str:
    return _digest_mac(key, method, path, hashlib.sha256(body).digest(), timestamp, nonce, sender, receiver)


def _digest_mac(
    key: bytes,
    method: str,
    path: str,
    body_digest: bytes,
    timestamp: str,
    nonce: str,
    sender: str,
    receiver: str,
) -> str:
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
    return {
        KEY_HEADER: sender_public,
        TIME_HEADER: timestamp,
        NONCE_HEADER: nonce,
        MAC_HEADER: _request_mac(key, method, path, body, timestamp, nonce, sender_public, receiver_public),
    }


def sign_reply(key: bytes, status: int, body: bytes, request_nonce: str) -> dict[str, str]:
    """Return the header that proves this status and body answer the request with ``request_nonce``."""
    return {REPLY_MAC_HEADER: _reply_mac(key, status, body, request_nonce)}


def _header(headers: Mapping[str, str] | Any, name: str) -> str | None:
    wanted = name.lower()
    values = [value for key, value in headers.items() if str(key).lower() == wanted]
    return values[0] if len(values) == 1 and isinstance(values[0], str) else None


def verify_reply(
    key: bytes, status: int, headers: Mapping[str, str] | Any, body: bytes, request_nonce: str
) -> None:
    """Check that a reply (status code included) came from the holder of ``key``; raise :class:`AuthError`.

    A caller must not act on the status or body of a reply that fails this check.
    """
    mac = _header(headers, REPLY_MAC_HEADER)
    if mac is None or not hmac.compare_digest(_reply_mac(key, status, body, request_nonce), mac):
        raise AuthError(
            f"the {status} reply is not signed by the peer's key (missing or wrong {REPLY_MAC_HEADER}): "
            "not trusting it; the peer is down, or something between us altered the reply",
            status=502,
        )


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
        """Check what can be checked before a streamed body arrives: well-formed proof, known sender,
        fresh time. Records nothing; the request still needs :meth:`verify_digest` once its body is in.

        A removed member passes this check (its refusal is decided, and signed, by the full check).
        """
        proof = _parse_proof(headers)
        member = self._lookup(proof.sender)
        self._check_time(proof, self.clock() if now is None else now)
        return member

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
        """:meth:`verify` for a body that was hashed while it streamed in (``body_sha256`` is its digest)."""
        proof = _parse_proof(headers)
        member = self._lookup(proof.sender)
        moment = self.clock() if now is None else now
        self._check_time(proof, moment)
        try:
            key = self.key_for(proof.sender)
        except MeshError as error:
            raise AuthError(f"cannot derive a key for the sender: {error}") from None
        expected = _digest_mac(
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
        nonce = _header(request_headers, NONCE_HEADER)
        if nonce is None:
            raise AuthError(f"request has no single {NONCE_HEADER} header to bind the reply to")
        return sign_reply(self.key_for(peer_public_key), status, body, nonce)
