"""A link planted where the agent makes a directory is refused, and output files follow the umask.

Before issue 39 the agent made its directories with ``mkdir(exist_ok=True)`` and then chowned
and chmodded the path, following any symbolic link there: whoever could write to a ``--work-dir``
could plant ``cache -> /etc`` and have root hand ``/etc`` to the run-as account. Uploaded
adapters and checkpoints were 0644 whatever the launching user's umask. Real agent, real files,
links made by another uid as an attacker's would be.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from shardpool.errors import ShardpoolError
from shardpool.files.client import RemoteFiles
from shardpool.files.server import FileServer
from tests.helpers.agents import make_agent, shared_dir

ATTACKER_UID = 65534  # nobody: the kind of account that could write to a careless --work-dir

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the agent runs as root; so does this test")


def _plant(work: Path, name: str, kind: str, target: Path) -> None:
    """Put a link (or a directory) of another user where the agent will make directory ``name``."""
    planted = work / name
    if kind == "link":
        planted.symlink_to(target, target_is_directory=True)
    else:
        planted.mkdir()
    os.chown(planted, ATTACKER_UID, ATTACKER_UID, follow_symlinks=False)


@pytest.mark.parametrize(
    ("name", "kind"),
    [("cache", "link"), ("jobs", "link"), ("cache", "directory of another user")],
)
def test_a_planted_link_under_the_work_directory_is_refused_and_its_target_untouched(
    name: str, kind: str
) -> None:
    with shared_dir() as shared:
        target = shared / "precious"
        target.mkdir(mode=0o755)
        work = shared / "work"
        work.mkdir(mode=0o777)  # a careless --work-dir anyone can write to
        work.chmod(0o777)
        _plant(work, name, kind, target)
        agent = make_agent(work, None)
        with pytest.raises(ShardpoolError, match=rf"{work / name} is (a symbolic link|owned by uid 65534)"):
            agent.start()
        agent.stop()
        found = target.stat()
        assert (found.st_uid, found.st_gid, stat.S_IMODE(found.st_mode)) == (0, 0, 0o755)
        assert not any(target.iterdir())


@contextmanager
def _umask(mask: int) -> Iterator[None]:
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


@pytest.mark.parametrize(("mask", "mode"), [(0o077, 0o600), (0o022, 0o644), (0o027, 0o640)])
def test_an_uploaded_adapter_gets_the_mode_the_launching_users_umask_implies(
    tmp_path: Path, mask: int, mode: int
) -> None:
    secret = secrets.token_hex(32)
    source = tmp_path / "adapter.safetensors"
    source.write_bytes(os.urandom(10_000))
    with (
        _umask(mask),
        FileServer("127.0.0.1", files={}, upload_root=tmp_path / "out", secret=secret) as server,
    ):
        RemoteFiles(server.url, secret=secret).upload(source, "checkpoint-1/adapter_model.safetensors")
    written = tmp_path / "out" / "checkpoint-1" / "adapter_model.safetensors"
    assert stat.S_IMODE(written.stat().st_mode) == mode
