"""What a supervised mesh launcher asks of its supervisor: one object, given to the launcher at construction.

The mesh launcher's event loop (:func:`~shardpool.launch.mesh_launcher.run_mesh_job`) knows how to
start, follow and stop stages; whether a silent stage is a lost member, when to stop for a member
worth a restart, and how to grow in place are the supervisor's decisions
(:class:`shardpool.elastic.supervisor.Supervisor`). These protocols are all the loop sees of them,
so the layer below never imports the one above. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from shardpool.contract.job import Job
from shardpool.launch.mesh_members import MeshMember

__all__ = ["GrowthOrder", "StallWatch", "Supervision"]


class StallWatch(Protocol):
    """A watch over the stages' beats (:class:`shardpool.elastic.beats.BeatWatch`)."""

    def on_step(self, event: dict[str, Any]) -> None:
        """See a ``step`` event (the stall bound follows the measured steps)."""
        ...

    def stalled(self, finished: Iterable[int]) -> tuple[str, str] | None:
        """The member whose stage stopped beating and why, or None (``finished`` ranks are done)."""
        ...


class GrowthOrder(Protocol):
    """A growth in place, as the event loop carries it out (:class:`shardpool.elastic.growth.GrowOrder`).

    ``started``, ``grown``, ``applied`` and ``failed`` read the run's state; the loop moves it by
    :meth:`joiners_started`, :meth:`abandon` and :meth:`followed`.
    """

    job: Job
    joined: dict[str, tuple[MeshMember, list[int]]]
    renumber: dict[int, int]
    watch: StallWatch | None

    @property
    def started(self) -> bool: ...
    @property
    def grown(self) -> bool: ...
    @property
    def applied(self) -> bool: ...
    @property
    def failed(self) -> str | None: ...

    def joiners_started(self) -> None:
        """Every joining rank was started."""
        ...

    def abandon(self, reason: str) -> None:
        """The growth failed for ``reason``; the joining ranks were stopped."""
        ...

    def followed(self) -> None:
        """The loop follows the grown job now."""
        ...


class Supervision(Protocol):
    """What the event loop of a supervised run asks, each attempt."""

    @property
    def lost_after_s(self) -> float:
        """Seconds of agent silence after which a member is lost."""
        ...

    def watch(self, job: Job) -> StallWatch | None:
        """The stall watch over ``job``'s stages, or None when they do not beat."""
        ...

    def interrupt(self) -> bool:
        """Whether to stop the stages now, on purpose (a member worth a restart joined)."""
        ...

    def tick(self) -> None:
        """Called on every turn of the event loop (release reported steps, move a growth on)."""
        ...

    def grow(self) -> GrowthOrder | None:
        """The growth in place to carry out now, if any."""
        ...
