"""`mesh init` and `mesh join` create the agent's run-as account and launch group where missing.

The real ``groupadd``/``useradd`` run, as root, on throwaway names (``sp-test-<random>``) that are
deleted afterwards; the machine's own ``shardpool`` account is never touched.
"""

from __future__ import annotations

import grp
import os
import pwd
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from mesh.cli import agent_process
from mesh.cli.accounts import AGENT_LAUNCH_GROUP, AGENT_RUN_AS, account_commands, ensure_agent_accounts
from mesh.constants import AGENT_SOCKET_ENV
from shardpool.agent.accounts import DEFAULT_LAUNCH_GROUP, DEFAULT_RUN_AS
from tests.helpers.agents import shared_dir
from tests.security.test_two_meshes_one_machine import _mesh_state

as_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None, reason="needs root and useradd/groupadd"
)


def test_the_names_are_the_agents_defaults() -> None:
    """mesh/ may not import shardpool, so it names the accounts itself: the same as the agent."""
    assert (AGENT_RUN_AS, AGENT_LAUNCH_GROUP) == (DEFAULT_RUN_AS, DEFAULT_LAUNCH_GROUP)


@pytest.fixture
def throwaway() -> Iterator[str]:
    """A user and group name nothing on this machine has; both removed after the test."""
    name = f"sp-test-{secrets.token_hex(3)}"
    yield name
    subprocess.run(["userdel", name], capture_output=True, check=False)
    subprocess.run(["groupdel", name], capture_output=True, check=False)


@as_root
def test_the_missing_group_and_account_are_created_in_one_line(throwaway: str) -> None:
    assert [argv[0] for argv in account_commands(throwaway, throwaway)] == ["groupadd", "useradd"]
    line = ensure_agent_accounts(throwaway, throwaway)
    assert line is not None and "\n" not in line
    assert f"group {throwaway!r}" in line and f"system account {throwaway!r}" in line
    user, group = pwd.getpwnam(throwaway), grp.getgrnam(throwaway)
    assert user.pw_gid == group.gr_gid and 0 < user.pw_uid < 1000  # a system account
    assert user.pw_shell.endswith(("nologin", "false")) and not Path(user.pw_dir).exists()
    assert ensure_agent_accounts(throwaway, throwaway) is None  # nothing left to do


@as_root
def test_only_what_is_missing_is_created(throwaway: str) -> None:
    subprocess.run(["groupadd", "--system", throwaway], check=True)
    line = ensure_agent_accounts(throwaway, throwaway)
    assert line is not None and f"group {throwaway!r}" not in line and f"system account {throwaway!r}" in line
    assert pwd.getpwnam(throwaway).pw_gid == grp.getgrnam(throwaway).gr_gid


@as_root
@pytest.mark.slow
def test_the_agent_starts_as_the_account_init_created(
    throwaway: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `mesh init/join` run: the account line, then the agent listening, running stages as it."""
    monkeypatch.delenv(AGENT_SOCKET_ENV, raising=False)
    monkeypatch.setattr(agent_process, "AGENT_RUN_AS", throwaway)
    monkeypatch.setattr(agent_process, "AGENT_LAUNCH_GROUP", throwaway)
    with shared_dir() as shared:
        paths = _mesh_state(shared / "mesh", "alpha", "127.0.0.2")
        try:
            created, started = agent_process.start_shardpool_agent(paths, timeout=60).splitlines()
        finally:
            agent_process.stop_shardpool_agent(paths)
    assert created.startswith("Created the group") and throwaway in created
    assert started.startswith("shardpool agent: listening on"), started
