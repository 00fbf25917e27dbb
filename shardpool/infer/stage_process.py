"""One inference stage process: build the stage, join the ring, and serve messages until STOP.

``python -m shardpool.infer.stage_process JOB RANK``, where JOB is an
:class:`~shardpool.contract.inference.InferenceJob` file: written by the driver for a local stage,
or by a member's agent for a stage on the mesh. The stage is built as for training (its layers
only, NF4, the adapter loaded unmerged) and kept in eval mode; a local stage opens the job's
input paths, a mesh stage reads them by name from the driver's file server (the weights it owns
by range, verified). It then loops: take the next message (a thread per rank it hears from keeps
a receive posted), do what it asks for one sequence slot, pass the result on. Each slot has its own KV
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
from shardpool.infer.sends import PendingSends
from shardpool.model.lora import LoraSettings
from shardpool.model.nf4 import DTYPES
from shardpool.model.stage import BaseSettings, PipelineStage, StageSpec, build_stage
from shardpool.model.weights import WeightReader
from shardpool.train.process_group import prove_peers, select_device
from shardpool.train.runfiles import read_files_secret

__all__ = [
    "main",
    "RingFiles",
    "StageLoop",
    "build_inference_stage",
    "frame_bytes",
    "join_ring",
    "make_frame",
    "read_frame",
    "ring_files",
]

#: What hidden states cross the ring in: fp32 holds every compute dtype exactly.
WIRE_DTYPE = torch.float32
#: Sends a stage lets run before it waits for the oldest (each holds its tensor until then).
_MAX_PENDING_SENDS = 8
#: Bytes of a header on the wire (int64 values).
_HEADER_BYTES = HEADER_LEN * 8


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


def frame_bytes(hidden_size: int) -> int:
    """The size of a frame between stages: a header and one position's hidden state."""
    return _HEADER_BYTES + hidden_size * WIRE_DTYPE.itemsize


