"""Admission for the agent's costly requests: how many may hold a handler thread at once.

The agent's listeners each have one bounded pool of handler threads, shared by every route. A
request that holds a thread for long (a probe, a profile wait, an echo, a long poll) is admitted
only while its kind has a free slot; one that finds none is answered at once (a one-line 429) or,
for a long poll, answered without waiting. So no kind of request, and no single caller, can take
every thread, and the event polls that keep jobs alive always find one.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager

__all__ = ["Slots"]


class Slots:
    """At most ``limit`` holders at once for each key (one shared count when no key is given).

    Taking a slot never blocks: :meth:`hold` yields whether one was free, so the caller answers
    at once when none was.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a slot limit must be at least 1, not {limit}")
        self.limit = limit
        self._held: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def held(self, key: Hashable = None) -> int:
        """How many slots of ``key`` are held right now."""
        with self._lock:
            return self._held.get(key, 0)

    @contextmanager
    def hold(self, key: Hashable = None) -> Iterator[bool]:
        """Hold a slot of ``key`` for the ``with`` block if one is free; yields whether one was."""
        with self._lock:
            taken = self._held.get(key, 0) < self.limit
            if taken:
                self._held[key] = self._held.get(key, 0) + 1
        try:
            yield taken
        finally:
            if taken:
                with self._lock:
                    left = self._held[key] - 1
                    if left:
                        self._held[key] = left
                    else:
                        del self._held[key]  # keys (uids, job ids) are not remembered once idle
