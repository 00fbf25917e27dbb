"""``torchrun --nproc-per-node N -m shardpool finetune config.yaml``: one machine, N stage processes.

(``generate`` and ``serve`` under torchrun: :func:`inference_under_torchrun`, at the end: rank 0
drives the ring, ranks 1..N-1 are its N-1 stages.)

torchrun starts the N processes itself and sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in each (torch.distributed's own
contract). Each process joins torchrun's store (``env://``, as ``init_process_group`` would). Then:

  1. rank 0 does what ``shardpool finetune`` does before any stage starts: checks the config,
     tokenizes, and plans N stages on this machine (``cuda:0`` .. ``cuda:N-1`` where CUDA is
     present, else N CPU stages; the GPUs are measured in a child process that ends before
     stage 0 trains in this one, :mod:`shardpool.plan.probe_process`); it writes the job file
     into ``output_dir/.shardpool`` and publishes its path in the store under ``shardpool/job``;
  2. every rank reads the job and runs its stage in its own process
     (:class:`shardpool.elastic.rank.ElasticStageWorker`), joined on torchrun's store instead of a
     rendezvous store of shardpool's;
  3. rank 0 relays the events as the local launcher does (progress, ``metrics.jsonl``,
     checkpoints, the merged adapter) and writes the model card.

Every value on torchrun's store is sealed (:class:`shardpool.elastic.messages.ControlStore`) with a
key derived from ``SHARDPOOL_CONTROL_SECRET``, which the user sets to the same random value in every
process's environment (``export SHARDPOOL_CONTROL_SECRET=$(openssl rand -hex 32)`` before
torchrun). Without it the key is a public one and rank 0 says so in one line: torchrun's store is
then as open to other local users as torchrun leaves it.

A config that fails its checks is reported by rank 0 alone, in one line (status 2); rank 0
publishes the failure, and the other ranks exit without a word (status 0: they did nothing), so
torchrun's summary names rank 0 as the failure and torchrun exits non-zero. A failure while training is
one line from the rank that failed, which exits at once (torchrun then stops the others).
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from rich.console import Console

from shardpool.config import Config, load_config
from shardpool.contract.events import StageEvent, parse_stage_event
from shardpool.contract.job import CONTROL_SECRET_ENV, Job
from shardpool.errors import ShardpoolError

__all__ = [
    "JOB_KEY",
    "INFERENCE_JOB_KEY",
    "TorchrunWorld",
    "finetune_under_torchrun",
    "inference_under_torchrun",
    "torchrun_config",
    "torchrun_devices",
    "torchrun_inference_stages",
    "torchrun_world",
]

#: The store key rank 0 publishes the job under: ``{"job_file": PATH}`` or ``{"error": LINE}``.
JOB_KEY = "shardpool/job"
_STAGE_DONE_KEY = "shardpool/stage_done/{rank}"
_STORE_PREFIX = "shardpool/run/"
#: How long ranks other than 0 wait for rank 0 to tokenize, profile and plan.
_PREPARE_TIMEOUT = timedelta(minutes=30)
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TorchrunWorld:
    """Where this process stands in a torchrun launch, from the variables torchrun sets."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def torchrun_world(environ: Mapping[str, str]) -> TorchrunWorld | None:
    """This process's torchrun world, or None when torchrun did not start it (no ``RANK``/``WORLD_SIZE``).

    A partial or malformed set of torchrun's variables is refused in one line rather than guessed.
    """
    present = [name for name in _TORCHRUN_VARIABLES if environ.get(name)]
    if not {"RANK", "WORLD_SIZE"} & set(present):
        return None
    missing = [name for name in _TORCHRUN_VARIABLES if name not in present]
    if missing:
        raise ShardpoolError(
            f"RANK and WORLD_SIZE are set but {', '.join(missing)} are not; start with "
            "`torchrun --nproc-per-node N -m shardpool finetune CONFIG`, or unset RANK and WORLD_SIZE"
        )
    numbers: dict[str, int] = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        text = environ.get(name, environ["WORLD_SIZE"] if name == "LOCAL_WORLD_SIZE" else "")
        if not text.isdigit():
            raise ShardpoolError(f"torchrun's {name} is {text[:40]!r}; it must be a whole number")
        numbers[name] = int(text)
    world = TorchrunWorld(
        rank=numbers["RANK"],
        world_size=numbers["WORLD_SIZE"],
        local_rank=numbers["LOCAL_RANK"],
        local_world_size=numbers["LOCAL_WORLD_SIZE"],
        master_addr=environ["MASTER_ADDR"],
        master_port=numbers["MASTER_PORT"],
    )
    if not 0 <= world.rank < world.world_size:
        raise ShardpoolError(f"torchrun's RANK {world.rank} is outside WORLD_SIZE {world.world_size}")
    return world


