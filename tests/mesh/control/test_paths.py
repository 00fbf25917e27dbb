"""Tests of mesh/control/paths.py: the per-pair path state machine, with time passed in."""

from __future__ import annotations

from mesh.control.model import PathInstruction, RosterEntry
from mesh.control.paths import AllocationWant, PathPlanner, lan_candidate, pair_id
from mesh.control.report import MemberReport, PeerReport
from mesh.wireguard.keys import generate_private_key, public_key

A, B, C, COORD, FIXED = (public_key(generate_private_key()) for _ in range(5))
OBSERVED = {A: "203.0.113.10:40001", B: "203.0.113.20:40002", C: "203.0.113.30:40003"}
MEMBERS = [
    RosterEntry("coord", "198.51.100.1", COORD, "203.0.113.1:51820", True),
    RosterEntry("a", "198.51.100.2", A),
    RosterEntry("b", "198.51.100.3", B),
]
PAIR = pair_id(A, B)
PORTS = {PAIR: (51821, 51822)}
T0 = 1_000_000.0


def _side(key: str) -> int:
    return 0 if PAIR.startswith(key) else 1


def _relay_of(key: str) -> str:
    return f"203.0.113.1:{PORTS[PAIR][_side(key)]}"


def _step(planner: PathPlanner, now: float, reports=None, observed=None, members=None, relay=True):
    return planner.step(now, members or MEMBERS, observed or OBSERVED, reports or {}, relay)


def _plan(planner: PathPlanner, relay: bool = True) -> dict[str, dict[str, PathInstruction]]:
    return planner.instructions({PAIR: ("203.0.113.1", *PORTS[PAIR])} if relay else {})


def _ok(try_id: int, a: bool = True, b: bool = True) -> dict[str, MemberReport]:
    return {A: MemberReport(tries={B: (try_id, a)}), B: MemberReport(tries={A: (try_id, b)})}


def _connected(planner: PathPlanner) -> int:
    _step(planner, T0)
    try_id = _plan(planner)[A][B].punch.id
    _step(planner, T0 + 8, _ok(try_id))
    return try_id


def test_a_new_pair_is_relayed_at_once_and_gets_a_direct_try() -> None:
    planner = PathPlanner(sync_interval=2.0)
    wants = _step(planner, T0)
    first, second = PAIR.split("|")
    assert wants == [
        AllocationWant(PAIR, first, OBSERVED[first].split(":")[0], second, OBSERVED[second].split(":")[0])
    ]
    plan = _plan(planner)
    assert plan[A][B].path == "relay" and plan[A][B].endpoint == _relay_of(A)
    assert plan[B][A].endpoint == _relay_of(B)
    try_a, try_b = plan[A][B].punch, plan[B][A].punch
    assert try_a.path == try_b.path == "direct"
    assert try_a.endpoint == OBSERVED[B] and try_b.endpoint == OBSERVED[A]
    assert try_a.id == try_b.id and try_a.at == try_b.at == T0 + 4.5 and try_a.window == 3.0


def test_pairs_with_a_roster_endpoint_or_the_coordinator_get_no_instruction() -> None:
    members = [*MEMBERS, RosterEntry("fixed", "198.51.100.9", FIXED, "198.51.100.25:51820")]
    planner = PathPlanner()
    _step(
        planner,
        T0,
        observed={**OBSERVED, FIXED: "198.51.100.25:51820", COORD: "203.0.113.1:51820"},
        members=members,
    )
    plan = _plan(planner)
    assert set(plan) == {A, B} and set(plan[A]) == {B}


def test_both_sides_ok_makes_the_pair_direct_and_frees_the_relay() -> None:
    planner = PathPlanner()
    _connected(planner)
    plan = _plan(planner)
    assert plan[A][B] == PathInstruction("direct", OBSERVED[B], None)
    assert plan[B][A] == PathInstruction("direct", OBSERVED[A], None)
    assert _step(planner, T0 + 10) == []


def test_one_side_ok_is_not_enough_and_waits_for_the_other() -> None:
    planner = PathPlanner()
    _step(planner, T0)
    try_id = _plan(planner)[A][B].punch.id
    _step(planner, T0 + 8, {A: MemberReport(tries={B: (try_id, True)})})
    assert _plan(planner)[A][B].punch is not None
    _step(planner, T0 + 9, _ok(try_id))
    assert _plan(planner)[A][B].path == "direct"


def test_a_failed_try_stays_relayed_and_retries_20s_later() -> None:
    planner = PathPlanner()
    _step(planner, T0)
    try_id = _plan(planner)[A][B].punch.id
    _step(planner, T0 + 8, _ok(try_id, b=False))
    plan = _plan(planner)
    assert plan[A][B] == PathInstruction("relay", _relay_of(A), None)
    _step(planner, T0 + 27)
    assert _plan(planner)[A][B].punch is None
    _step(planner, T0 + 28)
    retry = _plan(planner)[A][B].punch
    assert retry is not None and retry.id != try_id and retry.at == T0 + 28 + 4.5


