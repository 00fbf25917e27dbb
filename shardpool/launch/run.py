"""A run on the launcher's side: where it starts, the job its stages read, the records it keeps.

A :class:`Launcher` starts a run's stages: :class:`~shardpool.launch.local_launcher.LocalLauncher`
on this machine, :class:`~shardpool.launch.mesh_launcher.MeshLauncher` on mesh members.
:func:`build_job` turns a planned run into the :class:`~shardpool.contract.job.Job` every stage
process reads from ``output_dir/.shardpool/job.json``. :class:`RunRecord` follows the stages'
events and keeps ``metrics.jsonl`` (one line per logged step and one per periodic eval, with
Hugging Face's names: ``loss``, ``learning_rate``, ``epoch``, ``eval_loss``, and one per round of
samples, ``shardpool.sample_prompts``) and ``run_summary.json`` (how the run ended). Torch-free:
nothing here touches a tensor.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mesh.files import atomic_write, write_json
from shardpool.config import Config
from shardpool.contract.events import STAGE_COPY_FIGURES, StageEvent
from shardpool.contract.job import Job, StagePlacement
from shardpool.host.cpu_quota import available_cpus
from shardpool.launch.local_launcher import LocalLauncher
from shardpool.launch.mesh_launcher import MeshLauncher
from shardpool.launch.model_card import TrainingOutcome
from shardpool.plan.local_fleet import DeviceProbe
from shardpool.plan.result import Plan, PlannedStage

__all__ = [
    "METRICS_FILE",
    "RUN_DIR_NAME",
    "Launcher",
    "OnEvent",
    "PlannedRun",
    "RunRecord",
    "append_metrics_line",
    "build_job",
    "is_logged_step",
    "keeps_state",
    "launcher_for",
    "placement_of",
    "replica_places_of",
    "sample_decoder",
    "trim_metrics",
    "write_job",
]

RUN_DIR_NAME = ".shardpool"
METRICS_FILE = "metrics.jsonl"
_SUMMARY_FILE = "run_summary.json"
#: metrics.jsonl events that a restart keeps (see :func:`trim_metrics`).
HISTORY_EVENTS = frozenset({"member_lost", "replan", "member_joined"})
_JOB_FILE = "job.json"

OnEvent = Callable[[dict[str, Any]], None]  # what receives a stage's events, one at a time


class Launcher(Protocol):
    """Where a run's stages start, and what they reach the launcher at."""

    @property
    def address(self) -> str:
        """The launcher's address as the stages reach it (rendezvous store, file server)."""
        ...

    @property
    def port(self) -> int:
        """The rendezvous store's port (0: any free port)."""
        ...

    @property
    def control_secret(self) -> str:
        """The secret only this run's processes hold, from which the key that seals the rendezvous
        store's values is derived (:func:`shardpool.elastic.messages.control_key`)."""
        ...

    def plan(self, config: Config) -> Plan:
        """Place the config's stages on the devices this launcher starts them on."""
        ...

    def serving(self, inputs: dict[str, str], output_dir: Path) -> AbstractContextManager[str | None]:
        """While open, the stages can read ``inputs`` and write into ``output_dir``; yields the file server's URL, if any."""
        ...

    def start(self, job: Job, job_file: Path, on_event: OnEvent) -> None:
        """Run every rank of ``job`` until all finish, passing their events to ``on_event``."""
        ...


class PlannedRun(Protocol):
    """What a job is built from: the config, where each stage runs, and where training starts."""

    @property
    def config(self) -> Config: ...
    @property
    def placements(self) -> list[StagePlacement]: ...
    @property
    def total_steps(self) -> int: ...
    @property
    def first_step(self) -> int: ...
    @property
    def eval_before(self) -> float | None: ...
    @property
    def planned(self) -> Plan | None: ...
    @property
    def sample_prompt_ids(self) -> Sequence[Sequence[int]]: ...
    @property
    def eos_token_ids(self) -> Sequence[int]: ...


def launcher_for(
    config: Config, *, say: Callable[[str], None], probe: DeviceProbe, agent_socket: str | None = None
) -> Launcher:
    """This machine's launcher, or with ``placement: mesh`` the members' (their agents are asked first of all).

    ``probe`` measures this machine's devices for a local plan (mesh members profile their own);
    ``agent_socket`` is where this machine's agent listens (default: the environment, else
    :data:`mesh.constants.DEFAULT_AGENT_SOCKET`).
    """
    if config.shardpool.placement == "mesh":
        return MeshLauncher.connect(say=say, agent_socket=agent_socket)
    return LocalLauncher(probe=probe, port=config.shardpool.master_port or 0)


