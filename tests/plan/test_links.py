"""Link probes over loopback."""

from __future__ import annotations

from shardpool.plan.links import ProbeServer, measure_loopback, probe_link


def test_loopback_measures_positive_numbers() -> None:
    measured = measure_loopback(payload_bytes=4 << 20)
    assert measured.bandwidth > 1e7  # even a busy machine moves 10 MB/s over loopback
    assert 0 < measured.latency < 0.05


def test_probe_server_serves_several_probes() -> None:
    with ProbeServer() as server:
        first = probe_link(server.address, payload_bytes=1 << 20, pings=3)
        second = probe_link(server.address, payload_bytes=3 << 20, pings=3)
    assert first.bandwidth > 0 and second.bandwidth > 0
