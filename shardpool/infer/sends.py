"""Sends in flight on the inference ring, each with the tensor gloo reads until it is waited for.

A gloo send completes only once its receiver has posted the receive, so a rank that waited on
each send would stall on a busy neighbour (and the ring could deadlock). The driver and the stages
start their sends (``isend``) and keep them here: past ``cap`` the oldest is waited for, and
:meth:`PendingSends.finish` waits for the rest before the process group goes.
"""

from __future__ import annotations

import collections
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PendingSends"]


class PendingSends:
    """Started sends, oldest first; each keeps its tensor alive until it has been waited for."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._pending: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()

    def start(self, tensor: torch.Tensor, destination: int, tag: int = 0) -> None:
        """Send ``tensor`` to rank ``destination`` on ``tag``, first waiting for the oldest sends
        past the cap (which raises if one failed)."""
        while len(self._pending) >= self.cap:
            self._pending.popleft()[0].wait()
        self._pending.append((dist.isend(tensor, dst=destination, tag=tag), tensor))

    def finish(self, timeout_s: float | None = None, *, failures_ok: bool = False) -> None:
        """Wait for every pending send, oldest first. ``failures_ok``: a send whose receiver is
        gone (its stage stopped) is dropped instead of raising."""
        while self._pending:
            work, _tensor = self._pending.popleft()
            try:
                if timeout_s is None:
                    work.wait()
                else:
                    work.wait(timeout=timedelta(seconds=timeout_s))
            except RuntimeError:
                if not failures_ok:
                    raise

    def clear(self) -> None:
        """Forget every pending send without waiting (their process group is already gone)."""
        self._pending.clear()
