"""Local accounts: who may launch jobs through the agent, and the unprivileged accounts jobs run as.

The agent runs as root, because it reads the member's WireGuard key to sign requests. Nothing it
starts does: the device profiler runs as the run-as account (a system user, ``shardpool`` by
default), and each job's stages under a uid of their own (:class:`JobUids`, from a range no
passwd entry uses, as systemd's ``DynamicUser`` does) with the run-as account's group, in a 0700
directory that uid owns, so one job's stages can never read another job's secret, model or
output; the uid is taken back once nothing runs under it. Who may ask for a job is decided from
the uid the kernel reports for the agent's Unix socket peer, never from anything the caller says:
root, or a member of the launch group (``shardpool`` by default).

Every directory the agent makes (work, job, cache, profiler and socket directories) goes through
:func:`make_directory`, which never follows a symbolic link, refuses a directory someone else
owns, and sets owner and mode through the directory's own descriptor: a link planted where the
agent expects a directory can never make root chown or chmod its target.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import secrets
import signal
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from shardpool.errors import ShardpoolError

__all__ = [
    "DEFAULT_JOB_UIDS",
    "DEFAULT_LAUNCH_GROUP",
    "DEFAULT_RUN_AS",
    "Caller",
    "JobUids",
    "LaunchPolicy",
    "RunAs",
    "disown_tree",
    "kill_uid",
    "make_directory",
    "make_tree",
    "resolve_run_as",
    "share_with_group",
    "uids_running",
]

DEFAULT_RUN_AS = "shardpool"
DEFAULT_LAUNCH_GROUP = "shardpool"
#: The uids jobs run as, one per job: systemd's ``DynamicUser`` range, which no passwd entry may use.
DEFAULT_JOB_UIDS = range(61184, 65520)


@dataclass(frozen=True)
class RunAs:
    """An unprivileged account the agent's children run as: the run-as account itself (the device
    profiler), or one job's uid with the run-as account's group (that job's stages)."""

    user: str
    uid: int
    gid: int

    def popen_kwargs(self) -> dict[str, object]:
        """``subprocess.Popen`` arguments that drop to this account (no supplementary groups)."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def make_private_dir(self, path: Path, *, fresh: bool = False) -> Path:
        """Create ``path`` (missing parents root-owned, 0755) and hand it to this account with mode 0700.

        Refused (:func:`make_directory`) when ``path`` is a symbolic link, not a directory, or
        owned by anyone but root or this account; with ``fresh``, FileExistsError when it exists at all.
        """
        make_tree(path.parent)
        return make_directory(path, mode=0o700, owner=(self.uid, self.gid), fresh=fresh)


_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def _planted(path: Path, what: str) -> ShardpoolError:
    return ShardpoolError(
        f"{path} is {what}, where shardpool expects its own directory; remove it (it may have been "
        "planted to redirect the agent) and start again"
    )


def _open_no_link(parent_fd: int, name: str, path: Path) -> int | os.stat_result:
    """Open directory ``name`` under ``parent_fd`` without following a link; a link's own stat instead."""
    try:
        return os.open(name, _DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
    found = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    if not stat.S_ISLNK(found.st_mode):
        raise _planted(path, "not a directory")
    return found


def _open_child(parent_fd: int, name: str, path: Path) -> int:
    """Open directory ``name`` under ``parent_fd``; a symbolic link is followed only when root owns it."""
    opened = _open_no_link(parent_fd, name, path)
    if isinstance(opened, int):
        return opened
    if opened.st_uid != 0:
        raise _planted(path, "a symbolic link made by another user")
    return os.open(name, _DIRECTORY_FLAGS, dir_fd=parent_fd)  # root's own link, e.g. /var/run


def _open_directory(path: Path, *, create: bool) -> int:
    """Open the directory ``path`` from ``/`` down, refusing links other users made on the way;
    with ``create``, make missing components 0755 (this process's own)."""
    fd = os.open("/", _DIRECTORY_FLAGS)
    walked = Path("/")
    try:
        for name in path.parts[1:]:
            walked /= name
            created = False
            if create:
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                    created = True
                except FileExistsError:
                    pass
            child = _open_child(fd, name, walked)
            os.close(fd)
            fd = child
            if created:
                os.fchmod(fd, 0o755)  # whatever the umask: the run-as account must pass through
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_directory(
    path: Path, *, mode: int, owner: tuple[int, int] | None = None, fresh: bool = False
) -> Path:
    """Create the directory ``path`` (its parent must exist), or take the one there, never
    following a symbolic link at ``path`` (nor one another user made above it).

    Refuses (:class:`ShardpoolError`) a link, a non-directory, or a directory owned by anyone but
    root, this process or ``owner``'s uid; with ``fresh``, anything already at ``path`` is a
    FileExistsError (a job's directory is never re-used). With ``owner`` the directory is handed to it with ``mode``;
    without, a directory made here gets ``mode`` and an existing one keeps its own. Owner and mode
    are set through the directory's descriptor, so what is changed is what was checked.
    """
    path = Path(os.path.abspath(path))
    parent_fd = _open_directory(path.parent, create=False)
    try:
        created = True
        try:
            os.mkdir(path.name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            if fresh:
                raise FileExistsError(errno.EEXIST, "a job directory is never re-used", str(path)) from None
            created = False
        fd = _open_no_link(parent_fd, path.name, path)
        if not isinstance(fd, int):
            raise _planted(path, "a symbolic link")
    finally:
        os.close(parent_fd)
    try:
        found = os.fstat(fd)
        trusted = {0, os.geteuid()} | ({owner[0]} if owner is not None else set())
        if found.st_uid not in trusted:
            raise ShardpoolError(
                f"{path} is owned by uid {found.st_uid}, not by root or the account it is for; "
                "remove it (someone else made it) and start again"
            )
        if owner is not None:
            os.fchown(fd, *owner)
        if owner is not None or created:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return path


def make_tree(path: Path) -> Path:
    """Create ``path`` and its missing parents as 0755 directories of this process; existing ones
    are left as they are, but a link another user made on the way is refused."""
    path = Path(os.path.abspath(path))
    os.close(_open_directory(path, create=True))
    return path


def disown_tree(path: Path) -> None:
    """Hand ``path`` and everything beneath it to root (mode kept), never following a link.

    Run once a job's processes are gone, so that a later job given the same uid cannot read
    what this one left (its secret, logs and downloads).
    """
    os.chown(path, 0, 0, follow_symlinks=False)
    for _, dirs, files, fd in os.fwalk(path, follow_symlinks=False):
        for name in [*dirs, *files]:
            os.chown(name, 0, 0, dir_fd=fd, follow_symlinks=False)


def share_with_group(path: Path, gid: int) -> None:
    """Make ``path`` and what it holds read-write for group ``gid`` (directories setgid), never
    following a link: the fetch cache every job's uid shares through the run-as account's group."""
    fd = os.open(path, _DIRECTORY_FLAGS | os.O_NOFOLLOW)
    try:
        os.fchown(fd, -1, gid)
        os.fchmod(fd, 0o2770)
    finally:
        os.close(fd)
    for _, dirs, files, dir_fd in os.fwalk(path, follow_symlinks=False):
        for name in dirs:
            found = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            os.chown(name, -1, gid, dir_fd=dir_fd, follow_symlinks=False)
            os.chmod(name, stat.S_IMODE(found.st_mode) | 0o2070, dir_fd=dir_fd)
        for name in files:
            found = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISREG(found.st_mode):
                os.chown(name, -1, gid, dir_fd=dir_fd, follow_symlinks=False)
                os.chmod(name, stat.S_IMODE(found.st_mode) | 0o060, dir_fd=dir_fd)


@dataclass
class JobUids:
    """Hands each job a uid of its own from ``uids`` and takes it back once nothing runs under it.

    A uid is handed out only when no passwd entry names it and no process runs under it (real,
    effective, saved or filesystem uid). :func:`kill_uid` kills whatever still runs under a job's
    uid (the uid is the job's alone, so nothing else is hit); :meth:`release` then removes its
    ``/dev/shm`` files and frees it.
    """

    uids: range = DEFAULT_JOB_UIDS
    _held: set[int] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self) -> int:
        """A free uid of the range; ShardpoolError when every one is held or in use."""
        named = {entry.pw_uid for entry in pwd.getpwall()}
        with self._lock:
            busy = self._held | named | uids_running()
            free = [uid for uid in self.uids if uid not in busy]
            while free:
                uid = free.pop(secrets.randbelow(len(free)))
                if not _has_passwd_entry(uid):
                    self._held.add(uid)
                    return uid
        raise ShardpoolError(
            f"no free job uid in {self.uids.start}-{self.uids.stop - 1}: every one runs a job; "
            "wait for one to end or widen the range"
        )

    def release(self, uid: int) -> None:
        """Free ``uid`` once nothing runs under it (:func:`kill_uid` returned 0), clearing its
        ``/dev/shm`` files first."""
        _remove_shm_of(uid)
        with self._lock:
            self._held.discard(uid)

    @property
    def held(self) -> frozenset[int]:
        """The uids handed out and not yet reclaimed."""
        with self._lock:
            return frozenset(self._held)


def _has_passwd_entry(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def _uids_of(pid: str) -> set[int]:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Uid:"):
                    return {int(x) for x in line.split()[1:5]}
    except (OSError, ValueError):
        pass
    return set()


def uids_running() -> set[int]:
    """Every uid (real, effective, saved or filesystem) some process on this machine runs under."""
    running: set[int] = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            running |= _uids_of(pid)
    return running


def kill_uid(uid: int) -> int:
    """SIGKILL every process running under ``uid``; the number found (0: none was left).

    Each process is pinned with a pidfd and its uid checked again through it, so a pid re-used
    by another process meanwhile is never signalled.
    """
    found = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or uid not in _uids_of(pid):
            continue
        try:
            pidfd = os.pidfd_open(int(pid))
        except OSError:
            continue
        try:
            if uid in _uids_of(pid):
                found += 1
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(pidfd)
    return found


def _remove_shm_of(uid: int) -> None:
    try:
        entries = list(os.scandir("/dev/shm"))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.stat(follow_symlinks=False).st_uid == uid and not entry.is_dir(follow_symlinks=False):
                os.unlink(entry.path)
        except OSError:
            pass


def resolve_run_as(user: str, *, python: str = sys.executable, check_python: bool = True) -> RunAs:
    """Look up the run-as account and refuse root, a missing user, or one that cannot run Python.

    The Python check runs the interpreter once as that user, because a virtual environment under
    a 0700 home directory is the usual reason stages would fail to start.
    """
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ShardpoolError(
            f"run-as user {user!r} does not exist; create it with "
            f"`useradd --system --user-group --no-create-home --shell /usr/sbin/nologin {user}` "
            "or pass --run-as USER"
        ) from None
    if entry.pw_uid == 0:
        raise ShardpoolError(f"run-as user {user!r} is root; jobs never run as root, pass --run-as USER")
    account = RunAs(user, entry.pw_uid, entry.pw_gid)
    if check_python:
        _check_can_run_python(account, python)
    return account


def _check_can_run_python(account: RunAs, python: str) -> None:
    try:
        result = subprocess.run(
            [python, "-c", "import shardpool"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
            env={
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
            },
            **account.popen_kwargs(),  # type: ignore[arg-type]
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        reason = str(error)
    else:
        if result.returncode == 0:
            return
        reason = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
    raise ShardpoolError(
        f"run-as user {account.user!r} cannot run {python} with shardpool ({reason}); install shardpool "
        "where that user can read it (e.g. a virtual environment under /opt)"
    )


@dataclass(frozen=True)
class Caller:
    """A local user on the agent's Unix socket, as the kernel reports it."""

    uid: int
    gid: int
    pid: int

    @property
    def user(self) -> str:
        """The caller's user name (the uid as text if it has no passwd entry)."""
        try:
            return pwd.getpwuid(self.uid).pw_name
        except KeyError:
            return str(self.uid)

    @property
    def is_root(self) -> bool:
        """Whether the caller is root (who may stop anyone's job)."""
        return self.uid == 0


@dataclass(frozen=True)
class LaunchPolicy:
    """Who may submit and manage jobs through the local agent: root or the members of ``group``.

    ``denied_uids`` are refused even when in the group: the run-as account and every job uid
    (``job_uids``), so that a stage process can never submit jobs of its own.
    """

    group: str = DEFAULT_LAUNCH_GROUP
    denied_uids: frozenset[int] = frozenset()
    job_uids: range = DEFAULT_JOB_UIDS

    def allows(self, caller: Caller) -> bool:
        """Whether ``caller`` may launch: root, or in the group (primary or supplementary)."""
        if caller.is_root:
            return True
        if caller.uid in self.denied_uids or caller.uid in self.job_uids:
            return False
        try:
            entry = grp.getgrnam(self.group)
        except KeyError:
            return False
        if caller.gid == entry.gr_gid:
            return True
        try:
            user = pwd.getpwuid(caller.uid)
        except KeyError:
            return False
        return user.pw_gid == entry.gr_gid or user.pw_name in entry.gr_mem

    def refusal(self, caller: Caller) -> str:
        """The one-line reason a caller is refused, with the fix."""
        if caller.uid in self.denied_uids or caller.uid in self.job_uids:
            return f"user {caller.user!r} runs job stages and may not launch jobs itself"
        return (
            f"user {caller.user!r} may not launch shardpool jobs on this machine; "
            f"ask an admin to run `usermod -aG {self.group} {caller.user}` (then log in again)"
        )
