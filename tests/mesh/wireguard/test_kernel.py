"""Tests of mesh/wireguard/kernel.py: request building and multi-message dump merging.

The message tests build real pyroute2 ``wgmsg`` netlink messages, encode them to bytes and decode
them again, as the kernel's reply would arrive. The live test needs the kernel module and skips
without it (this CI machine's kernel has none; the userspace backend is tested for real).
"""

from __future__ import annotations

import os
from socket import AF_INET, inet_pton

import pytest

from mesh.wireguard.backend import PeerConfig
from mesh.wireguard.kernel import KernelBackend, kernel_wireguard_available, merge_dump, peer_request
from mesh.wireguard.keys import generate_private_key, public_key

pytest.importorskip("pyroute2")
from pyroute2.netlink.generic.wireguard import wgmsg  # noqa: E402

PRIVATE = generate_private_key()
KEYS = [public_key(generate_private_key()) for _ in range(3)]


def _allowed(address: str, mask: int) -> dict:
    return {
        "attrs": [
            ["WGALLOWEDIP_A_FAMILY", AF_INET],
            ["WGALLOWEDIP_A_IPADDR", inet_pton(AF_INET, address)],
            ["WGALLOWEDIP_A_CIDR_MASK", mask],
        ]
    }


def _peer(key: str, allowed: list[dict], endpoint: dict | None = None, handshake: int = 0) -> dict:
    attrs: list = [["WGPEER_A_PUBLIC_KEY", key]]
    if endpoint:
        attrs.append(["WGPEER_A_ENDPOINT", endpoint])
    attrs += [
        ["WGPEER_A_LAST_HANDSHAKE_TIME", {"tv_sec": handshake, "tv_nsec": 0}],
        ["WGPEER_A_RX_BYTES", 111],
        ["WGPEER_A_TX_BYTES", 222],
        ["WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL", 25],
        ["WGPEER_A_ALLOWEDIPS", allowed],
    ]
    return {"attrs": attrs}


def _wire(attrs: list) -> wgmsg:
    message = wgmsg()
    message["cmd"] = 0
    message["version"] = 1
    message["attrs"] = attrs
    message.encode()
    decoded = wgmsg(message.data)
    decoded.decode()
    return decoded


def test_dump_split_over_several_messages_is_merged() -> None:
    first = _wire(
        [
            ["WGDEVICE_A_PRIVATE_KEY", PRIVATE],
            ["WGDEVICE_A_LISTEN_PORT", 51820],
            [
                "WGDEVICE_A_PEERS",
                [
                    _peer(
                        KEYS[0],
                        [_allowed("198.51.100.2", 32)],
                        {"addr": "192.0.2.2", "port": 51820},
                        1700000000,
                    ),
                    _peer(KEYS[1], [_allowed("198.51.100.3", 32)]),
                ],
            ],
        ]
    )
    # The kernel continues peer 1's allowed IPs in the next message, then adds peer 2.
    second = _wire(
        [
            [
                "WGDEVICE_A_PEERS",
                [
                    _peer(KEYS[1], [_allowed("203.0.113.0", 24)]),
                    _peer(KEYS[2], [_allowed("198.51.100.4", 32)]),
                ],
            ]
        ]
    )
    device = merge_dump([first, second])
    assert device.public_key == public_key(PRIVATE)
    assert device.listen_port == 51820
    assert [peer.public_key for peer in device.peers] == KEYS
    assert device.peers[0].endpoint == "192.0.2.2:51820"
    assert device.peers[0].last_handshake == 1700000000
    assert device.peers[1].allowed_ips == ("198.51.100.3/32", "203.0.113.0/24")
    assert device.peers[1].last_handshake is None and device.peers[1].endpoint is None
    assert (device.peers[2].rx_bytes, device.peers[2].tx_bytes, device.peers[2].persistent_keepalive) == (
        111,
        222,
        25,
    )


def test_peer_request_for_add_and_remove() -> None:
    add = peer_request(PeerConfig(KEYS[0], ("198.51.100.2/32",), "192.0.2.2:51820", 25))
    assert add == {
        "public_key": KEYS[0],
        "endpoint_addr": "192.0.2.2",
        "endpoint_port": 51820,
        "persistent_keepalive": 25,
        "replace_allowed_ips": True,
        "allowed_ips": ["198.51.100.2/32"],
    }
    assert peer_request(PeerConfig(KEYS[0], remove=True)) == {"public_key": KEYS[0], "remove": True}
    assert "endpoint_addr" not in peer_request(PeerConfig(KEYS[0], ("198.51.100.2/32",)))


def test_peer_request_encodes_into_a_genetlink_message() -> None:
    from pyroute2.netlink.generic.wireguard import AsyncWireGuard

    message = wgmsg()
    message["attrs"].append(["WGDEVICE_A_IFNAME", "wg0"])
    AsyncWireGuard.__new__(AsyncWireGuard)._wg_set_peer(
        message, peer_request(PeerConfig(KEYS[0], ("198.51.100.2/32",), "192.0.2.2:51820", 25))
    )
    message["cmd"] = 1
    message["version"] = 1
    message.encode()
    decoded = wgmsg(message.data)
    decoded.decode()
    peer = decoded.get_attr("WGDEVICE_A_PEERS")[0]
    assert peer.get_attr("WGPEER_A_PUBLIC_KEY").decode() == KEYS[0]
    assert peer.get_attr("WGPEER_A_ENDPOINT")["port"] == 51820
    assert peer.get_attr("WGPEER_A_ALLOWEDIPS")[0]["addr"] == "198.51.100.2/32"


@pytest.mark.skipif(
    os.geteuid() != 0 or not kernel_wireguard_available(),
    reason="no kernel WireGuard module here (or not root); the userspace backend is tested for real instead",
)
def test_live_kernel_interface() -> None:  # pragma: no cover - runs only where the module exists
    import subprocess

    netns = f"sp{os.getpid()}-k"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        code = (
            "from mesh.wireguard.kernel import KernelBackend\n"
            "from mesh.wireguard.backend import PeerConfig\n"
            f"b = KernelBackend(); b.create('spk0'); b.configure('spk0', {PRIVATE!r}, 41820)\n"
            f"b.update_peers('spk0', [PeerConfig({KEYS[0]!r}, ('198.51.100.2/32',), '192.0.2.2:51820', 25)])\n"
            "d = b.show('spk0'); print(d.listen_port, len(d.peers)); b.destroy('spk0')\n"
        )
        out = subprocess.run(
            ["ip", "netns", "exec", netns, "python3", "-c", code], capture_output=True, text=True, check=True
        )
        assert out.stdout.split() == ["41820", "1"]
    finally:
        subprocess.run(["ip", "netns", "del", netns])
    assert KernelBackend.name == "kernel"
