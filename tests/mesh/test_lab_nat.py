"""The lab's addressing, the NAT grid's iptables rules and expected paths as plain data (shardpool_dev.lab.nat,
shardpool_dev.lab.grid, the mesh CIDR of shardpool_dev.lab.hosts; no namespaces)."""

from __future__ import annotations

import ipaddress

import pytest
from shardpool_dev.lab.grid import (
    STANDARD_GRID,
    STANDARD_ROUTERS,
    expected_path,
    longest_loss_s,
    pairs,
    received_sequences,
)
from shardpool_dev.lab.hosts import MESH_CIDR, UNDERLAY, mesh_address
from shardpool_dev.lab.nat import (
    INTERNET,
    MAX_ROUTERS,
    lan_address,
    lan_gateway,
    lan_subnet,
    router_nat_rules,
    udp_block_rules,
)


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


def test_the_mesh_cidr_is_the_sixteenth_of_test_net_2_no_host_network_overlaps() -> None:
    mesh = ipaddress.IPv4Network(MESH_CIDR)
    assert mesh == ipaddress.IPv4Network("198.51.100.0/28")
    hosts = [ipaddress.IPv4Network(f"{prefix}.0/24") for prefix in (UNDERLAY, INTERNET)]
    hosts += [ipaddress.IPv4Network(lan_subnet(index)) for index in range(1, MAX_ROUTERS + 1)]
    assert [network for network in hosts if network.overlaps(mesh)] == []
    assert [mesh_address(number) for number in (1, 2, 14)] == [
        "198.51.100.1",
        "198.51.100.2",
        "198.51.100.14",
    ]
    assert len(STANDARD_GRID) <= len(list(mesh.hosts())) == 14, "the standard grid fits in one mesh"
    for number in (0, 15):
        with pytest.raises(ValueError, match="outside 1..14"):
            mesh_address(number)


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


STANDARD_NAT = {label: kind for label, (kind, _) in STANDARD_ROUTERS.items()}


def _path(a: str, b: str, nat: dict[str, str] = STANDARD_NAT) -> str:
    sites = {site.label: site for site in STANDARD_GRID}
    return expected_path(sites[a], sites[b], nat)


def test_the_standard_grid_implies_lan_direct_and_relay_where_issue_15_says() -> None:
    assert _path("m1a", "m1b") == "lan"
    assert _path("m1a", "m2") == "direct", "cone <-> cone"
    assert _path("m2", "m3") == _path("m3", "m2") == "direct", "cone <-> symmetric"
    assert _path("m3", "m4") == "relay", "symmetric <-> symmetric"
    assert _path("ublk", "m1a") == _path("m2", "ublk") == "relay", "UDP only to the relay"
    assert {_path("coord", site.label) for site in STANDARD_GRID[1:]} == {"direct"}
    assert _path("m3", "m4", {**STANDARD_NAT, "r3": "cone"}) == "direct", "after set_nat(r3, cone)"


def test_the_standard_grid_has_21_pairs_each_once() -> None:
    listed = pairs(STANDARD_GRID)
    assert len(listed) == 21
    assert len({frozenset((a.label, b.label)) for a, b in listed}) == 21


def test_ping_output_gives_answered_sequences_and_the_longest_loss() -> None:
    output = (
        "64 bytes from 198.51.100.6: icmp_seq=1 ttl=64 time=0.5 ms\n"
        "64 bytes from 198.51.100.6: icmp_seq=2 ttl=64 time=0.5 ms\n"
        "64 bytes from 198.51.100.6: icmp_seq=9 ttl=64 time=0.5 ms\n"
        "\n--- 198.51.100.6 ping statistics ---\n10 packets transmitted, 3 received, 70% packet loss\n"
    )
    answered, transmitted = received_sequences(output)
    assert (answered, transmitted) == ([1, 2, 9], 10)
    assert longest_loss_s(answered, transmitted, 0.2) == pytest.approx(6 * 0.2)
    assert longest_loss_s([], 25, 0.2) == pytest.approx(5.0), "nothing answered: all of it lost"
    assert longest_loss_s([1, 2, 3], 3, 0.2) == 0.0
    assert received_sequences("ping: connect: Network is unreachable") == ([], None)
