"""The run-as account and the launch policy, with real users and groups (root only)."""

from __future__ import annotations

import grp
import os
import pwd
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardpool.agent.accounts import Caller, LaunchPolicy, resolve_run_as
from shardpool.errors import ShardpoolError

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and groups: needs root")


@pytest.fixture()
def scratch_users() -> Iterator[tuple[str, str, str]]:
    """A group and two system users, one in the group and one not; deleted afterwards."""
    tag = uuid.uuid4().hex[:6]
    group, member, outsider = f"spg{tag}", f"spm{tag}", f"spo{tag}"
    subprocess.run(["groupadd", "--system", group], check=True)
    for user in (member, outsider):
        subprocess.run(["useradd", "--system", "--no-create-home", "--user-group", user], check=True)
    subprocess.run(["usermod", "-aG", group, member], check=True)
    try:
        yield group, member, outsider
    finally:
        for user in (member, outsider):
            subprocess.run(["userdel", user], check=False, capture_output=True)
        subprocess.run(["groupdel", group], check=False, capture_output=True)


def caller_of(user: str) -> Caller:
    entry = pwd.getpwnam(user)
    return Caller(entry.pw_uid, entry.pw_gid, pid=1)


@needs_root
def test_launch_group_admits_members_and_root_and_refuses_everyone_else(
    scratch_users: tuple[str, str, str],
) -> None:
    group, member, outsider = scratch_users
    policy = LaunchPolicy(group)
    assert policy.allows(caller_of(member))
    assert policy.allows(Caller(0, 0, 1))
    assert not policy.allows(caller_of(outsider))
    assert not policy.allows(Caller(65534, 65534, 1))
    assert not policy.allows(Caller(4_000_000, 4_000_000, 1))  # no passwd entry at all
    message = policy.refusal(caller_of(outsider))
    assert outsider in message and f"usermod -aG {group} {outsider}" in message and "\n" not in message


@needs_root
def test_the_run_as_account_may_not_launch_even_in_the_group(scratch_users: tuple[str, str, str]) -> None:
    group, member, _ = scratch_users
    stage_account = caller_of(member)
    policy = LaunchPolicy(group, denied_uids=frozenset({stage_account.uid}))
    assert not policy.allows(stage_account)
    assert "runs job stages" in policy.refusal(stage_account)


@needs_root
def test_a_missing_group_admits_only_root() -> None:
    policy = LaunchPolicy("no-such-group-" + uuid.uuid4().hex[:6])
    assert policy.allows(Caller(0, 0, 1))
    assert not policy.allows(Caller(65534, 65534, 1))


def test_run_as_refuses_root_and_unknown_users() -> None:
    with pytest.raises(ShardpoolError, match="jobs never run as root"):
        resolve_run_as("root", check_python=False)
    with pytest.raises(ShardpoolError, match="does not exist; create it with `useradd"):
        resolve_run_as("no-such-user-" + uuid.uuid4().hex[:6], check_python=False)


@needs_root
def test_run_as_account_owns_a_private_job_directory_and_runs_unprivileged(
    scratch_users: tuple[str, str, str], tmp_path: Path
) -> None:
    _, member, _ = scratch_users
    account = resolve_run_as(member, check_python=False)
    job_dir = account.make_private_dir(tmp_path / "jobs" / "j1")
    stat = job_dir.stat()
    assert (stat.st_uid, stat.st_gid, stat.st_mode & 0o777) == (account.uid, account.gid, 0o700)
    result = subprocess.run(
        ["/bin/sh", "-c", "id -u; id -G"],
        capture_output=True,
        text=True,
        check=True,
        **account.popen_kwargs(),
    )
    uid, groups = result.stdout.split("\n")[:2]
    assert int(uid) == account.uid and groups.split() == [str(account.gid)]
    assert grp.getgrgid(account.gid)  # primary group only: no supplementary groups inherited from root


@needs_root
def test_run_as_check_says_how_to_fix_an_unreadable_python(
    scratch_users: tuple[str, str, str], tmp_path: Path
) -> None:
    _, member, _ = scratch_users
    hidden = tmp_path / "private"
    hidden.mkdir(mode=0o700)
    python = hidden / "python"
    python.symlink_to(sys.executable)
    with pytest.raises(ShardpoolError, match="cannot run .* install shardpool where that user can read it"):
        resolve_run_as(member, python=str(python))
