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

import collections
import os
import queue
import shutil
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardpool.contract.inference import ADAPTER_PREFIX, MODEL_PREFIX, InferenceJob
from shardpool.contract.job import CONTROL_SECRET_ENV
from shardpool.elastic.group_store import GroupStore
from shardpool.elastic.messages import ControlStore, control_key
from shardpool.errors import ShardpoolError
from shardpool.files.client import RemoteFiles
from shardpool.infer.messages import HEADER_LEN, HEADER_TAG, SAMPLING_LEN, Header, Kind
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
#: Sends a stage lets run before it waits for the oldest (each holds its tensor until then).
_MAX_PENDING_SENDS = 8


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


@dataclass(frozen=True)
class _Prefill:
    """A new sequence's settings as stage 0 received them from the driver (with its prompt), or a
    later stage from the one before it (without)."""

    sampling: Sampling
    stop_ids: list[int]
    prompt: torch.Tensor | None


@dataclass
class _Sequence:
    """What the last stage keeps of one slot's sequence to pick its tokens and know its end."""

    sampling: Sampling
    generator: torch.Generator
    stop_ids: frozenset[int]
    max_new_tokens: int
    generated: int = 0


class StageLoop:
    """What one stage does with each message of the ring.

    Stage 0 hears from two ranks: the driver (new sequences, releases, cancels, STOP) and the last
    stage (each sequence's next token, as a DECODE). It waits on both at once (a receive from any
    rank), so a token's round goes through the stages only. With one stage, the stage is both: it
    keeps its own DECODEs in a queue and takes them between the driver's messages.
    """

    def __init__(self, stage: PipelineStage, spec: InferenceJob, rank: int) -> None:
        self.stage = stage
        self.rank = rank
        self.device = torch.device(spec.stages[rank].device)
        self.compute_dtype = DTYPES[spec.stages[rank].dtype or "float32"]
        self.hidden_size = int(stage.hf_config.hidden_size)
        self.driver = spec.driver_rank
        self.first_rank = 0
        self.is_first = rank == 0
        self.is_last = bool(stage.spec.is_last)
        self.previous = self.driver if self.is_first else rank - 1
        self.next = self.driver if self.is_last else rank + 1
        self.caches: dict[int, object] = {}
        self.sequences: dict[int, _Sequence] = {}  # the last stage's
        self.cancelled: set[int] = set()  # stage 0's: slots to continue no further
        self.own_decodes: collections.deque[Header] = collections.deque()  # one stage: its next tokens
        # Stage 0's messages, received by a thread that always has the next receive posted: a gloo
        # send completes only once its receiver has posted the receive, so the last stage's DECODE
        # never waits on stage 0's own sends (which wait on stage 1, … on the last stage).
        self.inbox: queue.Queue[tuple[int, Header, _Prefill | None] | BaseException] = queue.Queue()
        # Sends in flight, each with its tensor; the oldest is waited for past a few.
        self.sends: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()

    def run(self) -> None:
        """Handle messages until STOP; READY first, once the previous rank (the driver, for stage 0) is ready too."""
        self._expect(Kind.READY)
        self._send_header(Header(Kind.READY), self.next)
        if self.is_first:
            inbox = threading.Thread(target=self._receive_first, name="shardpool-stage0-inbox", daemon=True)
            inbox.start()
            self._run_first()
            # Its last message (a STOP) is taken: it ends now. Nothing of gloo may outlive the
            # group, nor a thread return from a gloo call while the interpreter exits.
            inbox.join()
        else:
            self._run_later()
        while self.sends:
            self.sends.popleft()[0].wait()

    # ----- stage 0 ------------------------------------------------------------------------------
    def _receive_first(self) -> None:
        """Stage 0's inbox: each header from any rank (the driver or the last stage), with a new
        sequence's settings and prompt, until the last STOP it will get."""
        try:
            while True:
                values = torch.empty(HEADER_LEN, dtype=torch.int64)
                work = dist.irecv(values, tag=HEADER_TAG)  # from any rank
                work.wait()
                source = int(work._source_rank())  # noqa: SLF001 - torch's only way to read it
                header = Header.decode(values.tolist())
                prefill = None
                if source == self.driver and header.kind is Kind.PREFILL:
                    prefill = _Prefill(
                        self._recv_sampling(), self._recv_stop_ids(header.token), self._recv_prompt(header)
                    )
                self.inbox.put((source, header, prefill))
                if header.kind is Kind.STOP and (self.is_last or source == self.last_rank):
                    return
        except BaseException as error:  # noqa: BLE001 - raised again by the stage's loop
            self.inbox.put(error)

    def _run_first(self) -> None:
        stopping = False
        while True:
            if self.own_decodes and self.inbox.empty():
                self._continue(self.own_decodes.popleft())
                continue
            item = self.inbox.get()
            if isinstance(item, BaseException):
                raise item
            source, header, prefill = item
            if header.kind is Kind.STOP:
                if source != self.driver:  # the last stage's: no DECODE follows it
                    return
                self._send_header(header, self.next)
                if self.is_last:
                    return
                stopping = True  # drop the DECODEs still coming back until the last stage's STOP
            elif stopping:
                continue
            elif source == self.driver:
                self._from_driver(header, prefill)
            elif header.kind is Kind.DECODE:
                self._continue(header)
            else:
                raise ShardpoolError(f"stage 0 got an unexpected {header.kind.name} from rank {source}")

    def _from_driver(self, header: Header, prefill: _Prefill | None) -> None:
        if header.kind is Kind.PREFILL and prefill is not None:
            self._forward(header, prefill)
        elif header.kind is Kind.RELEASE:
            self.cancelled.discard(header.slot)
            self._release(header)
        elif header.kind is Kind.CANCEL:
            self.cancelled.add(header.slot)
        else:
            raise ShardpoolError(f"stage 0 got an unexpected {header.kind.name} from the driver")

    def _continue(self, header: Header) -> None:
        """A sequence's next token: computed, unless its slot was cancelled: then it is released on
        every stage, and the last one tells the driver the slot is free."""
        if header.slot not in self.cancelled:
            self._forward(header)
            return
        self.cancelled.discard(header.slot)
        self._release(Header(Kind.RELEASE, header.slot, extra=1))

    # ----- stages 1 .. S-1 ----------------------------------------------------------------------
    def _run_later(self) -> None:
        while True:
            header = self._recv_header()
            if header.kind is Kind.STOP:
                if self.is_last:
                    self._send_header(header, self.first_rank)  # no DECODE follows it to stage 0
                self._send_header(header, self.next)
                return
            if header.kind is Kind.RELEASE:
                self._release(header)
            elif header.kind in (Kind.PREFILL, Kind.DECODE):
                self._forward(header)
            else:
                raise ShardpoolError(f"stage {self.rank} got an unexpected {header.kind.name} message")

    # ----- every stage --------------------------------------------------------------------------
    @property
    def last_rank(self) -> int:
        """The rank of the ring's last stage."""
        return self.driver - 1

    def _release(self, header: Header) -> None:
        """Drop the slot's cache and pass the RELEASE on; the last stage answers a cancelled slot's."""
        self.caches.pop(header.slot, None)
        self.sequences.pop(header.slot, None)
        if not self.is_last:
            self._send_header(header, self.next)
        elif header.extra:
            self._send_header(Header(Kind.RELEASED, header.slot), self.driver)

    def _forward(self, header: Header, prefill: _Prefill | None = None) -> None:
        settings = None
        if header.kind is Kind.PREFILL:
            if prefill is None:  # a later stage: what stage 0 passed on
                prefill = _Prefill(self._recv_sampling(), self._recv_stop_ids(header.token), None)
            settings = (prefill.sampling, prefill.stop_ids)
            self.caches[header.slot] = self.stage.new_cache()
        elif header.slot not in self.caches:
            raise ShardpoolError(
                f"stage {self.rank} got a token for slot {header.slot}, which holds no sequence"
            )
        inputs = self._inputs(header, prefill)
        positions = torch.arange(header.position, header.position + header.length, device=self.device)
        output = self.stage.forward_cached(
            inputs, cache=self.caches[header.slot], position_ids=positions[None]
        )
        if not self.is_last:
            self._send_header(header, self.next)
            if settings is not None:
                self._send_sampling(settings[0])
                self._send_stop_ids(settings[1])
            self._isend(output.detach().to(device="cpu", dtype=WIRE_DTYPE).contiguous(), self.next)
            return
        if settings is not None:
            sampling, stop_ids = settings
            self.sequences[header.slot] = _Sequence(
                sampling, seeded_generator(sampling), frozenset(stop_ids), header.extra
            )
        self._pick(header, output[0, -1].to("cpu"))

    def _pick(self, header: Header, logits: torch.Tensor) -> None:
        """The last stage: choose the slot's token, hand it to stage 0 as the next DECODE unless
        the sequence has ended (a stop id, or its max_new_tokens), and tell the driver."""
        sequence = self.sequences[header.slot]
        token = next_token(logits, sequence.sampling, sequence.generator)
        sequence.generated += 1
        position = header.position + header.length
        last = token in sequence.stop_ids or sequence.generated >= sequence.max_new_tokens
        if not last:
            decode = Header(Kind.DECODE, header.slot, 1, position, token)
            if self.is_first:
                self.own_decodes.append(decode)
            else:
                self._send_header(decode, self.first_rank)
        self._send_header(Header(Kind.TOKEN, header.slot, 1, position, token, int(last)), self.driver)

    def _inputs(self, header: Header, prefill: _Prefill | None) -> torch.Tensor:
        if self.is_first:
            if header.kind is Kind.DECODE:
                return torch.tensor([[header.token]], device=self.device)
            assert prefill is not None and prefill.prompt is not None
            return prefill.prompt[None].to(self.device)
        hidden = torch.empty((1, header.length, self.hidden_size), dtype=WIRE_DTYPE)
        dist.recv(hidden, src=self.previous)
        return hidden.to(device=self.device, dtype=self.compute_dtype)

    def _expect(self, kind: Kind) -> None:
        header = self._recv_header()
        if header.kind is not kind:
            raise ShardpoolError(f"stage {self.rank} expected {kind.name}, got {header.kind.name}")

    def _recv_header(self) -> Header:
        values = torch.empty(HEADER_LEN, dtype=torch.int64)
        dist.recv(values, src=self.previous, tag=HEADER_TAG)
        return Header.decode(values.tolist())

    def _isend(self, tensor: torch.Tensor, destination: int, tag: int = 0) -> None:
        self.sends.append((dist.isend(tensor, dst=destination, tag=tag), tensor))
        if len(self.sends) > _MAX_PENDING_SENDS:
            self.sends.popleft()[0].wait()  # raises if it failed

    def _send_header(self, header: Header, destination: int) -> None:
        self._isend(torch.tensor(header.encode(), dtype=torch.int64), destination, HEADER_TAG)

    def _recv_sampling(self) -> Sampling:
        values = torch.empty(SAMPLING_LEN, dtype=torch.float64)
        dist.recv(values, src=self.previous)
        return Sampling.decode(values.tolist())

    def _send_sampling(self, sampling: Sampling) -> None:
        self._isend(torch.tensor(sampling.encode(), dtype=torch.float64), self.next)

    def _recv_prompt(self, header: Header) -> torch.Tensor:
        ids = torch.empty(header.length, dtype=torch.int64)
        dist.recv(ids, src=self.driver)
        return ids

    def _recv_stop_ids(self, count: int) -> list[int]:
        if count == 0:
            return []
        ids = torch.empty(count, dtype=torch.int64)
        dist.recv(ids, src=self.previous)
        return [int(value) for value in ids.tolist()]

    def _send_stop_ids(self, stop_ids: list[int]) -> None:
        if stop_ids:
            self._isend(torch.tensor(stop_ids, dtype=torch.int64), self.next)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