def make_frame(header: Header, hidden_size: int, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """``header`` as a frame for the next stage (bytes), with a DECODE's one-position ``hidden``
    state in the wire dtype, or zeros in its place."""
    frame = torch.zeros(frame_bytes(hidden_size), dtype=torch.uint8)
    frame[:_HEADER_BYTES].view(torch.int64).copy_(torch.tensor(header.encode(), dtype=torch.int64))
    if hidden is not None:
        if hidden.numel() != hidden_size:
            raise ShardpoolError(
                f"a frame holds one position's hidden state ({hidden_size} values), not {hidden.numel()}"
            )
        frame[_HEADER_BYTES:].view(WIRE_DTYPE).copy_(hidden.reshape(-1))
    return frame


def read_frame(frame: torch.Tensor, hidden_size: int) -> tuple[Header, torch.Tensor | None]:
    """The header a frame holds and, for a DECODE, its hidden state as ``(1, 1, hidden_size)``."""
    header = Header.decode(frame[:_HEADER_BYTES].view(torch.int64).tolist())
    if header.kind is not Kind.DECODE:
        return header, None
    return header, frame[_HEADER_BYTES:].view(WIRE_DTYPE).reshape(1, 1, hidden_size)


@dataclass(frozen=True)
class _Message:
    """One message as a stage's receiving thread took it from rank ``source``: its header and,
    for a new sequence, its sampling settings and stop ids; ``inputs`` is what the stage computes
    on (a PREFILL's prompt ids or hidden states, a DECODE's hidden state; None for stage 0's
    DECODE, whose token is in the header)."""

    source: int
    header: Header
    settings: tuple[Sampling, list[int]] | None = None
    inputs: torch.Tensor | None = None


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

    Receiving threads (one per rank it hears from) always have the next receive posted, so gloo
    has told the sender its receive is ready before the message goes, and a message crosses a
    link once. Stage 0 hears from two ranks: the driver (new sequences, releases, cancels, STOP)
    and the last stage (each sequence's next token, as a DECODE), so a token's round goes through
    the stages only. A later stage hears from the stage before it, in frames: a header with room
    for one position's hidden state, which a DECODE fills, so a decode step is one message per
    link. With one stage, the stage keeps its own DECODEs in a queue and takes them between the
    driver's messages.
    """

    def __init__(self, stage: PipelineStage, spec: InferenceJob, rank: int) -> None:
        self.stage = stage
        self.rank = rank
        self.device = torch.device(spec.stages[rank].device)
        self.compute_dtype = DTYPES[spec.stages[rank].dtype or "float32"]
        self.hidden_size = int(stage.hf_config.hidden_size)
        self.driver = spec.driver_rank
        self.is_first = rank == 0
        self.is_last = bool(stage.spec.is_last)
        self.previous = self.driver if self.is_first else rank - 1
        self.next = self.driver if self.is_last else rank + 1
        self.caches: dict[int, object] = {}
        self.sequences: dict[int, _Sequence] = {}  # the last stage's
        self.cancelled: set[int] = set()  # stage 0's: slots to continue no further
        self.own_decodes: collections.deque[_Message] = collections.deque()  # one stage: its next tokens
        self.inbox: queue.Queue[_Message | BaseException] = queue.Queue()
        self.sends = PendingSends(_MAX_PENDING_SENDS)

    def run(self) -> None:
        """Handle messages until STOP; READY first, once the previous rank (the driver, for stage 0) is ready too."""
        ready = self._receive_one(self.previous)
        if ready.header.kind is not Kind.READY:
            raise ShardpoolError(f"stage {self.rank} expected READY, got {ready.header.kind.name}")
        self._send_header(Header(Kind.READY), self.next)
        sources = [self.previous]
        if self.is_first and not self.is_last:
            sources.append(self.last_rank)
        receivers = [
            threading.Thread(
                target=self._receive, args=(source,), name=f"shardpool-stage-from-{source}", daemon=True
            )
            for source in sources
        ]
        for receiver in receivers:
            receiver.start()
        with torch.inference_mode():
            if self.is_first:
                self._run_first()
            else:
                self._run_later()
        # Each receiver has taken its last message (a STOP). Nothing of gloo may outlive the
        # group, nor a thread return from a gloo call while the interpreter exits.
        for receiver in receivers:
            receiver.join()
        self.sends.finish()

    @property
    def last_rank(self) -> int:
        """The rank of the ring's last stage."""
        return self.driver - 1

    # ----- receiving ----------------------------------------------------------------------------
    def _receive(self, source: int) -> None:
        """A receiving thread: every message from ``source`` into the inbox, until its STOP."""
        try:
            while True:
                message = self._receive_one(source)
                self.inbox.put(message)
                if message.header.kind is Kind.STOP:
                    return
        except BaseException as error:  # noqa: BLE001 - raised again by the stage's loop
            self.inbox.put(error)

    def _receive_one(self, source: int) -> _Message:
        """The next message from ``source``, with what follows its header (a PREFILL's settings and
        inputs)."""
        inputs = None
        if self.is_first:  # from the driver or the last stage: a header alone
            values = torch.empty(HEADER_LEN, dtype=torch.int64)
            dist.recv(values, src=source, tag=HEADER_TAG)
            header = Header.decode(values.tolist())
        else:
            frame = torch.empty(frame_bytes(self.hidden_size), dtype=torch.uint8)
            dist.recv(frame, src=source, tag=HEADER_TAG)
            header, inputs = read_frame(frame, self.hidden_size)
        if header.kind is not Kind.PREFILL or source != self.previous:
            return _Message(source, header, inputs=inputs)
        sampling = self._recv_sampling()
        stop_ids = self._recv_stop_ids(header.token)
        if self.is_first:
            inputs = torch.empty(header.length, dtype=torch.int64)
        else:
            inputs = torch.empty((1, header.length, self.hidden_size), dtype=WIRE_DTYPE)
        dist.recv(inputs, src=source)
        return _Message(source, header, (sampling, stop_ids), inputs)

    def _next(self) -> _Message:
        item = self.inbox.get()
        if isinstance(item, BaseException):
            raise item
        return item

    # ----- stage 0 ------------------------------------------------------------------------------
    def _run_first(self) -> None:
        stopping = False
        while True:
            if self.own_decodes and self.inbox.empty():
                self._continue(self.own_decodes.popleft())
                continue
            message = self._next()
            header, source = message.header, message.source
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
                self._from_driver(message)
            elif header.kind is Kind.DECODE:
                self._continue(message)
            else:
                raise ShardpoolError(f"stage 0 got an unexpected {header.kind.name} from rank {source}")

    def _from_driver(self, message: _Message) -> None:
        header = message.header
        if header.kind is Kind.PREFILL:
            self._forward(message)
        elif header.kind is Kind.RELEASE:
            self.cancelled.discard(header.slot)
            self._release(header)
        elif header.kind is Kind.CANCEL:
            self.cancelled.add(header.slot)
        else:
            raise ShardpoolError(f"stage 0 got an unexpected {header.kind.name} from the driver")

    def _continue(self, message: _Message) -> None:
        """A sequence's next token: computed, unless its slot was cancelled: then it is released on
        every stage, and the last one tells the driver the slot is free."""
        slot = message.header.slot
        if slot not in self.cancelled:
            self._forward(message)
            return
        self.cancelled.discard(slot)
        self._release(Header(Kind.RELEASE, slot, extra=1))

    # ----- stages 1 .. S-1 ----------------------------------------------------------------------
    def _run_later(self) -> None:
        while True:
            message = self._next()
            header = message.header
            if header.kind is Kind.STOP:
                if self.is_last:
                    self._send_header(header, 0)  # no DECODE follows it to stage 0
                self._send_header(header, self.next)
                return
            if header.kind is Kind.RELEASE:
                self._release(header)
            elif header.kind in (Kind.PREFILL, Kind.DECODE):
                self._forward(message)
            else:
                raise ShardpoolError(f"stage {self.rank} got an unexpected {header.kind.name} message")

    # ----- every stage --------------------------------------------------------------------------
    def _release(self, header: Header) -> None:
        """Drop the slot's cache and pass the RELEASE on; the last stage answers a cancelled slot's."""
        self.caches.pop(header.slot, None)
        self.sequences.pop(header.slot, None)
        if not self.is_last:
            self._send_header(header, self.next)
        elif header.extra:
            self._send_header(Header(Kind.RELEASED, header.slot), self.driver)

    def _forward(self, message: _Message) -> None:
        header = message.header
        if header.kind is Kind.PREFILL:
            self.caches[header.slot] = self.stage.new_cache()
        elif header.slot not in self.caches:
            raise ShardpoolError(
                f"stage {self.rank} got a token for slot {header.slot}, which holds no sequence"
            )
        positions = torch.arange(header.position, header.position + header.length, device=self.device)
        output = self.stage.forward_cached(
            self._inputs(message), cache=self.caches[header.slot], position_ids=positions[None]
        )
        if not self.is_last:
            hidden = output.detach().to(device="cpu", dtype=WIRE_DTYPE).contiguous()
            if message.settings is None:  # a DECODE: its hidden state rides in its frame
                self._send_header(header, self.next, hidden)
                return
            self._send_header(header, self.next)
            self._send_sampling(message.settings[0])
            self._send_stop_ids(message.settings[1])
            self.sends.start(hidden, self.next)
            return
        if message.settings is not None:
            sampling, stop_ids = message.settings
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
                self.own_decodes.append(_Message(self.rank, decode))
            else:
                self._send_header(decode, 0)
        self._send_header(Header(Kind.TOKEN, header.slot, 1, position, token, int(last)), self.driver)

    def _inputs(self, message: _Message) -> torch.Tensor:
        if message.inputs is None:  # stage 0's DECODE
            return torch.tensor([[message.header.token]], device=self.device)
        if self.is_first:
            return message.inputs[None].to(self.device)
        return message.inputs.to(device=self.device, dtype=self.compute_dtype)

    def _send_header(self, header: Header, destination: int, hidden: torch.Tensor | None = None) -> None:
        """A header to ``destination``: to a later stage as a frame (with a DECODE's ``hidden``
        state), to stage 0 or the driver alone."""
        if 0 < destination < self.driver:
            self.sends.start(make_frame(header, self.hidden_size, hidden), destination, HEADER_TAG)
        else:
            self.sends.start(torch.tensor(header.encode(), dtype=torch.int64), destination, HEADER_TAG)

    def _recv_sampling(self) -> Sampling:
        values = torch.empty(SAMPLING_LEN, dtype=torch.float64)
        dist.recv(values, src=self.previous)
        return Sampling.decode(values.tolist())

    def _send_sampling(self, sampling: Sampling) -> None:
        self.sends.start(torch.tensor(sampling.encode(), dtype=torch.float64), self.next)

    def _recv_stop_ids(self, count: int) -> list[int]:
        if count == 0:
            return []
        ids = torch.empty(count, dtype=torch.int64)
        dist.recv(ids, src=self.previous)
        return [int(value) for value in ids.tolist()]

    def _send_stop_ids(self, stop_ids: list[int]) -> None:
        if stop_ids:
            self.sends.start(torch.tensor(stop_ids, dtype=torch.int64), self.next)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
