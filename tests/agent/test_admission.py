"""Admission slots (shardpool/agent/admission.py) and the share of the mesh listener's pool each
costly route may hold (shardpool/agent/mesh_routes.py RouteLimits)."""

from __future__ import annotations

import pytest

from shardpool.agent.admission import Slots
from shardpool.agent.mesh_routes import RouteLimits


def test_a_slot_is_refused_at_once_past_the_limit_and_freed_on_exit() -> None:
    slots = Slots(2)
    with slots.hold() as first, slots.hold() as second, slots.hold() as third:
        assert (first, second, third) == (True, True, False)
        assert slots.held() == 2
    assert slots.held() == 0
    with slots.hold() as again:
        assert again


def test_each_key_has_its_own_slots_and_an_idle_key_is_forgotten() -> None:
    slots = Slots(1)
    with slots.hold(1000) as mine, slots.hold(1000) as mine_again, slots.hold(1001) as theirs:
        assert (mine, mine_again, theirs) == (True, False, True)
    assert slots._held == {}


def test_a_slot_is_freed_when_its_block_raises() -> None:
    slots = Slots(1)
    with pytest.raises(RuntimeError), slots.hold():
        raise RuntimeError("handler failed")
    assert slots.held() == 0


@pytest.mark.parametrize("threads", [16, 32, 64, 128])
def test_the_costly_routes_leave_a_fifth_of_the_pool_to_short_requests(threads: int) -> None:
    limits = RouteLimits.for_threads(threads)
    profile_waiters = max(1, threads // 16)
    held = (
        limits.probes + limits.echoes + limits.starts + limits.stops + limits.waiting_polls + profile_waiters
    )
    assert held <= 0.8 * threads, (threads, limits)