def test_no_report_by_the_deadline_counts_as_a_failure() -> None:
    planner = PathPlanner(sync_interval=2.0)
    _step(planner, T0)
    _step(planner, T0 + 4.5 + 3.0 + 6.0)  # exactly the deadline: still waiting
    assert _plan(planner)[A][B].punch is not None
    _step(planner, T0 + 13.6)
    assert _plan(planner)[A][B].punch is None and _plan(planner)[A][B].path == "relay"


def test_stale_results_of_an_old_try_are_ignored() -> None:
    planner = PathPlanner()
    _step(planner, T0)
    try_id = _plan(planner)[A][B].punch.id
    _step(planner, T0 + 8, _ok(try_id - 1, a=False, b=False))
    assert _plan(planner)[A][B].punch.id == try_id


def test_without_a_relay_the_pair_is_pending_until_the_try_works() -> None:
    planner = PathPlanner()
    assert _step(planner, T0, relay=False) == []
    plan = _plan(planner, relay=False)
    assert plan[A][B].path == "pending" and plan[A][B].endpoint is None and plan[A][B].punch is not None
    _step(planner, T0 + 8, _ok(plan[A][B].punch.id), relay=False)
    assert _plan(planner, relay=False)[A][B].path == "direct"


def test_a_relayed_pair_without_granted_ports_is_pending() -> None:
    planner = PathPlanner()
    _step(planner, T0)
    assert planner.instructions({})[A][B].path == "pending"


def test_an_observed_endpoint_change_sends_a_direct_pair_back_to_the_relay_and_repunches() -> None:
    planner = PathPlanner()
    old_id = _connected(planner)
    moved = {**OBSERVED, A: "203.0.113.77:40100"}
    wants = _step(planner, T0 + 30, observed=moved)
    assert [w.pair for w in wants] == [PAIR]
    assert "203.0.113.77" in (wants[0].ip_a, wants[0].ip_b)
    plan = _plan(planner)
    assert plan[A][B].path == "relay" and plan[B][A].punch.endpoint == "203.0.113.77:40100"
    assert plan[A][B].punch.id > old_id


def test_both_sides_without_a_handshake_for_180s_repunch() -> None:
    planner = PathPlanner()
    _connected(planner)
    now = T0 + 400

    def reports(a_seen: float | None, b_seen: float | None) -> dict[str, MemberReport]:
        return {
            A: MemberReport(peers={B: PeerReport(OBSERVED[B], a_seen)}),
            B: MemberReport(peers={A: PeerReport(OBSERVED[A], b_seen)}),
        }

    _step(planner, now, reports(now - 200, now - 10))
    assert _plan(planner)[A][B].path == "direct"
    _step(planner, now, reports(now - 200, None))
    assert _plan(planner)[A][B].path == "relay" and _plan(planner)[A][B].punch is not None


def test_a_removed_member_drops_its_pairs_and_allocations_at_once() -> None:
    planner = PathPlanner()
    members = [*MEMBERS, RosterEntry("c", "198.51.100.4", C)]
    assert len(_step(planner, T0, members=members)) == 3
    wants = _step(planner, T0 + 1, members=MEMBERS)
    assert [w.pair for w in wants] == [PAIR]
    assert set(planner.pairs) == {PAIR}
    assert C not in planner.instructions({})


def test_a_member_not_yet_observed_gets_no_pair_state() -> None:
    planner = PathPlanner()
    assert _step(planner, T0, observed={A: OBSERVED[A]}) == []
    assert planner.pairs == {}


def test_members_behind_one_public_ip_try_lan_first_then_alternate_with_direct() -> None:
    planner = PathPlanner()
    observed = {A: "203.0.113.10:40001", B: "203.0.113.10:40002"}
    reports = {
        A: MemberReport(lan=("10.0.0.5:51820", "198.51.100.17:51820")),
        B: MemberReport(lan=("172.16.0.9:51821", "198.51.100.18:51821")),
    }
    _step(planner, T0, reports, observed)
    plan = _plan(planner)
    assert plan[A][B].punch.path == "lan"
    assert plan[A][B].punch.endpoint == "198.51.100.18:51821"
    assert plan[B][A].punch.endpoint == "198.51.100.17:51820"
    failed = {**reports, A: MemberReport(lan=reports[A].lan, tries={B: (plan[A][B].punch.id, False)})}
    _step(planner, T0 + 8, failed, observed)
    _step(planner, T0 + 30, reports, observed)
    assert _plan(planner)[A][B].punch.path == "direct"


