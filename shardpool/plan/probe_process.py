"""Measure this machine's accelerators in a child process, so that no training process keeps their memory.

Measuring a GPU creates a CUDA (or XPU, MPS) context on it, a few hundred MiB, and leaves the
profiled layer in torch's caching allocator. A process that measures and then trains (rank 0
under torchrun) or waits for its stage processes (the local launcher) would hold both for the
whole run: memory the plan counted as free. So ``shardpool finetune`` and torchrun's rank 0
measure through :class:`ProcessProbe`: discovery, the NF4 probe and the layer profile of each
accelerator run in one child process, started with ``spawn`` (a fresh interpreter, so no CUDA
state crosses either way), which ends with the planning (the ``with`` block), before any stage
starts. The CPU is measured in this process as before (:func:`measured_in_child`): it keeps no
context, and a CPU-only plan pays for no child. The child reads and writes the same profile
cache (``profiles.json``) as this process.

``shardpool plan`` and ``shardpool devices`` measure in their own process: they exit when they
have printed, and no stage ever runs in them.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from types import TracebackType
from typing import Any, TypeVar

from shardpool.errors import ShardpoolError
from shardpool.model.shape import ModelShape
from shardpool.plan.costmodel import Workload
from shardpool.plan.device_facts import DeviceInfo, LayerProfile, device_kind
from shardpool.plan.fleet import LinkSpec

__all__ = ["MeasuringProcess", "ProcessProbe", "measured_in_child"]

#: How long a child told to stop may take to exit before it is killed.
_STOP_GRACE_S = 10.0

_Result = TypeVar("_Result")


def measured_in_child(device: str) -> bool:
    """Whether ``device`` is measured in the child process: every accelerator (``cuda``, ``xpu``,
    ``mps``, any index), since measuring one leaves a context and cached memory on it; the CPU
    keeps nothing of the kind, so it is measured in this process."""
    return device_kind(device) != "cpu"


class MeasuringProcess:
    """One child process (``spawn``) that runs functions for this process and hands back their results.

    Functions, arguments, results and exceptions cross a pipe pickled (a function by its import
    path). A child that dies during a call is a ShardpoolError here. The child dies with this
    process (``PR_SET_PDEATHSIG`` on Linux, for the thread that started it), ignores Ctrl-C (this
    process decides, and :meth:`close` ends it), and sends what it prints on stdout to stderr
    (stdout may carry this process's events, ``finetune --json``).
    """

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._connection, child_end = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child_end, os.getpid()), name="shardpool-measure", daemon=True
        )
        self._process.start()
        child_end.close()
        self.pid: int = self._process.pid or 0
        self._closed = False

    def call(self, function: Callable[..., _Result], *args: Any, **kwargs: Any) -> _Result:
        """``function(*args, **kwargs)`` run in the child; its exception is raised here."""
        if self._closed:
            raise ShardpoolError("the measuring process was closed; measure inside its `with` block")
        try:
            self._connection.send((function, args, kwargs))
            if self._connection not in wait([self._connection, self._process.sentinel]):
                raise EOFError  # the child exited without a word
            status, value = self._connection.recv()  # a child that died has closed its end: EOFError
        except (EOFError, OSError):
            raise ShardpoolError(self._death_line()) from None
        if status == "error":
            raise value
        return value  # type: ignore[no-any-return]

    def close(self, *, at_once: bool = False) -> None:
        """End the child: asked to stop (it finishes nothing further), or ``at_once`` (an error or an
        interrupt here) terminated; either way killed if it has not exited in a few seconds."""
        if self._closed:
            return
        self._closed = True
        if not at_once:
            try:
                self._connection.send(None)
            except OSError:
                pass  # already gone
            self._process.join(_STOP_GRACE_S)
        if self._process.exitcode is None:
            self._process.terminate()
            self._process.join(_STOP_GRACE_S)
        if self._process.exitcode is None:
            self._process.kill()
            self._process.join()
        self._connection.close()
        self._process.close()

    def __enter__(self) -> MeasuringProcess:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close(at_once=error is not None)

    def _death_line(self) -> str:
        """Why the child did not answer, in one line with what to do."""
        self._process.join(_STOP_GRACE_S)
        code = self._process.exitcode
        how = (
            "is still running but closed its pipe"
            if code is None
            else f"was killed by signal {-code}"
            if code < 0
            else f"exited with status {code}"
        )
        return (
            f"the process measuring this machine's accelerators {how} before it answered (a crashed "
            "driver, or out of memory); run `shardpool devices` to check each device"
        )


class ProcessProbe:
    """The :class:`~shardpool.plan.local_fleet.DeviceProbe` of a process that goes on to train or to
    wait for its stages: accelerators measured in a :class:`MeasuringProcess`, the CPU here.

    The child starts at the first accelerator measured and ends when the ``with`` block does (or
    at :meth:`close`), so measure inside the block and start stages after it; a probe used again
    later starts a new child. ``in_child`` chooses the devices measured in the child (default
    :func:`measured_in_child`); ``use_cache`` is :class:`~shardpool.plan.profiler.TorchProbe`'s.
    """

    def __init__(
        self, *, use_cache: bool = True, in_child: Callable[[str], bool] = measured_in_child
    ) -> None:
        self.use_cache = use_cache
        self.in_child = in_child
        self._child: MeasuringProcess | None = None

    def device_info(self, name: str) -> DeviceInfo:
        """Kind, label, free memory and (CPU) threads of a local device."""
        return self._measure(name, _device_info, name, self.use_cache)

    def profile_layer(
        self, shape: ModelShape, workload: Workload, *, device: str, threads: int | None
    ) -> LayerProfile:
        """One decoder layer profiled on ``device`` (see :func:`shardpool.plan.profiler.profile_layer`)."""
        return self._measure(device, _profile_layer, shape, workload, device, threads, self.use_cache)

    def loopback(self) -> LinkSpec:
        """The measured link between two stages on this machine (TCP over 127.0.0.1: no device touched)."""
        from shardpool.plan.profiler import TorchProbe

        return TorchProbe(use_cache=self.use_cache).loopback()

    def co_run_slowdown(self, copies: int, threads: int) -> float:
        """How much slower ``copies`` CPU stages compute side by side than alone, measured in this
        process (the CPU keeps no context; see :mod:`shardpool.plan.co_run`)."""
        from shardpool.plan.co_run import co_run_slowdown

        return co_run_slowdown(copies, threads, use_cache=self.use_cache)

    def close(self, *, at_once: bool = False) -> None:
        """End the measuring child, if one was started (see :meth:`MeasuringProcess.close`)."""
        child, self._child = self._child, None
        if child is not None:
            child.close(at_once=at_once)

    def __enter__(self) -> ProcessProbe:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close(at_once=error is not None)

    def _measure(self, device: str, function: Callable[..., _Result], *args: Any) -> _Result:
        """``function(*args)`` in the child when ``device`` is measured there, else here."""
        if not self.in_child(device):
            return function(*args)
        if self._child is None:
            self._child = MeasuringProcess()
        return self._child.call(function, *args)


# ---------------------------------------------------------------------------- what is measured


def _device_info(name: str, use_cache: bool) -> DeviceInfo:
    from shardpool.plan.profiler import TorchProbe

    return TorchProbe(use_cache=use_cache).device_info(name)


def _profile_layer(
    shape: ModelShape, workload: Workload, device: str, threads: int | None, use_cache: bool
) -> LayerProfile:
    """The layer profile, after which the profiled layer's memory goes back to the device: a later
    :func:`_device_info` of the same device (a second stage on it) then sees it free again."""
    import gc

    import torch

    from shardpool.plan.profiler import TorchProbe

    profile = TorchProbe(use_cache=use_cache).profile_layer(shape, workload, device=device, threads=threads)
    gc.collect()
    backend = {"cuda": torch.cuda, "xpu": getattr(torch, "xpu", None), "mps": torch.mps}.get(
        device_kind(device)
    )
    if backend is not None:
        backend.empty_cache()
    return profile


# ---------------------------------------------------------------------------- the child


def _serve(connection: Connection, parent: int) -> None:
    """The child's loop: run each ``(function, args, kwargs)`` received, send back ``("ok", result)``
    or ``("error", exception)``; return on ``None`` or when this process's parent is gone."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    while True:
        try:
            request = connection.recv()
        except EOFError:
            return
        if request is None:
            return
        function, args, kwargs = request
        try:
            reply: tuple[str, Any] = ("ok", function(*args, **kwargs))
        except Exception as error:  # noqa: BLE001 - every failure goes back to the parent, which raises it
            reply = ("error", _portable(error))
        connection.send(reply)


def _portable(error: Exception) -> Exception:
    """``error`` as it can cross the pipe: itself (with the child's traceback as a note, unless it is
    a ShardpoolError, whose one line is the whole story), or its one line as a ShardpoolError where
    it does not survive pickling."""
    if not isinstance(error, ShardpoolError):
        error.add_note("in the measuring process:\n" + "".join(traceback.format_exception(error)).rstrip())
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any exception type that cannot be rebuilt on the other side
        return ShardpoolError(f"{type(error).__name__}: {error}")
    return error
