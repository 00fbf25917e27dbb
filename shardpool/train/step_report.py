"""What every rank reports of a step, gathered in one all-gather with named fields.

After each optimizer step every rank reports its compute, wait and sync seconds, the bytes it
sent and the most micro-batches it held at once; a run that copies its state adds the copy's
figures, a step that measures room (the re-balance check step, or every step of a run that may
grow) adds the rank's room, and a run that may grow adds whether rank 0 found the launcher's grow
decision. :func:`gather_step_reports` sends one row per rank (:meth:`StepReport.row`) through
:func:`~shardpool.train.loss.gather_timings` and reads the columns back by name
(:meth:`GatheredStep.from_columns`): the optional fields are present on every rank or on none, as
the job decides them, so the layout is known on both ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardpool.errors import ShardpoolError
from shardpool.train.loss import gather_timings

__all__ = ["CopyFigures", "GatheredStep", "StepReport", "gather_step_reports"]

#: A rank's step-boundary copy figures: the copy's seconds, the seconds the step was blocked
#: handing it over, and the copy thread's CPU seconds.
CopyFigures = tuple[float, float, float]


@dataclass(frozen=True)
class StepReport:
    """One rank's figures for one step (``None``: not reported by this job)."""

    compute_s: float
    wait_s: float
    bytes_sent: int
    sync_s: float
    in_flight: int
    copy_figures: CopyFigures | None = None
    room_bytes: float | None = None
    grow_due: bool | None = None

    def row(self) -> list[float]:
        """The figures after the first three, in column order (the optional ones when present)."""
        extra = [self.sync_s, float(self.in_flight)]
        if self.copy_figures is not None:
            extra += [float(value) for value in self.copy_figures]
        if self.room_bytes is not None:
            extra.append(float(self.room_bytes))
        if self.grow_due is not None:
            extra.append(1.0 if self.grow_due else 0.0)
        return extra


@dataclass(frozen=True)
class GatheredStep:
    """Every rank's report of one step, each field a list by rank."""

    compute_s: list[float]
    wait_s: list[float]
    bytes_sent: list[float]
    sync_s: list[float]
    in_flight: list[int]
    #: ``stage_copy_s``, ``stage_copy_blocked_s``, ``stage_copy_cpu_s``, each by rank.
    copy_figures: tuple[list[float], list[float], list[float]] | None = None
    rooms: list[int] | None = None
    #: Whether any rank said the job grows after this step (rank 0 is the one that looks).
    grow_due: bool | None = None

    @classmethod
    def from_columns(cls, columns: list[list[float]], like: StepReport) -> GatheredStep:
        """Read :func:`~shardpool.train.loss.gather_timings`' columns laid out as ``like``'s row."""
        expected = 5 + 3 * (like.copy_figures is not None) + (like.room_bytes is not None)
        expected += like.grow_due is not None
        if len(columns) != expected:
            raise ShardpoolError(
                f"a step report has {len(columns)} columns, {expected} expected: every rank must "
                "report the same fields (a job's ranks disagree; restart the run)"
            )
        compute, wait, sent, sync, in_flight, *rest = columns
        copies = None
        if like.copy_figures is not None:
            copies, rest = (rest[0], rest[1], rest[2]), rest[3:]
        rooms = None
        if like.room_bytes is not None:
            rooms, rest = [int(value) for value in rest[0]], rest[1:]
        grow_due = max(rest[0]) > 0 if like.grow_due is not None else None
        return cls(compute, wait, sent, sync, [int(count) for count in in_flight], copies, rooms, grow_due)


def gather_step_reports(report: StepReport, world_size: int) -> GatheredStep:
    """Every rank's :class:`StepReport` of this step, in one all-gather (every rank calls it)."""
    columns = gather_timings(report.compute_s, report.wait_s, report.bytes_sent, world_size, *report.row())
    return GatheredStep.from_columns(columns, like=report)
