"""A stage's compute time is the device's time, not the time its kernels took to launch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardpool.data.rows import TokenRows
from shardpool.train import clock as clock_module
from shardpool.train import pipeline
from shardpool.train.clock import EventClock, SynchronizedClock, WallClock, clock_kind, stage_clock
from shardpool.train.pipeline import StagePipe


def test_every_asynchronous_device_is_timed_by_a_clock_that_waits_for_it() -> None:
    assert {kind: clock_kind(kind) for kind in ("cpu", "cuda", "xpu", "mps")} == {
        "cpu": "wall",
        "cuda": "events",  # ROCm's torch calls its devices cuda too
        "xpu": "events",
        "mps": "synchronized",
    }
    with pytest.raises(ValueError, match="no compute clock for device type 'meta'"):
        clock_kind("meta")
    assert isinstance(stage_clock(torch.device("cpu")), WallClock)


class _Event:
    """A device timing event whose elapsed time the test sets: each event is its record order in ms x 10."""

    recorded: list[_Event] = []
    waited: list[_Event] = []

    def record(self) -> None:
        self.at = 10.0 * len(_Event.recorded)
        _Event.recorded.append(self)

    def elapsed_time(self, end: _Event) -> float:
        return end.at - self.at

    def synchronize(self) -> None:
        _Event.waited.append(self)


def test_event_intervals_are_read_once_as_device_seconds() -> None:
    _Event.recorded, _Event.waited = [], []
    clock = EventClock(_Event)
    for _ in range(3):
        clock.stop(clock.start())  # events 0-1, 2-3, 4-5: 10 ms each
    assert clock.collect() == pytest.approx(0.030)
    assert _Event.waited == [_Event.recorded[-1]], "one wait, for the last event"
    assert clock.collect() == 0.0


def test_the_synchronized_clock_waits_for_the_device_at_both_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    now = iter([1.0, 3.5])
    monkeypatch.setattr(clock_module.time, "perf_counter", lambda: next(now))
    calls: list[str] = []
    clock = SynchronizedClock(lambda: calls.append("sync"))
    clock.stop(clock.start())
    assert calls == ["sync", "sync"] and clock.collect() == 2.5


class _CountingClock:
    """A stand-in device clock: every interval takes exactly 1 s of device time."""

    def __init__(self) -> None:
        self.open = 0
        self.ended = 0

    def start(self) -> int:
        self.open += 1
        return self.open

    def stop(self, mark: Any) -> None:
        self.ended += 1

    def collect(self) -> float:
        seconds, self.ended = float(self.ended), 0
        return seconds


class _Spec:
    index, num_stages, is_first, is_last = 0, 1, True, True


class _LoneWire:
    """A lone stage's wire: no neighbour on either side."""

    previous = next = None


class _Stage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 8)

    def forward(self, ids: torch.Tensor, **_: Any) -> torch.Tensor:
        return self.embed(ids)


def test_the_pipeline_times_its_passes_with_its_device_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    devices: list[torch.device] = []

    def device_clock(device: torch.device) -> _CountingClock:
        devices.append(device)
        return _CountingClock()

    monkeypatch.setattr(pipeline, "stage_clock", device_clock)
    pipe = StagePipe(
        _Stage(), _Spec(), wire=_LoneWire(), device=torch.device("cpu"), hidden_size=8, packed=True
    )  # type: ignore[arg-type]
    ids = torch.tensor([[1, 2, 3]])
    rows = [
        TokenRows(input_ids=ids, labels=ids, attention_mask=ids * 0 + 1, position_ids=ids) for _ in range(3)
    ]
    totals = pipe.run_schedule("1f1b", rows, step_label_tokens=6)
    assert devices == [torch.device("cpu")]
    # three forwards and three backwards, one device second each: the clock's time, not the wall's
    assert totals.compute_seconds == 6.0
