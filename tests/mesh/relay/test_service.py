"""Tests of mesh/relay/service.py and forwarder.py with real UDP sockets on loopback addresses.

Member A sends from 127.0.0.2, member B from 127.0.0.3, a stranger from 127.0.0.4; the relay
listens on 127.0.0.1 (Linux routes all of 127/8 to lo).
"""

from __future__ import annotations

import os
import random
import socket
import threading
from collections.abc import Iterator

import pytest

from mesh.errors import MeshError
from mesh.relay.allocations import AllocationRequest
from mesh.relay.forwarder import is_wireguard_message, source_forms
from mesh.relay.service import COUNTERS, RelayService
from tests.helpers.relay import udp_socket, wait_until, wireguard_data

RELAY = "127.0.0.1"
IP_A, IP_B, STRANGER = "127.0.0.2", "127.0.0.3", "127.0.0.4"
REQUEST = AllocationRequest("A|B", "A", IP_A, "B", IP_B)


def _initiation() -> bytes:
    return b"\x01\0\0\0" + os.urandom(144)


def _ports() -> range:
    start = random.randrange(40000, 60000)
    return range(start, start + 16)


def _nothing_arrives(sock: socket.socket, wait: float = 0.3) -> bool:
    sock.settimeout(wait)
    try:
        sock.recvfrom(70000)
    except TimeoutError:
        return True
    finally:
        sock.settimeout(2.0)
    return False


@pytest.fixture
def relay() -> Iterator[RelayService]:
    service = RelayService(RELAY, _ports())
    service.start()
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture
def members() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = udp_socket(IP_A), udp_socket(IP_B)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _learn_both(relay: RelayService, a: socket.socket, b: socket.socket, port_a: int, port_b: int) -> None:
    """A speaks first (nobody to forward to yet), then B, whose datagram reaches A."""
    a.sendto(_initiation(), (RELAY, port_a))
    assert wait_until(lambda: relay.counters()["dropped_unlearned"] == 1)
    b.sendto(_initiation(), (RELAY, port_b))
    a.recvfrom(70000)


@pytest.mark.parametrize(
    ("datagram", "ok"),
    [
        (b"\x01\0\0\0" + bytes(144), True),
        (b"\x02\0\0\0" + bytes(88), True),
        (b"\x03\0\0\0" + bytes(60), True),
        (b"\x04\0\0\0" + bytes(28), True),
        (b"\x04\0\0\0" + bytes(1436), True),
        (b"\x04\0\0\0" + bytes(1448), True),  # a full 1420-byte MTU packet: padding stops at the MTU
        (b"\x01\0\0\0" + bytes(145), False),
        (b"\x02\0\0\0" + bytes(89), False),
        (b"\x04\0\0\0" + bytes(12), False),
        (b"\x05\0\0\0" + bytes(60), False),
        (b"\x01\x01\0\0" + bytes(144), False),
        (b"\x04\0\0", False),
        (b"", False),
        (b"\x04\0\0\0" + bytes(65532), False),
    ],
    ids=lambda value: f"{value[0]}-{len(value)}" if isinstance(value, bytes) and value else str(value),
)
def test_wireguard_message_check(datagram: bytes, ok: bool) -> None:
    assert is_wireguard_message(datagram) is ok


def test_source_forms_cover_ipv4_mapped_senders() -> None:
    assert source_forms("192.0.2.1") == {"192.0.2.1", "::ffff:192.0.2.1"}
    assert source_forms("2001:0db8::0001") == {"2001:db8::1"}


def test_forwards_both_ways_unchanged(relay: RelayService, members) -> None:
    a, b = members
    allocation = relay.apply([REQUEST])["A|B"]
    assert allocation.port_a != allocation.port_b
    assert {allocation.port_a, allocation.port_b} <= set(relay.ports)
    _learn_both(relay, a, b, allocation.port_a, allocation.port_b)
    for size in (0, 16, 1408):
        sent = wireguard_data(size)
        a.sendto(sent, (RELAY, allocation.port_a))
        got, source = b.recvfrom(70000)
        assert got == sent and source == (RELAY, allocation.port_b)
        reply = wireguard_data(size)
        b.sendto(reply, (RELAY, allocation.port_b))
        got, source = a.recvfrom(70000)
        assert got == reply and source == (RELAY, allocation.port_a)
    counters = relay.counters()
    assert counters["forwarded"] == 7 and counters["allocations"] == 1
    assert counters["dropped_foreign"] == counters["dropped_malformed"] == 0
    assert set(counters) == set(COUNTERS)


