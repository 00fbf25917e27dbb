"""Regression tests for token hygiene and strict input checks in the mesh (issue 9, section 5).

Each test names a hole that existed before: a name with a trailing newline passed the ``$``
anchor, a NaN timestamp passed every freshness comparison, a revoked or removed member's token
still admitted machines, and a token file readable by every local user was accepted.
"""

from __future__ import annotations

import json
import math
import os
import time

import pytest

from mesh.addresses import parse_interface_name
from mesh.cli.parser import main
from mesh.control.client import http_request, request_join
from mesh.control.model import RosterEntry, check_name
from mesh.control.protocol import ProtocolError, open_join_request, seal_join_request
from mesh.control.roster import AdmitRequest, JoinRefused
from mesh.control.token import JoinToken, new_token, parse_token, secret_hash
from mesh.errors import MeshError
from mesh.units import parse_duration
from mesh.wireguard.keys import generate_private_key, public_key
from tests.helpers.mesh_hosts import InProcessCoordinator, write_coordinator_state

COORD_PRIVATE = generate_private_key()


@pytest.fixture
def coordinator(tmp_path):
    service = InProcessCoordinator(tmp_path)
    yield service
    service.close()


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _new_key() -> str:
    return public_key(generate_private_key())


def _snapshot(coordinator: InProcessCoordinator) -> tuple[object, object]:
    return coordinator.store.roster(), coordinator.store.counts()


# --- names and interface names: fullmatch, so "a\n" is not "a" -----------------------------------


@pytest.mark.parametrize("name", ["a\n", "gpu-b\n"])
def test_member_name_with_a_newline_is_refused_by_every_check(name: str) -> None:
    with pytest.raises(MeshError, match="member name"):
        check_name(name)
    with pytest.raises(MeshError, match="member name"):
        RosterEntry.from_json({"name": name, "address": "198.51.100.2", "public_key": _new_key()})


def test_join_request_for_a_name_with_a_newline_is_refused_and_admits_nobody(coordinator) -> None:
    token = coordinator.invite()
    before = _snapshot(coordinator)
    with pytest.raises(MeshError, match="refused the join: member name 'a\\\\n' is invalid"):
        request_join(token, "a\n", _new_key(), None)
    assert _snapshot(coordinator) == before


def test_interface_name_with_a_newline_is_refused() -> None:
    assert parse_interface_name("shardpool0") == "shardpool0"
    with pytest.raises(MeshError, match="--interface"):
        parse_interface_name("shardpool0\n")


def test_cli_refuses_a_name_with_a_newline_in_one_line(capsys, coordinator) -> None:
    state = write_coordinator_state(coordinator)
    code, _, err = _cli(capsys, "remove", "a\n", "--state-dir", str(state))
    assert code == 2
    assert err.count("\n") == 1 and "member name 'a\\n' is invalid" in err


# --- timestamps from the network or a token must be finite ------------------------------------


@pytest.mark.parametrize("stamp", [math.nan, 10**400], ids=["nan", "int-400-digits"])
def test_join_request_with_a_non_finite_timestamp_is_refused(stamp: float) -> None:
    token = new_token(public_key(COORD_PRIVATE), "192.0.2.1:51820", 3600)
    envelope, _ = seal_join_request(token, "b", _new_key(), None, now=stamp)
    with pytest.raises(ProtocolError, match="timestamp") as refused:
        open_join_request(envelope, COORD_PRIVATE, {token.token_id: secret_hash(token.secret)}.get)
    assert 400 <= refused.value.status < 500


@pytest.mark.parametrize("stamp", [math.nan, 10**400], ids=["nan", "int-400-digits"])
def test_coordinator_answers_a_non_finite_join_timestamp_with_4xx_and_admits_nobody(
    coordinator, stamp: float
) -> None:
    token = coordinator.invite()
    before = _snapshot(coordinator)
    envelope, _ = seal_join_request(token, "b", _new_key(), None, now=stamp)
    status, _, body = http_request(
        "127.0.0.1", coordinator.port, "POST", "/v1/join", json.dumps(envelope).encode()
    )
    assert status == 400, body
    assert "timestamp is not a finite number" in json.loads(body)["error"]
    assert _snapshot(coordinator) == before


def test_token_expiry_is_never_compared_with_a_non_finite_time() -> None:
    expired = new_token(public_key(COORD_PRIVATE), "192.0.2.1:51820", 60, now=time.time() - 3600)
    with pytest.raises(MeshError, match="expired"):
        expired.check_not_expired()
    with pytest.raises(MeshError, match="fix the clock"):
        expired.check_not_expired(now=math.nan)
    with pytest.raises(MeshError, match="expiry"):
        JoinToken(os.urandom(8), os.urandom(32), public_key(COORD_PRIVATE), "192.0.2.1:1", math.nan)  # type: ignore[arg-type]
    assert parse_token(expired.encode()).expires_at == expired.expires_at


