"""Tests of mesh/node/probe.py: ICMP reachability, on loopback only."""

from __future__ import annotations

import struct

from mesh.node.probe import icmp_checksum, ping, probe_all


def test_checksum_of_a_known_echo_request() -> None:
    header = struct.pack("!BBHHH", 8, 0, 0, 1, 1)
    checksum = icmp_checksum(header + b"abcd")
    packet = struct.pack("!BBHHH", 8, 0, checksum, 1, 1) + b"abcd"
    assert icmp_checksum(packet) == 0
    assert icmp_checksum(b"\x00\x01\xf2") == icmp_checksum(b"\x00\x01\xf2\x00")


def test_loopback_answers() -> None:
    assert ping("127.0.0.1", timeout=1.0) is True
    assert probe_all(["127.0.0.1", "127.0.0.2"], timeout=1.0) == {"127.0.0.1": True, "127.0.0.2": True}
    assert probe_all([]) == {}


def test_round_trips_are_measured_in_seconds() -> None:
    from mesh.node.probe import probe_rtts, round_trip

    seconds = round_trip("127.0.0.1", timeout=1.0)
    assert seconds is not None and 0 <= seconds < 1.0
    rtts = probe_rtts(["127.0.0.1"], timeout=1.0)
    assert rtts["127.0.0.1"] is not None and rtts["127.0.0.1"] < 1.0