def torchrun_devices(world_size: int, cuda_devices: int) -> list[str]:
    """The device of each of ``world_size`` stages: ``cuda:RANK`` where CUDA is present, else the CPU.

    Fewer GPUs than processes is refused: two stages of one launch sharing a GPU is a choice a
    config states (``shardpool.devices``), not one torchrun makes.
    """
    if cuda_devices == 0:
        return ["cpu"] * world_size
    if cuda_devices < world_size:
        raise ShardpoolError(
            f"torchrun started {world_size} processes but this machine has {cuda_devices} CUDA "
            f"device(s); use --nproc-per-node {cuda_devices}"
        )
    return [f"cuda:{rank}" for rank in range(world_size)]


def torchrun_config(config: Config, world: TorchrunWorld, devices: list[str]) -> Config:
    """``config`` as one torchrun launch runs it: one stage per process, on ``devices``, one replica.

    Whatever the config says that torchrun cannot honour is refused in one line: the mesh,
    several machines, replicas, and a stage count or device list other than torchrun's.
    """
    section = config.shardpool
    if world.world_size != world.local_world_size:
        raise ShardpoolError(
            f"torchrun spans {world.world_size // max(1, world.local_world_size)} machines; shardpool "
            "runs torchrun on one machine only; use `placement: mesh` to pool several machines"
        )
    if section.placement == "mesh":
        raise ShardpoolError(
            "torchrun runs every stage on this machine; remove `placement: mesh` or start without torchrun"
        )
    if section.replicas != 1:
        raise ShardpoolError(
            f"under torchrun each process is one stage of one pipeline; set shardpool.replicas: 1 "
            f"(it is {section.replicas}) or start without torchrun"
        )
    if section.shares is not None or section.data_parallel == "on":
        raise ShardpoolError(
            "under torchrun each process is one stage of one pipeline; remove shardpool.shares and "
            "data_parallel: on, or start without torchrun"
        )
    asked = {"shardpool.stages": section.stages, "shardpool.layers": section.layers and len(section.layers)}
    for key, count in asked.items():
        if count is not None and count != world.world_size:
            raise ShardpoolError(
                f"torchrun started {world.world_size} processes but {key} gives {count} stages; "
                f"use --nproc-per-node {count} or remove {key}"
            )
    if section.devices is not None and list(section.devices) != devices:
        raise ShardpoolError(
            f"under torchrun the stages run on {devices}; remove shardpool.devices "
            f"({section.devices}) or start without torchrun"
        )
    updated = section.model_copy(update={"stages": world.world_size, "devices": devices})
    return config.model_copy(update={"shardpool": updated})


def finetune_under_torchrun(
    config_path: str | Path, world: TorchrunWorld, *, resume: bool = False, console: Console | None = None
) -> Path | None:
    """Run this process's part of a torchrun launch; rank 0 returns the output directory, others None."""
    import torch.distributed as dist

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raw_store, _, _ = next(dist.rendezvous("env://", timeout=_PREPARE_TIMEOUT))
    store = _sealed(raw_store, world)
    if world.rank == 0:
        return _lead(config_path, world, store, resume=resume, console=console or Console())
    job_file = _wait_for_job(store)
    _run_rank(job_file, world.rank, store, events=_publish_stage_done(store, world.rank))
    return None


