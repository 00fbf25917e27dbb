"""Tests of mesh/control/auth.py, verifier.py and directory.py: pairwise keys, signed requests and replies, directories and nonce caches."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from mesh.control.auth import (
    CONTROL_PURPOSE,
    KEY_HEADER,
    MAC_HEADER,
    MAX_CLOCK_SKEW,
    NONCE_HEADER,
    REPLY_MAC_HEADER,
    ROSTER_PURPOSE,
    TIME_HEADER,
    AuthError,
    pair_key,
    request_mac,
    sign_reply,
    sign_request,
    verify_reply,
)
from mesh.control.directory import CachedRosterDirectory, FixedDirectory, Member, RosterStoreDirectory
from mesh.control.model import Roster, RosterEntry
from mesh.control.roster import RosterStore
from mesh.control.verifier import RequestVerifier
from mesh.files import write_json
from mesh.wireguard.keys import generate_private_key, public_key

MESH = "testmesh"
RECEIVER_PRIVATE = generate_private_key()
RECEIVER = public_key(RECEIVER_PRIVATE)
SENDER_PRIVATE = generate_private_key()
SENDER = public_key(SENDER_PRIVATE)
OTHER_PRIVATE = generate_private_key()
OTHER = public_key(OTHER_PRIVATE)
BODY = b'{"job": 1}'
PATH = "/v1/jobs?limit=5"


def _verifier(*members: Member, nonce_cap: int = 64) -> RequestVerifier:
    listed = members or (Member("a", "198.51.100.2", SENDER, True), Member("c", "198.51.100.3", OTHER, True))
    return RequestVerifier(RECEIVER_PRIVATE, MESH, FixedDirectory(listed), nonce_cap=nonce_cap)


def _signed(
    private: str = SENDER_PRIVATE,
    method: str = "POST",
    path: str = PATH,
    body: bytes = BODY,
    now: float | None = None,
    receiver: str = RECEIVER,
) -> dict[str, str]:
    key = pair_key(private, receiver, MESH, CONTROL_PURPOSE)
    return sign_request(
        key,
        sender_public=public_key(private),
        receiver_public=receiver,
        method=method,
        path=path,
        body=body,
        now=now,
    )


def test_both_sides_derive_the_same_key_and_it_differs_per_purpose_and_mesh() -> None:
    mine = pair_key(SENDER_PRIVATE, RECEIVER, MESH, CONTROL_PURPOSE)
    assert mine == pair_key(RECEIVER_PRIVATE, SENDER, MESH, CONTROL_PURPOSE)
    assert len(mine) == 32
    assert mine != pair_key(SENDER_PRIVATE, RECEIVER, MESH, ROSTER_PURPOSE)
    assert mine != pair_key(SENDER_PRIVATE, RECEIVER, "othermesh", CONTROL_PURPOSE)
    assert mine != pair_key(SENDER_PRIVATE, OTHER, MESH, CONTROL_PURPOSE)


def test_a_signed_request_round_trips_to_its_member() -> None:
    member = _verifier().verify("POST", PATH, _signed(), BODY)
    assert (member.name, member.address, member.public_key) == ("a", "198.51.100.2", SENDER)


def test_header_names_are_case_insensitive() -> None:
    headers = {name.lower(): value for name, value in _signed().items()}
    assert _verifier().verify("POST", PATH, headers, BODY).name == "a"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", PATH, BODY),
        ("POST", "/v1/other?limit=5", BODY),
        ("POST", "/v1/jobs?limit=6", BODY),
        ("POST", "/v1/jobs", BODY),
        ("POST", PATH, b'{"job": 2}'),
        ("POST", PATH, b""),
    ],
)
def test_a_changed_method_path_query_or_body_is_refused(method: str, path: str, body: bytes) -> None:
    verifier = _verifier()
    with pytest.raises(AuthError, match="MAC from a is wrong") as caught:
        verifier.verify(method, path, _signed(), body)
    assert caught.value.status == 401
    assert verifier.remembered(SENDER) == 0


@pytest.mark.parametrize("header", [TIME_HEADER, NONCE_HEADER, MAC_HEADER])
def test_a_changed_time_nonce_or_mac_is_refused(header: str) -> None:
    headers = _signed()
    replacement = {
        TIME_HEADER: f"{float(headers[TIME_HEADER]) + 1:.3f}",
        NONCE_HEADER: _signed()[NONCE_HEADER],
        MAC_HEADER: "0" * 64,
    }
    headers[header] = replacement[header]
    with pytest.raises(AuthError, match="MAC from a is wrong"):
        _verifier().verify("POST", PATH, headers, BODY)


def test_a_request_claiming_another_members_key_is_refused() -> None:
    headers = _signed()
    headers[KEY_HEADER] = OTHER
    verifier = _verifier()
    with pytest.raises(AuthError, match="MAC from c is wrong"):
        verifier.verify("POST", PATH, headers, BODY)
    assert verifier.remembered(OTHER) == 0


def test_a_request_signed_for_another_receiver_is_refused() -> None:
    # Same pairwise key would be derived if the sender's key were reused to address OTHER; the
    # MAC names the receiver, so a request meant for one member is worthless at another.
    third_private = generate_private_key()
    headers = _signed(receiver=public_key(third_private))
    with pytest.raises(AuthError, match="MAC from a is wrong"):
        _verifier().verify("POST", PATH, headers, BODY)


def test_a_replayed_request_is_refused() -> None:
    verifier = _verifier()
    headers = _signed()
    verifier.verify("POST", PATH, headers, BODY)
    with pytest.raises(AuthError, match="replay"):
        verifier.verify("POST", PATH, headers, BODY)
    assert verifier.remembered(SENDER) == 1


@pytest.mark.parametrize("offset", [-MAX_CLOCK_SKEW - 5, MAX_CLOCK_SKEW + 5])
def test_stale_and_future_times_are_refused(offset: float) -> None:
    verifier = _verifier()
    with pytest.raises(AuthError, match="off this machine's clock"):
        verifier.verify("POST", PATH, _signed(now=time.time() + offset), BODY)
    assert verifier.remembered(SENDER) == 0


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "1e999", "Infinity", "-5", "1.5e3", ""])
def test_non_finite_or_odd_times_are_refused_even_with_a_valid_mac(text: str) -> None:
    headers = _signed()
    key = pair_key(SENDER_PRIVATE, RECEIVER, MESH, CONTROL_PURPOSE)
    # Re-sign around the hostile time so only the time check can refuse it.
    headers[TIME_HEADER] = text
    headers[MAC_HEADER] = request_mac(key, "POST", PATH, BODY, text, headers[NONCE_HEADER], SENDER, RECEIVER)
    with pytest.raises(AuthError, match="finite Unix time"):
        _verifier().verify("POST", PATH, headers, BODY)


def test_the_verifier_refuses_a_non_finite_clock() -> None:
    with pytest.raises(AuthError, match="non-finite"):
        _verifier().verify("POST", PATH, _signed(), BODY, now=float("nan"))
    with pytest.raises(Exception, match="finite Unix time"):
        _signed(now=float("inf"))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda h: h.pop(KEY_HEADER), "no X-Shardpool-Key header"),
        (lambda h: h.pop(MAC_HEADER), "no X-Shardpool-Mac header"),
        (lambda h: h.update({KEY_HEADER: "x" * 44}), "not a WireGuard public key"),
        (lambda h: h.update({KEY_HEADER: "A" * 5000}), "longer than 44"),
        (lambda h: h.update({NONCE_HEADER: "AAAA"}), "not 16 bytes"),
        (lambda h: h.update({NONCE_HEADER: "!" * 24}), "not 16 bytes"),
        (lambda h: h.update({MAC_HEADER: "Z" * 64}), "64 lowercase hex"),
        (lambda h: h.update({TIME_HEADER: "9" * 100}), "longer than 24"),
    ],
)
def test_missing_garbled_or_oversized_headers_get_a_one_line_401(change, reason: str) -> None:
    headers = _signed()
    change(headers)
    with pytest.raises(AuthError, match=reason) as caught:
        _verifier().verify("POST", PATH, headers, BODY)
    assert caught.value.status == 401 and "\n" not in str(caught.value)


def test_a_header_sent_twice_is_refused() -> None:
    headers = list(_signed().items()) + [(NONCE_HEADER.lower(), _signed()[NONCE_HEADER])]

    class Pairs:
        def items(self):  # noqa: ANN202 - mimics email.message.Message, which keeps repeats
            return headers

    with pytest.raises(AuthError, match="more than once"):
        _verifier().verify("POST", PATH, Pairs(), BODY)


def test_unknown_and_removed_keys_touch_no_nonce_cache() -> None:
    stranger = generate_private_key()
    verifier = _verifier(
        Member("a", "198.51.100.2", SENDER, current=False), Member("c", "198.51.100.3", OTHER, True)
    )
    with pytest.raises(AuthError, match="not in this mesh") as unknown:
        verifier.verify("POST", PATH, _signed(private=stranger), BODY)
    assert unknown.value.status == 401 and unknown.value.removed is None
    for _ in range(5):
        with pytest.raises(AuthError, match="a was removed") as removed:
            verifier.verify("POST", PATH, _signed(), BODY)
        assert removed.value.status == 403 and removed.value.removed.public_key == SENDER
    assert verifier.remembered(SENDER) == 0 and verifier.remembered(public_key(stranger)) == 0
    # A removed key with a wrong MAC is an unsigned 401, not a "you were removed" answer.
    forged = _signed()
    forged[MAC_HEADER] = "0" * 64
    with pytest.raises(AuthError, match="MAC") as wrong:
        verifier.verify("POST", PATH, forged, BODY)
    assert wrong.value.removed is None


def test_each_members_nonce_cache_stays_at_its_cap_under_a_flood() -> None:
    verifier = _verifier(nonce_cap=16)
    now = time.time()
    accepted = 0
    for _ in range(200):
        try:
            verifier.verify("POST", PATH, _signed(now=now), BODY, now=now)
            accepted += 1
        except AuthError as error:
            assert "more than 16 requests" in str(error)
    assert accepted == 16 and verifier.remembered(SENDER) == 16
    # Another member is unaffected by the flooder.
    assert verifier.verify("POST", PATH, _signed(private=OTHER_PRIVATE, now=now), BODY, now=now).name == "c"
    # Once the flood's timestamps are too old to be replayed, their slots are free again.
    later = now + 2 * MAX_CLOCK_SKEW + 1
    assert verifier.verify("POST", PATH, _signed(now=later), BODY, now=later).name == "a"
    assert verifier.remembered(SENDER) == 1


def test_reply_mac_covers_status_body_and_request_nonce() -> None:
    key = pair_key(RECEIVER_PRIVATE, SENDER, MESH, CONTROL_PURPOSE)
    nonce = _signed()[NONCE_HEADER]
    headers = sign_reply(key, 200, b'{"ok": 1}', nonce)
    verify_reply(key, 200, headers, b'{"ok": 1}', nonce)
    verify_reply(key, 200, {REPLY_MAC_HEADER.lower(): headers[REPLY_MAC_HEADER]}, b'{"ok": 1}', nonce)
    for status, body, bound, reply_headers in (
        (403, b'{"ok": 1}', nonce, headers),
        (200, b'{"ok": 2}', nonce, headers),
        (200, b'{"ok": 1}', _signed()[NONCE_HEADER], headers),
        (200, b'{"ok": 1}', nonce, {}),
    ):
        with pytest.raises(AuthError, match="not signed by the peer"):
            verify_reply(key, status, reply_headers, body, bound)
    with pytest.raises(AuthError):
        verify_reply(
            pair_key(RECEIVER_PRIVATE, OTHER, MESH, CONTROL_PURPOSE), 200, headers, b'{"ok": 1}', nonce
        )


def test_verifier_signs_replies_the_sender_can_check() -> None:
    verifier = _verifier()
    request = _signed()
    verifier.verify("POST", PATH, request, BODY)
    reply = verifier.reply_headers(SENDER, 201, b"done", request)
    verify_reply(
        pair_key(SENDER_PRIVATE, RECEIVER, MESH, CONTROL_PURPOSE), 201, reply, b"done", request[NONCE_HEADER]
    )


def test_roster_store_directory_knows_removed_members(tmp_path: Path) -> None:
    store = RosterStore.create(
        tmp_path / "coordinator.db",
        MESH,
        "198.51.100.0/28",
        RosterEntry("coord", "198.51.100.1", RECEIVER, None, True),
    )
    directory = RosterStoreDirectory(store)
    assert directory.lookup(RECEIVER) == Member("coord", "198.51.100.1", RECEIVER, True)
    assert directory.lookup(SENDER) is None
    (tmp_path / "coordinator.db").write_bytes(b"not a database")
    with pytest.raises(Exception, match="cannot read the coordinator database"):
        directory.lookup(RECEIVER)


def test_cached_roster_directory_follows_the_file_and_fails_closed(tmp_path: Path) -> None:
    path = tmp_path / "roster.json"
    directory = CachedRosterDirectory(path, MESH)
    verifier = RequestVerifier(RECEIVER_PRIVATE, MESH, directory)
    with pytest.raises(AuthError, match="cannot read the roster"):
        verifier.verify("POST", PATH, _signed(), BODY)
    members = (
        RosterEntry("coord", "198.51.100.1", RECEIVER, None, True),
        RosterEntry("a", "198.51.100.2", SENDER, None),
    )
    write_json(path, Roster(MESH, "198.51.100.0/28", 1, members).to_json())
    assert verifier.verify("POST", PATH, _signed(), BODY).name == "a"
    write_json(path, Roster(MESH, "198.51.100.0/28", 2, members[:1]).to_json())
    with pytest.raises(AuthError, match="not in this mesh"):
        verifier.verify("POST", PATH, _signed(), BODY)
    write_json(path, Roster("othermesh", "198.51.100.0/28", 3, members).to_json())
    with pytest.raises(AuthError, match="is for mesh othermesh"):
        verifier.verify("POST", PATH, _signed(), BODY)
    path.write_text(json.dumps({"members": "broken"}))
    with pytest.raises(AuthError, match="cannot check the sender's key"):
        verifier.verify("POST", PATH, _signed(), BODY)
