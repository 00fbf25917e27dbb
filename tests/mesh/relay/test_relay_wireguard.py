"""A real WireGuard tunnel through the relay: two wireguard-go peers in namespaces whose only
endpoints for each other are relay ports, with the relay in a third namespace."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
import time

import pytest
from shardpool_dev.lab import MESH_CIDR, Host, Lab, mesh_address, netns_skip_reason

from mesh.wireguard.keys import generate_private_key, public_key

pytestmark = [pytest.mark.netns, pytest.mark.slow]

SKIP = netns_skip_reason()
ADDRESS_A, ADDRESS_B = mesh_address(2), mesh_address(3)
"""The tunnel addresses of a and b, in the lab's mesh CIDR (of prefix length ``PREFIX``)."""
PREFIX = ipaddress.ip_network(MESH_CIDR).prefixlen

RELAY_SCRIPT = """
import json, sys
from mesh.relay.allocations import AllocationRequest
from mesh.relay.service import RelayService

service = RelayService(sys.argv[1], range(40000, 40010))
service.start()
allocation = service.apply([AllocationRequest(**json.loads(sys.stdin.readline()))])
print(json.dumps({pair: [a.port_a, a.port_b] for pair, a in allocation.items()}), flush=True)
sys.stdin.readline()
print(json.dumps(service.counters()), flush=True)
service.stop()
"""


def _wireguard(lab: Lab, host: Host, tmp_path, private: str, address: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        lab.command(host, "wireguard-go", host.interface, env={"WG_PROCESS_FOREGROUND": "1"}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while not lab.run(host, "ip", "link", "show", host.interface).returncode == 0:
        assert time.monotonic() < deadline and process.poll() is None, "wireguard-go did not start"
        time.sleep(0.05)
    key_file = tmp_path / f"{host.label}.key"
    key_file.write_text(private)
    key_file.chmod(0o600)
    for argv in (
        ["wg", "set", host.interface, "private-key", str(key_file), "listen-port", "51820"],
        ["ip", "addr", "add", f"{address}/{PREFIX}", "dev", host.interface],
        ["ip", "link", "set", host.interface, "up"],
    ):
        result = lab.run(host, *argv)
        assert result.returncode == 0, result.stderr
    return process


@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
def test_wireguard_handshakes_and_pings_through_the_relay(tmp_path) -> None:
    with Lab(tmp_path) as lab:
        relay, a, b = lab.add_host("r", 1), lab.add_host("a", 2), lab.add_host("b", 3)
        key_a, key_b = generate_private_key(), generate_private_key()
        _wireguard(lab, a, tmp_path, key_a, ADDRESS_A)
        _wireguard(lab, b, tmp_path, key_b, ADDRESS_B)
        server = subprocess.Popen(
            lab.command(relay, sys.executable, "-c", RELAY_SCRIPT, relay.underlay),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert server.stdin is not None and server.stdout is not None
        request = {"pair": "a|b", "key_a": "a", "ip_a": a.underlay, "key_b": "b", "ip_b": b.underlay}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        port_a, port_b = json.loads(server.stdout.readline())["a|b"]
        for host, peer_key, peer_address, port in (
            (a, key_b, ADDRESS_B, port_a),
            (b, key_a, ADDRESS_A, port_b),
        ):
            set_peer = [
                "wg", "set", host.interface, "peer", public_key(peer_key), "allowed-ips", f"{peer_address}/32",
                "endpoint", f"{relay.underlay}:{port}", "persistent-keepalive", "1",
            ]  # fmt: skip
            assert lab.run(host, *set_peer).returncode == 0

        deadline = time.monotonic() + 10
        while not lab.ping(a, ADDRESS_B, timeout=1, count=2):
            assert time.monotonic() < deadline, lab.last_ping
        assert lab.ping(b, ADDRESS_A, timeout=1, count=2), lab.last_ping
        handshake = lab.run(a, "wg", "show", a.interface, "latest-handshakes").stdout.split()
        assert int(handshake[1]) > 0
        # Each side still sends to its relay port: nothing roamed to a direct address.
        assert (
            lab.run(a, "wg", "show", a.interface, "endpoints").stdout.split()[1]
            == f"{relay.underlay}:{port_a}"
        )
        assert (
            lab.run(b, "wg", "show", b.interface, "endpoints").stdout.split()[1]
            == f"{relay.underlay}:{port_b}"
        )

        server.stdin.write("\n")
        server.stdin.flush()
        counters = json.loads(server.stdout.readline())
        assert server.wait(timeout=10) == 0, server.stderr.read() if server.stderr else ""
        assert counters["forwarded"] >= 6  # initiation, response, 2+2 echoes at least
        assert counters["dropped_foreign"] == counters["dropped_malformed"] == 0
