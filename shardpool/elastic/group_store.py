"""The rendezvous store as torch's own process-group rendezvous sees it: sealed like every message.

``torch.distributed.init_process_group`` and ``new_group`` publish and read each rank's gloo
address through the store they are given. :class:`GroupStore` is a ``torch.distributed.Store``
written in Python that passes every call to a :class:`~shardpool.elastic.messages.ControlStore`,
so those addresses are sealed and checked like the job's own messages: a process outside the job
cannot point a rank at an address of its choosing.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from shardpool.elastic.messages import ControlStore

__all__ = ["GroupStore"]


class GroupStore(dist.Store):  # type: ignore[misc]
    """A ``torch.distributed.Store`` over ``control``: values sealed on set, checked on get."""

    def __init__(self, control: ControlStore) -> None:
        super().__init__()
        self._control = control

    def set(self, key: str, value: str | bytes) -> None:
        """Seal and set ``value`` (torch passes bytes or str)."""
        self._control.set(key, value)

    def get(self, key: str) -> bytes:
        """The value at ``key`` once one that passes its MAC is there (forged ones are waited past)."""
        return self._control.get(key)

    def add(self, key: str, amount: int) -> int:
        """A counter: passes through unsealed."""
        return self._control.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        """Whether every key is set."""
        return self._control.check(list(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Wait until every key is set."""
        self._control.wait(list(keys), timeout)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``."""
        return self._control.delete_key(key)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Not offered: a sealed value cannot be compared with an unsealed expectation."""
        raise RuntimeError("shardpool's rendezvous store does not offer compare_set")
