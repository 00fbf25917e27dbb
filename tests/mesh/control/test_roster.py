"""Tests of mesh/control/roster.py, invites.py and roster_db.py: atomic admission, single-use tokens, revocation and address reuse."""

from __future__ import annotations

import os
import sqlite3
import stat
import threading
import time

import pytest

from mesh.addresses import first_address, parse_cidr
from mesh.control.model import RosterEntry
from mesh.control.roster import AdmitRequest, JoinRefused, RosterStore
from mesh.control.roster_db import SCHEMA_VERSION
from mesh.control.token import secret_hash
from mesh.errors import MeshError
from mesh.wireguard.keys import generate_private_key, public_key

COORD_KEY = public_key(generate_private_key())


def _store(tmp_path, cidr: str = "198.51.100.0/28") -> RosterStore:
    address = first_address(parse_cidr(cidr))
    return RosterStore.create(
        tmp_path / "c.db", "mesh1", cidr, RosterEntry("coord", address, COORD_KEY, "192.0.2.1:51820", True)
    )


def _token(store: RosterStore, uses: int = 1, ttl: float = 3600) -> tuple[bytes, bytes]:
    token_id, secret = os.urandom(8), os.urandom(32)
    store.add_token(token_id, secret_hash(secret), time.time() + ttl, uses)
    return token_id, secret


def _request(token: tuple[bytes, bytes], name: str, key: str | None = None) -> AdmitRequest:
    return AdmitRequest(
        token_id=token[0],
        secret=token[1],
        nonce=os.urandom(16),
        nonce_expires_at=time.time() + 300,
        name=name,
        public_key=key or public_key(generate_private_key()),
        endpoint=None,
    )


def test_new_store_has_the_coordinator_and_is_private(tmp_path) -> None:
    store = _store(tmp_path)
    roster = store.roster()
    assert [(m.name, m.address, m.coordinator) for m in roster.members] == [("coord", "198.51.100.1", True)]
    assert roster.revision == 1 and roster.cidr == "198.51.100.0/28"
    assert stat.S_IMODE(os.stat(tmp_path / "c.db").st_mode) == 0o600
    with pytest.raises(MeshError, match="already exists"):
        _store(tmp_path)


def test_admit_allocates_addresses_in_order_and_bumps_revision(tmp_path) -> None:
    store = _store(tmp_path)
    token = _token(store, uses=3)
    assert store.admit(_request(token, "b")).address == "198.51.100.2"
    assert store.admit(_request(token, "c")).address == "198.51.100.3"
    roster = store.roster()
    assert [m.name for m in roster.members] == ["coord", "b", "c"]
    assert roster.revision == 3


def _refused(store: RosterStore, request: AdmitRequest, message: str, now: float | None = None) -> None:
    before, counts = store.roster(), store.counts()
    with pytest.raises(JoinRefused, match=message):
        store.admit(request, now)
    assert store.roster() == before
    assert store.counts() == counts


def test_single_use_token_admits_once(tmp_path) -> None:
    store = _store(tmp_path)
    token = _token(store)
    store.admit(_request(token, "b"))
    _refused(store, _request(token, "c"), "already used")


def test_expired_unknown_and_forged_tokens_are_refused(tmp_path) -> None:
    store = _store(tmp_path)
    token = _token(store, ttl=60)
    _refused(store, _request(token, "b"), "expired", now=time.time() + 120)
    _refused(store, _request((os.urandom(8), token[1]), "b"), "unknown join token")
    _refused(store, _request((token[0], os.urandom(32)), "b"), "secret is wrong")


def test_replayed_nonce_is_refused(tmp_path) -> None:
    store = _store(tmp_path)
    token = _token(store, uses=5)
    request = _request(token, "b")
    store.admit(request)
    replay = AdmitRequest(
        **{**request.__dict__, "name": "c", "public_key": public_key(generate_private_key())}
    )
    _refused(store, replay, "replayed")


def test_name_and_key_collisions_are_refused_without_using_the_token(tmp_path) -> None:
    store = _store(tmp_path)
    token = _token(store, uses=2)
    key = public_key(generate_private_key())
    store.admit(_request(token, "b", key))
    _refused(store, _request(token, "b"), "name 'b' is already taken by 198.51.100.2.*--name")
    _refused(store, _request(token, "c", key), "already belongs to member 'b'")
    assert store.counts()["tokens_usable"] == 1


