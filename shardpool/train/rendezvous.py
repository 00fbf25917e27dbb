"""The rendezvous store: where a run's stage processes first meet, hosted by the launcher.

Only the launcher imports this module; a stage process joins the store with a plain
``torch.distributed.TCPStore`` client. Any local user can reach the store too, so both sides
seal every value they set and check every value they read
(:class:`shardpool.elastic.messages.ControlStore`, over the store this module hosts).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from mesh.errors import MeshError
from mesh.http.transport import listen_tcp
from shardpool.errors import ShardpoolError

__all__ = ["rendezvous_store"]


def rendezvous_store(host: str, *, port: int = 0, timeout_s: float = 300.0) -> Any:
    """The torch.distributed TCPStore the stage processes meet at, hosted by the launcher.

    Hosting it there (not in rank 0) lets the OS pick a free port (``port=0``), and keeps rendezvous
    on the launcher's address whichever machine runs stage 0. The store listens on ``host`` only
    (the launcher's mesh address, or loopback): torch's own master socket would listen on every
    interface, so this creates the listening socket itself and hands it over as
    ``master_listen_fd``. The store owns that socket from then on and closes it when it is freed.
    """
    try:
        listener = listen_tcp(host, port)
    except MeshError as error:
        raise ShardpoolError(f"cannot host the rendezvous store: {error}") from None
    bound_port = listener.getsockname()[1]
    fd = listener.detach()
    try:
        return dist.TCPStore(
            host,
            bound_port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=fd,
        )
    except BaseException:
        _close_quietly(fd)
        raise


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass  # the store already closed it
