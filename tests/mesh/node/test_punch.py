"""Tests of mesh/node/punch.py: judging a try from device status, and the follower's schedule."""

from __future__ import annotations

from dataclasses import replace

from mesh.control.model import PathInstruction, PunchTry
from mesh.node.punch import PREPARE_S, PUNCH_KEEPALIVE, PathFollower, judge_try, start_changes
from mesh.wireguard.backend import DeviceStatus, PeerConfig, PeerStatus
from mesh.wireguard.keys import generate_private_key, public_key

PEER, OTHER = (public_key(generate_private_key()) for _ in range(2))
RELAY = "203.0.113.1:51821"
DIRECT = "203.0.113.20:40002"
ROAMED = "203.0.113.20:55555"
AT = 1_000_000.0
PUNCH = PunchTry(5, DIRECT, "direct", AT, 3.0)
ALLOWED = ("198.51.100.3/32",)


def _status(endpoint: str | None, rx: int = 100, handshake: float | None = AT - 50) -> PeerStatus:
    return PeerStatus(PEER, endpoint, ALLOWED, handshake, rx, 10, 25)


BEFORE = _status(RELAY)


def test_packets_from_a_non_relay_endpoint_are_a_success_and_keep_the_device_endpoint() -> None:
    ok, change = judge_try(PUNCH, RELAY, BEFORE, _status(DIRECT, rx=300), 25)
    assert ok and change == PeerConfig(PEER, ALLOWED, None, 25)


def test_a_roamed_endpoint_counts_as_success() -> None:
    ok, _ = judge_try(PUNCH, RELAY, BEFORE, _status(ROAMED, rx=300), 25)
    assert ok


def test_a_fresh_handshake_counts_as_traffic() -> None:
    ok, _ = judge_try(
        PUNCH, None, _status(None, rx=0, handshake=None), _status(DIRECT, rx=0, handshake=AT + 1), 25
    )
    assert ok


def test_roamed_back_to_the_relay_is_a_failure_and_restores_the_relay() -> None:
    ok, change = judge_try(PUNCH, RELAY, BEFORE, _status(RELAY, rx=500, handshake=AT + 1), 25)
    assert not ok and change == PeerConfig(PEER, ALLOWED, RELAY, 25)


def test_silence_is_a_failure() -> None:
    ok, change = judge_try(PUNCH, RELAY, BEFORE, _status(DIRECT, rx=100), 25)
    assert not ok and change.endpoint == RELAY and change.persistent_keepalive == 25


def test_a_vanished_peer_is_a_failure() -> None:
    ok, _ = judge_try(PUNCH, RELAY, BEFORE, None, 25)
    assert not ok


def test_with_a_live_session_the_keepalive_goes_0_then_1_so_the_first_punch_leaves_at_once() -> None:
    changes, baseline = start_changes(PUNCH, BEFORE)
    assert changes == [
        PeerConfig(PEER, ALLOWED, DIRECT, 0),
        PeerConfig(PEER, ALLOWED, DIRECT, PUNCH_KEEPALIVE),
    ]
    assert baseline == BEFORE


def test_without_a_session_the_peer_is_made_anew_so_its_handshake_is_not_rate_limited() -> None:
    for handshake in (None, AT - 181):
        changes, baseline = start_changes(PUNCH, _status(None, rx=500, handshake=handshake))
        assert changes == [
            PeerConfig(PEER, remove=True),
            PeerConfig(PEER, ALLOWED, DIRECT, 0),
            PeerConfig(PEER, ALLOWED, DIRECT, PUNCH_KEEPALIVE),
        ]
        assert baseline.rx_bytes == 0 and baseline.last_handshake is None
        ok, _ = judge_try(PUNCH, None, baseline, _status(DIRECT, rx=92, handshake=AT + 0.01), 25)
        assert ok


def test_the_coordinators_fresh_flag_decides_for_both_sides_alike() -> None:
    """One side alone starting afresh would strand the other on keys nobody holds any more."""
    live_here = _status(RELAY, handshake=AT - 10)
    changes, _ = start_changes(replace(PUNCH, fresh=True), live_here)
    assert changes[0] == PeerConfig(PEER, remove=True), "fresh: anew even though this side looks live"
    stale_here = _status(RELAY, handshake=None)
    changes, baseline = start_changes(replace(PUNCH, fresh=False), stale_here)
    assert changes == [
        PeerConfig(PEER, ALLOWED, DIRECT, 0),
        PeerConfig(PEER, ALLOWED, DIRECT, PUNCH_KEEPALIVE),
    ]
    assert baseline == stale_here


