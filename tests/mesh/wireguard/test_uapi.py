"""Tests of mesh/wireguard/uapi.py: request encoding and reply parsing, checked against a real wireguard-go."""

from __future__ import annotations

import pytest
from shardpool_dev.lab import WireGuardGoInNetns, netns_skip_reason

from mesh.errors import MeshError
from mesh.wireguard.backend import PeerConfig
from mesh.wireguard.keys import generate_private_key, key_to_hex, public_key
from mesh.wireguard.uapi import UapiClient, encode_get, encode_set, parse_errno, parse_get

PRIVATE = generate_private_key()
PEER_A = public_key(generate_private_key())
PEER_B = public_key(generate_private_key())


def test_encode_get() -> None:
    assert encode_get() == b"get=1\n\n"


def test_encode_set_device_and_peers() -> None:
    request = encode_set(
        private_key=PRIVATE,
        listen_port=51820,
        replace_peers=True,
        peers=[
            PeerConfig(PEER_A, ("198.51.100.2/32",), "192.0.2.2:51820", 25),
            PeerConfig(PEER_B, remove=True),
        ],
    ).decode()
    assert request == (
        "set=1\n"
        f"private_key={key_to_hex(PRIVATE)}\n"
        "listen_port=51820\n"
        "replace_peers=true\n"
        f"public_key={key_to_hex(PEER_A)}\n"
        "endpoint=192.0.2.2:51820\n"
        "persistent_keepalive_interval=25\n"
        "replace_allowed_ips=true\n"
        "allowed_ip=198.51.100.2/32\n"
        f"public_key={key_to_hex(PEER_B)}\n"
        "remove=true\n"
        "\n"
    )


def test_peer_without_endpoint_leaves_it_alone() -> None:
    assert "endpoint=" not in encode_set(peers=[PeerConfig(PEER_A, ("198.51.100.2/32",))]).decode()


def test_parse_get_reply() -> None:
    reply = (
        f"private_key={key_to_hex(PRIVATE)}\nlisten_port=51820\n"
        f"public_key={key_to_hex(PEER_A)}\npreshared_key={'0' * 64}\nprotocol_version=1\n"
        "endpoint=192.0.2.2:51820\nlast_handshake_time_sec=1700000000\nlast_handshake_time_nsec=500000000\n"
        "tx_bytes=100\nrx_bytes=200\npersistent_keepalive_interval=25\nallowed_ip=198.51.100.2/32\nallowed_ip=203.0.113.0/24\n"
        f"public_key={key_to_hex(PEER_B)}\nlast_handshake_time_sec=0\nlast_handshake_time_nsec=0\n"
        "tx_bytes=0\nrx_bytes=0\npersistent_keepalive_interval=0\n"
        "errno=0\n\n"
    )
    device = parse_get(reply)
    assert device.public_key == public_key(PRIVATE)
    assert device.listen_port == 51820
    assert len(device.peers) == 2
    first, second = device.peers
    assert first.public_key == PEER_A and first.endpoint == "192.0.2.2:51820"
    assert first.allowed_ips == ("198.51.100.2/32", "203.0.113.0/24")
    assert first.last_handshake == pytest.approx(1700000000.5)
    assert (first.rx_bytes, first.tx_bytes, first.persistent_keepalive) == (200, 100, 25)
    assert second.endpoint is None and second.last_handshake is None and second.allowed_ips == ()


@pytest.mark.parametrize("reply", ["", "listen_port=1\n\n", "errno=x\n\n"])
def test_reply_without_errno_is_an_error(reply: str) -> None:
    with pytest.raises(MeshError, match="errno"):
        parse_errno(reply)


def test_nonzero_errno_get_is_an_error() -> None:
    with pytest.raises(MeshError, match="errno=22"):
        parse_get("errno=22\n\n")


def test_malformed_reply_is_an_error() -> None:
    with pytest.raises(MeshError, match="malformed|no '='"):
        parse_get(f"public_key={key_to_hex(PEER_A)}\nrx_bytes=lots\nerrno=0\n\n")


skip_reason = netns_skip_reason()


@pytest.fixture
def wggo():
    if skip_reason:
        pytest.skip(skip_reason)
    with WireGuardGoInNetns("u") as device:
        yield device


def test_against_real_wireguard_go(wggo: WireGuardGoInNetns) -> None:
    client = UapiClient(wggo.socket)
    client.set(encode_set(private_key=PRIVATE, listen_port=41820))
    client.set(
        encode_set(
            peers=[
                PeerConfig(PEER_A, ("198.51.100.2/32",), "192.0.2.2:51820", 25),
                PeerConfig(PEER_B, ("198.51.100.3/32", "203.0.113.0/24"), None, 0),
            ]
        )
    )
    device = client.get()
    assert device.public_key == public_key(PRIVATE)
    assert device.listen_port == 41820
    by_key = {peer.public_key: peer for peer in device.peers}
    assert set(by_key) == {PEER_A, PEER_B}
    assert by_key[PEER_A].endpoint == "192.0.2.2:51820"
    assert by_key[PEER_A].persistent_keepalive == 25
    assert by_key[PEER_A].allowed_ips == ("198.51.100.2/32",)
    assert sorted(by_key[PEER_B].allowed_ips) == ["198.51.100.3/32", "203.0.113.0/24"]
    assert by_key[PEER_B].last_handshake is None

    # wg, reading the same socket, agrees with what we parsed
    dump = wggo.wg("show", wggo.interface, "dump").splitlines()
    assert dump[0].split("\t")[:3] == [PRIVATE, public_key(PRIVATE), "41820"]
    assert {line.split("\t")[0] for line in dump[1:]} == {PEER_A, PEER_B}

    client.set(encode_set(peers=[PeerConfig(PEER_A, remove=True)]))
    assert [peer.public_key for peer in client.get().peers] == [PEER_B]
    client.set(encode_set(replace_peers=True))
    assert client.get().peers == ()


def test_real_wireguard_go_refuses_bad_settings(wggo: WireGuardGoInNetns) -> None:
    client = UapiClient(wggo.socket)
    with pytest.raises(MeshError, match="errno="):
        client.set(b"set=1\nlisten_port=notaport\n\n")
    with pytest.raises(MeshError, match="errno="):
        client.set(b"set=1\nallowed_ip=198.51.100.0/28\n\n")


def test_missing_socket_is_explained(tmp_path) -> None:
    with pytest.raises(MeshError, match="mesh up"):
        UapiClient(tmp_path / "none.sock").get()