def _lead(
    config_path: str | Path, world: TorchrunWorld, store: Any, *, resume: bool, console: Console
) -> Path:
    """Rank 0: prepare and publish the job, run stage 0 here while relaying the run's events, finish."""
    import torch

    from shardpool.console import RunEvents
    from shardpool.data.hub import with_local_sources
    from shardpool.finetune import _write_run_inputs, finish_run, prepare_run, run_outputs
    from shardpool.launch.run import build_job, write_job
    from shardpool.model.lora import base_model_reference
    from shardpool.plan.config_plan import plan_for_config
    from shardpool.plan.probe_process import ProcessProbe
    from shardpool.run_attempts import relay_stages
    from shardpool.trackers import check_trackers, open_trackers
    from shardpool.train.runfiles import job_inputs

    try:
        as_written = load_config(config_path)
        check_trackers(as_written)
        devices = torchrun_devices(
            world.world_size, torch.cuda.device_count() if torch.cuda.is_available() else 0
        )
        as_written = torchrun_config(as_written, world, devices)
        config = with_local_sources(as_written)
        reference = base_model_reference(as_written.base_model)
        # Every GPU is measured in a child process that ends here: stage 0 then trains in this
        # process without a context on the other ranks' GPUs or the profiled layer's memory.
        with ProcessProbe() as probe:
            prepared = prepare_run(config, resume=resume, planner=lambda c: plan_for_config(c, probe=probe))
        run = replace(prepared, base_model_reference=reference)
        run_dir = _write_run_inputs(run, console)
        inputs = job_inputs(config, run_dir, run.resume_from)
        job = build_job(
            run, inputs=inputs, master_addr=_ip_address(world.master_addr), master_port=world.master_port
        )
        job_file = write_job(job, run_dir)
    except BaseException as error:
        store.set(
            JOB_KEY, json.dumps({"error": str(error).splitlines()[0] if str(error) else type(error).__name__})
        )
        raise
    store.set(JOB_KEY, json.dumps({"job_file": str(job_file)}))

    def start(on_event: Callable[[dict[str, Any]], None]) -> None:
        def relay(event: dict[str, Any]) -> None:
            on_event(parse_stage_event(event).model_dump(mode="json"))

        _run_rank(job_file, 0, store, events=relay)
        for rank in range(1, job.world_size):
            on_event(
                json.loads(
                    store.get(_STAGE_DONE_KEY.format(rank=rank), timeout_s=_PREPARE_TIMEOUT.total_seconds())
                )
            )

    outputs = run_outputs(run)
    trackers = open_trackers(as_written, Path(config.output_dir))
    try:
        relayed = relay_stages(
            console, RunEvents(), run, job, start=start, outputs=outputs, trackers=trackers
        )
    finally:
        trackers.close()
    if relayed.final_dir is not None:
        outputs.write_adapter(relayed.final_dir)
    finish_run(as_written, config, run, relayed.record, console)
    return Path(config.output_dir)


def _ip_address(host: str) -> str:
    """``MASTER_ADDR`` as an IP address (torchrun's standalone mode says ``localhost``), for the job."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        try:
            return socket.gethostbyname(host)
        except OSError as error:
            raise ShardpoolError(f"torchrun's MASTER_ADDR {host!r} does not resolve: {error}") from None


#: The key's stand-in when ``SHARDPOOL_CONTROL_SECRET`` is unset: public, so the store is not authenticated.
_PUBLIC_SECRET = "shardpool torchrun run without SHARDPOOL_CONTROL_SECRET"


def _sealed(store: Any, world: TorchrunWorld) -> Any:
    """torchrun's ``store`` with every value sealed by the key of ``SHARDPOOL_CONTROL_SECRET``."""
    from shardpool.elastic.messages import ControlStore, control_key

    secret = os.environ.get(CONTROL_SECRET_ENV, "")
    if not secret:
        if world.rank == 0:
            print(
                f"shardpool: warning: {CONTROL_SECRET_ENV} is not set, so torchrun's store is not "
                "authenticated; set it to one random value for every process",
                file=sys.stderr,
                flush=True,
            )
        secret = _PUBLIC_SECRET
    return ControlStore(store, control_key(secret, addr=world.master_addr, port=world.master_port))


def _wait_for_job(store: Any) -> Path:
    """The job file rank 0 published; exit quietly when rank 0 published its failure.

    Status 0, since this rank did nothing: torchrun then reports rank 0 alone as the failure (status
    2, with its one line), rather than a rank that exited first for no reason of its own.
    """
    published = json.loads(store.get(JOB_KEY, timeout_s=_PREPARE_TIMEOUT.total_seconds()))
    if "error" in published:
        sys.exit(0)
    return Path(published["job_file"])


def _publish_stage_done(store: Any, rank: int) -> Callable[[dict[str, Any]], None]:
    """Events of a rank other than 0: its ``stage_done`` (peak memory) goes to rank 0 through the store."""

    def events(event: dict[str, Any]) -> None:
        if event.get("event") == StageEvent.STAGE_DONE:
            store.set(
                _STAGE_DONE_KEY.format(rank=rank),
                json.dumps(parse_stage_event(event).model_dump(mode="json")),
            )

    return events


def _run_rank(job_file: Path, rank: int, store: Any, *, events: Callable[[dict[str, Any]], None]) -> None:
    """Train ``rank``'s stage in this process; on any failure print one line and exit at once (status 1),
    so that no collective waits on this rank (torchrun then stops the others)."""
    from shardpool.elastic.rank import ElasticStageWorker

    job = Job.read(job_file)
    try:
        worker = ElasticStageWorker(
            job, rank, job_dir=job_file.parent, store=store.prefixed(_STORE_PREFIX), events=events
        )
        try:
            worker.run()
        finally:
            if hasattr(worker, "files"):
                worker.files.close()
    except BaseException as error:  # noqa: BLE001 - one line, then out before a collective hangs
        message = str(error) if isinstance(error, ShardpoolError) else f"{type(error).__name__}: {error}"
        stage = job.stage_index(rank)
        print(f"shardpool: error: stage {stage} (rank {rank}) failed: {message.splitlines()[0] if message else ''}",
              file=sys.stderr, flush=True)  # fmt: skip
        os._exit(1)


