"""How long a stage's forward and backward passes take on its device, not how long launching them took.

A GPU runs kernels asynchronously: ``time.perf_counter()`` around a forward pass on CUDA measures
the kernel launches, and the GPU time lands in whatever next waits for the device (a staged send,
the step-end copy). The stage times feed calibration (``plan/calibrate.py``) and re-balancing, so
a stage on a GPU would look nearly free. A stage therefore times its compute with the clock its
device needs (:func:`clock_kind`):

- ``wall``: the CPU, where work is done when the call returns;
- ``events``: CUDA (ROCm included) and XPU record a timing event on the compute stream before and
  after each pass; the elapsed device time is read once, when the step's compute is collected
  (one wait for the last event, where the step waits for the device anyway);
- ``synchronized``: MPS, whose events torch exposes less uniformly: the device is synchronised
  before the clock is read at each end of a pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

__all__ = ["EventClock", "StageClock", "SynchronizedClock", "WallClock", "clock_kind", "stage_clock"]

ClockKind = Literal["wall", "events", "synchronized"]

_EVENT_KINDS = frozenset({"cuda", "xpu"})
_SYNCHRONIZED_KINDS = frozenset({"mps"})


def clock_kind(device_type: str) -> ClockKind:
    """Which clock times compute on a device of ``device_type`` (see the module's docstring).

    Every accelerator kind that runs work asynchronously gets a clock that waits for the device;
    only the CPU is timed by the wall clock alone.
    """
    if device_type in _EVENT_KINDS:
        return "events"
    if device_type in _SYNCHRONIZED_KINDS:
        return "synchronized"
    if device_type == "cpu":
        return "wall"
    raise ValueError(f"no compute clock for device type {device_type!r}")


class StageClock(Protocol):
    """Times intervals of a stage's compute: ``start()`` returns a mark, ``stop(mark)`` ends its
    interval, ``collect()`` returns the seconds of the intervals ended since the last collect."""

    def start(self) -> Any: ...

    def stop(self, mark: Any) -> None: ...

    def collect(self) -> float: ...


@dataclass
class WallClock:
    """The CPU's clock: each interval is over when its call returns."""

    pending: float = 0.0

    def start(self) -> float:
        """The interval's start time."""
        return time.perf_counter()

    def stop(self, mark: float) -> None:
        """End the interval started at ``mark``."""
        self.pending += time.perf_counter() - mark

    def collect(self) -> float:
        """Seconds of the intervals since the last collect."""
        seconds, self.pending = self.pending, 0.0
        return seconds


@dataclass
class SynchronizedClock:
    """The wall clock read only after the device has finished the work queued so far."""

    synchronize: Callable[[], None]
    wall: WallClock = field(default_factory=WallClock)

    def start(self) -> float:
        """Wait for the device's queued work, then the interval's start time."""
        self.synchronize()
        return self.wall.start()

    def stop(self, mark: float) -> None:
        """Wait for the interval's work on the device, then end it."""
        self.synchronize()
        self.wall.stop(mark)

    def collect(self) -> float:
        """Seconds of the intervals since the last collect."""
        return self.wall.collect()


@dataclass
class EventClock:
    """Timing events recorded on the device's compute stream around each interval.

    ``new_event`` makes an event with timing enabled (``torch.cuda.Event(enable_timing=True)``);
    recording one queues it on the current stream without waiting. Reading the intervals waits
    only for the last event, once per step.
    """

    new_event: Callable[[], Any]
    intervals: list[tuple[Any, Any]] = field(default_factory=list)

    def start(self) -> Any:
        """Record the interval's start event on the compute stream."""
        event = self.new_event()
        event.record()
        return event

    def stop(self, mark: Any) -> None:
        """Record the interval's end event on the compute stream."""
        end = self.new_event()
        end.record()
        self.intervals.append((mark, end))

    def collect(self) -> float:
        """Device seconds of the intervals since the last collect (waits for the last one to end)."""
        if not self.intervals:
            return 0.0
        self.intervals[-1][1].synchronize()
        milliseconds = sum(start.elapsed_time(end) for start, end in self.intervals)
        self.intervals.clear()
        return milliseconds / 1000.0


def stage_clock(device: torch.device) -> StageClock:
    """The clock that times compute on ``device`` (:func:`clock_kind`)."""
    kind = clock_kind(device.type)
    if kind == "wall":
        return WallClock()
    module = torch.get_device_module(device)
    if kind == "synchronized":
        return SynchronizedClock(module.synchronize)
    return EventClock(lambda: module.Event(enable_timing=True))