def test_a_fresh_try_makes_the_peer_anew_a_second_early_then_punches_at_its_time() -> None:
    """Both sides reset before either sends, so no side throws away a session the other just made."""
    fresh = replace(PUNCH, fresh=True)
    follower = _follower(PathInstruction("relay", RELAY, fresh))
    device = DeviceStatus(None, 51820, (BEFORE,))
    assert follower.next_event() == AT - PREPARE_S
    assert follower.due(AT - 1.5, device) == []
    assert follower.due(AT - PREPARE_S, device) == [
        PeerConfig(PEER, remove=True),
        PeerConfig(PEER, ALLOWED, DIRECT, 0),
    ]
    assert follower.busy() == {PEER} and follower.next_event() == AT
    made_anew = DeviceStatus(None, 51820, (_status(DIRECT, rx=0, handshake=None),))
    assert follower.due(AT, made_anew) == [PeerConfig(PEER, ALLOWED, DIRECT, PUNCH_KEEPALIVE)]
    after = DeviceStatus(None, 51820, (_status(ROAMED, rx=92, handshake=AT + 0.05),))
    assert follower.due(AT + 3.0, after) == [PeerConfig(PEER, ALLOWED, None, 25)]
    assert follower.results == {PEER: (5, True)}


def _follower(instruction: PathInstruction) -> PathFollower:
    follower = PathFollower(25)
    follower.follow({PEER: instruction}, [PEER])
    return follower


def test_a_try_starts_at_its_time_is_judged_after_its_window_and_is_reported() -> None:
    follower = _follower(PathInstruction("relay", RELAY, PUNCH))
    device = DeviceStatus(None, 51820, (BEFORE,))
    assert follower.next_event() == AT - PREPARE_S, "woken early in case the try needs a fresh peer"
    assert follower.due(AT - 0.1, device) == [], "a live session is kept: nothing before `at`"
    assert follower.due(AT, device)[-1] == PeerConfig(PEER, ALLOWED, DIRECT, PUNCH_KEEPALIVE)
    assert follower.busy() == {PEER} and follower.next_event() == AT + 3.0
    assert follower.due(AT + 1, device) == []
    after = DeviceStatus(None, 51820, (_status(ROAMED, rx=400),))
    assert follower.due(AT + 3.0, after) == [PeerConfig(PEER, ALLOWED, None, 25)]
    assert follower.results == {PEER: (5, True)} and follower.pushed[PEER] == DIRECT
    assert follower.busy() == {PEER}, (
        "judged here, still open at the coordinator: the relay is not pushed back"
    )
    assert follower.next_event() is None
    report = follower.report(after, ("192.168.1.4:51820",), False)
    assert report.tries == {PEER: (5, True)} and report.peers[PEER].endpoint == ROAMED
    follower.follow({PEER: PathInstruction("direct", DIRECT, None)}, [PEER])
    assert follower.runs == {} and follower.busy() == frozenset()


def test_the_same_try_is_not_run_twice_and_a_running_try_is_not_replaced() -> None:
    follower = _follower(PathInstruction("relay", RELAY, PUNCH))
    follower.due(AT, DeviceStatus(None, 51820, (BEFORE,)))
    follower.follow({PEER: PathInstruction("relay", RELAY, replace(PUNCH, id=6, at=AT + 20))}, [PEER])
    assert follower.runs[PEER].punch.id == 5
    follower.due(AT + 3, DeviceStatus(None, 51820, (_status(RELAY),)))
    assert follower.results[PEER] == (5, False) and follower.pushed[PEER] == RELAY
    follower.follow({PEER: PathInstruction("relay", RELAY, PUNCH)}, [PEER])
    assert follower.runs == {}


def test_a_try_pulled_after_its_window_is_reported_failed_without_touching_the_device() -> None:
    follower = _follower(PathInstruction("relay", RELAY, PUNCH))
    assert follower.due(AT + 10, DeviceStatus(None, 51820, (BEFORE,))) == []
    assert follower.results == {PEER: (5, False)} and PEER not in follower.pushed


def test_peers_that_leave_the_roster_are_forgotten() -> None:
    follower = _follower(PathInstruction("relay", RELAY, PUNCH))
    follower.results[OTHER] = (1, True)
    follower.follow({}, [])
    assert follower.runs == {} and follower.results == {} and follower.instructions == {}


def test_remember_notes_only_instruction_endpoints() -> None:
    follower = _follower(PathInstruction("relay", RELAY, None))
    follower.remember([PeerConfig(PEER, ALLOWED, RELAY, 25), PeerConfig(OTHER, ALLOWED, DIRECT, 25)])
    assert follower.pushed == {PEER: RELAY}


def test_reports_list_only_instructed_peers() -> None:
    follower = _follower(PathInstruction("relay", RELAY, None))
    other = replace(BEFORE, public_key=OTHER)
    report = follower.report(DeviceStatus(None, 51820, (BEFORE, other)), (), True)
    assert set(report.peers) == {PEER} and report.relay is True


def test_a_try_the_coordinator_dropped_before_it_began_is_not_run() -> None:
    follower = _follower(PathInstruction("relay", RELAY, PUNCH))
    follower.follow({PEER: PathInstruction("relay", RELAY, None)}, [PEER])
    assert follower.runs == {} and follower.due(AT, DeviceStatus(None, 51820, (BEFORE,))) == []
    newer = replace(PUNCH, id=9, at=AT + 20)
    follower.follow({PEER: PathInstruction("relay", RELAY, newer)}, [PEER])
    assert follower.runs[PEER].punch == newer
