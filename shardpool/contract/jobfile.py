"""The description of one run that every stage process receives: plain JSON, never a pickle.

The fields and their limits are :class:`shardpool.contract.spec.JobSpec` (torch-free, closed); this
module adds what a stage process needs on top: its :class:`StageSpec`, and reading and writing the
job file. Moving a stage to another machine changes only its ``device``, its ``host`` and the
rendezvous address here; nothing else a stage process reads depends on where it runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from mesh.files import write_json
from shardpool.contract.spec import (
    MAX_JOB_JSON_BYTES,
    ContractError,
    JobSpec,
    StagePlacement,
    describe_validation_error,
    read_job_json,
)

if TYPE_CHECKING:
    from shardpool.model.stage import StageSpec

__all__ = ["StagePlacement", "Job"]


class Job(JobSpec):
    """Everything a stage process needs to build its stage and train it (see :class:`JobSpec`)."""

    def stage_spec(self, rank: int) -> StageSpec:
        """The StageSpec a global rank builds."""
        from shardpool.model.stage import StageSpec

        index = self.stage_index(rank)
        placement = self.stages[index]
        return StageSpec(
            index=index,
            num_stages=self.num_stages,
            start=placement.start,
            stop=placement.stop,
            device=placement.device,
        )

    def write(self, path: str | Path) -> None:
        """Save as JSON, atomically."""
        write_json(path, self.model_dump(mode="json"))

    @classmethod
    def read(cls, path: str | Path) -> Job:
        """Load and validate a job written by :meth:`write` (at most 16 MiB)."""
        path = Path(path)
        with open(path, "rb") as handle:
            data = handle.read(MAX_JOB_JSON_BYTES + 1)
        raw = read_job_json(data, source=str(path))
        try:
            return cls.model_validate(raw)
        except ValidationError as error:
            raise ContractError(describe_validation_error(error, str(path))) from None
