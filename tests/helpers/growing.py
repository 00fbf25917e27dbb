"""A local launcher that grows its job in place once, as the mesh supervisor does when a member joins.

It lets the stage side of :mod:`shardpool.elastic.growth` be tested with real stage processes on
one machine, without network namespaces: after the step the job checks its plan at (the forced
re-balance check of :data:`shardpool.contract.rebalance.FORCE_ENV`, which holds every rank until
the launcher answers), it starts one more stage process with the grown job, waits until that
process has built its stage, publishes the grow decision, and only then answers the check. The
running ranks then re-shard if the forced split moves their layers, and grow after the next step. The joining process's events are relayed like the
others' (it reports the steps once it is rank 0).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardpool.contract.events import EVENT_PREFIX, StageEvent, parse_stage_event
from shardpool.contract.job import Job, StagePlacement
from shardpool.elastic.messages import ControlStore, control_key, encode_growth, grow_key, ranks_ready
from shardpool.launch.local_launcher import LocalLauncher, _start_rank, run_local_job

__all__ = ["GrowingLauncher"]

READY_WITHIN_S = 240.0


class GrowingLauncher(LocalLauncher):
    """:class:`LocalLauncher` that grows the job to ``layers`` (layers per stage) after step ``after``,
    the new stage process taking stage ``joining_stage``. ``running_layers`` are the layers per
    stage the running ranks hold when they grow: the forced re-shard's (default: the job's)."""

    def __init__(
        self,
        *,
        probe: Any,
        after: int,
        layers: list[int],
        joining_stage: int,
        running_layers: list[int] | None = None,
    ) -> None:
        super().__init__(probe=probe)
        self.after = after
        self.layers = layers
        self.running_layers = running_layers
        self.joining_stage = joining_stage
        self.joiner: subprocess.Popen[bytes] | None = None
        self.renumber: dict[int, int] = {}
        self._relay_lock = (
            threading.Lock()
        )  # the joiner's events and the others' reach on_event one at a time
        self._on_event: Callable[[dict[str, Any]], None] = lambda event: None

    def start(self, job: Job, job_file: Path, on_event: Callable[[dict[str, Any]], None]) -> None:
        log_dir = job_file.parent / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)

        def relayed(event: dict[str, Any]) -> None:
            with self._relay_lock:
                on_event(event)

        def held(event: dict[str, Any]) -> None:
            if event.get("event") == StageEvent.STEP and event["step"] == self.after and self.joiner is None:
                self._grow(job, job_file, log_dir)
            relayed(event)

        self._on_event = relayed

        try:
            run_local_job(job, job_file, log_dir=log_dir, on_event=held, secret=self.control_secret)
            if self.joiner is not None:
                if self.joiner.wait(timeout=60) != 0:
                    raise AssertionError(f"the joining stage exited {self.joiner.returncode}: see {log_dir}")
                self._relay.join(timeout=10)
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
            grown,
            grown_file,
            self.joining_stage,
            log_dir / f"joining-rank-{self.joining_stage}.log",
            secret=self.control_secret,
        )
        self._relay = threading.Thread(target=self._drain, daemon=True)
        self._relay.start()
        store = ControlStore(
            dist.TCPStore(job.master_addr, job.master_port, is_master=False, timeout=timedelta(seconds=30)),
            control_key(self.control_secret, addr=job.master_addr, port=job.master_port),
        )
        deadline = time.monotonic() + READY_WITHIN_S
        while not ranks_ready(store, grown.generation, [self.joining_stage]):
            if self.joiner.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"the joining stage did not get ready (exit {self.joiner.poll()}): see {log_dir}"
                )
            time.sleep(0.1)
        old_layers = [(placement.start, placement.stop) for placement in job.stages]
        if self.running_layers is not None:
            bounds = list(itertools.accumulate(self.running_layers, initial=0))
            old_layers = list(itertools.pairwise(bounds))
        decision = grown.model_dump(mode="json") | {"joining": False}
        store.set(grow_key(grown.generation), encode_growth(decision, self.renumber, old_layers))

    def _drain(self) -> None:
        """Relay the joining process's events; its other stdout lines are dropped (its log has stderr)."""
        assert self.joiner is not None and self.joiner.stdout is not None
        for raw in self.joiner.stdout:
            line = raw.decode("utf-8", errors="replace")
            if line.startswith(EVENT_PREFIX):
                self._on_event(
                    parse_stage_event(json.loads(line[len(EVENT_PREFIX) :])).model_dump(mode="json")
                )
