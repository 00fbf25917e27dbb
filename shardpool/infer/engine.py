"""The driver of the inference ring: start the stages, admit requests into sequence slots, and
stream each one's tokens back.

:class:`PipelineEngine` hosts the rendezvous store (every value sealed with the ring's control
key), has its :class:`~shardpool.infer.rings.Stages` start one process per stage
(:mod:`shardpool.infer.stage_process`: children of this process, or on mesh members through their
agents) and joins their gloo world as the last rank (on the mesh, over the WireGuard interface:
``GLOO_SOCKET_IFNAME`` is set in this process). A request takes a free slot and goes round the
ring as a PREFILL (its prompt, sampling settings, stop ids and ``max_new_tokens``). The last stage
picks each token, hands it straight to stage 0 as the slot's next DECODE unless the sequence has
ended, and tells this driver, which hands it to the request's :class:`Stream`: a token's round
goes through the stages only. Up to ``max_slots`` sequences are in flight at once, so while the
last stage samples one sequence's token the first already computes another's: the pipeline
fills. A finished slot is released (each stage drops its cache) and taken by the next waiting
request; a cancelled one (a stop string, a client gone) is continued no further (CANCEL to stage
0) and taken again once every stage has dropped it (RELEASED from the last).

A stage that fails (or dies, or whose member is lost) fails every request in flight with its
one-line error, and the engine stops, or, with ``restart`` (``shardpool serve``), starts a fresh
ring (placed again: on the mesh, over the members online then) and serves again.
:meth:`PipelineEngine.close` stops the stages and leaves no process behind.

The driver's gloo world is torch.distributed's default group, which is global to the process:
one engine at a time per process. Its stage processes die with the thread that created the
engine (PR_SET_PDEATHSIG), so create it in a thread that outlives it (the main thread).
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardpool.contract.inference import ADAPTER_PREFIX, INFERENCE_KIND, MODEL_PREFIX, InferenceJob
from shardpool.contract.job import StagePlacement
from shardpool.elastic.group_store import GroupStore
from shardpool.elastic.messages import ControlStore, control_key
from shardpool.errors import ShardpoolError
from shardpool.infer.messages import HEADER_LEN, HEADER_TAG, Header, Kind
from shardpool.infer.rings import LocalStages, Ring, Stages
from shardpool.infer.sampling import Sampling
from shardpool.infer.sends import PendingSends
from shardpool.infer.target import Target
from shardpool.train.process_group import prove_peers
from shardpool.train.rendezvous import rendezvous_store

__all__ = ["EngineFailed", "GenerationRequest", "PipelineEngine", "Stream"]

#: Sends the driver lets run before it waits for the oldest.
_MAX_PENDING_SENDS = 64
_STOP_WAIT_S = 10.0
_WATCH_INTERVAL_S = 0.5
_RESTART_TRIES = 3

log = logging.getLogger(__name__)


class EngineFailed(ShardpoolError):
    """A stage failed or the ring broke: requests in flight end with this one-line error."""


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to continue: its prompt ids, how many tokens at most, how to pick them, and
    which token ids end it (kept in the output, as ``generate`` keeps its eos)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    stop_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ShardpoolError("the prompt is empty; give at least one token")
        if self.max_new_tokens < 1:
            raise ShardpoolError(f"max_new_tokens {self.max_new_tokens} must be at least 1")


@dataclass
class Stream:
    """The tokens of one request as they come. Iterate it for the token ids; afterwards
    ``finish_reason`` is ``"stop"`` (a stop token), ``"length"`` (max_new_tokens or the context)
    or ``"cancelled"``. A failed engine raises :class:`EngineFailed` from the iteration."""

    request: GenerationRequest
    items: queue.Queue[tuple[str, Any]] = field(default_factory=queue.Queue)
    finish_reason: str | None = None
    cancelled: bool = False
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    #: Set by the engine once the request holds a slot: tells the ring to continue it no further.
    on_cancel: Callable[[], None] | None = field(default=None, repr=False)

    def __iter__(self) -> Iterator[int]:
        while True:
            kind, value = self.items.get()
            if kind == "token":
                yield int(value)
            elif kind == "end":
                self.finish_reason = str(value)
                return
            else:
                raise EngineFailed(str(value))

    def cancel(self) -> None:
        """Ask for no more tokens: the stream ends at the next token that comes back, and its
        slot is freed once every stage has dropped it."""
        self.cancelled = True
        if self.on_cancel is not None:
            self.on_cancel()

    def tokens(self) -> list[int]:
        """Every token, once the request has finished."""
        return list(self)


@dataclass
class _Slot:
    stream: Stream
    ended: bool = False  # the stream has its end; the slot waits for the stages to free it
    cancel_sent: bool = False


class PipelineEngine:
    """S stage processes and this process as the ring's driver; see the module's docstring."""

    def __init__(
        self,
        target: Target,
        placements: Sequence[StagePlacement] = (),
        *,
        stages: Stages | None = None,
        max_slots: int = 8,
        max_context: int = 4096,
        threads_per_process: int | None = None,
        log_dir: Path | None = None,
        timeout_s: float = 300.0,
        restart: bool = False,
    ) -> None:
        if max_slots < 1:
            raise ShardpoolError(f"max_slots {max_slots} must be at least 1")
        self.target = target
        self.max_slots = max_slots
        self.max_context = max_context
        self._work = Path(tempfile.mkdtemp(prefix="shardpool-infer-"))
        self.log_dir = log_dir or self._work
        if stages is None:
            if not placements:
                raise ShardpoolError("the engine needs the stages' places")
            stages = LocalStages(placements, work_dir=self._work, log_dir=self.log_dir)
        #: Where the stages run (this machine's processes, or mesh members).
        self.stages = stages
        self.placements: list[StagePlacement] = []
        self._lock = threading.RLock()  # Stream.cancel may run in a thread that holds it
        self._slots: dict[int, _Slot] = {}
        self._waiting: collections.deque[Stream] = collections.deque()
        self._sends = PendingSends(_MAX_PENDING_SENDS)
        self._failure: str | None = None
        self._last_failure = ""
        self._closing = False
        self._ring: Ring | None = None
        self._threads = threads_per_process
        self._timeout_s = timeout_s
        #: Start the ring again after a stage fails (``serve``); requests in flight still fail.
        self.restart = restart
        self.restarts = 0
        self._restart_due = threading.Event()
        try:
            self._start(timeout_s)
        except BaseException:
            stages.close()
            raise
        if restart:
            threading.Thread(target=self._restarter, name="shardpool-infer-restarter", daemon=True).start()

    # ----- the public side ----------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        """How many stage processes the ring has."""
        return len(self.placements)

    def submit(self, request: GenerationRequest) -> Stream:
        """Queue ``request``; its tokens arrive on the returned stream. One line when it cannot fit."""
        if len(request.prompt_ids) + request.max_new_tokens > self.max_context:
            raise ShardpoolError(
                f"the prompt ({len(request.prompt_ids)} tokens) plus max_new_tokens ({request.max_new_tokens}) "
                f"exceeds the context of {self.max_context} tokens; shorten one of them"
            )
        stream = Stream(request)
        with self._lock:
            if self._failure is not None:
                raise EngineFailed(self._failure)
            if self._closing:
                raise EngineFailed("the engine is closing")
            self._waiting.append(stream)
            ring = self._ring
            try:
                self._admit_waiting()
                return stream
            except RuntimeError as error:  # the ring broke before the watcher or receiver saw it
                broke = f"the inference ring broke: {str(error).splitlines()[0]}"
        time.sleep(0.2)  # let the failed stage's own line reach its log first
        self._fail_all(_ring_failure(ring) or broke, ring)
        raise EngineFailed(self._failure or broke)

    def generate(self, request: GenerationRequest) -> list[int]:
        """The tokens of ``request``, once it has finished."""
        return self.submit(request).tokens()

    @property
    def ring(self) -> Ring | None:
        """The stages now running (a :class:`~shardpool.infer.rings.LocalRing`'s processes, or a
        :class:`~shardpool.infer.rings.MeshRing`'s members), None between a failure and a restart."""
        return self._ring

    @property
    def failure(self) -> str | None:
        """Why the engine failed, or None while it runs."""
        return self._failure

    def close(self) -> None:
        """Stop the stages (STOP round the ring), then make sure no stage process is left."""
        with self._lock:
            already = self._closing
            self._closing = True
            if not already and self._failure is None:
                self._send(Header(Kind.STOP))
        if not already:
            self._receiver.join(timeout=_STOP_WAIT_S)
            if self._ring is not None:
                self._ring.stop()
            # Nothing of the ring may outlive close: a thread still in a gloo call, or a send gloo
            # still holds, when the interpreter exits makes the process abort there.
            # A ring that never sent STOP back: its stages are gone now, so the receiver's recv fails.
            self._receiver.join(timeout=_STOP_WAIT_S)
            self._watcher.join(timeout=_STOP_WAIT_S)
            self._sends.finish(_STOP_WAIT_S, failures_ok=True)  # a stage gone: nothing more to deliver
            self._fail_all("the engine was closed")
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except RuntimeError:
                    pass
            self._store = None  # the rendezvous store's server thread ends with it, here
            self.stages.close()
            for file in self._work.iterdir():
                if file.suffix == ".json":
                    file.unlink(missing_ok=True)

    def __enter__(self) -> PipelineEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- starting -----------------------------------------------------------------------------
    def _start(self, timeout_s: float) -> None:
        placements = self.stages.place()
        address = self.stages.address
        self._store = rendezvous_store(address, timeout_s=timeout_s)
        secret = self.stages.control_secret()
        threads = self._threads or max(1, (os.cpu_count() or 1) // len(placements))
        job = InferenceJob(
            kind=INFERENCE_KIND,
            inputs=target_inputs(self.target),
            files_url=self.stages.files_url,
            lora_r=self.target.lora_r,
            lora_alpha=self.target.lora_alpha,
            lora_targets=list(self.target.lora_targets),
            stages=list(placements),
            master_addr=address,
            master_port=int(self._store.port),
            threads_per_process=threads,
            timeout_s=timeout_s,
        )
        self.job = job
        self.placements = list(placements)
        ring: Ring | None = None
        try:
            ring = self.stages.start(job, secret)
            self._ring = ring
            sealed = ControlStore(self._store, control_key(secret, addr=address, port=job.master_port))
            world = job.num_stages + 1
            _fresh_group_names()
            if self.stages.interface:
                os.environ["GLOO_SOCKET_IFNAME"] = self.stages.interface
            dist.init_process_group(
                backend="gloo",
                store=GroupStore(sealed),
                rank=job.driver_rank,
                world_size=world,
                timeout=timedelta(seconds=timeout_s),
            )
            prove_peers(
                sealed.peer_key(0), group=None, name="world", rank=job.driver_rank, ranks=range(world)
            )
            self._wait_ready(ring)
        except BaseException as error:
            died = _ring_failure(ring)  # before they are stopped: a stage that failed on its own
            if ring is not None:
                ring.stop()
            if dist.is_initialized():
                dist.destroy_process_group()
            if died is not None:
                raise EngineFailed(died) from None
            if isinstance(error, (EngineFailed, KeyboardInterrupt)):
                raise
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise EngineFailed(f"the stages did not join the ring: {first}") from None
        self._receiver = threading.Thread(
            target=self._receive, args=(ring,), name="shardpool-infer-receiver", daemon=True
        )
        self._receiver.start()
        self._watcher = threading.Thread(
            target=self._watch, args=(ring,), name="shardpool-infer-watch", daemon=True
        )
        self._watcher.start()

    def _wait_ready(self, ring: Ring) -> None:
        """Wait for the ring's READY (every stage built), stopping early when a stage dies."""
        with self._lock:
            self._send(Header(Kind.READY))
        values = torch.empty(HEADER_LEN, dtype=torch.int64)
        received: list[BaseException | None] = []

        def receive() -> None:
            try:
                dist.recv(values, src=self.num_stages - 1, tag=HEADER_TAG)
                received.append(None)
            except BaseException as error:  # noqa: BLE001 - reported by the waiting thread
                received.append(error)

        waiter = threading.Thread(target=receive, name="shardpool-infer-ready", daemon=True)
        waiter.start()
        while waiter.is_alive():
            died = ring.failure()
            if died is not None:
                raise EngineFailed(died)
            waiter.join(timeout=0.05)
        if received and received[0] is not None:
            raise EngineFailed(f"the stages did not get ready: {str(received[0]).splitlines()[0]}")
        header = Header.decode(values.tolist())
        if header.kind is not Kind.READY:
            raise EngineFailed(f"the last stage answered {header.kind.name} instead of READY")

    # ----- the ring -----------------------------------------------------------------------------
    def _send(self, header: Header, *tensors: torch.Tensor) -> None:
        """Start sending a header and what follows it to stage 0 (the caller holds the lock)."""
        self._sends.start(torch.tensor(header.encode(), dtype=torch.int64), 0, HEADER_TAG)
        for tensor in tensors:
            self._sends.start(tensor, 0)

    def _admit_waiting(self) -> None:
        while self._waiting and len(self._slots) < self.max_slots:
            stream = self._waiting.popleft()
            if stream.cancelled:
                stream.items.put(("end", "cancelled"))
                continue
            slot = next(index for index in range(self.max_slots) if index not in self._slots)
            self._slots[slot] = _Slot(stream)
            stream.on_cancel = functools.partial(self._cancel, slot, stream)
            request = stream.request
            prompt = torch.tensor(request.prompt_ids, dtype=torch.int64)
            sampling = torch.tensor(request.sampling.encode(), dtype=torch.float64)
            stop_ids = sorted(request.stop_token_ids)
            payload = [sampling, *([torch.tensor(stop_ids, dtype=torch.int64)] if stop_ids else []), prompt]
            header = Header(
                Kind.PREFILL, slot, len(request.prompt_ids), 0, len(stop_ids), request.max_new_tokens
            )
            self._send(header, *payload)

    def _cancel(self, slot: int, stream: Stream) -> None:
        """Continue ``stream``'s slot no further (once): stage 0 turns its next DECODE into a RELEASE."""
        with self._lock:
            held = self._slots.get(slot)
            if held is None or held.stream is not stream or held.ended or held.cancel_sent:
                return
            held.cancel_sent = True
            if self._failure is None and not self._closing:
                try:
                    self._send(Header(Kind.CANCEL, slot))
                except RuntimeError:  # the ring broke: the watcher and receiver report it
                    pass

    def _receive(self, ring: Ring) -> None:
        """Hand each token the last stage sends to its request, until STOP or the ring breaks."""
        last = self.num_stages - 1
        try:
            while True:
                values = torch.empty(HEADER_LEN, dtype=torch.int64)
                dist.recv(values, src=last, tag=HEADER_TAG)
                header = Header.decode(values.tolist())
                if header.kind is Kind.STOP:
                    return
                with self._lock:
                    if header.kind is Kind.TOKEN:
                        self._on_token(header)
                    elif header.kind is Kind.RELEASED:
                        self._free(header.slot)
                    else:
                        raise EngineFailed(f"the last stage sent {header.kind.name} instead of a token")
        except Exception as error:  # noqa: BLE001 - a broken ring fails every request, said once
            broke = f"the inference ring broke: {str(error).splitlines()[0]}"
            self._fail_all(_root_cause(ring) or broke, ring)

    def _on_token(self, header: Header) -> None:
        held = self._slots.get(header.slot)
        if held is None:
            raise EngineFailed(f"a token came back for slot {header.slot}, which holds no request")
        stream, request = held.stream, held.stream.request
        if not held.ended:
            if stream.first_token_at is None:
                stream.first_token_at = time.perf_counter()
            if stream.cancelled:
                held.ended = True
                stream.items.put(("end", "cancelled"))
            else:
                stream.items.put(("token", header.token))
                if header.extra:
                    held.ended = True
                    stream.items.put(("end", "stop" if header.token in request.stop_token_ids else "length"))
        if header.extra:  # the sequence's last token: no DECODE follows, every stage may drop it
            self._send(Header(Kind.RELEASE, header.slot))
            self._free(header.slot)

    def _free(self, slot: int) -> None:
        """The slot is free on every stage: end its stream if it still waits, take the next request."""
        held = self._slots.pop(slot, None)
        if held is not None and not held.ended:
            held.stream.items.put(("end", "cancelled"))
        self._admit_waiting()

    def _fail_all(self, message: str, ring: Ring | None = None) -> None:
        """Fail every request in flight or waiting with ``message`` and stop the stages (then start
        them again, with ``restart``). ``ring``: the ring that broke; a call about a ring already
        replaced is ignored."""
        with self._lock:
            if ring is not None and ring is not self._ring:
                return
            first = self._failure is None and not self._closing
            if first:
                self._failure = message
                self._last_failure = message
            failure = self._failure or message
            streams = [slot.stream for slot in self._slots.values() if not slot.ended] + list(self._waiting)
            self._slots.clear()
            self._waiting.clear()
            broken = self._ring
        for stream in streams:
            stream.items.put(("error", failure))
        if not self._closing and broken is not None:
            broken.stop()
            if first and self.restart:
                self._restart_due.set()

    def _restarter(self) -> None:
        """Start the ring again each time it fails, until the engine closes. One thread for the
        engine's life: a stage dies with the thread that started it (PR_SET_PDEATHSIG is per
        thread), so the stages of a new ring must not be started by a thread that then ends."""
        while not self._closing:
            if self._restart_due.wait(timeout=_WATCH_INTERVAL_S):
                self._restart_due.clear()
                if not self._closing:
                    self._start_again()

    def _start_again(self) -> None:
        """Replace a failed ring with a fresh one: new processes (placed again: on the mesh, over the
        members online now), a new store and key. Until it is up, new requests are refused with the
        failure's line; then it serves."""
        self._receiver.join(timeout=_STOP_WAIT_S)
        self._watcher.join(timeout=_STOP_WAIT_S)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:
                pass
        for attempt in range(_RESTART_TRIES):
            if self._closing:
                return
            with self._lock:
                self._sends.clear()
                self._ring = None
            try:
                self._start(self._timeout_s)
            except ShardpoolError as error:
                log.warning("the inference ring did not start again (try %d): %s", attempt + 1, error)
                time.sleep(2.0 * (attempt + 1))
                continue
            with self._lock:
                self.restarts += 1
                self._failure = None
            log.warning("the inference ring started again after: %s", self._last_failure)
            return

    def _watch(self, ring: Ring) -> None:
        """Notice a stage of ``ring`` that died or a member that was lost: the ring may not break at
        once, its neighbours wait."""
        while not self._closing and ring is self._ring:
            if ring.failure() is not None:
                self._fail_all(_root_cause(ring) or "a stage ended", ring)
                return
            time.sleep(_WATCH_INTERVAL_S)


def _ring_failure(ring: Ring | None) -> str | None:
    return None if ring is None else ring.failure()


def _root_cause(ring: Ring) -> str | None:
    """The ring's failure once its root cause had time to show (``ring.settle_s``): the stage that
    died or the member that was lost, rather than a neighbour that only lost its peer."""
    deadline = time.monotonic() + ring.settle_s
    while time.monotonic() < deadline:
        time.sleep(0.1)
        cause = ring.failure()
        if cause is not None and ("killed by signal" in cause or "was lost" in cause):
            return cause
    return ring.failure()


def target_inputs(target: Target) -> dict[str, str]:
    """The ring's inputs by name: the base model's config and weights, and the adapter's files."""
    inputs = {MODEL_PREFIX + "config.json": str(target.model_dir / "config.json")}
    for path in sorted(target.model_dir.glob("*.safetensors")):
        inputs[MODEL_PREFIX + path.name] = str(path)
    if target.adapter_dir is not None:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            inputs[ADAPTER_PREFIX + name] = str(target.adapter_dir / name)
    return inputs


def _fresh_group_names() -> None:
    """Name the next default group as a fresh process names its first: "0".

    torch names each process group by a per-process counter and keys its rendezvous under that
    name; a failed ``init_process_group`` (an earlier ring that never formed) leaves the counter
    raised, and the driver would then wait under "1/..." for stages that write under "0/...".
    The stages are fresh processes, so the driver starts its count again too (there is no public
    API for it; ``destroy_process_group`` resets the same counter after a ring that did form).
    """
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and not dist.is_initialized() and hasattr(world, "group_count"):
        world.group_count = 0
