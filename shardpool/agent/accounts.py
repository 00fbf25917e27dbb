"""Local accounts: who may launch jobs through the agent, and the unprivileged account jobs run as.

The agent runs as root, because it reads the member's WireGuard key to sign requests. Nothing it
starts for a job does: stage processes run as :class:`RunAs` (a system user, ``shardpool`` by
default), in a job directory that account owns with mode 0700. Who may ask for a job is decided
from the uid the kernel reports for the agent's Unix socket peer, never from anything the caller
says: root, or a member of the launch group (``shardpool`` by default).

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
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from shardpool.errors import ShardpoolError

__all__ = [
    "DEFAULT_LAUNCH_GROUP",
    "DEFAULT_RUN_AS",
    "Caller",
    "LaunchPolicy",
    "RunAs",
    "make_directory",
    "make_tree",
    "resolve_run_as",
]

DEFAULT_RUN_AS = "shardpool"
DEFAULT_LAUNCH_GROUP = "shardpool"


@dataclass(frozen=True)
class RunAs:
    """The unprivileged account stage processes run as."""

    user: str
    uid: int
    gid: int

    def popen_kwargs(self) -> dict[str, object]:
        """``subprocess.Popen`` arguments that drop to this account (no supplementary groups)."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def make_private_dir(self, path: Path) -> Path:
        """Create ``path`` (missing parents root-owned, 0755) and hand it to this account with mode 0700.

        Refused (:func:`make_directory`) when ``path`` is a symbolic link, not a directory, or
        owned by anyone but root or this account.
        """
        make_tree(path.parent)
        return make_directory(path, mode=0o700, owner=(self.uid, self.gid))


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


def make_directory(path: Path, *, mode: int, owner: tuple[int, int] | None = None) -> Path:
    """Create the directory ``path`` (its parent must exist), or take the one there, never
    following a symbolic link at ``path`` (nor one another user made above it).

    Refuses (:class:`ShardpoolError`) a link, a non-directory, or a directory owned by anyone but
    root, this process or ``owner``'s uid. With ``owner`` the directory is handed to it with
    ``mode``; without, a directory made here gets ``mode`` and an existing one keeps its own. Owner
    and mode are set through the directory's descriptor, so what is changed is what was checked.
    """
    path = Path(os.path.abspath(path))
    parent_fd = _open_directory(path.parent, create=False)
    try:
        created = True
        try:
            os.mkdir(path.name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
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

    ``denied_uids`` are refused even when in the group: the run-as account, so that a stage
    process can never submit jobs of its own.
    """

    group: str = DEFAULT_LAUNCH_GROUP
    denied_uids: frozenset[int] = frozenset()

    def allows(self, caller: Caller) -> bool:
        """Whether ``caller`` may launch: root, or in the group (primary or supplementary)."""
        if caller.is_root:
            return True
        if caller.uid in self.denied_uids:
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
        if caller.uid in self.denied_uids:
            return f"user {caller.user!r} runs job stages and may not launch jobs itself"
        return (
            f"user {caller.user!r} may not launch shardpool jobs on this machine; "
            f"ask an admin to run `usermod -aG {self.group} {caller.user}` (then log in again)"
        )
