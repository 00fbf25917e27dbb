"""A stage's side of keeping a run alive across a lost member: its beat and its step-boundary copies.

With :attr:`Job.keep_state <shardpool.contract.job.Job.keep_state>` (the launcher sets it for mesh
runs with ``on_member_loss: continue``), a stage process

* **beats** (:func:`start_beat`): a daemon thread sets :func:`~shardpool.elastic.messages.beat_key`
  of its rank to its next sealed beat number (:func:`~shardpool.elastic.messages.encode_beat`)
  every :data:`~shardpool.contract.liveness.BEAT_INTERVAL_S` on the launcher's rendezvous store,
  through a sealing store client of its own. A stopped process stops beating; a launcher
  that is gone ends the thread quietly (the stage's own collectives then time out).
* **copies its step-boundary state** (:class:`StateCopier`): after every optimizer step the worker
  hands CPU clones of its checkpoint files to a background thread, which writes them into
  :func:`~shardpool.contract.liveness.live_dir` through the same :class:`RunFiles` channel as
  checkpoints and then adds 1 to :func:`~shardpool.elastic.messages.live_key`. One copy is in
  flight at a time; a copy that fails is logged on stderr (the rank's log) and training goes on.

The copy's files have a checkpoint's names (``stage-i.safetensors``, ``rng-rank-r.safetensors``), so
the launcher can rename a complete ``live_dir(N)`` to ``checkpoints/checkpoint-N.partial``, finalize
it and resume from it like any checkpoint.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardpool.contract.liveness import BEAT_INTERVAL_S, live_dir
from shardpool.elastic.messages import beat_key, encode_beat, live_key
from shardpool.train.runfiles import RunFiles

__all__ = ["StateCopier", "beat", "start_beat", "store_client"]

#: How long a beat or copy store client waits for the launcher's store before it gives up.
STORE_TIMEOUT_S = 10.0

StoreFactory = Callable[[], Any]


def store_client(addr: str, port: int, *, timeout_s: float = STORE_TIMEOUT_S) -> StoreFactory:
    """A factory of new clients of the launcher's rendezvous store (one per thread that uses it)."""

    def connect() -> Any:
        return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))

    return connect


def beat(
    connect: StoreFactory,
    rank: int,
    stop: threading.Event,
    *,
    interval_s: float = BEAT_INTERVAL_S,
    key: Callable[[], str] | None = None,
) -> None:
    """Set ``beat_key(rank)`` (or ``key()``, read afresh each beat: a job that grows in place
    renumbers its ranks) to the next beat number, 1, 2, ..., every ``interval_s`` until ``stop`` is
    set or the store is gone. ``connect`` gives a sealing client
    (:class:`~shardpool.elastic.messages.ControlStore`): only the rank can raise its number.

    A failure (no store, launcher gone) ends the loop without raising: a missing beat is exactly
    what the launcher watches for, and the stage must not fail because of it.
    """
    current_key = key if key is not None else (lambda: beat_key(rank))
    try:
        store = connect()
        count = 0
        while not stop.is_set():
            count += 1
            store.set(current_key(), encode_beat(count))
            stop.wait(interval_s)
    except Exception as error:  # noqa: BLE001 - the beat just stops; see the docstring
        print(f"shardpool: rank {rank} stopped beating: {error}", file=sys.stderr, flush=True)


def start_beat(
    connect: StoreFactory,
    rank: int,
    *,
    interval_s: float = BEAT_INTERVAL_S,
    key: Callable[[], str] | None = None,
) -> tuple[threading.Thread, threading.Event]:
    """Start :func:`beat` in a daemon thread; return the thread and the event that stops it."""
    stop = threading.Event()
    thread = threading.Thread(
        target=beat, args=(connect, rank, stop), kwargs={"interval_s": interval_s, "key": key},
        name=f"shardpool-beat-{rank}", daemon=True,
    )  # fmt: skip
    thread.start()
    return thread, stop


def cpu_clones(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU copies of ``tensors`` that later steps cannot change (AdamW updates in place)."""
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in tensors.items()}


class StateCopier:
    """Writes step-boundary copies in one background thread, one copy in flight at a time.

    ``submit(step, files)`` waits for the previous copy, then queues ``files`` (file name → CPU
    tensors, already cloned) for ``live_dir(step)``; the thread writes each file through ``files``
    (a :class:`RunFiles`, whose local writes and uploads are safe next to the main thread's) and
    then adds 1 to ``live_key(step)`` on its own store client. ``bytes_copied`` counts what the
    last copy wrote; ``copy_seconds`` is how long it took from ``submit`` until its files were
    written (the window in which losing this member also loses the step just copied);
    ``cpu_seconds`` is the CPU time the thread spent on it (taken from the stage's compute when
    the cores are busy); ``blocked_seconds`` is what the worker last spent handing a copy over
    (its clones, and waiting for the copy before), between steps; ``failures`` counts copies
    that failed.
    """

    def __init__(self, files: RunFiles, connect: StoreFactory, *, rank: int) -> None:
        self.files = files
        self.rank = rank
        self._connect = connect
        self._store: Any = None
        self._queue: queue.Queue[tuple[int, float, dict[str, dict[str, torch.Tensor]]] | None] = queue.Queue()
        self.bytes_copied = 0
        self.copy_seconds = 0.0
        self.cpu_seconds = 0.0
        self.blocked_seconds = 0.0
        self.failures = 0
        self._thread = threading.Thread(target=self._serve, name=f"shardpool-copy-{rank}", daemon=True)
        self._thread.start()

    def submit(
        self, step: int, files: dict[str, dict[str, torch.Tensor]], *, since: float | None = None
    ) -> None:
        """Queue the copy after ``step`` once the previous one is written; ``since`` (a
        ``time.perf_counter()``, default now) is when the step ended, for ``copy_seconds`` and
        ``blocked_seconds``."""
        started = time.perf_counter() if since is None else since
        self.wait()
        self._queue.put((step, started, files))
        self.blocked_seconds = time.perf_counter() - started

    def wait(self) -> None:
        """Block until every queued copy is written (or has failed)."""
        self._queue.join()

    def close(self) -> None:
        """Wait for the last copy, then end the thread."""
        self.wait()
        self._queue.put(None)
        self._thread.join()

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    self.files.close_connection()
                    return
                self._copy(*item)
            except Exception:  # noqa: BLE001 - a failed copy is loud, never fatal
                self.failures += 1
                step = item[0] if item else "?"
                print(
                    f"shardpool: rank {self.rank}: step-boundary copy after step {step} failed; "
                    "training goes on without it",
                    file=sys.stderr,
                    flush=True,
                )
                traceback.print_exc(file=sys.stderr)
                sys.stderr.flush()
            finally:
                self._queue.task_done()

    def _copy(self, step: int, started: float, files: dict[str, dict[str, torch.Tensor]]) -> None:
        cpu_started = time.thread_time()
        written = 0
        for name, tensors in files.items():
            self.files.save_tensors(f"{live_dir(step)}/{name}", tensors)
            written += sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        # Every file is on the launcher's disk: from here the launcher counts the copy complete.
        written_at = time.perf_counter()
        if self._store is None:
            self._store = self._connect()
        self._store.add(live_key(step), 1)
        self.bytes_copied = written
        self.copy_seconds = written_at - started
        self.cpu_seconds = time.thread_time() - cpu_started
