"""`output_dir` is held by one run at a time (flock on output_dir/.shardpool.lock)."""

from __future__ import annotations

import getpass
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shardpool.launch.output_lock import LOCK_FILE, OutputDirBusy, locked_output_dir
from tests.helpers.training import REPO_ROOT, run_cli, write_config


def test_the_holder_is_written_into_the_lock_file(tmp_path: Path) -> None:
    with locked_output_dir(tmp_path / "out") as lock_file:
        holder = json.loads(lock_file.read_text())
        assert lock_file == tmp_path / "out" / LOCK_FILE
        assert holder["pid"] == os.getpid()
        assert holder["user"] == getpass.getuser()
        assert holder["host"] == socket.gethostname()
        assert holder["started"].endswith(" UTC")


def test_a_second_holder_is_refused_in_one_line_naming_the_first(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with locked_output_dir(out):
        with pytest.raises(OutputDirBusy) as caught:
            with locked_output_dir(out):
                pytest.fail("two holders at once")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"output_dir {out} is in use by another run (pid {os.getpid()}, ")
    assert message.endswith("); wait for it to finish or stop it, or set another `output_dir`")


def test_the_lock_is_released_when_the_block_ends_normally_or_by_an_exception(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with locked_output_dir(out):
        pass
    with pytest.raises(RuntimeError), locked_output_dir(out):
        raise RuntimeError("a failed run")
    with locked_output_dir(out) as lock_file:
        assert json.loads(lock_file.read_text())["pid"] == os.getpid()


def test_a_killed_holder_leaves_the_file_but_not_the_lock(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = (
        "import sys, time\n"
        "from shardpool.launch.output_lock import locked_output_dir\n"
        f"with locked_output_dir({str(out)!r}):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(60)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(OutputDirBusy, match=f"pid {holder.pid},"):
            with locked_output_dir(out):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert (out / LOCK_FILE).exists()
    with locked_output_dir(out):
        pass


def test_a_second_finetune_into_a_held_output_dir_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    """The real CLI, while this process holds the directory as a running finetune would."""
    config = yaml.safe_load((REPO_ROOT / "configs" / "quickstart.yaml").read_text())
    out = tmp_path / "out"
    config["output_dir"] = str(out)
    config_file = write_config(tmp_path / "run.yaml", config)
    with locked_output_dir(out) as lock_file:
        before = lock_file.read_bytes()
        result = run_cli("finetune", str(config_file), timeout=300)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith(
            f"shardpool: error: output_dir {out} is in use by another run (pid {os.getpid()}, "
            f"user {getpass.getuser()}, host {socket.gethostname()}, since "
        )
        assert sorted(path.name for path in out.iterdir()) == [LOCK_FILE]
        assert lock_file.read_bytes() == before