def build_job(
    run: PlannedRun,
    *,
    inputs: dict[str, str],
    master_addr: str,
    master_port: int,
    files_url: str | None = None,
    rebalance_at: int | None = None,
) -> Job:
    """The job of ``run``: its config, placements, input files by name and rendezvous address.

    ``files_url`` is the launcher's file server, for stages on other machines; ``rebalance_at``
    the step after which the stages wait for the launcher's re-balance decision (None: they never do).
    """
    config = run.config
    replica_places = replica_places_of(run.planned)
    replicas = len(replica_places) if replica_places else config.shardpool.replicas
    processes = len(run.placements) * replicas
    return Job(
        config=config.model_dump(mode="json"),
        stages=run.placements,
        replicas=replicas,
        inputs=inputs,
        output_dir=str(Path(config.output_dir).resolve()),
        master_addr=master_addr,
        master_port=master_port,
        total_steps=run.total_steps,
        threads_per_process=_threads_per_process(config, processes),
        resume_step=run.first_step,
        eval_before=run.eval_before,
        files_url=files_url,
        rebalance_at=rebalance_at,
        keep_state=keeps_state(config, processes),
        replica_places=replica_places,
        shares=list(run.planned.shares) if run.planned is not None and replica_places else None,
        warmup_lead=_warmup_lead(run),
        sample_prompt_ids=[list(ids) for ids in run.sample_prompt_ids],
        eos_token_ids=list(run.eos_token_ids),
    )


def _warmup_lead(run: PlannedRun) -> int:
    """The 1F1B warm-up lead the stages run: the plan's, else the config's, else 1."""
    if run.planned is not None:
        return run.planned.warmup_lead
    lead = run.config.shardpool.warmup_lead
    return lead if isinstance(lead, int) else 1


def replica_places_of(plan: Plan | None) -> list[StagePlacement] | None:
    """Where each replica of a data-parallel plan runs (None for a pipeline plan, or no plan)."""
    if plan is None or not plan.is_data_parallel:
        return None
    return [placement_of(stage) for stage in plan.data_parallel]


def placement_of(stage: PlannedStage) -> StagePlacement:
    """The job's placement of a planned stage: its layers, device, host, dtype and NF4 backend."""
    return StagePlacement(
        start=stage.start,
        stop=stage.stop,
        device=stage.device,
        host=stage.host,
        dtype=stage.dtype or None,
        nf4_backend=stage.nf4_backend or None,  # type: ignore[arg-type]
    )


def keeps_state(config: Config, world_size: int) -> bool:
    """Whether a run's stages beat and copy their step-boundary state: a mesh run of more than one
    process that continues when a member is lost (:mod:`shardpool.contract.liveness`)."""
    settings = config.shardpool
    return settings.placement == "mesh" and settings.on_member_loss == "continue" and world_size > 1


def write_job(job: Job, run_dir: Path) -> Path:
    """Write ``job.json`` into the run directory; return its path."""
    path = run_dir / _JOB_FILE
    job.write(path)
    return path


