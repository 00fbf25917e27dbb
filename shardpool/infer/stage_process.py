"""One inference stage process: build the stage, join the ring, and serve messages until STOP.

``python -m shardpool.infer.stage_process JOB RANK``, where JOB is an
:class:`~shardpool.contract.inference.InferenceJob` file: written by the driver for a local stage,
or by a member's agent for a stage on the mesh. The stage is built as for training (its layers
only, NF4, the adapter loaded unmerged) and kept in eval mode; a local stage opens the job's
input paths, a mesh stage reads them by name from the driver's file server (the weights it owns
by range, verified). It then loops: receive a header from the previous rank (the driver, for
stage 0), do what it asks for one sequence slot, pass the result on. Each slot has its own KV
cache (:meth:`PipelineStage.forward_cached`); the last stage also keeps each slot's sampling
settings and random stream and answers the driver with the chosen token. Messages are handled in
the order they arrive, so with several sequences in flight every stage works on a different one.

Every value it reads at the rendezvous is sealed with the ring's control key (from the driver's
environment for a local stage, from the file-server secret its agent wrote 0600 into the job
directory for a mesh stage), and every pair of the gloo world proves that key before any prompt
flows (as training's ranks do). Any failure writes one line on stderr and exits 1; the driver
reports that line.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from shardpool.contract.inference import ADAPTER_PREFIX, MODEL_PREFIX, InferenceJob
from shardpool.contract.job import CONTROL_SECRET_ENV
from shardpool.elastic.group_store import GroupStore
from shardpool.elastic.messages import ControlStore, control_key
from shardpool.errors import ShardpoolError
from shardpool.files.client import RemoteFiles
from shardpool.infer.messages import HEADER_LEN, SAMPLING_LEN, Header, Kind
from shardpool.infer.sampling import Sampling, next_token, seeded_generator
from shardpool.model.lora import LoraSettings
from shardpool.model.nf4 import DTYPES
from shardpool.model.stage import BaseSettings, PipelineStage, StageSpec, build_stage
from shardpool.model.weights import WeightReader
from shardpool.train.process_group import prove_peers, select_device
from shardpool.train.runfiles import read_files_secret

__all__ = ["main", "RingFiles", "StageLoop", "join_ring", "build_inference_stage", "ring_files"]

#: What hidden states cross the ring in: fp32 holds every compute dtype exactly.
WIRE_DTYPE = torch.float32


def main(argv: list[str]) -> int:
    """Run one stage until the driver stops the ring; one line on stderr and exit 1 on failure."""
    job_path, rank = Path(argv[0]), int(argv[1])
    try:
        job = InferenceJob.read(job_path)
        torch.set_num_threads(stage_threads(job))
        join_ring(job, rank, job_dir=job_path.parent)
        with ring_files(job, job_dir=job_path.parent) as files:
            stage = build_inference_stage(job, rank, files)
        StageLoop(stage, job, rank).run()
    except BaseException as error:  # noqa: BLE001 - every failure must reach the driver
        traceback.print_exc(file=sys.stderr)
        message = str(error) if isinstance(error, ShardpoolError) else f"{type(error).__name__}: {error}"
        print(f"error: {message.splitlines()[0] if message else type(error).__name__}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def stage_threads(job: InferenceJob) -> int:
    """The threads this stage computes with: on a mesh member, the agent's share of that machine's
    usable CPUs (``SHARDPOOL_THREADS``); here, the driver's share of this one."""
    if job.files_url is not None:
        return max(1, int(os.environ.get("SHARDPOOL_THREADS") or job.threads_per_process))
    return job.threads_per_process


def control_secret(job: InferenceJob, job_dir: Path) -> str:
    """The secret the ring's control key derives from: the file-server secret a mesh stage's agent
    wrote into its job directory, or the one a local driver put in this process's environment."""
    if job.files_url is not None:
        return read_files_secret(job_dir)
    secret = os.environ.get(CONTROL_SECRET_ENV, "")
    if not secret:
        raise ShardpoolError(
            f"{CONTROL_SECRET_ENV} is not set: an inference stage is started by shardpool generate or serve"
        )
    return secret