def test_lan_success_makes_the_pair_lan_with_the_lan_endpoints() -> None:
    planner = PathPlanner()
    observed = {A: "203.0.113.10:40001", B: "203.0.113.10:40002"}
    reports = {A: MemberReport(lan=("198.51.100.17:51820",)), B: MemberReport(lan=("198.51.100.18:51821",))}
    _step(planner, T0, reports, observed)
    try_id = _plan(planner)[A][B].punch.id
    both_ok = {
        key: MemberReport(lan=r.lan, tries={other: (try_id, True)})
        for (key, r), other in zip(reports.items(), (B, A), strict=True)
    }
    _step(planner, T0 + 8, both_ok, observed)
    assert _plan(planner)[A][B] == PathInstruction("lan", "198.51.100.18:51821", None)


def test_one_side_without_lan_candidates_tries_direct() -> None:
    planner = PathPlanner()
    observed = {A: "203.0.113.10:40001", B: "203.0.113.10:40002"}
    _step(planner, T0, {A: MemberReport(lan=("198.51.100.17:51820",)), B: MemberReport()}, observed)
    assert _plan(planner)[A][B].punch.path == "direct"


def test_behind_one_ip_the_first_try_waits_for_both_lan_reports_then_alternates() -> None:
    """A report still on its way must not spend the first try (and 20 s) on direct."""
    planner = PathPlanner()
    observed = {A: "203.0.113.10:40001", B: "203.0.113.10:40002"}
    only_a = {A: MemberReport(lan=("198.51.100.17:51820",))}
    _step(planner, T0, only_a, observed)
    assert _plan(planner)[A][B].punch is None, "no try before B's LAN addresses are known"
    both = {**only_a, B: MemberReport(lan=("198.51.100.18:51821",))}
    _step(planner, T0 + 2, both, observed)
    first = _plan(planner)[A][B].punch
    assert first is not None and first.path == "lan"
    failed = {A: MemberReport(lan=only_a[A].lan, tries={B: (first.id, False)}), B: both[B]}
    _step(planner, T0 + 20, failed, observed)
    _step(planner, T0 + 60, both, observed)
    second = _plan(planner)[A][B].punch
    assert second is not None and second.path == "direct" and second.id != first.id


def test_lan_candidate_picks_the_longest_shared_prefix_or_the_first() -> None:
    assert lan_candidate(("10.1.2.3:1", "192.168.1.9:1"), ("192.168.1.4:2",)) == "192.168.1.9:1"
    assert lan_candidate(("10.1.2.3:1", "172.16.0.1:1"), ("192.168.1.4:2",)) == "10.1.2.3:1"


def test_pair_ids_are_symmetric() -> None:
    assert pair_id(A, B) == pair_id(B, A)


def test_member_relays_never_carry_their_own_pair_and_keep_a_pair_in_place() -> None:
    from mesh.control.paths import place_on_members

    wants = [AllocationWant(pair_id(A, B), *sorted((A, B))[:1], "1.1.1.1", sorted((A, B))[1], "2.2.2.2")]
    assert place_on_members(wants, [A, B]) == {}
    placed = place_on_members(wants, [A, C])
    assert placed == {C: wants}
    assert place_on_members(wants, [C, A]) == placed


def test_a_relayed_pair_whose_observed_endpoint_changes_tries_again_at_once() -> None:
    planner = PathPlanner()
    _step(planner, T0)
    try_id = _plan(planner)[A][B].punch.id
    _step(planner, T0 + 8, _ok(try_id, a=False))
    _step(planner, T0 + 10)
    assert _plan(planner)[A][B].punch is None
    moved = {**OBSERVED, B: "203.0.113.20:51820"}
    _step(planner, T0 + 12, observed=moved)
    retry = _plan(planner)[A][B].punch
    assert retry is not None and retry.endpoint == "203.0.113.20:51820"


def test_a_try_starts_afresh_unless_both_sides_report_a_live_session() -> None:
    planner = PathPlanner()
    observed = {A: "203.0.113.10:40001", B: "198.51.100.20:40002"}
    _step(planner, T0, {A: MemberReport(), B: MemberReport()}, observed)
    assert _plan(planner)[A][B].punch.fresh is True, "no session reported: both sides start anew"
    planner = PathPlanner()
    live = {
        A: MemberReport(peers={B: PeerReport(endpoint=None, last_handshake=T0 - 30, rx_bytes=1, tx_bytes=1)}),
        B: MemberReport(peers={A: PeerReport(endpoint=None, last_handshake=T0 - 31, rx_bytes=1, tx_bytes=1)}),
    }
    _step(planner, T0, live, observed)
    instructions = _plan(planner)
    assert instructions[A][B].punch.fresh is False and instructions[B][A].punch.fresh is False
    one_sided = {**live, B: MemberReport()}
    planner = PathPlanner()
    _step(planner, T0, one_sided, observed)
    assert _plan(planner)[A][B].punch.fresh is True, "a handshake only one side saw is no session"
