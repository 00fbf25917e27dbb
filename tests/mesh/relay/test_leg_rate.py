"""The relay's per-port rate (issue 39, item 9): a token bucket for datagrams and one for bytes a
second, so one member, or a host behind its NAT, cannot flood through a relay port.

The buckets alone on a fake clock, then a relay on loopback (see test_service.py for the layout)
whose clock never moves, so a port's one-second budget is all it ever gets.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator

import pytest

from mesh.errors import MeshError
from mesh.relay.allocations import LEG_BYTES_PER_S, LEG_PACKETS_PER_S, AllocationRequest
from mesh.relay.forwarder import MAX_DATAGRAM, LegRate, TokenBucket
from mesh.relay.service import RelayService
from tests.helpers.relay import udp_socket, wait_until, wireguard_data

RELAY = "127.0.0.1"
PAIR_AB = AllocationRequest("A|B", "A", "127.0.0.2", "B", "127.0.0.3")
PAIR_CD = AllocationRequest("C|D", "C", "127.0.0.5", "D", "127.0.0.6")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_packet_budget_refills_at_its_rate_up_to_one_second() -> None:
    clock = Clock()
    rate = LegRate(packets_per_s=10, bytes_per_s=10**6, clock=clock)
    assert [rate.admits(100) for _ in range(12)] == [True] * 10 + [False] * 2
    clock.now += 0.5
    assert [rate.admits(100) for _ in range(6)] == [True] * 5 + [False]
    clock.now += 60  # an idle minute earns one second's worth, no more
    assert sum(rate.admits(100) for _ in range(30)) == 10


def test_the_byte_budget_binds_and_a_refused_datagram_spends_nothing() -> None:
    clock = Clock()
    rate = LegRate(packets_per_s=1000, bytes_per_s=3000, clock=clock)
    assert rate.admits(MAX_DATAGRAM), "the byte bucket holds at least one largest datagram"
    assert not rate.admits(1)
    clock.now += 1.0
    assert [rate.admits(1000) for _ in range(4)] == [True, True, True, False]
    assert rate.packets.tokens == pytest.approx(1000 - 3), "the refused ones took no packet"


def test_a_clock_that_steps_back_earns_nothing() -> None:
    bucket = TokenBucket(rate=10, depth=10)
    bucket.refill(5.0)
    bucket.tokens = 0
    bucket.refill(4.0)
    bucket.refill(5.0)
    assert bucket.tokens == 0
    bucket.refill(5.5)
    assert bucket.tokens == pytest.approx(5)
    with pytest.raises(ValueError, match="positive"):
        TokenBucket(rate=0, depth=1)


def test_default_limits_sit_well_above_a_relayed_pairs_throughput() -> None:
    measured_relayed = 10.2e6  # bytes/s through the relay in the NAT benchmark (docs/performance.md)
    assert LEG_BYTES_PER_S >= 6 * measured_relayed
    assert LEG_PACKETS_PER_S * 1452 >= LEG_BYTES_PER_S, (
        "full-size WireGuard datagrams meet the byte limit first"
    )
    with pytest.raises(MeshError, match="positive"):
        RelayService(RELAY, range(40000, 40010), leg_packets_per_s=0)


def _drain(sock: socket.socket, quiet: float = 0.3) -> int:
    """How many datagrams arrive until none has for ``quiet`` seconds."""
    count = 0
    sock.settimeout(quiet)
    try:
        while True:
            sock.recvfrom(70000)
            count += 1
    except TimeoutError:
        return count
    finally:
        sock.settimeout(2.0)


@pytest.fixture
def sockets() -> Iterator[dict[str, socket.socket]]:
    opened = {
        name: udp_socket(ip)
        for name, ip in zip("ABCD", ("127.0.0.2", "127.0.0.3", "127.0.0.5", "127.0.0.6"), strict=True)
    }
    try:
        yield opened
    finally:
        for sock in opened.values():
            sock.close()


def _learn(relay: RelayService, first: socket.socket, second: socket.socket, ports: tuple[int, int]) -> None:
    """The first member speaks (nobody to forward to yet), then the second, whose datagram arrives."""
    dropped = relay.counters()["dropped_unlearned"]
    first.sendto(wireguard_data(), (RELAY, ports[0]))
    assert wait_until(lambda: relay.counters()["dropped_unlearned"] == dropped + 1, timeout=3.0)
    second.sendto(wireguard_data(), (RELAY, ports[1]))
    first.recvfrom(70000)


def test_a_flood_over_a_ports_rate_is_dropped_and_a_normal_pair_is_not(sockets) -> None:
    start = random.randrange(40000, 60000)
    relay = RelayService(RELAY, range(start, start + 16), leg_packets_per_s=40, clock=lambda: 0.0)
    relay.start()
    try:
        allocations = relay.apply([PAIR_AB, PAIR_CD])
        ab = (allocations["A|B"].port_a, allocations["A|B"].port_b)
        cd = (allocations["C|D"].port_a, allocations["C|D"].port_b)
        a, b, c, d = (sockets[name] for name in "ABCD")
        _learn(relay, a, b, ab)
        _learn(relay, c, d, cd)
        for _ in range(200):  # A floods: its port has 39 of its 40 datagrams left, and time stands still
            a.sendto(wireguard_data(), (RELAY, ab[0]))
        assert wait_until(lambda: relay.counters()["dropped_rate"] == 200 - 39, timeout=3.0)
        assert _drain(b) == 39
        for _ in range(10):  # the other pair, and B's own port, keep their budgets
            c.sendto(wireguard_data(1400), (RELAY, cd[0]))
            d.sendto(wireguard_data(1400), (RELAY, cd[1]))
            b.sendto(wireguard_data(), (RELAY, ab[1]))
        assert (_drain(d), _drain(c), _drain(a)) == (10, 10, 10)
        assert relay.counters()["dropped_rate"] == 200 - 39
    finally:
        relay.stop()
