"""Tests of mesh/cli/ (the mesh commands): bad input is refused in one clear line and leaves no state behind.

The full command flow (init, join, status, remove, down, up, leave, export-config) runs for real
in tests/mesh/test_e2e.py; these cover argument checking and error reporting.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mesh.cli.parser import main
from mesh.cli.tokens import read_join_token
from mesh.constants import TOKEN_ENV
from mesh.control.client import request_join
from mesh.control.token import new_token, parse_token
from mesh.node.config import load_config, save_config
from mesh.state import StatePaths
from mesh.wireguard.keys import generate_private_key, public_key
from tests.helpers.mesh_hosts import InProcessCoordinator, write_coordinator_state

REPO = Path(__file__).resolve().parents[2]


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
    ids=["not-a-token", "short-token", "truncated-token", "expired-token"],  # the same on every xdist worker
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
        (["init", "--endpoint", "192.0.2.1:51820", "--cidr", "198.51.100.5/28"], ("--cidr", "not a network")),
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
        "import sys, mesh, mesh.cli.parser, mesh.node.api, mesh.node.syncd, mesh.wireguard.kernel, mesh.wireguard.userspace;"
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


# --- where `mesh join` takes its token from -------------------------------------------------------


def _expired_token() -> str:
    """A well-formed but expired token: the "expired" error proves the token was read and parsed."""
    return new_token(
        public_key(generate_private_key()), "192.0.2.1:51820", 60, now=time.time() - 3600
    ).encode()


def _private_file(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture
def no_token_env(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    return monkeypatch


def test_join_reads_the_token_from_each_single_source(capsys, tmp_path, no_token_env) -> None:
    home = str(tmp_path / "home")
    token = _expired_token()
    code, _, err = _run(capsys, "join", token, "--state-dir", home)
    assert code == 2
    _one_line_error(err, "join token expired")
    no_token_env.setattr(sys, "stdin", io.StringIO(f"{token}\n"))
    code, _, err = _run(capsys, "join", "-", "--state-dir", home)
    assert code == 2
    _one_line_error(err, "join token expired")
    token_file = _private_file(tmp_path / "token", f"{token}\n")
    code, _, err = _run(capsys, "join", "--token-file", str(token_file), "--state-dir", home)
    assert code == 2
    _one_line_error(err, "join token expired")
    no_token_env.setenv(TOKEN_ENV, token)
    code, _, err = _run(capsys, "join", "--state-dir", home)
    assert code == 2
    _one_line_error(err, "join token expired")
    assert not Path(home).exists()


def test_join_token_file_may_hold_the_whole_output_of_mesh_invite(tmp_path, no_token_env) -> None:
    token = _expired_token()
    output = (
        "Join token 0011223344556677 (valid 1h, 1 use).\n"
        "On another machine run this and paste the token (or pipe it in), so it stays out of `ps`:\n"
        "  shardpool mesh join - --endpoint THAT_MACHINE:PORT\n"
        f"{token}\n"
    )
    token_file = _private_file(tmp_path / "invite.txt", output)
    assert read_join_token(None, str(token_file)) == parse_token(token)
    wrapped = _private_file(tmp_path / "wrapped.txt", f"{token[:40]}\n{token[40:]}\n")
    assert read_join_token(None, str(wrapped)) == parse_token(token)


@pytest.mark.parametrize(
    ("argv", "env", "fragments"),
    [
        ([], None, ("no join token given", "'-' for standard input", "--token-file", TOKEN_ENV)),
        ([], "  ", ("no join token given",)),
        (["TOKEN", "--token-file", "f"], None, ("given 2 ways", "the TOKEN argument", "--token-file")),
        (["-"], "spm1.x", ("given 2 ways", "'-' (standard input)", TOKEN_ENV)),
        (["TOKEN", "--token-file", "f"], "spm1.x", ("given 3 ways", "use exactly one")),
        (["--token-file", "missing-file"], None, ("cannot open --token-file missing-file",)),
    ],
)
def test_join_needs_exactly_one_token_source(
    capsys, tmp_path, no_token_env, argv: list[str], env: str | None, fragments: tuple[str, ...]
) -> None:
    if env is not None:
        no_token_env.setenv(TOKEN_ENV, env)
    no_token_env.chdir(tmp_path)
    argv = [_expired_token() if a == "TOKEN" else a for a in argv]
    code, _, err = _run(capsys, "join", *argv, "--state-dir", str(tmp_path / "home"))
    assert code == 2
    _one_line_error(err, *fragments)
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        ("", ("standard input is empty",)),
        ("\n  \n", ("standard input is empty",)),
        ("x" * (64 * 1024 + 1), ("more than 65536 bytes",)),
        ("hello\n", ("not a shardpool join token",)),
    ],
)
def test_join_refuses_bad_standard_input(
    capsys, tmp_path, no_token_env, content: str, fragments: tuple[str, ...]
) -> None:
    no_token_env.setattr(sys, "stdin", io.StringIO(content))
    code, _, err = _run(capsys, "join", "-", "--state-dir", str(tmp_path / "home"))
    assert code == 2
    _one_line_error(err, *fragments)


def test_join_token_file_that_is_a_directory_or_binary_is_refused(capsys, tmp_path, no_token_env) -> None:
    folder = tmp_path / "folder"
    folder.mkdir(mode=0o700)
    code, _, err = _run(capsys, "join", "--token-file", str(folder), "--state-dir", str(tmp_path / "h"))
    assert code == 2
    _one_line_error(err, "is a directory")
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00")
    binary.chmod(0o600)
    code, _, err = _run(capsys, "join", "--token-file", str(binary), "--state-dir", str(tmp_path / "h"))
    assert code == 2
    _one_line_error(err, "is not text")


def test_join_reads_a_piped_token_in_a_real_process(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    result = subprocess.run(
        [sys.executable, "-m", "mesh", "join", "-", "--state-dir", str(tmp_path / "home")],
        input=_expired_token() + "\n",
        capture_output=True,
        text=True,
        env=dict(env, PYTHONPATH=str(REPO)),
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("shardpool: error: join token expired at ")
    assert result.stderr.count("\n") == 1


def test_join_help_recommends_keeping_the_token_out_of_ps(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["join", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for fragment in ("visible to every local user in `ps`", "--token-file PATH", TOKEN_ENV, "'-' to read it"):
        assert fragment in out


# --- invites: issue for a name, list, revoke ------------------------------------------------------


@pytest.fixture
def coordinator_state(tmp_path):
    service = InProcessCoordinator(tmp_path)
    yield service, str(write_coordinator_state(service))
    service.close()


def test_invite_list_shows_each_invite_with_its_state(capsys, coordinator_state) -> None:
    coordinator, state = coordinator_state
    code, out, _ = _run(capsys, "invite", "--name", "gpu-b", "--ttl", "2h", "--state-dir", state)
    assert code == 0
    lines = out.splitlines()
    named = parse_token(lines[-1])
    assert lines[0] == f"Join token {named.token_id.hex()} for 'gpu-b' (valid 2h, 1 use)."
    assert lines[2] == "  shardpool mesh join - --name gpu-b --endpoint THAT_MACHINE:PORT"
    shared = parse_token(_run(capsys, "invite", "--uses", "3", "--state-dir", state)[1].splitlines()[-1])
    revoked = parse_token(_run(capsys, "invite", "--state-dir", state)[1].splitlines()[-1])
    request_join(named, "gpu-b", public_key(generate_private_key()), None)
    request_join(shared, "gpu-c", public_key(generate_private_key()), None)
    assert _run(capsys, "invite", "--revoke", revoked.encode(), "--state-dir", state)[0] == 0

    code, out, _ = _run(capsys, "invite", "--list", "--json", "--state-dir", state)
    assert code == 0
    listed = {item["id"]: item for item in json.loads(out)}
    assert set(listed) == {named.token_id.hex(), shared.token_id.hex(), revoked.token_id.hex()}
    assert listed[named.token_id.hex()] | {"created_at": 0, "revoked_at": 0} == {
        "id": named.token_id.hex(),
        "created_at": 0,
        "expires_at": named.expires_at,
        "uses_left": 0,
        "state": "used",
        "name": "gpu-b",
        "revoked_at": 0,
        "joined": ["gpu-b"],
    }
    assert (listed[shared.token_id.hex()]["state"], listed[shared.token_id.hex()]["uses_left"]) == (
        "active",
        2,
    )
    assert listed[shared.token_id.hex()]["joined"] == ["gpu-c"]
    assert listed[revoked.token_id.hex()]["state"] == "revoked"
    assert abs(listed[revoked.token_id.hex()]["revoked_at"] - time.time()) < 600

    code, out, _ = _run(capsys, "invite", "--list", "--state-dir", state)
    rows = [line.split() for line in out.splitlines()]
    assert rows[0] == ["ID", "CREATED", "EXPIRES", "USES", "LEFT", "STATE", "FOR", "JOINED"]
    by_id = {row[0]: row for row in rows[1:]}
    assert by_id[named.token_id.hex()][-4:] == ["0", "used", "gpu-b", "gpu-b"]
    assert by_id[shared.token_id.hex()][-4:] == ["2", "active", "-", "gpu-c"]
    assert by_id[revoked.token_id.hex()][-4:] == ["1", "revoked", "-", "-"]


def test_revoking_twice_says_so_and_changes_nothing(capsys, coordinator_state) -> None:
    coordinator, state = coordinator_state
    token = parse_token(_run(capsys, "invite", "--state-dir", state)[1].splitlines()[-1])
    _run(capsys, "invite", "--revoke", token.token_id.hex(), "--state-dir", state)
    code, out, _ = _run(capsys, "invite", "--revoke", token.token_id.hex().upper(), "--state-dir", state)
    assert code == 0
    assert out.startswith(f"Invite {token.token_id.hex()} was already revoked at ")


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["invite", "--revoke", "0011223344556677"], ("no invite has id 0011223344556677", "--list")),
        (["invite", "--revoke", "xyz"], ("invite id 'xyz' is not 16 hex digits",)),
        (["invite", "--revoke", "spm1.AAAA"], ("join token is truncated",)),
        (["invite", "--list", "--ttl", "1h"], ("--list does not take --ttl",)),
        (
            ["invite", "--revoke", "00", "--name", "b", "--uses", "2"],
            ("--revoke does not take --uses, --name",),
        ),
        (["invite", "--json"], ("--json only goes with --list",)),
        (["invite", "--name", "Bad"], ("member name 'Bad' is invalid",)),
        (["invite", "--name", "coord"], ("member 'coord' already exists at 198.51.100.1",)),
        (["invite", "--uses", "0"], ("--uses must be at least 1",)),
        (["remove", "ghost"], ("no active member and no pending invite is called 'ghost'",)),
        (["remove", "coord"], ("coordinator itself",)),
    ],
)
def test_invite_and_remove_refuse_bad_input_in_one_line(
    capsys, coordinator_state, argv: list[str], fragments: tuple[str, ...]
) -> None:
    coordinator, state = coordinator_state
    before = coordinator.store.invites(), coordinator.store.roster()
    code, _, err = _run(capsys, *argv, "--state-dir", state)
    assert code == 2
    _one_line_error(err, *fragments)
    assert (coordinator.store.invites(), coordinator.store.roster()) == before


def test_invite_list_and_revoke_on_a_member_point_at_the_coordinator(capsys, coordinator_state) -> None:
    coordinator, state = coordinator_state
    config = load_config(StatePaths(Path(state)))
    save_config(StatePaths(Path(state)), config.with_changes(role="member"))
    for argv in (["invite", "--list"], ["invite", "--revoke", "0011223344556677"]):
        code, _, err = _run(capsys, *argv, "--state-dir", state)
        assert code == 2
        _one_line_error(err, "not the coordinator", coordinator.endpoint)


def test_status_path_is_the_coordinators_word_or_direct_on_a_fresh_handshake() -> None:
    from mesh.cli.status import path_of

    assert path_of("relay", None) == "relay"
    assert path_of("lan", 500.0) == "lan"
    assert path_of("pending", 1.0) is None
    assert path_of(None, 10.0) == "direct"
    assert path_of(None, 400.0) is None and path_of(None, None) is None


def test_mesh_init_without_cidr_takes_the_documented_default() -> None:
    """Tests and the lab pass TEST-NET ranges; a user's `mesh init` without --cidr gets 10.77.0.0/24."""
    from mesh.cli.parser import build_parser

    args = build_parser().parse_args(["init", "--endpoint", "192.0.2.1:51820"])
    assert args.cidr == "10.77.0.0/24"