def test_roster_refuses_non_finite_token_expiry_and_clock(coordinator) -> None:
    store = coordinator.store
    counts = store.counts()
    for expiry in (math.inf, math.nan):
        with pytest.raises(MeshError, match="finite"):
            store.add_token(os.urandom(8), secret_hash(os.urandom(32)), expiry, 1)
    assert store.counts() == counts
    token = coordinator.invite(ttl=60)
    request = AdmitRequest(
        token.token_id, token.secret, os.urandom(16), time.time() + 300, "b", _new_key(), None
    )
    with pytest.raises(MeshError, match="finite"):
        store.admit(request, now=math.nan)
    assert store.counts() == counts | {"tokens_usable": counts["tokens_usable"] + 1}


def test_a_ttl_of_hundreds_of_digits_is_a_clear_error_not_a_crash() -> None:
    with pytest.raises(MeshError, match="too long"):
        parse_duration("9" * 400)
    with pytest.raises(MeshError, match="too long"):
        parse_duration("100000w")


# --- revoked invites and removed members ------------------------------------------------------


def _invite(capsys, state, *options: str) -> JoinToken:
    code, out, err = _cli(capsys, "invite", *options, "--state-dir", str(state))
    assert code == 0, err
    return parse_token(out.strip().splitlines()[-1])


def test_a_revoked_invite_is_refused_at_join_with_a_one_line_reason(capsys, coordinator) -> None:
    state = write_coordinator_state(coordinator)
    token = _invite(capsys, state)
    code, out, _ = _cli(capsys, "invite", "--revoke", token.token_id.hex(), "--state-dir", str(state))
    assert code == 0 and f"Revoked invite {token.token_id.hex()}" in out
    before = _snapshot(coordinator)
    with pytest.raises(MeshError) as refused:
        request_join(token, "b", _new_key(), None)
    assert str(refused.value) == (
        "the coordinator refused the join: join token was revoked on the coordinator: "
        "ask for a new one with `shardpool mesh invite`"
    )
    assert _snapshot(coordinator) == before


def test_removing_a_member_revokes_the_multi_use_invite_it_joined_with(capsys, coordinator) -> None:
    state = write_coordinator_state(coordinator)
    token = _invite(capsys, state, "--uses", "3")
    request_join(token, "b", _new_key(), None)
    code, out, _ = _cli(capsys, "remove", "b", "--state-dir", str(state))
    assert code == 0 and f"Revoked 1 invite made for or used by 'b': {token.token_id.hex()}." in out
    # The removed machine still holds the token text, with 2 uses left: it must not get back in.
    for name in ("b", "b-again"):
        with pytest.raises(MeshError, match="join token was revoked"):
            request_join(token, name, _new_key(), None)
    assert [m.name for m in coordinator.store.roster().members] == ["coord"]


def test_removing_a_name_revokes_the_pending_invites_made_for_it(capsys, coordinator) -> None:
    state = write_coordinator_state(coordinator)
    for_c = _invite(capsys, state, "--name", "c")
    unrelated = _invite(capsys, state)
    code, out, _ = _cli(capsys, "remove", "c", "--state-dir", str(state))
    assert code == 0
    assert out.splitlines() == [
        "No active member is called 'c'.",
        f"Revoked 1 invite made for or used by 'c': {for_c.token_id.hex()}.",
    ]
    with pytest.raises(MeshError, match="join token was revoked"):
        request_join(for_c, "c", _new_key(), None)
    assert request_join(unrelated, "d", _new_key(), None).member.name == "d"


def test_an_invite_made_for_a_name_admits_only_that_name(capsys, coordinator) -> None:
    state = write_coordinator_state(coordinator)
    token = _invite(capsys, state, "--name", "gpu-b")
    before = _snapshot(coordinator)
    with pytest.raises(MeshError, match="made for member 'gpu-b', not 'intruder'.*--name gpu-b"):
        request_join(token, "intruder", _new_key(), None)
    assert _snapshot(coordinator) == before
    assert request_join(token, "gpu-b", _new_key(), None).member.address == "198.51.100.2"


def test_revoke_refusal_happens_in_the_admission_transaction(coordinator) -> None:
    token = coordinator.invite(uses=2)
    coordinator.store.revoke_invite(token.token_id)
    request = AdmitRequest(
        token.token_id, token.secret, os.urandom(16), time.time() + 300, "b", _new_key(), None
    )
    counts = coordinator.store.counts()
    with pytest.raises(JoinRefused, match="revoked"):
        coordinator.store.admit(request)
    assert coordinator.store.counts() == counts
    assert [i.uses_left for i in coordinator.store.invites() if i.token_id == token.token_id.hex()] == [2]


# --- the token is not taken from a file other users can read ----------------------------------


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o622])
def test_token_file_that_other_users_can_read_or_change_is_refused(capsys, tmp_path, mode: int) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(new_token(public_key(COORD_PRIVATE), "192.0.2.1:51820", 60).encode() + "\n")
    token_file.chmod(mode)
    code, _, err = _cli(
        capsys, "join", "--token-file", str(token_file), "--state-dir", str(tmp_path / "home")
    )
    assert code == 2
    assert err.count("\n") == 1
    assert f"is {'readable' if mode & 0o044 else 'writable'} by other users (mode {mode:04o})" in err
    assert f"chmod 600 {token_file}" in err
    assert not (tmp_path / "home").exists()
