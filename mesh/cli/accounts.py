"""The local accounts the shardpool agent needs, made by ``mesh init`` and ``mesh join`` when missing.

The agent never runs a stage as root: stages run with the run-as account's group (under a uid of
their own per job, or as the account itself), and the launch group says
which local users may submit jobs (docs/agent.md). Both are named ``shardpool`` unless the agent
is told otherwise. On a fresh machine neither exists, so ``init``/``join`` (already root) create
them with the system's own ``groupadd`` and ``useradd`` and say so in one line.
"""

from __future__ import annotations

import grp
import os
import pwd
import subprocess
from pathlib import Path

from mesh.errors import MeshError

__all__ = ["AGENT_LAUNCH_GROUP", "AGENT_RUN_AS", "account_commands", "ensure_agent_accounts"]

#: The account stages run as and the launch group: the agent's defaults (``shardpool agent --run-as/--group``).
AGENT_RUN_AS = "shardpool"
AGENT_LAUNCH_GROUP = "shardpool"


def _nologin_shell() -> str:
    for shell in ("/usr/sbin/nologin", "/sbin/nologin"):
        if Path(shell).exists():
            return shell
    return "/bin/false"


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def account_commands(user: str = AGENT_RUN_AS, group: str = AGENT_LAUNCH_GROUP) -> list[list[str]]:
    """The commands that create what is missing of the launch group and the run-as system account
    (its primary group is the launch group; no home, no login shell); empty when both exist."""
    commands: list[list[str]] = []
    if not _group_exists(group):
        commands.append(["groupadd", "--system", group])
    if not _user_exists(user):
        commands.append(
            ["useradd", "--system", "--gid", group, "--no-create-home", "--shell", _nologin_shell(), user]
        )
    return commands


def ensure_agent_accounts(user: str = AGENT_RUN_AS, group: str = AGENT_LAUNCH_GROUP) -> str | None:
    """Create the launch group and the run-as account where missing; the line saying so, or None.

    Needs root. Raises MeshError, in one line with the command to run by hand, when a command fails.
    """
    commands = account_commands(user, group)
    if not commands:
        return None
    if os.geteuid() != 0:
        raise MeshError(f"the agent needs the {user!r} account; as root run: {_shown(commands)}")
    for argv in commands:
        try:
            result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise MeshError(f"could not run {argv[0]} ({error}); as root run: {_shown(commands)}") from None
        if result.returncode != 0:
            reason = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
            raise MeshError(f"{argv[0]} failed ({reason}); as root run: {_shown(commands)}")
    made = [f"group {group!r}" for argv in commands if argv[0] == "groupadd"]
    made += [f"system account {user!r}" for argv in commands if argv[0] == "useradd"]
    return (
        f"Created the {' and the '.join(made)} for the shardpool agent (its run-as account is {user!r}; "
        f"let a user launch jobs with `usermod -aG {group} USER`)."
    )


def _shown(commands: list[list[str]]) -> str:
    return "; ".join(" ".join(argv) for argv in commands)
