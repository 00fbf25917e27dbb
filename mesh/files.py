"""The project's one way to write a file: beside the target, synced, then renamed over it.

A crash mid-write leaves either the old file or the new one, never half of one. Every writer in
shardpool and mesh goes through :class:`AtomicFile` (streamed or by path) or :func:`atomic_write`
(bytes in one piece). The temporary file is created with ``O_EXCL`` under a random name, so a
link planted in a shared directory is never followed, and it gets its mode (and owner, when
given) through its descriptor before any byte is written. Without a mode, a file gets the one a
plain ``open()`` would give it: 0666 less the process's umask (:func:`umask_mode`), so a user's
umask 077 keeps their adapters and checkpoints private.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["AtomicFile", "atomic_write", "umask_mode", "write_json"]


def umask_mode(requested: int = 0o666) -> int:
    """``requested`` less this process's umask: the mode ``open()`` would give a new file.

    Read from ``/proc/self/status`` where it is there, because setting the umask to read it
    changes it for every thread for a moment.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return requested & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    current = os.umask(0o022)
    os.umask(current)
    return requested & ~current


class AtomicFile:
    """A file written in pieces, or by a library through :attr:`temp_path`, published by one rename.

    Use it as a context manager and call :meth:`commit` when the content is complete; leaving the
    block without a commit (an exception included) discards the temporary file.
    """

    def __init__(
        self, path: str | os.PathLike[str], mode: int | None = None, *, owner: tuple[int, int] | None = None
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        self.temp_path = Path(temp)
        try:
            os.fchmod(fd, umask_mode() if mode is None else mode)
            if owner is not None:
                os.fchown(fd, *owner)
        except BaseException:
            os.close(fd)
            self.temp_path.unlink(missing_ok=True)
            raise
        self._handle = os.fdopen(fd, "wb")
        self._done = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes."""
        self._handle.write(data)

    def commit(self) -> None:
        """Make what was written (through :meth:`write` or :attr:`temp_path`) the content of ``path``."""
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        os.replace(self.temp_path, self.path)
        self._done = True
        _sync_directory(self.path.parent)

    def abort(self) -> None:
        """Discard the temporary file (nothing happens after :meth:`commit`)."""
        if self._done:
            return
        self._done = True
        self._handle.close()
        self.temp_path.unlink(missing_ok=True)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.abort()


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes,
    mode: int | None = None,
    *,
    owner: tuple[int, int] | None = None,
) -> None:
    """Replace ``path`` with ``data``: readers see the old file or the new one, never part of one."""
    with AtomicFile(path, mode, owner=owner) as file:
        file.write(data)
        file.commit()


def write_json(path: str | os.PathLike[str], value: Any, mode: int = 0o644) -> None:
    """Replace ``path`` with ``value`` as indented, key-sorted JSON."""
    atomic_write(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode("utf-8"), mode)


def _sync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` survive a crash."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