def _threads_per_process(config: Config, processes: int) -> int:
    if config.shardpool.threads_per_stage:
        return config.shardpool.threads_per_stage
    return max(1, available_cpus() // processes)


@dataclass
class RunRecord:
    """What the launcher records of a run from its stages' events, and writes into ``output_dir``."""

    output_dir: Path
    logging_steps: int
    total_steps: int
    first_step: int
    eval_before: float | None = None
    eval_after: float | None = None
    last_loss: float | None = None
    last_step: int = 0
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    on_metrics: Callable[[dict[str, Any]], None] | None = None  # each metrics.jsonl line, also to trackers
    #: The texts of ``shardpool.sample_prompts``, and what turns a sample's token ids into text (the
    #: run's tokenizer); without them a samples line keeps the ids alone (``prompt``, ``completion``: null).
    sample_prompts: Sequence[str] = ()
    decode: Callable[[list[int]], str] | None = None

    def timed(self, start: Callable[[OnEvent], None], on_event: OnEvent) -> None:
        """Run ``start(on_event)`` (the stages, until all finish) and record how long it took."""
        started = time.monotonic()
        try:
            start(on_event)
        finally:
            self.seconds += time.monotonic() - started

    def outcome(self, steps: int) -> TrainingOutcome:
        """What the model card reports of this run: steps, the last train loss, eval loss before and after."""
        return TrainingOutcome(
            steps=steps,
            final_train_loss=self.last_loss,
            eval_loss_before=self.eval_before,
            eval_loss_after=self.eval_after,
        )

    def record_rebalance(self, line: dict[str, Any]) -> None:
        """Append a re-balance (or member loss, re-plan, join) event to ``metrics.jsonl`` (not to trackers: it holds no scalars)."""
        append_metrics_line(self.output_dir / METRICS_FILE, line)

    def _metrics_line(self, line: dict[str, Any]) -> None:
        append_metrics_line(self.output_dir / METRICS_FILE, line)
        if self.on_metrics is not None:
            self.on_metrics(line)

    def record(self, event: dict[str, Any]) -> None:
        """Note one event: a step's loss (and its metrics line when due), a periodic eval's line, a rank's peaks, the eval losses."""
        kind = event.get("event")
        if kind == StageEvent.STEP:
            self.last_loss = event["loss"]
            self.last_step = event["step"]
            if is_logged_step(event["step"], self.logging_steps, self.total_steps):
                self._metrics_line(_step_metrics(event))
        elif kind == StageEvent.EVAL:
            self._metrics_line(_eval_metrics(event))
        elif kind == StageEvent.SAMPLES:
            self._metrics_line(self.samples_line(event))
        elif kind == StageEvent.STAGE_DONE:
            self.ranks[int(event["rank"])] = {key: value for key, value in event.items() if key != "event"}
        elif kind == StageEvent.DONE:
            self.eval_before = event.get("eval_before")
            self.eval_after = event.get("eval_after")

    def samples_line(self, event: dict[str, Any]) -> dict[str, Any]:
        """The metrics.jsonl line of a ``samples`` event: each prompt, its completion as text and its token ids."""
        samples = []
        for index, token_ids in enumerate(event["token_ids"]):
            prompt = self.sample_prompts[index] if index < len(self.sample_prompts) else None
            completion = self.decode(token_ids) if self.decode is not None else None
            samples.append({"prompt": prompt, "completion": completion, "token_ids": token_ids})
        return {"event": "samples", "step": event["step"], "samples": samples}

    def write_summary(self) -> None:
        """Record how the run ended: eval losses, time, and each stage process's peak memory."""
        write_json(
            self.output_dir / _SUMMARY_FILE,
            {
                "eval_loss_before": self.eval_before,
                "eval_loss_after": self.eval_after,
                "final_train_loss": self.last_loss,
                "steps": self.total_steps,
                "resumed_from_step": self.first_step,
                "seconds": round(self.seconds, 3),
                "ranks": [self.ranks[rank] for rank in sorted(self.ranks)],
            },
        )


def is_logged_step(step: int, logging_steps: int, total_steps: int) -> bool:
    """Whether ``step`` is logged (a metrics.jsonl line, a plain log line): every ``logging_steps``-th, and the last."""
    return step % logging_steps == 0 or step == total_steps


def _step_metrics(event: dict[str, Any]) -> dict[str, Any]:
    """The metrics.jsonl line of a ``step`` event."""
    record = {
        key: event[key] for key in ("step", "epoch", "loss", "learning_rate", "grad_norm", "tokens_per_s")
    }
    record.update(
        {
            "step_seconds": event["step_seconds"],
            "stage_compute_s": event["stage_compute_s"],
            "stage_wait_s": event["stage_wait_s"],
            "bytes_sent": sum(event["bytes_sent"]),
            "stage_bytes_sent": event["bytes_sent"],
        }
    )
    # stage_room_bytes: only on the re-balance check step's line
    for optional in (*STAGE_COPY_FIGURES, "stage_sync_s", "stage_in_flight", "stage_room_bytes"):
        if event.get(optional) is not None:
            record[optional] = event[optional]
    record.update(event.get("preference") or {})  # rewards/chosen, ... (TRL's names) of a preference run
    if event.get("loss_scale") is not None:
        # fp16 runs: the scale after this step, and whether an overflow skipped it.
        record["loss_scale"] = event["loss_scale"]
        record["skipped_step"] = bool(event.get("skipped_step", False))
    return record


def _eval_metrics(event: dict[str, Any]) -> dict[str, Any]:
    """The metrics.jsonl line of an ``eval`` event, as Hugging Face logs one: step, epoch, eval_loss."""
    return {key: event[key] for key in ("step", "epoch", "eval_loss")}


def sample_decoder(tokenizer: Any) -> Callable[[list[int]], str] | None:
    """What turns a sample's token ids into its text: the run's tokenizer, special tokens skipped
    (None without a tokenizer)."""
    if tokenizer is None:
        return None
    return lambda token_ids: str(tokenizer.decode(token_ids, skip_special_tokens=True))


def append_metrics_line(path: Path, record: dict[str, Any]) -> None:
    """Append one line to ``metrics.jsonl``."""
    with open(path, "a", encoding="utf-8") as file:
        file.write(json.dumps(record) + "\n")


def trim_metrics(path: Path, *, keep_through_step: int) -> None:
    """Drop metric lines past the step a run restarts from, so a resumed run does not repeat them.

    The lines of lost and joined members and re-plans (:data:`HISTORY_EVENTS`) stay: they are the
    run's history, not work that is done again. Step 0 (a fresh start) drops everything.
    """
    if not path.is_file():
        return
    if keep_through_step == 0:
        path.unlink()
        return
    kept = [
        line
        for line in path.read_text(encoding="utf-8").splitlines()
        if json.loads(line)["step"] <= keep_through_step or json.loads(line).get("event") in HISTORY_EVENTS
    ]
    if not kept:
        path.unlink()
        return
    atomic_write(path, ("\n".join(kept) + "\n").encode("utf-8"))
