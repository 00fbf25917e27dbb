"""Tests of mesh/node/candidates.py: which interface addresses become LAN candidates."""

from __future__ import annotations

from mesh.control.report import MAX_LAN
from mesh.node.candidates import lan_candidates, local_candidates


def test_only_routable_non_mesh_addresses_with_the_listen_port() -> None:
    addresses = [
        ("lo", "127.0.0.1"),
        ("eth0", "192.168.1.4"),
        ("wlan0", "10.0.0.7"),
        ("eth1", "169.254.3.3"),
        ("shardpool0", "198.51.100.2"),
        ("other", "198.51.100.9"),
        ("eth0", "192.168.1.4"),
        ("odd", "not an address"),
    ]
    assert lan_candidates(addresses, "shardpool0", "198.51.100.0/28", 51820) == (
        "192.168.1.4:51820",
        "10.0.0.7:51820",
    )


def test_at_most_the_report_cap() -> None:
    addresses = [("eth0", f"192.168.{i}.1") for i in range(40)]
    assert len(lan_candidates(addresses, "wg0", "198.51.100.0/28", 1)) == MAX_LAN


def test_this_machine_lists_without_error() -> None:
    for candidate in local_candidates("shardpool0", "198.51.100.0/28", 51820):
        assert candidate.endswith(":51820") and not candidate.startswith("127.")
