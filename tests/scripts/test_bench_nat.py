"""The pure helpers of scripts/bench_nat.py (the benchmark itself is a script, not a test)."""

from __future__ import annotations

from shardpool_dev.bench import nat
from shardpool_dev.lab.grid import STANDARD_GRID, STANDARD_ROUTERS

SITES = {site.label: site for site in STANDARD_GRID}
NAT = {label: kind for label, (kind, _) in STANDARD_ROUTERS.items()}


def test_pair_names_do_not_depend_on_order() -> None:
    assert nat.pair_name("m4", "m3") == nat.pair_name("m3", "m4") == "m3<->m4"


def test_direct_is_counted_only_where_the_nats_allow_it_and_not_for_the_coordinator() -> None:
    allowed = [(a.label, b.label) for a, b in nat.pairs(STANDARD_GRID) if nat.direct_allowed(a, b, NAT)]
    assert ("m1a", "m1b") in allowed and ("m2", "m3") in allowed
    assert ("m3", "m4") not in allowed and not any("coord" in pair or "ublk" in pair for pair in allowed)
    # m1a, m1b, m2 with each other (3) and with m3, m4 (6)
    assert len(allowed) == 9
    assert nat.direct_allowed(SITES["m3"], SITES["m4"], {**NAT, "r3": "cone"})


def test_seconds_are_summarized_per_expected_path_with_the_never_counted() -> None:
    expected = {"a<->b": "direct", "a<->c": "direct", "b<->c": "relay", "c<->d": "relay"}
    seconds = {"a<->b": 2.04, "a<->c": 6.0, "b<->c": 11.0}
    assert nat.seconds_by_path(seconds, expected) == {
        "direct": {"pairs": 2, "never": 0, "median_s": 4.0, "max_s": 6.0},
        "relay": {"pairs": 2, "never": 1, "median_s": 11.0, "max_s": 11.0},
    }
    assert nat.summarize_seconds([None]) == {"pairs": 1, "never": 1, "median_s": None, "max_s": None}


def test_shares_and_throughput_ratio_round_and_survive_zero() -> None:
    assert nat.share(2, 3) == 0.667
    assert nat.share(0, 0) is None
    assert nat.throughput_ratio(90.0, 100.0) == 0.9
    assert nat.throughput_ratio(90.0, 0.0) is None


def test_the_pair_clock_counts_a_pair_once_both_sides_show_its_path_from_the_later_join() -> None:
    clock = nat.PairClock(None, STANDARD_GRID, NAT)  # the lab is only used to run commands
    clock.keys = {"m2": "K2", "m3": "K3", "m4": "K4"}
    clock.joined = {"m2": 0.0, "m3": -100.0, "m4": -100.0}
    now = nat.time.monotonic()
    clock.joined["m2"] = now - 7.0
    clock._record_paths("m2", [{"public_key": "K3", "path": "direct"}, {"public_key": "K4", "path": "relay"}])
    clock._record_paths("m3", [{"public_key": "K2", "path": "direct"}, {"public_key": "K4", "path": "relay"}])
    found = clock.to_path()
    assert 7.0 <= found["m2<->m3"] < 8.0, "from m2's join, the later one"
    assert found["m2<->m4"] is None, "m2 sees m4 relayed, but the grid implies direct; m4 not heard from"
    assert found["m3<->m4"] is None, "only one side has shown it so far"
    assert clock.paths_seen[("m2", "m4")] == "relay"