def test_a_stranger_gets_nothing_through(relay: RelayService, members) -> None:
    a, b = members
    allocation = relay.apply([REQUEST])["A|B"]
    _learn_both(relay, a, b, allocation.port_a, allocation.port_b)
    stranger = udp_socket(STRANGER)
    try:
        for port in (allocation.port_a, allocation.port_b):
            for _ in range(5):
                stranger.sendto(wireguard_data(), (RELAY, port))
        assert wait_until(lambda: relay.counters()["dropped_foreign"] == 10)
        assert _nothing_arrives(a) and _nothing_arrives(b) and _nothing_arrives(stranger, 0.05)
        # The stranger did not displace the members' learned addresses: they still talk.
        a.sendto(sent := wireguard_data(), (RELAY, allocation.port_a))
        assert b.recvfrom(70000)[0] == sent
    finally:
        stranger.close()
    assert relay.counters()["forwarded"] == 2


def test_malformed_datagrams_are_dropped(relay: RelayService, members) -> None:
    a, b = members
    allocation = relay.apply([REQUEST])["A|B"]
    _learn_both(relay, a, b, allocation.port_a, allocation.port_b)
    bad = [b"\x01\0\0\0" + bytes(10), b"\x04\0\0\0" + bytes(20), b"\x09\0\0\0" + bytes(60), b"hello"]
    for datagram in bad:
        a.sendto(datagram, (RELAY, allocation.port_a))
    assert wait_until(lambda: relay.counters()["dropped_malformed"] == 4)
    assert _nothing_arrives(b)


def test_removed_member_is_cut_off_within_the_call(relay: RelayService, members) -> None:
    a, b = members
    allocation = relay.apply([REQUEST])["A|B"]
    _learn_both(relay, a, b, allocation.port_a, allocation.port_b)
    assert relay.apply([]) == {}
    # Both ports are closed when apply returns: they can be bound again at once.
    for port in (allocation.port_a, allocation.port_b):
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        probe.bind((RELAY, port))
        probe.close()
    before = relay.counters()["forwarded"]
    a.sendto(wireguard_data(), (RELAY, allocation.port_a))
    b.sendto(wireguard_data(), (RELAY, allocation.port_b))
    assert _nothing_arrives(a) and _nothing_arrives(b)
    assert relay.counters()["forwarded"] == before and relay.counters()["allocations"] == 0


def test_a_pair_that_stays_keeps_its_ports_and_a_new_ip_moves_the_permission(
    relay: RelayService, members
) -> None:
    a, b = members
    first = relay.apply([REQUEST])["A|B"]
    assert relay.apply([REQUEST]) == {"A|B": first}
    moved = AllocationRequest("A|B", "A", STRANGER, "B", IP_B)
    assert relay.apply([moved]) == {"A|B": first}
    new_a = udp_socket(STRANGER)
    try:
        a.sendto(wireguard_data(), (RELAY, first.port_a))  # the old IP is no longer permitted
        assert wait_until(lambda: relay.counters()["dropped_foreign"] == 1)
        new_a.sendto(_initiation(), (RELAY, first.port_a))
        b.sendto(sent := _initiation(), (RELAY, first.port_b))
        assert new_a.recvfrom(70000)[0] == sent
    finally:
        new_a.close()


def test_nat_rebinding_moves_the_learned_address(relay: RelayService, members) -> None:
    a, b = members
    allocation = relay.apply([REQUEST])["A|B"]
    _learn_both(relay, a, b, allocation.port_a, allocation.port_b)
    rebound = udp_socket(IP_A)  # same IP, new source port: what a NAT does after a mapping expires
    try:
        rebound.sendto(wireguard_data(), (RELAY, allocation.port_a))
        assert b.recvfrom(70000)[1] == (RELAY, allocation.port_b)
        b.sendto(sent := wireguard_data(), (RELAY, allocation.port_b))
        assert rebound.recvfrom(70000)[0] == sent
        assert _nothing_arrives(a)
    finally:
        rebound.close()


