"""A local launcher that grows its job in place once, as the mesh supervisor does when a member joins.

It lets the stage side of :mod:`shardpool.contract.grow` be tested with real stage processes on
one machine, without network namespaces: after the step the job checks its plan at (the forced
re-balance check of :data:`shardpool.contract.rebalance.FORCE_ENV`, which holds every rank until
the launcher answers), it starts one more stage process with the grown job, waits until that
process has built its stage, publishes the grow decision, and only then answers the check. The
running ranks then grow after the next step.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardpool.contract.events import StageEvent
from shardpool.contract.grow import encode_growth, grow_key, ready_key
from shardpool.contract.job import Job, StagePlacement
from shardpool.launch.local_launcher import LocalLauncher, _start_rank, run_local_job

__all__ = ["GrowingLauncher"]

READY_WITHIN_S = 240.0


class GrowingLauncher(LocalLauncher):
    """:class:`LocalLauncher` that grows the job to ``layers`` (layers per stage) after step ``after``,
    the new stage process taking stage ``joining_stage``."""

    def __init__(self, *, probe: Any, after: int, layers: list[int], joining_stage: int) -> None:
        super().__init__(probe=probe)
        self.after = after
        self.layers = layers
        self.joining_stage = joining_stage
        self.joiner: subprocess.Popen[bytes] | None = None
        self.renumber: dict[int, int] = {}

    def start(self, job: Job, job_file: Path, on_event: Callable[[dict[str, Any]], None]) -> None:
        log_dir = job_file.parent / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)

        def held(event: dict[str, Any]) -> None:
            if event.get("event") == StageEvent.STEP and event["step"] == self.after and self.joiner is None:
                self._grow(job, job_file, log_dir)
            on_event(event)

        try:
            run_local_job(job, job_file, log_dir=log_dir, on_event=held)
            if self.joiner is not None and self.joiner.wait(timeout=60) != 0:
                raise AssertionError(f"the joining stage exited {self.joiner.returncode}: see {log_dir}")
        finally:
            if self.joiner is not None and self.joiner.poll() is None:
                self.joiner.kill()
                self.joiner.wait()

    def _grow(self, job: Job, job_file: Path, log_dir: Path) -> None:
        """Start the joining rank, wait until it is ready, and publish the grow decision."""
        bounds = [sum(self.layers[:index]) for index in range(len(self.layers) + 1)]
        stages = [
            StagePlacement(start=start, stop=stop, device="cpu", host=job.stages[0].host)
            for start, stop in zip(bounds, bounds[1:], strict=False)
        ]
        grown = Job.model_validate(
            job.model_dump(mode="json")
            | {
                "stages": [stage.model_dump(mode="json") for stage in stages],
                "generation": job.generation + 1,
                "joining": True,
                "rebalance_at": None,
            }
        )
        grown_file = job_file.with_name("grown-job.json")
        grown.write(grown_file)
        running = [rank for rank in range(grown.world_size) if rank != self.joining_stage]
        self.renumber = dict(zip(range(job.world_size), running, strict=False))
        self.joiner = _start_rank(
            grown, grown_file, self.joining_stage, log_dir / f"joining-rank-{self.joining_stage}.log"
        )
        threading.Thread(target=self._drain, daemon=True).start()
        store = dist.TCPStore(
            job.master_addr, job.master_port, is_master=False, timeout=timedelta(seconds=30)
        )
        deadline = time.monotonic() + READY_WITHIN_S
        while int(store.add(ready_key(grown.generation), 0)) < 1:
            if self.joiner.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"the joining stage did not get ready (exit {self.joiner.poll()}): see {log_dir}"
                )
            time.sleep(0.1)
        old_layers = [(placement.start, placement.stop) for placement in job.stages]
        decision = grown.model_dump(mode="json") | {"joining": False}
        store.set(grow_key(grown.generation), encode_growth(decision, self.renumber, old_layers))

    def _drain(self) -> None:
        assert self.joiner is not None and self.joiner.stdout is not None
        for _ in self.joiner.stdout:
            pass