def join_ring(job: InferenceJob, rank: int, *, job_dir: Path) -> None:
    """Join the driver's gloo world through its sealed store and prove the control key to every rank."""
    store = ControlStore(
        dist.TCPStore(
            job.master_addr, job.master_port, is_master=False, timeout=timedelta(seconds=job.timeout_s)
        ),
        control_key(control_secret(job, job_dir), addr=job.master_addr, port=job.master_port),
    )
    world = job.num_stages + 1
    select_device(torch.device(job.stages[rank].device))
    dist.init_process_group(
        backend="gloo",
        store=GroupStore(store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=job.timeout_s),
    )
    prove_peers(store.peer_key(0), group=None, name="world", rank=rank, ranks=range(world))


@dataclass(frozen=True)
class RingFiles:
    """Where a stage finds its inputs: a directory with the model's config.json, a reader of its
    weights, and a directory with the adapter (None: the base model alone)."""

    model_dir: Path
    reader: WeightReader
    adapter_dir: Path | None


@contextmanager
def ring_files(job: InferenceJob, *, job_dir: Path) -> Iterator[RingFiles]:
    """The job's inputs: its paths for a local stage, else fetched by name from the driver's file
    server (config and adapter whole, the weights by range as the stage reads them); whatever
    was fetched is deleted on exit (the content-addressed cache keeps its copies)."""
    if job.files_url is None:
        adapter = next(
            (Path(path).parent for name, path in job.inputs.items() if name.startswith(ADAPTER_PREFIX)), None
        )
        model_dir = Path(job.inputs[MODEL_PREFIX + "config.json"]).parent
        with WeightReader(model_dir) as reader:
            yield RingFiles(model_dir, reader, adapter)
        return
    remote = RemoteFiles(job.files_url, secret=read_files_secret(job_dir))
    fetched = Path(tempfile.mkdtemp(prefix="shardpool-ring-"))
    try:
        model_dir = remote.fetch_file(MODEL_PREFIX + "config.json", fetched).parent
        adapter_dir = None
        for name in sorted(job.inputs):
            if name.startswith(ADAPTER_PREFIX):
                adapter_dir = remote.fetch_file(name, fetched).parent
        weights = sorted(
            name for name in job.inputs if name.startswith(MODEL_PREFIX) and name.endswith(".safetensors")
        )
        with WeightReader(remote, weights) as reader:
            yield RingFiles(Path(model_dir), reader, None if adapter_dir is None else Path(adapter_dir))
    finally:
        remote.close()
        shutil.rmtree(fetched, ignore_errors=True)


def build_inference_stage(job: InferenceJob, rank: int, files: RingFiles) -> PipelineStage:
    """Stage ``rank`` of the job, with the adapter loaded (or a no-op LoRA for the base alone), in eval mode."""
    placement = job.stages[rank]
    stage_spec = StageSpec(rank, job.num_stages, placement.start, placement.stop, placement.device)
    base = BaseSettings(
        compute_dtype=placement.dtype or "float32", nf4_backend=placement.nf4_backend or "bitsandbytes"
    )
    lora = LoraSettings(
        r=job.lora_r,
        alpha=job.lora_alpha,
        dropout=0.0,
        target_modules=tuple(job.lora_targets),
        init_from=None if files.adapter_dir is None else str(files.adapter_dir),
        all_linear=not job.lora_targets,
    )
    stage = build_stage(files.model_dir, stage_spec, base, lora, seed=0, reader=files.reader)
    if files.adapter_dir is None:  # the base alone: LoRA's B stays zero, so it adds exactly nothing
        for name, param in stage.named_lora_parameters():
            if ".lora_B." in name:
                param.data.zero_()
    stage.eval()
    for param in stage.parameters():
        param.requires_grad_(False)
    return stage


