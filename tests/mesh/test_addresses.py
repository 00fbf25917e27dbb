"""Tests of mesh/addresses.py: CIDRs, allocation without reuse, endpoints, interface names."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.addresses import (
    allocate_address,
    first_address,
    format_endpoint,
    parse_cidr,
    parse_endpoint,
    parse_interface_name,
    resolve_endpoint,
)
from mesh.errors import MeshError


def test_first_address_is_the_first_host() -> None:
    assert first_address(parse_cidr("192.0.2.0/24")) == "192.0.2.1"


def test_allocation_takes_the_lowest_never_used_address() -> None:
    network = parse_cidr("192.0.2.0/24")
    assert allocate_address(network, ["192.0.2.1"]) == "192.0.2.2"
    assert allocate_address(network, ["192.0.2.1", "192.0.2.2", "192.0.2.4"]) == "192.0.2.3"


def test_every_host_address_is_handed_out_once_then_exhausted() -> None:
    network = parse_cidr("198.51.100.0/28")
    used: list[str] = []
    for _ in range(14):
        used.append(allocate_address(network, used))
    assert len(set(used)) == 14
    assert all(ipaddress.IPv4Address(a) in network for a in used)
    assert "198.51.100.0" not in used and "198.51.100.15" not in used
    with pytest.raises(MeshError, match="no free address left in 198.51.100.0/28.*larger --cidr"):
        allocate_address(network, used)


@settings(max_examples=100, deadline=None)
@given(st.sets(st.integers(min_value=1, max_value=254), max_size=253))
def test_allocation_never_collides(taken: set[int]) -> None:
    network = parse_cidr("192.0.2.0/24")
    used = [f"192.0.2.{i}" for i in taken]
    address = allocate_address(network, used)
    assert address not in used
    assert int(address.rsplit(".", 1)[1]) == min(set(range(1, 255)) - taken)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("192.0.2.1/24", "not a network"),
        ("banana", "not a network"),
        ("2001:db8::/64", "IPv6"),
        ("192.0.2.0/31", "fewer than two"),
    ],
)
def test_bad_cidrs_are_refused(text: str, message: str) -> None:
    with pytest.raises(MeshError, match=message):
        parse_cidr(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("192.0.2.1:51820", ("192.0.2.1", 51820)),
        ("gpu.example.org:1", ("gpu.example.org", 1)),
        ("[2001:db8::1]:65535", ("2001:db8::1", 65535)),
    ],
)
def test_endpoints_parse(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text) == expected
    assert format_endpoint(*expected) == text


@pytest.mark.parametrize(
    "text", ["192.0.2.1", "192.0.2.1:0", "192.0.2.1:70000", ":51820", "2001:db8::1:51820", "[zz]:1", "a b:1"]
)
def test_bad_endpoints_are_refused(text: str) -> None:
    with pytest.raises(MeshError, match="--endpoint"):
        parse_endpoint(text)


def test_resolve_keeps_literal_addresses_and_resolves_localhost() -> None:
    assert resolve_endpoint("192.0.2.7:51820") == "192.0.2.7:51820"
    assert resolve_endpoint("localhost:51820") in ("127.0.0.1:51820", "[::1]:51820")


@pytest.mark.parametrize("name", ["", "x" * 16, "a b", "wg/0", ".."])
def test_bad_interface_names_are_refused(name: str) -> None:
    with pytest.raises(MeshError, match="--interface"):
        parse_interface_name(name)


def test_good_interface_name() -> None:
    assert parse_interface_name("shardpool0") == "shardpool0"


def test_literal_endpoint_takes_only_ipv4_and_port_text() -> None:
    from mesh.addresses import literal_endpoint
    from mesh.control.report import ReportError

    assert literal_endpoint("203.0.113.9:51820", "try endpoint") == "203.0.113.9:51820"
    for bad in ("gpu-box.example:51820", 51820, "x" * 65, "203.0.113.9"):
        with pytest.raises(MeshError):
            literal_endpoint(bad, "try endpoint")
    with pytest.raises(ReportError, match="lan candidate 'box.lan:1' is not a literal IPv4 endpoint"):
        literal_endpoint("box.lan:1", "lan candidate", error=ReportError)
