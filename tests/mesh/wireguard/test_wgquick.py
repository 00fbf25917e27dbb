"""Tests of mesh/wireguard/wgquick.py: rendering, parsing and round trips of wg-quick files."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.errors import MeshError
from mesh.wireguard.keys import generate_private_key, public_key
from mesh.wireguard.wgquick import WgQuickConfig, WgQuickPeer, parse_wgquick, render_wgquick, write_wgquick


def _config(peers: int = 2) -> WgQuickConfig:
    return WgQuickConfig(
        private_key=generate_private_key(),
        addresses=("198.51.100.2/28",),
        listen_port=51820,
        mtu=1420,
        peers=tuple(
            WgQuickPeer(
                public_key=public_key(generate_private_key()),
                allowed_ips=(f"198.51.100.{10 + i}/32",),
                endpoint=f"192.0.2.{10 + i}:51820" if i % 2 == 0 else None,
                persistent_keepalive=25,
                comment=f"peer-{i}",
            )
            for i in range(peers)
        ),
    )


def test_round_trip() -> None:
    config = _config(3)
    assert parse_wgquick(render_wgquick(config)) == config


@settings(max_examples=50, deadline=None)
@given(
    st.integers(min_value=0, max_value=5),
    st.one_of(st.none(), st.integers(min_value=1, max_value=65535)),
    st.one_of(st.none(), st.integers(min_value=1280, max_value=9000)),
)
def test_round_trip_any_shape(peers: int, port: int | None, mtu: int | None) -> None:
    base = _config(peers)
    config = WgQuickConfig(base.private_key, base.addresses, port, mtu, base.peers)
    assert parse_wgquick(render_wgquick(config)) == config


def test_rendered_text_has_the_wg_quick_keys() -> None:
    text = render_wgquick(_config(1))
    for key in (
        "[Interface]",
        "PrivateKey = ",
        "Address = 198.51.100.2/28",
        "ListenPort = 51820",
        "MTU = 1420",
        "[Peer]",
        "PersistentKeepalive = 25",
    ):
        assert key in text


@pytest.mark.skipif(shutil.which("wg") is None, reason="needs wg from wireguard-tools")
def test_wg_strip_style_section_is_accepted_by_wg(tmp_path) -> None:
    # `wg` itself only understands the non-wg-quick keys; drop Address and MTU as `wg-quick strip` does.
    text = "\n".join(
        line for line in render_wgquick(_config(2)).splitlines() if not line.startswith(("Address", "MTU"))
    )
    path = tmp_path / "x.conf"
    path.write_text(text)
    result = subprocess.run(["wg", "syncconf", "nonexistent0", str(path)], capture_output=True, text=True)
    assert "Line unrecognized" not in result.stderr and "Invalid" not in result.stderr


def test_file_is_written_0600(tmp_path) -> None:
    path = tmp_path / "mesh.conf"
    write_wgquick(path, _config())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert parse_wgquick(path.read_text()).listen_port == 51820


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no \\[Interface\\]"),
        ("[Peer]\nPublicKey = x\n", "not valid base64|decodes"),
        ("Address = 1.2.3.4\n", "inside a section"),
        ("[Interface]\nPrivateKey = abc\n", "private|PrivateKey"),
        ("[Interface]\n[Interface]\n", "second"),
        ("[Wat]\n", "unknown section"),
    ],
)
def test_bad_files_are_refused(text: str, message: str) -> None:
    with pytest.raises(MeshError, match=message):
        parse_wgquick(text)
