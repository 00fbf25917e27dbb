"""The launcher's watch over its stages' beats: a stage that stopped beating is a lost member.

With ``Job.keep_state`` every stage process raises its rank's sealed beat number in the
rendezvous store every second (:mod:`shardpool.contract.liveness`,
:func:`~shardpool.elastic.messages.read_beat`), from a thread of its own: a number that stops
rising names the process that stopped (a suspended laptop, a ``SIGSTOP``), not the neighbour that
waits for it. Only a number above the highest one read counts as a beat: an outsider that sets an
older sealed value back (the one thing it can do with a sealed beat) neither hides a stall nor
restarts the stall clock. Torch-free; the store is read through a callable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MIN_STALL_S", "STALL_STEPS", "BeatWatch", "stall_bound"]

#: The shortest stall bound, whatever the measured step time (a beat every second, scheduling noise).
MIN_STALL_S = 10.0
#: A stage is stalled after this many of the longest measured steps without a beat.
STALL_STEPS = 3


def stall_bound(longest_step_s: float | None, member_timeout_s: float) -> float:
    """Seconds without a beat after which a stage is stalled.

    Three times the longest measured step, at least :data:`MIN_STALL_S`, at most
    ``member_timeout_s``; before any step is measured, ``member_timeout_s``.
    """
    if longest_step_s is None:
        return member_timeout_s
    return min(max(STALL_STEPS * longest_step_s, MIN_STALL_S), member_timeout_s)


@dataclass
class BeatWatch:
    """The launcher's watch over its stages' beat numbers (read from the rendezvous store).

    ``beats(rank)`` reads a rank's beat number (:func:`~shardpool.elastic.messages.read_beat`;
    0 before its first beat or for a refused value); ``ranks`` are the
    ranks of each member, by name. :meth:`stalled` reads them at most every ``every_s`` seconds.
    """

    beats: Callable[[int], int]
    ranks: dict[str, list[int]]
    member_timeout_s: float
    every_s: float = 1.0
    clock: Callable[[], float] = time.monotonic
    longest_step_s: float | None = None
    _seen: dict[int, tuple[int, float]] = field(default_factory=dict)
    _checked_at: float | None = None

    def on_step(self, event: dict[str, Any]) -> None:
        """Note a ``step`` event's duration: the stall bound follows the longest measured step."""
        seconds = event.get("step_seconds")
        if isinstance(seconds, (int, float)) and seconds > 0:
            self.longest_step_s = max(self.longest_step_s or 0.0, float(seconds))

    @property
    def bound_s(self) -> float:
        """The current stall bound (:func:`stall_bound`)."""
        return stall_bound(self.longest_step_s, self.member_timeout_s)

    def stalled(self, finished: Iterable[int] = ()) -> tuple[str, str] | None:
        """(member, reason) of the first stage whose beats stopped for longer than the bound, or None.

        ``finished`` ranks have exited and beat no more; a rank whose number is still 0 has not
        started beating and is left to the startup timeouts. A number at or below the highest read
        is no beat.
        """
        now = self.clock()
        if self._checked_at is not None and now - self._checked_at < self.every_s:
            return None
        self._checked_at = now
        done = set(finished)
        bound = self.bound_s
        for member, ranks in self.ranks.items():
            for rank in ranks:
                if rank in done:
                    continue
                try:
                    count = int(self.beats(rank))
                except Exception:  # noqa: BLE001 - an unreadable counter is no evidence of a stall
                    continue
                seen = self._seen.get(rank)
                if seen is None or count > seen[0]:
                    self._seen[rank] = (count, now)
                    continue
                silent = now - seen[1]
                if seen[0] > 0 and silent > bound:  # the highest read: a refused value hides nothing
                    return member, f"its stage (rank {rank}) stopped beating for {silent:.0f} s"
        return None
