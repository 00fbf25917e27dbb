"""The NAT grid's addressing and iptables rules as plain data (mesh.lab.nat; no namespaces)."""

from __future__ import annotations

import pytest

from mesh.lab.nat import lan_address, lan_gateway, lan_subnet, router_nat_rules, udp_block_rules


def test_each_router_gets_a_slash_28_of_test_net_2_with_itself_first() -> None:
    assert lan_subnet(1) == "198.51.100.16/28"
    assert lan_gateway(1) == "198.51.100.17"
    assert [lan_address(3, host) for host in (2, 14)] == ["198.51.100.50", "198.51.100.62"]
    for bad in (
        lambda: lan_subnet(0),
        lambda: lan_subnet(16),
        lambda: lan_address(1, 1),
        lambda: lan_address(1, 15),
    ):
        with pytest.raises(ValueError):
            bad()


def test_a_cone_router_keeps_ports_and_forwards_each_members_port_to_it() -> None:
    rules = router_nat_rules("cone", [("198.51.100.18", 51820), ("198.51.100.19", 51821)])
    assert rules[0] == ["-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"]
    assert rules[2] == [
        *("-t", "nat", "-A", "PREROUTING", "-i", "wan", "-p", "udp", "--dport", "51821"),
        *("-j", "DNAT", "--to-destination", "198.51.100.19:51821"),
    ]
    assert len(rules) == 3
    with pytest.raises(ValueError, match="distinct listen ports"):
        router_nat_rules("cone", [("198.51.100.18", 51820), ("198.51.100.19", 51820)])


def test_a_symmetric_router_randomizes_every_mapping_and_forwards_nothing() -> None:
    assert router_nat_rules("symmetric", [("198.51.100.18", 51820)]) == [
        ["-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE", "--random-fully"]
    ]
    with pytest.raises(ValueError, match="unknown NAT kind"):
        router_nat_rules("port-restricted", [])


def test_a_udp_blocked_host_keeps_loopback_and_its_tunnel_and_drops_other_udp_last() -> None:
    rules = udp_block_rules("203.0.113.1", "wg-x")
    assert rules[-1] == ["-A", "OUTPUT", "-p", "udp", "!", "-d", "203.0.113.1", "-j", "DROP"]
    assert ["-A", "OUTPUT", "-o", "wg-x", "-j", "ACCEPT"] in rules[:-1]