# ----- generate and serve -----------------------------------------------------------------------
#: The store key rank 0 publishes an inference ring's job under: ``{"job_file": PATH}`` or ``{"error": LINE}``.
INFERENCE_JOB_KEY = "shardpool/inference-job"


def torchrun_inference_stages(world_size: int, stages: int | None) -> int:
    """How many stages a torchrun launch of ``world_size`` processes runs for ``generate``/``serve``:
    one process drives (rank 0: the tokenizer, the requests, serve's HTTP), the others are stages."""
    count = world_size - 1
    if count < 1:
        raise ShardpoolError(
            "under torchrun, rank 0 drives and the other processes are the stages: "
            "use --nproc-per-node 2 or more (N stages: N + 1)"
        )
    if stages is not None and stages != count:
        raise ShardpoolError(
            f"torchrun started {world_size} processes, which run {count} stage(s) and the driver; "
            f"use --nproc-per-node {stages + 1} or remove --stages"
        )
    return count


def inference_under_torchrun(
    world: TorchrunWorld,
    drive: Callable[[Any], None],
    *,
    stages: int | None,
    devices: str | None,
    placement: str,
) -> int:
    """Run this process's part of ``torchrun -m shardpool generate|serve``: rank 0 calls ``drive``
    with the ring's :data:`~shardpool.generate.StagesFor` (the other ranks, on this machine's
    devices) and returns its status; every other rank waits for the ring's job, then runs its
    stage until the driver stops the ring (a rank whose driver failed before the ring started
    exits quietly, status 0, so that torchrun names rank 0)."""
    import torch.distributed as dist

    from shardpool.infer import stage_process

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raw_store, _, _ = next(dist.rendezvous("env://", timeout=_PREPARE_TIMEOUT))
    store = _sealed(raw_store, world)
    secret = os.environ.get(CONTROL_SECRET_ENV, "") or _PUBLIC_SECRET
    if world.rank != 0:
        announced = json.loads(store.get(INFERENCE_JOB_KEY, timeout_s=_PREPARE_TIMEOUT.total_seconds()))
        if "error" in announced:
            return 0
        os.environ[CONTROL_SECRET_ENV] = secret  # where a local stage reads the ring's secret
        return stage_process.main([announced["job_file"], str(world.rank - 1)])
    published: list[Path] = []

    def publish(job_file: Path) -> None:
        store.set(INFERENCE_JOB_KEY, json.dumps({"job_file": str(job_file)}))
        published.append(job_file)

    try:
        if placement != "local":
            raise ShardpoolError(
                "under torchrun the stages are torchrun's processes; remove --placement mesh"
            )
        if world.local_world_size != world.world_size:
            raise ShardpoolError(
                "generate and serve run under torchrun on one machine only; "
                "across machines use --placement mesh without torchrun"
            )
        count = torchrun_inference_stages(world.world_size, stages)
        drive(_torchrun_stages_for(count, devices, secret, publish))
    except BaseException as error:
        if not published:
            line = str(error).splitlines()[0] if str(error) else type(error).__name__
            store.set(INFERENCE_JOB_KEY, json.dumps({"error": line}))
        raise
    return 0


def _torchrun_stages_for(
    count: int, devices: str | None, secret: str, publish: Callable[[Path], None]
) -> Callable[[Any, int, int], Any]:
    """The ring's stages: ``count`` even shares of the layers on ``devices`` (default one GPU per
    stage, ``cuda:0`` .. where CUDA is present, else the CPU), as ``--stages`` places them locally."""
    import torch

    from shardpool.generate import local_placements, parse_devices
    from shardpool.infer.rings import TorchrunStages

    if devices is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if 0 < gpus < count:
            raise ShardpoolError(
                f"torchrun started {count} stage processes but this machine has {gpus} CUDA device(s); "
                f"use --nproc-per-node {gpus + 1}, or name the devices with --devices"
            )
        chosen = [f"cuda:{stage}" for stage in range(count)] if gpus else ["cpu"]
    else:
        chosen = list(parse_devices(devices))

    def stages_for(target: Any, max_context: int, max_slots: int) -> Any:
        placements = local_placements(
            target.model_dir, count, chosen, max_context=max_context, max_slots=max_slots
        )
        return TorchrunStages(placements, secret=secret, publish=publish)

    return stages_for
