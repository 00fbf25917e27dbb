"""The launcher's stall watch: a stage whose beats stop is a lost member, one still starting is not."""

from __future__ import annotations

from shardpool.elastic.beats import MIN_STALL_S, BeatWatch, stall_bound


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_stall_bound_is_three_longest_steps_within_ten_seconds_and_the_member_timeout() -> None:
    assert stall_bound(None, 30.0) == 30.0, "before any step is measured: the member timeout"
    assert stall_bound(1.0, 30.0) == MIN_STALL_S == 10.0
    assert stall_bound(5.0, 30.0) == 15.0
    assert stall_bound(20.0, 30.0) == 30.0
    assert stall_bound(1.0, 5.0) == 5.0, "a member timeout under 10 s wins"


def _watch(beats: dict[int, int], clock: _Clock) -> BeatWatch:
    return BeatWatch(beats=beats.__getitem__, ranks={"a": [0], "b": [1]}, member_timeout_s=30.0, clock=clock)


def test_the_bound_follows_the_longest_measured_step() -> None:
    watch = _watch({0: 1, 1: 1}, _Clock())
    assert watch.bound_s == 30.0
    for seconds in (2.0, 6.0, 4.0):
        watch.on_step({"event": "step", "step": 1, "step_seconds": seconds})
    assert watch.bound_s == 18.0


def test_a_stage_whose_beats_stop_is_named_once_the_bound_passes() -> None:
    clock, beats = _Clock(), {0: 1, 1: 1}
    watch = _watch(beats, clock)
    watch.on_step({"event": "step", "step": 1, "step_seconds": 1.0})  # bound: 10 s
    assert watch.stalled() is None
    for _ in range(10):
        clock.now += 1.0
        beats[0] += 1  # rank 0 beats on (it waits for rank 1 but its beat thread runs)
        assert watch.stalled() is None
    clock.now += 1.5
    beats[0] += 1
    stalled = watch.stalled()
    assert stalled is not None
    member, reason = stalled
    assert member == "b", "the stopped process is named, not its waiting neighbour"
    assert "stopped beating for 12 s" in reason


def test_a_stage_that_has_not_beaten_yet_is_starting_not_stalled() -> None:
    clock, beats = _Clock(), {0: 0, 1: 0}
    watch = _watch(beats, clock)
    for _ in range(100):
        clock.now += 1.0
        assert watch.stalled() is None


def test_finished_ranks_and_unreadable_counters_are_not_stalls() -> None:
    clock = _Clock()

    def beats(rank: int) -> int:
        if rank == 1:
            raise OSError("store went away")
        return 5

    watch = BeatWatch(beats=beats, ranks={"a": [0], "b": [1]}, member_timeout_s=10.0, clock=clock)
    assert watch.stalled() is None
    clock.now = 100.0
    assert watch.stalled(finished=[0]) is None


def test_the_counters_are_read_at_most_once_a_second() -> None:
    clock, reads = _Clock(), []
    watch = BeatWatch(
        beats=lambda rank: reads.append(rank) or 1, ranks={"a": [0]}, member_timeout_s=10.0, clock=clock
    )
    watch.stalled()
    clock.now += 0.5
    watch.stalled()
    clock.now += 0.6
    watch.stalled()
    assert reads == [0, 0]


def test_a_replayed_older_beat_neither_hides_a_stall_nor_restarts_its_clock() -> None:
    """An outsider cannot raise a sealed beat; it can only set an older sealed value back, or one
    that is refused (read as 0). Neither counts as a beat."""
    clock, beats = _Clock(), {0: 5, 1: 5}
    watch = _watch(beats, clock)
    assert watch.stalled() is None
    for second in range(1, 40):
        clock.now = float(second)
        beats[0] += 1  # rank 0 beats on; rank 1 stalled at 5
        # the outsider's replays of rank 1's older sealed beats, and a value that is refused (0)
        beats[1] = (4, 0, 3, 5)[second % 4]
        found = watch.stalled()
        if found is not None:
            break
    assert found is not None and found[0] == "b", "the stall is found as if no one had touched rank 1's beat"
    assert clock.now == 31.0 and "stopped beating for 31 s" in found[1]
