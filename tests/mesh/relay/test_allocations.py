"""Tests of mesh/relay/allocations.py: which requests become allocations, within the bounds (no sockets)."""

from __future__ import annotations

from mesh.relay.allocations import (
    AllocationRequest,
    Limits,
    NewAllocationRate,
    plan_allocations,
    request_problem,
)


def _request(a: str, b: str, ip_a: str = "203.0.113.2", ip_b: str = "203.0.113.3") -> AllocationRequest:
    return AllocationRequest(f"{a}|{b}", a, ip_a, b, ip_b)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _plan(wanted, live=None, limits=None, rate=None):
    return plan_allocations(wanted, live or {}, limits or Limits(), rate or NewAllocationRate(60))


def test_new_requests_open_and_unwanted_close() -> None:
    old, new = _request("A", "B"), _request("A", "C")
    plan = _plan([new], live={old.pair: old})
    assert plan.open == [new] and plan.keep == [] and plan.close == ["A|B"] and plan.refused == {}


def test_a_wanted_live_pair_is_kept_even_with_a_new_ip() -> None:
    old = _request("A", "B")
    moved = _request("A", "B", ip_a="198.51.100.7")
    plan = _plan([moved], live={old.pair: old})
    assert plan.keep == [moved] and plan.open == [] and plan.close == []


def test_changed_members_reopen_the_pair() -> None:
    old = _request("A", "B")
    swapped = AllocationRequest("A|B", "B", "203.0.113.3", "A", "203.0.113.2")
    plan = _plan([swapped], live={old.pair: old})
    assert plan.close == ["A|B"] and plan.open == [swapped] and plan.keep == []


def test_total_bound_leaves_the_excess_out_and_prefers_live_pairs() -> None:
    live = _request("X", "Y")
    wanted = [_request("A", "B"), _request("C", "D"), live]
    plan = _plan(wanted, live={live.pair: live}, limits=Limits(max_allocations=2))
    assert plan.keep == [live]
    assert [r.pair for r in plan.open] == ["A|B"]
    assert list(plan.refused) == ["C|D"] and "2 allocations" in plan.refused["C|D"]


def test_per_member_bound() -> None:
    wanted = [_request("A", "B"), _request("A", "C"), _request("A", "D"), _request("B", "C")]
    plan = _plan(wanted, limits=Limits(max_per_member=2))
    assert [r.pair for r in plan.open] == ["A|B", "A|C", "B|C"]
    assert list(plan.refused) == ["A|D"]


def test_new_per_minute_bound_refills_after_a_minute() -> None:
    clock = _Clock()
    rate = NewAllocationRate(2, clock)
    first = _plan([_request("A", "B"), _request("A", "C"), _request("A", "D")], rate=rate)
    assert len(first.open) == 2 and list(first.refused) == ["A|D"]
    clock.now += 30
    assert _plan([_request("A", "D")], rate=rate).refused  # still within the same minute
    clock.now += 30.5
    assert [r.pair for r in _plan([_request("A", "D")], rate=rate).open] == ["A|D"]


def test_kept_pairs_do_not_count_against_the_rate() -> None:
    rate = NewAllocationRate(1)
    pairs = [_request("A", "B")]
    first = _plan(pairs, rate=rate)
    again = _plan(pairs, live={p.pair: p for p in first.open}, rate=rate)
    assert again.keep == pairs and again.refused == {}


def test_malformed_and_duplicate_requests_are_left_out() -> None:
    wanted = [
        _request("A", "B"),
        _request("A", "B"),
        _request("A", "A"),
        AllocationRequest("P|Q", "P", "not-an-ip", "Q", "203.0.113.3"),
        AllocationRequest("", "P", "203.0.113.2", "Q", "203.0.113.3"),
        AllocationRequest("x" * 300, "P", "203.0.113.2", "Q", "203.0.113.3"),
    ]
    plan = _plan(wanted)
    assert [r.pair for r in plan.open] == ["A|B"]
    assert plan.refused["A|B"] == "requested twice"
    assert "itself" in plan.refused["A|A"] and "not an IP" in plan.refused["P|Q"]
    assert len(plan.refused) == 5


def test_request_problem_accepts_ipv6() -> None:
    assert request_problem(_request("A", "B", ip_a="2001:db8::1")) is None


def test_a_refund_gives_the_place_back() -> None:
    rate = NewAllocationRate(1)
    assert rate.allows_one() and not rate.allows_one()
    rate.refund()
    assert rate.allows_one()
