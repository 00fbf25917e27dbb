"""The coordinator's shared path state: member reports in, per-member path instructions out.

The roster service's handler threads write reports and read instructions; the sync daemon's
step reads the reports, runs :class:`mesh.control.paths.PathPlanner` and publishes the
instructions, and the allocations that members started with ``--relay`` should serve. One lock guards both maps; values are immutable, so readers get a stable view.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import Any

from mesh.control.model import PathInstruction
from mesh.control.report import MemberReport
from mesh.relay.allocations import AllocationRequest

__all__ = ["PathBoard"]


class PathBoard:
    """Latest report per member, and the latest instructions per member, safe across threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reports: dict[str, MemberReport] = {}
        self._paths: dict[str, dict[str, PathInstruction]] = {}
        self._relaying: dict[str, list[AllocationRequest]] = {}

    def record(self, member_key: str, report: MemberReport) -> None:
        """Keep ``report`` as the latest from ``member_key``."""
        with self._lock:
            self._reports[member_key] = report

    def reports(self, members: Iterable[str]) -> dict[str, MemberReport]:
        """The latest reports of ``members``; reports of anyone else (removed members) are forgotten."""
        wanted = set(members)
        with self._lock:
            for gone in set(self._reports) - wanted:
                del self._reports[gone]
            return dict(self._reports)

    def publish(
        self,
        paths: Mapping[str, Mapping[str, PathInstruction]],
        relaying: Mapping[str, list[AllocationRequest]] | None = None,
    ) -> None:
        """Replace every member's instructions, and the allocations each relaying member should serve."""
        with self._lock:
            self._paths = {key: dict(value) for key, value in paths.items()}
            self._relaying = {key: list(value) for key, value in (relaying or {}).items()}

    def relay_json(self, member_key: str) -> list[dict[str, str]]:
        """The ``relay_allocations`` field of ``member_key``'s roster reply (empty unless it relays)."""
        with self._lock:
            return [asdict(request) for request in self._relaying.get(member_key, [])]

    def paths_json(self, member_key: str) -> dict[str, Any]:
        """The ``paths`` field of ``member_key``'s roster reply (peer key -> instruction as JSON)."""
        with self._lock:
            mine = self._paths.get(member_key, {})
            return {peer: instruction.to_json() for peer, instruction in mine.items()}
