"""Tests of mesh/cli.py: bad input is refused in one clear line and leaves no state behind.

The full command flow (init, join, status, remove, down, up, leave, export-config) runs for real
in tests/test_mesh_e2e.py; these cover argument checking and error reporting.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mesh.cli import main
from mesh.keys import generate_private_key, public_key
from mesh.token import new_token

REPO = Path(__file__).resolve().parent.parent


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("shardpool: error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize(
    ("token", "fragments"),
    [
        ("hello", ("not a shardpool join token",)),
        ("spm1.AAAA", ("truncated",)),
        (
            new_token(public_key(generate_private_key()), "192.0.2.1:51820", 60).encode()[:-6],
            ("truncated or garbled",),
        ),
        (
            new_token(
                public_key(generate_private_key()), "192.0.2.1:51820", 60, now=time.time() - 3600
            ).encode(),
            ("expired", "mesh invite"),
        ),
    ],
)
def test_join_refuses_bad_tokens_and_writes_nothing(
    capsys, tmp_path, token: str, fragments: tuple[str, ...]
) -> None:
    code, _, err = _run(capsys, "join", token, "--state-dir", str(tmp_path / "home"))
    assert code == 2
    _one_line_error(err, *fragments)
    assert not (tmp_path / "home").exists()


def test_join_with_unreachable_coordinator_leaves_no_key_or_state(capsys, tmp_path) -> None:
    if os.geteuid() != 0:
        pytest.skip("join checks for root before contacting the coordinator")
    token = new_token(public_key(generate_private_key()), "127.0.0.1:9", 60).encode()
    home = tmp_path / "home"
    code, _, err = _run(
        capsys, "join", token, "--state-dir", str(home), "--backend", "userspace", "--interface", "spnever0"
    )
    assert code == 2
    _one_line_error(err, "cannot reach the coordinator at 127.0.0.1:9")
    assert not (home / "private.key").exists() and not (home / "mesh.json").exists()


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["init", "--endpoint", "192.0.2.1"], ("--endpoint", "HOST:PORT")),
        (["init", "--endpoint", "192.0.2.1:51820", "--cidr", "10.77.0.5/24"], ("--cidr", "not a network")),
        (["init", "--endpoint", "192.0.2.1:51820", "--interface", "much-too-long-name"], ("--interface",)),
        (["init", "--endpoint", "192.0.2.1:51820", "--name", "Bad Name"], ("member name",)),
        (["init", "--endpoint", "192.0.2.1:51820", "--mtu", "100"], ("--mtu",)),
        (["init", "--endpoint", "192.0.2.1:51820", "--ttl", "forever"], ("duration",)),
        (["status"], ("no mesh state", "mesh init")),
        (["invite"], ("no mesh state",)),
        (["remove", "b"], ("no mesh state",)),
        (["export-config"], ("no mesh state",)),
    ],
)
def test_bad_arguments_are_one_line_errors(
    capsys, tmp_path, argv: list[str], fragments: tuple[str, ...]
) -> None:
    code, _, err = _run(capsys, *argv, "--state-dir", str(tmp_path / "home"))
    assert code == 2
    _one_line_error(err, *fragments)
    assert not (tmp_path / "home" / "mesh.json").exists()


def test_shardpool_entry_point_reports_mesh_errors_without_traceback(tmp_path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), SHARDPOOL_HOME=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-m", "shardpool", "mesh", "join", "spm1.garbage"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("shardpool: error: join token is")
    assert "Traceback" not in result.stderr


def test_mesh_package_never_imports_torch_or_shardpool() -> None:
    code = (
        "import sys, mesh, mesh.cli, mesh.api, mesh.syncd, mesh.backend_kernel, mesh.backend_userspace;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'shardpool')]; print(bad)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        check=True,
    )
    assert result.stdout.strip() == "[]"


def test_help_lists_every_command(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("init", "invite", "join", "status", "remove", "leave", "down", "up", "export-config"):
        assert command in out
