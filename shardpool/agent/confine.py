"""Keep a stage process's writes inside its job: Linux Landlock, applied in the child before exec.

A stage runs under its job's own unprivileged uid, which on its own could still write wherever
any user may (``/tmp``, ``/var/tmp``). Landlock, a Linux security module that an unprivileged
process can apply to itself and its children, takes every filesystem write right away except
beneath the directories given: the job directory, the shared fetch cache, and ``/dev``
(``/dev/null``, ``/dev/shm`` for NCCL, the GPU device files).
Reading is left alone: a stage reads the Python installation, its libraries and the drivers.

The rules are made with three system calls through ctypes (no library wraps them for Python).
On a kernel without Landlock (before 5.13, or with the module off), :func:`landlock_abi` is 0
and the agent says so once in its log: jobs still run under their own unprivileged uid in a 0700
directory, only without this second fence (docs/security.md lists it as a residual risk).
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["WRITE_RIGHTS_ABI1", "landlock_abi", "restrict_writes", "stage_writable_dirs", "write_rights"]

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # the same on every Linux arch
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

#: WRITE_FILE, REMOVE_DIR, REMOVE_FILE and every MAKE_* right (char, dir, reg, sock, fifo, block, sym).
WRITE_RIGHTS_ABI1 = (1 << 1) | (1 << 4) | (1 << 5) | sum(1 << bit for bit in range(6, 13))
_REFER = 1 << 13  # ABI 2: link or rename a file into another directory
_TRUNCATE = 1 << 14  # ABI 3

_libc: ctypes.CDLL | None = None


def _syscall() -> Callable[..., int]:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc.syscall  # type: ignore[no-any-return]


def landlock_abi() -> int:
    """The Landlock ABI version this kernel offers, or 0 where there is none (or not Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    version = _syscall()(
        _SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION)
    )
    return max(0, int(version))


def write_rights(abi: int) -> int:
    """Every write-like filesystem right the given Landlock ABI knows."""
    rights = WRITE_RIGHTS_ABI1
    if abi >= 2:
        rights |= _REFER
    if abi >= 3:
        rights |= _TRUNCATE
    return rights


def restrict_writes(writable: Sequence[str | os.PathLike[str]], abi: int) -> None:
    """Forbid this process (and all it starts) every filesystem write outside ``writable``.

    Meant to run in a child between fork and exec (a ``preexec_fn``). Raises OSError when a
    system call fails, so that a stage that could not be fenced does not start.
    """
    syscall = _syscall()
    rights = write_rights(abi)
    attr = ctypes.create_string_buffer(struct.pack("=Q", rights))
    ruleset = syscall(_SYS_CREATE_RULESET, attr, ctypes.c_size_t(len(attr.raw)), ctypes.c_uint32(0))
    if ruleset < 0:
        _raise("landlock_create_ruleset")
    try:
        for directory in writable:
            fd = os.open(directory, os.O_PATH | os.O_CLOEXEC | os.O_DIRECTORY)
            try:
                rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd))
                if (
                    syscall(
                        _SYS_ADD_RULE, ruleset, ctypes.c_int(_RULE_PATH_BENEATH), rule, ctypes.c_uint32(0)
                    )
                    < 0
                ):
                    _raise(f"landlock_add_rule({directory})")
            finally:
                os.close(fd)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            _raise("prctl(PR_SET_NO_NEW_PRIVS)")
        if syscall(_SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) < 0:
            _raise("landlock_restrict_self")
    finally:
        os.close(ruleset)


def _raise(what: str) -> None:
    errno = ctypes.get_errno()
    raise OSError(errno, f"{what}: {os.strerror(errno)}")


def stage_writable_dirs(job_dir: Path, cache_dir: Path) -> list[str]:
    """Where a stage may write: its job directory, the shared fetch cache, and ``/dev``."""
    return [str(job_dir), str(cache_dir), "/dev"]
