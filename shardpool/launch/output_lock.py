"""One run at a time per ``output_dir``: an ``fcntl.flock`` on ``output_dir/.shardpool.lock``.

Two runs writing one output directory would interleave checkpoints, metrics and the adapter. A
run holds the lock from before it writes anything until it ends; a second run is refused in one
line that names the holder (pid, user, host, start time), which the holder writes into the lock
file. The kernel drops the lock when the holder's file is closed or its process dies (SIGKILL
included), so a lock file left behind by a finished run never blocks the next one: what counts
is the flock, not the file.

The holder's details are published with one rename (:class:`mesh.files.AtomicFile`), so a reader
sees the old holder or the new one, never part of one. The new file is locked before the rename,
and a run that locked a file no longer at the path (replaced meanwhile) tries again on the new one.
"""

from __future__ import annotations

import fcntl
import getpass
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mesh.files import AtomicFile
from shardpool.errors import ShardpoolError

__all__ = ["LOCK_FILE", "OutputDirBusy", "holder_line", "locked_output_dir"]

#: The lock file's name inside ``output_dir``.
LOCK_FILE = ".shardpool.lock"
_ATTEMPTS = 20


class OutputDirBusy(ShardpoolError):
    """Another run holds ``output_dir``."""


@contextmanager
def locked_output_dir(output_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """Hold ``output_dir`` (created if absent) for this run until the block ends; yield the lock file.

    Raises :class:`OutputDirBusy` in one line naming the holder when another run holds it.
    """
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = _acquire(path)
    try:
        fd = _publish_holder(path, fd)
        yield path
    finally:
        os.close(fd)


def _acquire(path: Path) -> int:
    """An open descriptor of the file now at ``path``, flocked by us; refuse if another run holds it."""
    for _ in range(_ATTEMPTS):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputDirBusy(_busy_line(path)) from None
        except BaseException:
            os.close(fd)
            raise
        if _is_current(fd, path):
            return fd
        os.close(fd)  # the holder replaced the file while we locked the old one: lock the new one
    raise OutputDirBusy(_busy_line(path))


def _publish_holder(path: Path, held: int) -> int:
    """Replace the lock file with one naming this run, locked before it appears; return its descriptor.

    The descriptor of the old file (``held``) is closed once the new one is in place.
    """
    with AtomicFile(path) as staged:
        staged.write(json.dumps(_holder()).encode("utf-8"))
        fd = os.open(staged.temp_path, os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            staged.commit()
        except BaseException:
            os.close(fd)
            raise
    os.close(held)
    return fd


def _is_current(fd: int, path: Path) -> bool:
    try:
        now = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)


def _holder() -> dict[str, Any]:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return {
        "pid": os.getpid(),
        "user": user,
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }


def holder_line(path: Path) -> str:
    """Who holds the lock file at ``path``, as its holder wrote it: ``pid 12, user ann, host gpu1, since ...``."""
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        holder = None
    if not isinstance(holder, dict):
        return "holder unknown"
    parts = [f"{key} {holder[key]}" for key in ("pid", "user", "host") if key in holder]
    if "started" in holder:
        parts.append(f"since {holder['started']}")
    return ", ".join(parts) or "holder unknown"


def _busy_line(path: Path) -> str:
    return (
        f"output_dir {path.parent} is in use by another run ({holder_line(path)}); wait for it to "
        f"finish or stop it, or set another `output_dir`"
    )
