"""A machine-wide lock that lets one xdist worker run a test while the others wait between theirs.

A readers-writer lock on two ``flock`` files: every test takes the ``.rw`` file shared, a test that
needs a quiet machine (``timing``) takes it exclusively. The ``.gate`` file gives the exclusive
side priority: a waiting writer holds the gate, so readers cannot keep taking turns past it.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["machine_lock"]


@contextmanager
def machine_lock(stem: Path, *, exclusive: bool) -> Iterator[None]:
    """Hold ``stem``'s lock, ``exclusive`` or shared, for the body of the ``with``.

    The lock files are empty; opening them for append creates them and never changes what another
    worker holds.
    """
    with open(stem.with_suffix(".gate"), "a") as gate, open(stem.with_suffix(".rw"), "a") as rw:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(rw, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(rw, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)
