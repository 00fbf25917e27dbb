"""Report a step only once it is safe: the launcher's commit gate for runs that keep training (issue 16).

A run that keeps training across a lost member copies each stage's step-boundary state after
every optimizer step, while the next step computes (:mod:`shardpool.elastic.rank_liveness`). A member
lost before its copy of step N is written takes step N with it: the run restores N - 1 and
trains N again. No copy scheme avoids that moment: the update of step N exists only on its
member until it has been sent, and sending takes time. What the launcher can promise is that a
step it *reported* is never trained again: it reports step N (the ``metrics.jsonl`` line, the
trackers, the console, ``finetune --json``) only once every rank's copy of N is complete. A
step whose copy is still in flight when a member is lost is part of the interrupted work: it
was never shown, and it is trained again with the step after it.

:class:`CommitGate` holds the reports in the order they came and lets each step's (and
everything after it) through once ``committed(step)`` says so. The launcher calls
:meth:`CommitGate.release` from its event loop (several times a second) and
:meth:`CommitGate.release_all` when the stages have all finished (the run is over: its steps are
in the final adapter). Reports held when an attempt ends early are dropped with it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

__all__ = ["CommitGate", "passing"]

Report = Callable[[], None]


class CommitGate:
    """Runs reports in order, holding each step's (and what follows it) until ``committed(step)``.

    ``committed`` is asked about the oldest held step only, each time a report arrives and at
    each :meth:`release`. One thread uses a gate (the launcher's event loop).
    """

    def __init__(self, committed: Callable[[int], bool]) -> None:
        self._committed = committed
        self._held: deque[tuple[int | None, Report]] = deque()
        #: The newest step the stages finished, reported or held.
        self.newest_step = 0
        #: The newest step reported (0 before the first).
        self.reported_step = 0

    def step(self, step: int, report: Report) -> None:
        """Report step ``step`` (with ``report``) once its copy is complete."""
        self.newest_step = max(self.newest_step, step)
        self._held.append((step, report))
        self.release()

    def then(self, report: Report) -> None:
        """Run ``report`` after everything held so far (at once when nothing is held)."""
        self._held.append((None, report))
        self.release()

    def release(self) -> None:
        """Run the held reports up to the first step whose copy is not complete yet."""
        while self._held:
            step, _ = self._held[0]
            if step is not None and step > self.reported_step and not self._committed(step):
                return
            self._pop()

    def release_all(self) -> None:
        """Run every held report: the stages finished, so every step they trained is in the result."""
        while self._held:
            self._pop()

    @property
    def held_steps(self) -> int:
        """How many finished steps are held (their copies in flight)."""
        return sum(1 for step, _ in self._held if step is not None)

    def _pop(self) -> None:
        step, report = self._held.popleft()
        if step is not None:
            self.reported_step = max(self.reported_step, step)
        report()


def passing() -> CommitGate:
    """A gate that holds nothing (a run without step-boundary copies)."""
    return CommitGate(lambda step: True)
