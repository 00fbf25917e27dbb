"""Tests of mesh/wireguard/keys.py: key generation, wg interoperability, files and shared secrets."""

from __future__ import annotations

import base64
import os
import shutil
import stat
import subprocess

import pytest

from mesh.errors import MeshError
from mesh.wireguard.keys import (
    decode_key,
    generate_private_key,
    key_from_hex,
    key_to_hex,
    public_key,
    read_private_key,
    shared_secret,
    write_private_key,
)

needs_wg = pytest.mark.skipif(
    shutil.which("wg") is None, reason="needs wg from wireguard-tools (apt-get install wireguard-tools)"
)


def _wg(*argv: str, stdin: str = "") -> str:
    return subprocess.run(
        ["wg", *argv], input=stdin, capture_output=True, text=True, check=True
    ).stdout.strip()


@needs_wg
def test_our_private_keys_give_the_same_public_key_as_wg_pubkey() -> None:
    for _ in range(20):
        private = generate_private_key()
        assert public_key(private) == _wg("pubkey", stdin=private + "\n")


@needs_wg
def test_keys_from_wg_genkey_are_understood() -> None:
    for _ in range(10):
        private = _wg("genkey")
        assert public_key(private) == _wg("pubkey", stdin=private + "\n")


def test_generated_keys_are_clamped_and_distinct() -> None:
    keys = {generate_private_key() for _ in range(50)}
    assert len(keys) == 50
    for key in keys:
        raw = base64.b64decode(key)
        assert raw[0] & 7 == 0 and raw[31] & 128 == 0 and raw[31] & 64 == 64


def test_shared_secret_is_symmetric() -> None:
    a, b = generate_private_key(), generate_private_key()
    assert shared_secret(a, public_key(b)) == shared_secret(b, public_key(a))
    assert len(shared_secret(a, public_key(b))) == 32


def test_low_order_public_key_is_refused() -> None:
    zero = base64.b64encode(bytes(32)).decode()
    with pytest.raises(MeshError, match="low-order"):
        shared_secret(generate_private_key(), zero)


@pytest.mark.parametrize(
    "bad", ["", "not base64!", base64.b64encode(b"short").decode(), base64.b64encode(bytes(33)).decode()]
)
def test_bad_key_text_is_refused_with_a_clear_message(bad: str) -> None:
    with pytest.raises(MeshError, match="key"):
        decode_key(bad)


def test_hex_round_trip() -> None:
    key = generate_private_key()
    assert len(key_to_hex(key)) == 64
    assert key_from_hex(key_to_hex(key)) == key


def test_private_key_file_is_0600_and_read_back(tmp_path) -> None:
    path = tmp_path / "private.key"
    key = generate_private_key()
    write_private_key(path, key)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_private_key(path) == key


def test_readable_private_key_file_is_refused(tmp_path) -> None:
    path = tmp_path / "private.key"
    write_private_key(path, generate_private_key())
    os.chmod(path, 0o644)
    with pytest.raises(MeshError, match="chmod 600"):
        read_private_key(path)


def test_missing_private_key_file_is_explained(tmp_path) -> None:
    with pytest.raises(MeshError, match="missing"):
        read_private_key(tmp_path / "nope.key")
