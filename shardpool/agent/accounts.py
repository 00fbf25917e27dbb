"""Local accounts: who may launch jobs through the agent, and the unprivileged account jobs run as.

The agent runs as root, because it reads the member's WireGuard key to sign requests. Nothing it
starts for a job does: stage processes run as :class:`RunAs` (a system user, ``shardpool`` by
default), in a job directory that account owns with mode 0700. Who may ask for a job is decided
from the uid the kernel reports for the agent's Unix socket peer, never from anything the caller
says: root, or a member of the launch group (``shardpool`` by default).
"""

from __future__ import annotations

import grp
import os
import pwd
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
        """Create ``path`` (and parents, root-owned) and hand it to this account with mode 0700."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
        os.chown(path, self.uid, self.gid)
        os.chmod(path, 0o700)
        return path

    def give(self, path: Path, mode: int = 0o600) -> Path:
        """Hand a file the agent wrote to this account, readable by it alone."""
        os.chown(path, self.uid, self.gid)
        os.chmod(path, mode)
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
