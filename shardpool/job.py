"""The description of one run that every stage process receives: plain JSON, never a pickle.

Moving a stage to another machine changes only its ``device``, its ``host`` and the rendezvous
address here; nothing else a stage process reads depends on where it runs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shardpool.atomic import write_json_atomic
from shardpool.config import Config, parse_config
from shardpool.stage import StageSpec

__all__ = ["StagePlacement", "Job"]


@dataclass(frozen=True)
class StagePlacement:
    """Where one stage runs and which layers ``[start, stop)`` it owns."""

    start: int
    stop: int
    device: str
    host: str = "localhost"


@dataclass(frozen=True)
class Job:
    """Everything a stage process needs to build its stage and train it.

    ``inputs`` names every file a stage may read (``data.safetensors``, ``model/config.json``,
    ``model/*.safetensors``, ``init_adapter/*``, ``resume/*``) with its path on the launching
    machine. A stage on that machine opens the paths; a stage elsewhere fetches them by name from
    ``files_url``. ``master_addr:master_port`` is the launcher's torch.distributed TCPStore.
    """

    config: dict[str, Any]
    stages: list[StagePlacement]
    replicas: int
    inputs: dict[str, str]
    output_dir: str
    master_addr: str
    master_port: int
    total_steps: int
    threads_per_process: int
    resume_step: int = 0
    eval_before: float | None = None
    files_url: str | None = None
    timeout_s: float = 300.0

    @property
    def num_stages(self) -> int:
        """Stages per pipeline."""
        return len(self.stages)

    @property
    def world_size(self) -> int:
        """Stage processes in all: stages × replicas."""
        return self.num_stages * self.replicas

    def parsed_config(self) -> Config:
        """The validated run config."""
        return parse_config(self.config, source="job config")

    def stage_index(self, rank: int) -> int:
        """The stage a global rank runs (ranks are replica-major: rank = replica × S + stage)."""
        return rank % self.num_stages

    def replica_index(self, rank: int) -> int:
        """The replica (pipeline copy) a global rank belongs to."""
        return rank // self.num_stages

    def rank_of(self, *, replica: int, stage: int) -> int:
        """The global rank of a stage in a replica."""
        return replica * self.num_stages + stage

    def stage_spec(self, rank: int) -> StageSpec:
        """The StageSpec a global rank builds."""
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
        write_json_atomic(path, asdict(self))

    @classmethod
    def read(cls, path: str | Path) -> Job:
        """Load a job written by :meth:`write`."""
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        raw["stages"] = [StagePlacement(**stage) for stage in raw["stages"]]
        return cls(**raw)