class StageLoop:
    """What one stage does with each message of the ring."""

    def __init__(self, stage: PipelineStage, spec: InferenceJob, rank: int) -> None:
        self.stage = stage
        self.rank = rank
        self.device = torch.device(spec.stages[rank].device)
        self.compute_dtype = DTYPES[spec.stages[rank].dtype or "float32"]
        self.hidden_size = int(stage.hf_config.hidden_size)
        self.previous = spec.driver_rank if rank == 0 else rank - 1
        self.next = spec.driver_rank if stage.spec.is_last else rank + 1
        self.caches: dict[int, object] = {}
        self.samplings: dict[int, tuple[Sampling, torch.Generator]] = {}

    def run(self) -> None:
        """Handle messages until STOP; READY first, once the previous rank (the driver, for stage 0) is ready too."""
        self._expect(Kind.READY)
        self._send_header(Header(Kind.READY))
        while True:
            header = self._recv_header()
            if header.kind is Kind.STOP:
                self._send_header(header)
                return
            if header.kind is Kind.RELEASE:
                self.caches.pop(header.slot, None)
                self.samplings.pop(header.slot, None)
                if not self.stage.spec.is_last:
                    self._send_header(header)
            elif header.kind in (Kind.PREFILL, Kind.DECODE):
                self._forward(header)
            else:
                raise ShardpoolError(f"stage {self.rank} got an unexpected {header.kind.name} message")

    def _forward(self, header: Header) -> None:
        sampling = None
        if header.kind is Kind.PREFILL:
            sampling = self._recv_sampling()
            self.caches[header.slot] = self.stage.new_cache()
        elif header.slot not in self.caches:
            raise ShardpoolError(
                f"stage {self.rank} got a token for slot {header.slot}, which holds no sequence"
            )
        inputs = self._inputs(header)
        positions = torch.arange(header.position, header.position + header.length, device=self.device)
        output = self.stage.forward_cached(
            inputs, cache=self.caches[header.slot], position_ids=positions[None]
        )
        if not self.stage.spec.is_last:
            self._send_header(header)
            if sampling is not None:
                self._send_sampling(sampling)
            dist.send(output.detach().to(device="cpu", dtype=WIRE_DTYPE).contiguous(), dst=self.next)
            return
        if sampling is not None:
            self.samplings[header.slot] = (sampling, seeded_generator(sampling))
        chosen, generator = self.samplings[header.slot]
        token = next_token(output[0, -1].to("cpu"), chosen, generator)
        self._send_header(Header(Kind.TOKEN, header.slot, 1, header.position + header.length, token))

    def _inputs(self, header: Header) -> torch.Tensor:
        if self.stage.spec.is_first:
            if header.kind is Kind.DECODE:
                return torch.tensor([[header.token]], device=self.device)
            ids = torch.empty(header.length, dtype=torch.int64)
            dist.recv(ids, src=self.previous)
            return ids[None].to(self.device)
        hidden = torch.empty((1, header.length, self.hidden_size), dtype=WIRE_DTYPE)
        dist.recv(hidden, src=self.previous)
        return hidden.to(device=self.device, dtype=self.compute_dtype)

    def _expect(self, kind: Kind) -> None:
        header = self._recv_header()
        if header.kind is not kind:
            raise ShardpoolError(f"stage {self.rank} expected {kind.name}, got {header.kind.name}")

    def _recv_header(self) -> Header:
        values = torch.empty(HEADER_LEN, dtype=torch.int64)
        dist.recv(values, src=self.previous)
        return Header.decode(values.tolist())

    def _send_header(self, header: Header) -> None:
        dist.send(torch.tensor(header.encode(), dtype=torch.int64), dst=self.next)

    def _recv_sampling(self) -> Sampling:
        values = torch.empty(SAMPLING_LEN, dtype=torch.float64)
        dist.recv(values, src=self.previous)
        return Sampling.decode(values.tolist())

    def _send_sampling(self, sampling: Sampling) -> None:
        dist.send(torch.tensor(sampling.encode(), dtype=torch.float64), dst=self.next)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
