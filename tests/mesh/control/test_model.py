"""Tests of mesh/control/model.py: rosters from untrusted JSON."""

from __future__ import annotations

import pytest

from mesh.control.model import Roster, RosterEntry, check_name
from mesh.errors import MeshError
from mesh.wireguard.keys import generate_private_key, public_key

KEYS = [public_key(generate_private_key()) for _ in range(3)]


def _data(**changes) -> dict:
    data = {
        "mesh_id": "m",
        "cidr": "198.51.100.0/28",
        "revision": 3,
        "members": [
            {
                "name": "a",
                "address": "198.51.100.1",
                "public_key": KEYS[0],
                "endpoint": "192.0.2.1:51820",
                "coordinator": True,
            },
            {"name": "b", "address": "198.51.100.2", "public_key": KEYS[1], "endpoint": None},
        ],
    }
    data.update(changes)
    return data


def test_round_trip() -> None:
    roster = Roster.from_json(_data())
    assert Roster.from_json(roster.to_json()) == roster
    assert roster.by_name("b") == RosterEntry("b", "198.51.100.2", KEYS[1], None, False)
    assert roster.by_key(KEYS[0]).coordinator


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ([{"name": "a", "address": "198.51.100.1", "public_key": KEYS[0]}] * 2, "twice"),
        ([{"name": "a", "address": "198.51.100.16", "public_key": KEYS[0]}], "outside"),
        ([{"name": "a", "address": "nope", "public_key": KEYS[0]}], "malformed"),
        ([{"name": "A B", "address": "198.51.100.1", "public_key": KEYS[0]}], "invalid"),
        ([{"name": "a", "address": "198.51.100.1", "public_key": "short"}], "key"),
        ([{"name": "a", "address": "198.51.100.1", "public_key": KEYS[0], "endpoint": "nope"}], "endpoint"),
        (["x"], "not an object"),
    ],
)
def test_hostile_rosters_are_refused(members: list, message: str) -> None:
    with pytest.raises(MeshError, match=message):
        Roster.from_json(_data(members=members))


@pytest.mark.parametrize(
    "data", [None, [], {"members": []}, {"members": [], "cidr": "x", "revision": 1, "mesh_id": "m"}]
)
def test_bad_headers_are_refused(data) -> None:
    with pytest.raises(MeshError):
        Roster.from_json(data)


@pytest.mark.parametrize("name", ["", "-a", "A", "a_b", "x" * 64, None, 5, "a\nb", "a\n", "\na", "a b"])
def test_bad_names(name) -> None:
    with pytest.raises(MeshError, match="member name"):
        check_name(name)


def test_relay_allocations_parse_strictly() -> None:
    import pytest

    from mesh.control.model import parse_relay_allocations
    from mesh.errors import MeshError
    from mesh.relay.allocations import AllocationRequest
    from mesh.wireguard.keys import generate_private_key, public_key

    a, b = sorted(public_key(generate_private_key()) for _ in range(2))
    good = {"pair": f"{a}|{b}", "key_a": a, "ip_a": "198.51.100.18", "key_b": b, "ip_b": "198.51.100.19"}
    assert parse_relay_allocations(None) == []
    assert parse_relay_allocations([good]) == [AllocationRequest(**good)]
    bad = [
        "x",
        [good] * 300,
        [{**good, "extra": 1}],
        [{**good, "ip_a": "2001:db8::1"}],
        [{**good, "ip_a": "host"}],
        [{**good, "pair": f"{b}|{a}"}],
        [{**good, "key_a": b, "key_b": a, "pair": f"{b}|{a}"}],
        [{**good, "key_b": a, "pair": f"{a}|{a}"}],
        [{**good, "ip_b": 5}],
        [{**good, "key_a": "short", "pair": f"short|{b}"}],
    ]
    for data in bad:
        with pytest.raises(MeshError):
            parse_relay_allocations(data)
