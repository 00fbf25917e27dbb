"""Tests of mesh/control/report.py and the ``/v1/report`` route: strict parsing of member reports.

Bad bodies, from a proven member, must get a one-line 400 and leave the coordinator's board as it
was; a good report is recorded and the caller's own ``paths`` come back with its roster.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.control.auth import ROSTER_PURPOSE
from mesh.control.client import authenticated_request, request_join, send_report, sync_roster
from mesh.control.model import PathInstruction, PunchTry
from mesh.control.report import MAX_LAN, REPORT_MAX_BODY, MemberReport, PeerReport, ReportError, parse_report
from mesh.errors import MeshError
from mesh.relay.allocations import AllocationRequest
from mesh.wireguard.keys import generate_private_key, public_key
from tests.helpers.mesh_hosts import InProcessCoordinator

PEER = public_key(generate_private_key())
GOOD = MemberReport(
    lan=("192.168.1.4:51820",),
    relay=False,
    peers={PEER: PeerReport("203.0.113.5:40000", 1_700_000_000.5, 10, 20)},
    tries={PEER: (7, True)},
    relay_ports={f"{PEER}|{PEER}": (51821, 51822)},
)


def test_a_report_survives_its_json_round_trip() -> None:
    assert parse_report(json.loads(json.dumps(GOOD.to_json()))) == GOOD


def test_an_empty_object_is_an_empty_report() -> None:
    assert parse_report({}) == MemberReport()


BAD_BODIES = [
    [],
    "x",
    {"unknown": 1},
    {"lan": "1.2.3.4:5"},
    {"lan": ["1.2.3.4:5"] * (MAX_LAN + 1)},
    {"lan": ["host.example:5"]},
    {"lan": ["[2001:db8::1]:5"]},
    {"lan": ["1.2.3.4:0"]},
    {"lan": [5]},
    {"relay": 1},
    {"relay": "yes"},
    {"peers": []},
    {"peers": {"short": {}}},
    {"peers": {PEER: {"endpoint": None, "extra": 1}}},
    {"peers": {PEER: {"last_handshake": float("nan")}}},
    {"peers": {PEER: {"last_handshake": -1}}},
    {"peers": {PEER: {"last_handshake": True}}},
    {"peers": {PEER: {"rx_bytes": -1}}},
    {"peers": {PEER: {"rx_bytes": 1.5}}},
    {"peers": {PEER: {"tx_bytes": 2**64}}},
    {"peers": {PEER: {"endpoint": "1.2.3.4"}}},
    {"tries": {PEER: {"id": 1}}},
    {"tries": {PEER: {"id": 1, "ok": 1}}},
    {"tries": {PEER: {"id": "1", "ok": True}}},
    {"tries": {PEER: {"id": -1, "ok": True}}},
    {"tries": {PEER: {"id": 1, "ok": True, "x": 0}}},
    {"relay_ports": {"a|b": [1, 2]}},
    {"relay_ports": {f"{PEER}|{PEER}": [1]}},
    {"relay_ports": {f"{PEER}|{PEER}": [0, 70000]}},
    {"peers": {f"{i:043d}=": {} for i in range(300)}},
]


@pytest.mark.parametrize("body", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_bad_reports_are_refused_with_a_report_error(body) -> None:  # noqa: ANN001
    with pytest.raises(MeshError):
        parse_report(body)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=50), inner, max_size=5),
    max_leaves=30,
)
report_like = st.fixed_dictionaries(
    {},
    optional={
        "lan": json_values,
        "relay": json_values,
        "peers": st.dictionaries(st.sampled_from([PEER, "x"]), json_values, max_size=2),
        "tries": st.dictionaries(st.sampled_from([PEER, "x"]), json_values, max_size=2),
        "relay_ports": json_values,
    },
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.one_of(json_values, report_like))
def test_random_json_either_parses_or_raises_a_mesh_error(body) -> None:  # noqa: ANN001
    try:
        parse_report(body)
    except MeshError:
        pass


# ---------------------------------------------------------------- the route, over real sockets


@pytest.fixture
def coordinator(tmp_path):
    service = InProcessCoordinator(tmp_path)
    yield service
    service.close()


def _member(coordinator: InProcessCoordinator, name: str = "b") -> str:
    private = generate_private_key()
    request_join(coordinator.invite(), name, public_key(private), None)
    return private


def _post(coordinator: InProcessCoordinator, private: str, body: bytes) -> tuple[int, dict]:
    status, reply = authenticated_request(
        "127.0.0.1",
        coordinator.port,
        "POST",
        "/v1/report",
        body,
        private_key=private,
        peer_public_key=coordinator.public_key,
        mesh_id="testmesh",
        purpose=ROSTER_PURPOSE,
    )
    return status, json.loads(reply)


def test_a_member_report_is_recorded(coordinator) -> None:
    private = _member(coordinator)
    send_report("127.0.0.1", coordinator.port, private, coordinator.public_key, "testmesh", GOOD)
    assert coordinator.service.board.reports([public_key(private)]) == {public_key(private): GOOD}


@pytest.mark.parametrize(
    "body", BAD_BODIES[:12] + [b"{", b"\xff\xfe", b"[" * 5000 + b"]" * 5000], ids=range(15)
)
def test_bad_report_bodies_get_400_and_change_nothing(coordinator, body) -> None:  # noqa: ANN001
    private = _member(coordinator)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, reply = _post(coordinator, private, raw)
    assert status == 400 and "report" in reply["error"]
    assert coordinator.service.board.reports([public_key(private)]) == {}


def test_an_oversized_report_is_refused_unread(coordinator) -> None:
    private = _member(coordinator)
    with pytest.raises(MeshError):
        # the server answers 413 before reading the body, unsigned: the member's check fails
        _post(coordinator, private, b" " * (REPORT_MAX_BODY + 1))


def test_unproven_and_removed_senders_cannot_report(coordinator) -> None:
    with pytest.raises(MeshError, match="not in this mesh"):
        send_report(
            "127.0.0.1", coordinator.port, generate_private_key(), coordinator.public_key, "testmesh", GOOD
        )
    private = _member(coordinator)
    coordinator.store.revoke("b")
    with pytest.raises(MeshError, match="removed"):
        send_report("127.0.0.1", coordinator.port, private, coordinator.public_key, "testmesh", GOOD)
    assert coordinator.service.board.reports([public_key(private)]) == {}


def test_roster_replies_carry_only_the_callers_paths(coordinator) -> None:
    b, c = _member(coordinator, "b"), _member(coordinator, "c")
    punch = PunchTry(3, "203.0.113.9:4000", "direct", 1e9, 3.0)
    instruction = PathInstruction("relay", "203.0.113.1:51821", punch)
    first, second = sorted((public_key(b), public_key(c)))
    request = AllocationRequest(f"{first}|{second}", first, "198.51.100.18", second, "198.51.100.19")
    coordinator.service.board.publish(
        {public_key(b): {public_key(c): instruction}}, {public_key(c): [request]}
    )
    mine = sync_roster("127.0.0.1", coordinator.port, b, coordinator.public_key, "testmesh")
    theirs = sync_roster("127.0.0.1", coordinator.port, c, coordinator.public_key, "testmesh")
    assert mine.paths == {public_key(c): instruction} and mine.relay_allocations == []
    assert theirs.paths == {} and theirs.roster == mine.roster
    assert theirs.relay_allocations == [request]


def test_report_error_is_a_mesh_error() -> None:
    assert issubclass(ReportError, MeshError)
