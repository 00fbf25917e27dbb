"""Tests of mesh/state.py: state directory choice and atomic writes."""

from __future__ import annotations

import os
import stat

import pytest

from mesh.errors import MeshError
from mesh.files import atomic_write, write_json
from mesh.state import StatePaths, default_state_dir, read_json, resolve_state_dir


def test_state_dir_precedence(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SHARDPOOL_HOME", str(tmp_path / "env"))
    assert default_state_dir() == tmp_path / "env"
    assert resolve_state_dir(tmp_path / "flag") == tmp_path / "flag"
    assert resolve_state_dir(None) == tmp_path / "env"
    monkeypatch.delenv("SHARDPOOL_HOME")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert str(default_state_dir()) == "/var/lib/shardpool"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_state_dir() == tmp_path / "home" / ".local" / "share" / "shardpool"


def test_atomic_write_replaces_whole_file_with_mode(tmp_path) -> None:
    path = tmp_path / "sub" / "f"
    atomic_write(path, b"old", mode=0o600)
    atomic_write(path, b"new content", mode=0o600)
    assert path.read_bytes() == b"new content"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.listdir(path.parent) == ["f"], "no temporary file left behind"


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch) -> None:
    path = tmp_path / "f"
    atomic_write(path, b"old")

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="No space"):
        atomic_write(path, b"new")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f"], "the temporary file was removed"


def test_json_round_trip_and_corruption(tmp_path) -> None:
    path = tmp_path / "x.json"
    write_json(path, {"a": [1, 2]})
    assert read_json(path) == {"a": [1, 2]}
    path.write_text("{broken")
    with pytest.raises(MeshError, match="corrupt"):
        read_json(path)


def test_ensure_makes_a_private_tree(tmp_path) -> None:
    paths = StatePaths(tmp_path / "home")
    paths.ensure()
    assert stat.S_IMODE(os.stat(paths.root).st_mode) == 0o700
    assert paths.run.is_dir() and paths.logs.is_dir()