def test_exhausted_cidr_is_refused_without_using_the_token(tmp_path) -> None:
    store = _store(tmp_path, "198.51.100.0/29")  # 6 hosts: coordinator + 5
    token = _token(store, uses=10)
    for i in range(5):
        store.admit(_request(token, f"m{i}"))
    _refused(store, _request(token, "late"), "no free address left in 198.51.100.0/29")
    assert store.counts()["tokens_usable"] == 5


def test_revoked_address_is_never_reused_and_name_is_free_again(tmp_path) -> None:
    store = _store(tmp_path)
    token = _token(store, uses=3)
    key = public_key(generate_private_key())
    store.admit(_request(token, "b", key))
    revoked = store.revoke("b")
    assert revoked.address == "198.51.100.2"
    assert store.roster().by_name("b") is None
    assert store.lookup_key(key) == (RosterEntry("b", "198.51.100.2", key, None), True)
    again = store.admit(_request(token, "b"))
    assert again.address == "198.51.100.3"


def test_revoking_unknown_or_coordinator_is_refused(tmp_path) -> None:
    store = _store(tmp_path)
    with pytest.raises(MeshError, match="no active member"):
        store.revoke("ghost")
    with pytest.raises(MeshError, match="coordinator itself"):
        store.revoke("coord")


def _race(store: RosterStore, token: tuple[bytes, bytes], tag: str, racers: int = 6) -> list[str]:
    """Let ``racers`` threads admit with one token at the same instant; return their outcomes."""
    barrier = threading.Barrier(racers)
    results: list[str] = []

    def attempt(index: int) -> None:
        request = _request(token, f"{tag}-{index}")
        barrier.wait()
        try:
            store.admit(request)
            results.append("ok")
        except JoinRefused as error:
            results.append(str(error))

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_two_simultaneous_joins_with_one_token_exactly_one_wins(tmp_path) -> None:
    store = _store(tmp_path)
    for round_ in range(3):
        results = _race(store, _token(store), f"r{round_}")
        assert results.count("ok") == 1, results
        assert sum("already used" in r for r in results) == 5
    assert len(store.roster().members) == 4


def test_roster_survives_reopening(tmp_path) -> None:
    store = _store(tmp_path)
    store.admit(_request(_token(store), "b"))
    assert RosterStore(tmp_path / "c.db").roster() == store.roster()


def test_missing_database_is_explained(tmp_path) -> None:
    with pytest.raises(MeshError, match="not a coordinator"):
        RosterStore(tmp_path / "none.db")