def test_bounds_leave_the_excess_out_without_raising(members) -> None:
    def pair(x: str, y: str) -> AllocationRequest:
        return AllocationRequest(f"{x}|{y}", x, IP_A, y, IP_B)

    service = RelayService(RELAY, _ports(), max_allocations=3, max_per_member=2, max_new_per_minute=4)
    service.start()
    try:
        live = service.apply([pair("A", "B"), pair("A", "C"), pair("A", "D"), pair("B", "C"), pair("C", "D")])
        assert sorted(live) == ["A|B", "A|C", "B|C"]  # A's third left out; then the total bound
        assert service.counters()["refused"] == 2
        assert service.counters()["allocations"] == 3
        live = service.apply([pair("E", "F"), pair("G", "H")])  # two new: one fits in the minute's budget
        assert sorted(live) == ["E|F"]
        assert (
            len({port for allocation in live.values() for port in (allocation.port_a, allocation.port_b)})
            == 2
        )
    finally:
        service.stop()


def test_no_free_ports_leaves_the_pair_out() -> None:
    start = random.randrange(40000, 60000)
    service = RelayService(RELAY, range(start, start + 3), max_new_per_minute=2)
    service.start()
    try:
        wanted = [REQUEST, AllocationRequest("A|C", "A", IP_A, "C", IP_B)]
        for _ in range(3):
            live = service.apply(wanted)
            assert list(live) == ["A|B"] and service.counters()["refused"] == 1
        # The failed opens used none of the minute's budget: with a port free, A|C opens at once.
        assert sorted(service.apply(wanted[1:])) == ["A|C"]
    finally:
        service.stop()


def test_apply_before_start_is_refused() -> None:
    with pytest.raises(MeshError, match="not running"):
        RelayService(RELAY, _ports()).apply([REQUEST])
    with pytest.raises(MeshError, match="two consecutive ports"):
        RelayService(RELAY, range(5000, 5001))


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_stop_leaves_no_thread_and_no_socket(members) -> None:
    threads, fds = set(threading.enumerate()), _fds()
    service = RelayService(RELAY, _ports())
    service.start()
    allocation = service.apply([REQUEST, AllocationRequest("C|D", "C", IP_A, "D", IP_B)])["A|B"]
    assert len(_fds() - fds) >= 4
    service.stop()
    assert set(threading.enumerate()) == threads
    assert _fds() == fds
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind((RELAY, allocation.port_a))
    probe.close()
    service.start()  # and it starts again
    assert "A|B" in service.apply([REQUEST])
    service.stop()
    assert set(threading.enumerate()) == threads and _fds() == fds


def test_removing_one_member_closes_only_its_pairs(relay: RelayService, members) -> None:
    a, b = members
    with_c = AllocationRequest("A|C", "A", IP_A, "C", "127.0.0.5")
    live = relay.apply([REQUEST, with_c])
    kept = relay.apply([REQUEST])  # C was removed from the roster
    assert kept == {"A|B": live["A|B"]}
    c = udp_socket("127.0.0.5")
    try:
        c.sendto(wireguard_data(), (RELAY, live["A|C"].port_b))
        a.sendto(wireguard_data(), (RELAY, live["A|C"].port_a))
        assert _nothing_arrives(a) and _nothing_arrives(c)
    finally:
        c.close()
    _learn_both(relay, a, b, live["A|B"].port_a, live["A|B"].port_b)
    a.sendto(sent := wireguard_data(), (RELAY, live["A|B"].port_a))
    assert b.recvfrom(70000)[0] == sent


def test_a_host_that_is_not_ours_is_refused_in_one_line(caplog) -> None:
    service = RelayService("192.0.2.77", _ports())  # TEST-NET-1: no interface of this machine has it
    service.start()
    try:
        with caplog.at_level("WARNING", logger="shardpool.mesh.relay"):
            assert service.apply([REQUEST]) == {}
            assert service.apply([REQUEST]) == {}
        assert service.counters()["refused"] == 1
        warnings = [r.getMessage() for r in caplog.records if r.name == "shardpool.mesh.relay"]
        assert (
            len(warnings) == 1 and "cannot bind UDP 192.0.2.77" in warnings[0]
        )  # logged once, not every step
    finally:
        service.stop()
