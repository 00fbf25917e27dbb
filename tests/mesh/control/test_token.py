"""Tests of mesh/control/token.py: encoding, parsing, expiry and refusal of damaged tokens."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.control.token import TOKEN_PREFIX, JoinToken, new_token, parse_token, secret_hash
from mesh.errors import MeshError
from mesh.wireguard.keys import generate_private_key, public_key

COORDINATOR = public_key(generate_private_key())


def _token(endpoint: str = "192.0.2.1:51820", ttl: int = 3600) -> JoinToken:
    return new_token(COORDINATOR, endpoint, ttl)


@pytest.mark.parametrize("endpoint", ["192.0.2.1:51820", "gpu-box.example.org:443", "[2001:db8::1]:51820"])
def test_round_trip(endpoint: str) -> None:
    token = _token(endpoint)
    text = token.encode()
    assert text.startswith(TOKEN_PREFIX)
    assert parse_token(text) == token
    assert parse_token(f"  {text}\n") == token


def test_token_carries_a_256_bit_secret_and_the_pinned_key() -> None:
    token = _token()
    assert len(token.secret) == 32 and len(token.token_id) == 8
    assert token.coordinator_key == COORDINATOR
    assert _token().secret != token.secret


def test_secret_hash_is_not_the_secret_and_is_stable() -> None:
    token = _token()
    assert secret_hash(token.secret) == secret_hash(token.secret)
    assert secret_hash(token.secret) != token.secret
    assert len(secret_hash(token.secret)) == 32


def test_expiry_is_checked_locally() -> None:
    token = new_token(COORDINATOR, "192.0.2.1:51820", 60, now=time.time() - 120)
    with pytest.raises(MeshError, match="expired.*mesh invite"):
        token.check_not_expired()
    _token().check_not_expired()


def test_truncated_token_is_refused() -> None:
    text = _token().encode()
    for cut in (10, len(text) // 2, len(text) - 1):
        with pytest.raises(MeshError, match="truncated|garbled"):
            parse_token(text[:cut])


def test_garbled_token_is_refused() -> None:
    text = _token().encode()
    position = len(TOKEN_PREFIX) + 20
    flipped = text[:position] + ("A" if text[position] != "A" else "B") + text[position + 1 :]
    with pytest.raises(MeshError, match="garbled"):
        parse_token(flipped)


@pytest.mark.parametrize("text", ["", "hello", "spm1.", "spm1.!!!!", "spm2.AAAA"])
def test_junk_is_refused(text: str) -> None:
    with pytest.raises(MeshError):
        parse_token(text)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_any_text_gives_a_token_or_a_mesh_error(text: str) -> None:
    try:
        parse_token(text)
    except MeshError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=10_000), st.integers(min_value=0, max_value=255))
def test_any_single_byte_change_is_detected(position: int, value: int) -> None:
    import base64

    body = bytearray(base64.urlsafe_b64decode(_token().encode()[len(TOKEN_PREFIX) :] + "=="))
    index = position % len(body)
    if body[index] == value:
        return
    body[index] = value
    text = TOKEN_PREFIX + base64.urlsafe_b64encode(bytes(body)).decode().rstrip("=")
    with pytest.raises(MeshError):
        parse_token(text)