# A database as shardpool wrote it before invites could be revoked or made for a name (schema 0).
_SCHEMA_V0 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE members (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL, address TEXT NOT NULL UNIQUE, public_key TEXT NOT NULL,
    endpoint TEXT, coordinator INTEGER NOT NULL DEFAULT 0, joined_at REAL NOT NULL, revoked_at REAL
);
CREATE UNIQUE INDEX active_name ON members(name) WHERE revoked_at IS NULL;
CREATE UNIQUE INDEX active_key ON members(public_key) WHERE revoked_at IS NULL;
CREATE TABLE tokens (
    token_id BLOB PRIMARY KEY, secret_hash BLOB NOT NULL, created_at REAL NOT NULL,
    expires_at REAL NOT NULL, uses_left INTEGER NOT NULL
);
CREATE TABLE nonces (nonce BLOB PRIMARY KEY, expires_at REAL NOT NULL);
"""


def _old_database(path, token_id: bytes, secret: bytes) -> None:
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(_SCHEMA_V0)
    db.executemany(
        "INSERT INTO meta(key, value) VALUES (?, ?)",
        [("mesh_id", "old"), ("cidr", "198.51.100.0/28"), ("revision", "2"), ("created_at", "1")],
    )
    db.execute(
        "INSERT INTO members(name, address, public_key, endpoint, coordinator, joined_at) VALUES (?, ?, ?, ?, 1, 1)",
        ("coord", "198.51.100.1", COORD_KEY, "192.0.2.1:51820"),
    )
    db.execute(
        "INSERT INTO members(name, address, public_key, joined_at) VALUES (?, ?, ?, 2)",
        ("b", "198.51.100.2", public_key(generate_private_key())),
    )
    db.execute(
        "INSERT INTO tokens VALUES (?, ?, 1, ?, 2)", (token_id, secret_hash(secret), time.time() + 3600)
    )
    db.close()


def test_database_from_before_invite_revocation_is_migrated_on_open(tmp_path) -> None:
    token = (os.urandom(8), os.urandom(32))
    _old_database(tmp_path / "old.db", *token)
    store = RosterStore(tmp_path / "old.db")
    with sqlite3.connect(tmp_path / "old.db") as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 1
    assert [m.name for m in store.roster().members] == ["coord", "b"]
    [old] = store.invites()
    assert (old.token_id, old.uses_left, old.member_name, old.revoked_at, old.joined) == (
        token[0].hex(),
        2,
        None,
        None,
        (),
    )
    assert store.admit(_request(token, "c")).address == "198.51.100.3"
    assert store.invites()[0].joined == ("c",)
    # Opening it again finds it current and changes nothing.
    assert RosterStore(tmp_path / "old.db").roster() == store.roster()
    assert store.remove("c").revoked_invites == (token[0].hex(),)
    _refused(store, _request(token, "d"), "revoked")


def test_database_from_a_newer_shardpool_is_refused(tmp_path) -> None:
    store = _store(tmp_path)
    with sqlite3.connect(store.path) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(MeshError, match=f"schema version {SCHEMA_VERSION + 1}.*upgrade shardpool"):
        RosterStore(store.path)


def test_invites_report_their_state_and_who_joined(tmp_path) -> None:
    store = _store(tmp_path)
    now = time.time()
    used, shared, expiring, revoked = (_token(store, uses=n, ttl=60) for n in (1, 3, 1, 1))
    store.admit(_request(used, "b"))
    store.admit(_request(shared, "c"))
    store.admit(_request(shared, "d"))
    store.revoke_invite(revoked[0])
    states = {invite.token_id: invite for invite in store.invites()}
    assert [
        (states[t[0].hex()].state(now), states[t[0].hex()].uses_left)
        for t in (used, shared, expiring, revoked)
    ] == [
        ("used", 0),
        ("active", 1),
        ("active", 1),
        ("revoked", 1),
    ]
    assert states[shared[0].hex()].joined == ("c", "d")
    assert states[expiring[0].hex()].state(now + 120) == "expired"
    assert store.counts()["tokens_usable"] == 2


def test_invite_for_a_name_admits_only_that_name_and_dies_with_remove(tmp_path) -> None:
    store = _store(tmp_path)
    token_id, secret = os.urandom(8), os.urandom(32)
    store.add_token(token_id, secret_hash(secret), time.time() + 60, 2, member_name="b")
    _refused(store, _request((token_id, secret), "c"), "made for member 'b', not 'c'")
    store.admit(_request((token_id, secret), "b"))
    removal = store.remove("b")
    assert removal.member is not None and removal.member.name == "b"
    assert removal.revoked_invites == (token_id.hex(),)
    _refused(store, _request((token_id, secret), "b"), "revoked")


def test_remove_leaves_used_up_expired_and_unrelated_invites_alone(tmp_path) -> None:
    store = _store(tmp_path)
    single = _token(store)
    unrelated = _token(store)
    expired_id = os.urandom(8)
    store.add_token(expired_id, secret_hash(os.urandom(32)), time.time() + 1, 1, member_name="b")
    store.admit(_request(single, "b"))
    removal = store.remove("b", now=time.time() + 2)
    assert removal.revoked_invites == ()
    assert {i.token_id: i.revoked_at for i in store.invites()} == {
        single[0].hex(): None,
        unrelated[0].hex(): None,
        expired_id.hex(): None,
    }


def test_revoking_an_unknown_invite_is_explained(tmp_path) -> None:
    with pytest.raises(
        MeshError, match="no invite has id 0000000000000000: see `shardpool mesh invite --list`"
    ):
        _store(tmp_path).revoke_invite(bytes(8))
