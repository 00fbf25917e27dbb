"""A child process (``spawn``) that runs functions for this one: where measuring must not leave
anything in the measuring process (an accelerator's context) or must run beside other processes
(CPU stages sharing a host, :mod:`shardpool.plan.co_run`).
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

__all__ = ["MeasuringProcess"]

#: How long a child told to stop may take to exit before it is killed.
_STOP_GRACE_S = 10.0

_Result = TypeVar("_Result")


class MeasuringProcess:
    """One child process (``spawn``) that runs functions for this process and hands back their results.

    Functions, arguments, results and exceptions cross a pipe pickled (a function by its import
    path). A child that dies during a call is a ShardpoolError here. The child dies with this
    process (``PR_SET_PDEATHSIG`` on Linux, for the thread that started it), ignores Ctrl-C (this
    process decides, and :meth:`close` ends it), and sends what it prints on stdout to stderr
    (stdout may carry this process's events, ``finetune --json``).
    """

    def __init__(self, purpose: str = "this machine's accelerators") -> None:
        self.purpose = purpose  # what the child measures, for the line said when it dies
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
        self.send(function, *args, **kwargs)
        return self.receive()  # type: ignore[no-any-return]

    def send(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Start ``function(*args, **kwargs)`` in the child without waiting for it (several children
        then compute at once); :meth:`receive` takes its result."""
        if self._closed:
            raise ShardpoolError("the measuring process was closed; measure inside its `with` block")
        try:
            self._connection.send((function, args, kwargs))
        except OSError:
            raise ShardpoolError(self._death_line()) from None

    def receive(self) -> Any:
        """The result of the function last sent, once the child has run it; its exception is raised here."""
        try:
            if self._connection not in wait([self._connection, self._process.sentinel]):
                raise EOFError  # the child exited without a word
            status, value = self._connection.recv()  # a child that died has closed its end: EOFError
        except (EOFError, OSError):
            raise ShardpoolError(self._death_line()) from None
        if status == "error":
            raise value
        return value

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
            f"the process measuring {self.purpose} {how} before it answered (a crashed "
            "driver, or out of memory); run `shardpool devices` to check each device"
        )


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
