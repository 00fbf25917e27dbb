"""Tests of mesh/control/protocol.py: the sealed join exchange."""

from __future__ import annotations

import base64
import json
import math
import time
from dataclasses import replace

import pytest

from mesh.control.protocol import (
    MAX_CLOCK_SKEW,
    JoinContext,
    ProtocolError,
    open_join_request,
    open_join_response,
    seal_join_request,
    seal_join_response,
)
from mesh.control.token import new_token, secret_hash
from mesh.wireguard.keys import generate_private_key, public_key

COORD_PRIVATE = generate_private_key()
COORD_PUBLIC = public_key(COORD_PRIVATE)
MEMBER_KEY = public_key(generate_private_key())


def _setup():
    token = new_token(COORD_PUBLIC, "192.0.2.1:51820", 3600)
    hashes = {token.token_id: secret_hash(token.secret)}
    return token, hashes.get


def test_join_round_trip() -> None:
    token, lookup = _setup()
    envelope, joiner_context = seal_join_request(token, "gpu-2", MEMBER_KEY, "192.0.2.2:51820")
    assert token.secret not in json.dumps(envelope).encode()
    assert base64.b64encode(token.secret).decode() not in json.dumps(envelope)
    request, coordinator_context = open_join_request(envelope, COORD_PRIVATE, lookup)
    assert (request.name, request.public_key, request.endpoint, request.secret) == (
        "gpu-2",
        MEMBER_KEY,
        "192.0.2.2:51820",
        token.secret,
    )
    assert coordinator_context == joiner_context
    reply = seal_join_response(coordinator_context, {"address": "198.51.100.2"})
    assert open_join_response(joiner_context, reply) == {"address": "198.51.100.2"}


def test_wrong_secret_fails_authentication() -> None:
    token, lookup = _setup()
    forged = replace(token, secret=bytes(32))
    envelope, _ = seal_join_request(forged, "b", MEMBER_KEY, None)
    with pytest.raises(ProtocolError, match="failed authentication"):
        open_join_request(envelope, COORD_PRIVATE, lookup)


def test_token_for_another_coordinator_is_refused() -> None:
    token, lookup = _setup()
    other = replace(token, coordinator_key=public_key(generate_private_key()))
    envelope, _ = seal_join_request(other, "b", MEMBER_KEY, None)
    with pytest.raises(ProtocolError, match="made for coordinator key"):
        open_join_request(envelope, COORD_PRIVATE, lookup)


def test_unknown_token_id_is_refused() -> None:
    token, _ = _setup()
    envelope, _ = seal_join_request(token, "b", MEMBER_KEY, None)
    with pytest.raises(ProtocolError, match="unknown join token"):
        open_join_request(envelope, COORD_PRIVATE, lambda token_id: None)


@pytest.mark.parametrize("field", ["ciphertext", "ephemeral", "aead_nonce", "token_id"])
def test_tampering_with_any_field_is_detected(field: str) -> None:
    token, lookup = _setup()
    envelope, _ = seal_join_request(token, "b", MEMBER_KEY, None)
    raw = bytearray(base64.b64decode(envelope[field]))
    raw[0] ^= 1
    envelope[field] = base64.b64encode(bytes(raw)).decode()
    with pytest.raises(ProtocolError):
        open_join_request(envelope, COORD_PRIVATE, lambda token_id: lookup(token.token_id))


def test_stale_or_future_timestamps_are_refused() -> None:
    token, lookup = _setup()
    for offset in (-MAX_CLOCK_SKEW - 5, MAX_CLOCK_SKEW + 5):
        envelope, _ = seal_join_request(token, "b", MEMBER_KEY, None, now=time.time() + offset)
        with pytest.raises(ProtocolError, match="clock"):
            open_join_request(envelope, COORD_PRIVATE, lookup)


@pytest.mark.parametrize("stamp", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_non_finite_timestamps_are_refused_as_malformed(stamp: float) -> None:
    token, lookup = _setup()
    envelope, _ = seal_join_request(token, "b", MEMBER_KEY, None, now=stamp)
    with pytest.raises(ProtocolError, match="timestamp is not a finite number") as refused:
        open_join_request(envelope, COORD_PRIVATE, lookup)
    assert refused.value.status == 400


@pytest.mark.parametrize(
    "envelope",
    [
        None,
        [],
        "x",
        {},
        {"v": 2},
        {"v": 1, "token_id": 5},
        {"v": 1, "token_id": "AAAA"},
        {"v": 1, "token_id": "!!"},
    ],
)
def test_malformed_envelopes_are_refused(envelope) -> None:
    _, lookup = _setup()
    with pytest.raises(ProtocolError):
        open_join_request(envelope, COORD_PRIVATE, lookup)


def test_reply_from_an_impostor_is_refused() -> None:
    token, _ = _setup()
    _, joiner_context = seal_join_request(token, "b", MEMBER_KEY, None)
    impostor = JoinContext(reply_key=bytes(32), request_nonce=joiner_context.request_nonce)
    with pytest.raises(ProtocolError, match="does not hold the coordinator key"):
        open_join_response(joiner_context, seal_join_response(impostor, {"address": "198.51.100.14"}))
    with pytest.raises(ProtocolError, match="does not hold the coordinator key"):
        open_join_response(joiner_context, {"garbage": True})


def test_reply_is_bound_to_its_request() -> None:
    token, lookup = _setup()
    envelope_a, context_a = seal_join_request(token, "a", MEMBER_KEY, None)
    _, coordinator_a = open_join_request(envelope_a, COORD_PRIVATE, lookup)
    _, context_b = seal_join_request(token, "b", MEMBER_KEY, None)
    reply_a = seal_join_response(coordinator_a, {"ok": 1})
    assert open_join_response(context_a, reply_a) == {"ok": 1}
    with pytest.raises(ProtocolError):
        open_join_response(context_b, reply_a)
