"""Shared pieces of the mesh training end-to-end tests: the lab, the three-member mesh, launches.

The model and data of a launch exist only inside the launcher's private mount namespace on its
host (a tmpfs no other process can see), so every stage must fetch its tensors over the mesh.
"""

from __future__ import annotations

import json
import pwd
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from shardpool_dev.lab import Host, Lab, mesh_address

from mesh.constants import AGENT_PORT
from tests.helpers.training import base_config, completion_rows, write_jsonl

__all__ = [
    "AGENT_PORT",
    "ADDRESSES",
    "Drained",
    "MetricsWatch",
    "adapter_difference",
    "launch",
    "local_reference",
    "local_twin",
    "mesh_of_three",
    "nat_mesh_of_three",
    "nat_training_lab",
    "ok",
    "private_files",
    "reachable",
    "restart_host",
    "training_config",
    "training_lab",
    "wait_for",
]

ADDRESSES = {label: mesh_address(number) for number, label in enumerate("abc", start=1)}
"""The mesh address of each member of :func:`mesh_of_three` (a, the coordinator, first; b and c join in order)."""


def ok(result: subprocess.CompletedProcess[str]) -> str:
    """The stdout of a command that must have succeeded (else the test fails with its output)."""
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    )
    return result.stdout


def wait_for(condition: Any, timeout: float, step: float = 0.5) -> float:
    """Poll ``condition`` until true; fail the test after ``timeout`` s. Returns the seconds waited."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            pytest.fail(f"condition not met within {timeout} s")
        time.sleep(step)
    return time.monotonic() - started


def training_lab(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Lab]:
    """Hosts a, b, c (members) and x (an outsider on the underlay); closed when the generator ends."""
    with Lab(tmp_path_factory.mktemp(name)) as built:
        for index, label in enumerate("abcx", start=1):
            built.add_host(label, index)
        yield built


def nat_training_lab(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Lab]:
    """Host a (the coordinator) and x (an outsider) on the emulated internet; b and c each behind a
    symmetric NAT router, so a-b and a-c are direct and b-c can only go through a's relay."""
    with Lab(tmp_path_factory.mktemp(name)) as built:
        built.add_internet()
        built.add_host("a", 1)
        built.add_host("x", 4)
        for index, label in enumerate("bc", start=1):
            built.add_router(f"r{label}", "symmetric", 10 + index)
            built.add_host(label, 2, behind=f"r{label}")
        yield built


def nat_mesh_of_three(lab: Lab) -> dict[str, str]:
    """Form the mesh a (coordinator), b, c on a :func:`nat_training_lab`, b and c without --endpoint."""
    token = lab.init_mesh(lab.hosts["a"], uses=2)
    for label in "bc":
        lab.join_mesh(lab.hosts[label], token)
    return reachable(lab)


def reachable(lab: Lab) -> dict[str, str]:
    """Wait until every member of :func:`nat_mesh_of_three` pings every other and every agent
    answers a; the mesh addresses."""
    a = lab.hosts["a"]
    for source in (lab.hosts[name] for name in "abc"):
        for target, address in ADDRESSES.items():
            if target != source.label:
                wait_for(lambda source=source, address=address: lab.ping(source, address, timeout=1), 30)
    for address in ADDRESSES.values():
        # an agent imports a good part of shardpool before it listens: slow on a busy machine
        wait_for(lambda address=address: lab.agent_healthy(a, address, AGENT_PORT), 120)
    return dict(ADDRESSES)


def mesh_of_three(lab: Lab) -> dict[str, str]:
    """Form the mesh a (coordinator), b, c through the real CLI; wait for pings and agents."""
    a, b, c = (lab.hosts[name] for name in "abc")
    lab.form_mesh("a", "bc", uses=2)
    for source in (a, b, c):
        for target, address in ADDRESSES.items():
            if target != source.label:
                wait_for(lambda source=source, address=address: lab.ping(source, address, timeout=1), 20)
    for address in ADDRESSES.values():
        wait_for(lambda address=address: lab.agent_healthy(a, address, AGENT_PORT), 30)
    return dict(ADDRESSES)


def training_config(out: Path, private: Path, **overrides: Any) -> dict[str, Any]:
    """A 4-step, three-stage mesh run of the tiny model in ``private`` into ``out``."""
    settings: dict[str, Any] = {
        "val_set_size": 8,
        "max_steps": 4,
        "shardpool": {"placement": "mesh", "stages": 3},
    }
    settings.update(overrides)
    return base_config(private / "model", private / "data.jsonl", out, **settings)


def private_files(lab: Lab) -> Path:
    """The model and data every launch in ``lab`` copies into its private tmpfs, made on first use.

    Built once per lab (the same seed gives the same bytes every time) in a directory only root can
    read, so the stages, which run as the unprivileged run-as account, still see the files only
    through the launcher, over the mesh.
    """
    made = lab.workdir / "private-files"
    if not made.is_dir():
        from shardpool.model.tinymodel import make_tiny_llama

        building = lab.workdir / "private-files.building"
        building.mkdir(mode=0o700)
        make_tiny_llama(building / "model", num_layers=6, hidden_size=64, seed=3)
        write_jsonl(building / "data.jsonl", completion_rows(64))
        building.rename(made)
    return made


def launch(
    lab: Lab,
    host: Host,
    private: Path,
    config_path: Path,
    *extra: str,
    background: bool = False,
    user: str | None = None,
    env: dict[str, str] | None = None,
    files: Sequence[Path] = (),
) -> Any:
    """Run ``shardpool finetune`` on ``host`` with the model and data on a tmpfs only it can see.

    Root mounts the tmpfs and copies the files (:func:`private_files`, then ``files``: other data
    a config names, such as a preference dataset) into it; with ``user`` the launcher itself then
    runs as that account; ``env`` adds variables. Returns the CompletedProcess, or the Popen with
    ``background``.
    """
    made = private_files(lab)
    copied = [made / "model", made / "data.jsonl", *files]
    finetune = [sys.executable, "-m", "shardpool", "finetune", str(config_path), *extra]
    if user is not None:
        entry = pwd.getpwnam(user)
        finetune = ["setpriv", f"--reuid={user}", f"--regid={entry.pw_gid}", "--init-groups", "env",
                    f"HOME={lab.user_home(user)}", *finetune]  # fmt: skip
    script = " && ".join(
        [
            f"mount -t tmpfs shardpool-private {shlex.quote(str(private))}",
            f"cp -R {' '.join(shlex.quote(str(path)) for path in copied)} {shlex.quote(str(private))}",
            "exec " + shlex.join(finetune),
        ]
    )
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
    variables = {"COLUMNS": "200", **(env or {})}
    if not background:
        return lab.run(host, *argv, timeout=600, env=variables)
    command = lab.command(host, *argv, env=variables)
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def local_twin(tmp: Path, mesh_out: Path) -> Path:
    """Train the mesh run's config and split with local stage processes, from an identical model."""
    plan = json.loads((mesh_out / "plan.json").read_text())
    sizes = [stop - start for start, stop in (stage["layers"] for stage in plan["stages"])]
    return local_reference(tmp, sizes)


def local_reference(tmp: Path, layers: list[int], **overrides: Any) -> Path:
    """An uninterrupted local run of :func:`training_config` (with ``overrides``) split into
    ``layers``, from the model and data a mesh launch makes: the output directory (its adapter)."""
    from rich.console import Console

    from shardpool.config import parse_config
    from shardpool.finetune import finetune
    from shardpool.model.tinymodel import make_tiny_llama

    make_tiny_llama(tmp / "model", num_layers=6, hidden_size=64, seed=3)
    write_jsonl(tmp / "data.jsonl", completion_rows(64))
    settings = {key: value for key, value in overrides.items() if key != "shardpool"}
    config = training_config(
        tmp / "local-out", tmp, shardpool={"placement": "local", "layers": layers}, **settings
    )
    return finetune(parse_config(config), console=Console(quiet=True))


def adapter_difference(first: Path, second: Path) -> float:
    """The largest absolute difference between two adapters' tensors (they must hold the same names)."""
    from safetensors.torch import load_file

    one = load_file(str(first / "adapter_model.safetensors"))
    other = load_file(str(second / "adapter_model.safetensors"))
    assert one.keys() == other.keys(), sorted(set(one) ^ set(other))
    return max(float((one[key] - other[key]).abs().max()) for key in one)


def restart_host(lab: Lab, host: Host, *, agent: bool = True) -> float:
    """``mesh up`` on a host whose every process was killed (:meth:`Lab.kill_host`), as its owner
    would after a reboot; waits until host a pings it and (with ``agent``) its agent answers.
    Returns the seconds taken."""
    started = time.monotonic()
    ok(lab.mesh(host, "up", timeout=120))
    a = lab.hosts["a"]
    wait_for(lambda: lab.ping(a, ADDRESSES[host.label], timeout=1), 60)
    if agent:
        wait_for(lambda: lab.agent_healthy(a, ADDRESSES[host.label], AGENT_PORT), 120)
    return time.monotonic() - started


class MetricsWatch:
    """Watches a run's ``metrics.jsonl`` from a thread: when each line first appeared (monotonic s).

    The launcher rewrites the file when it restores a step-boundary copy (it trims it to that
    step, as ``--resume`` does), so the whole file is read on every poll and a line counts by its
    text: a redone step is a new line.
    """

    def __init__(self, path: Path, interval: float = 0.1) -> None:
        self.path = path
        self.interval = interval
        self.seen: list[tuple[float, dict[str, Any]]] = []
        self._texts: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-watch", daemon=True)

    def __enter__(self) -> MetricsWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        """Note the lines not seen before, with the time now."""
        try:
            lines = self.path.read_text().splitlines()
        except OSError:
            return
        now = time.monotonic()
        with self._lock:
            for text in lines:
                if text.strip() and text not in self._texts:
                    try:
                        record = json.loads(text)
                    except ValueError:
                        continue  # a line being written
                    self._texts.add(text)
                    self.seen.append((now, record))

    def first(
        self, match: Callable[[dict[str, Any]], bool], after: float = 0.0
    ) -> tuple[float, dict[str, Any]] | None:
        """The earliest (time, line) first seen at or after ``after`` that ``match`` accepts, or None."""
        with self._lock:
            return next(((t, r) for t, r in self.seen if t >= after and match(r)), None)

    def wait(
        self,
        match: Callable[[dict[str, Any]], bool],
        timeout: float,
        after: float = 0.0,
        alive: Callable[[], bool] = lambda: True,
    ) -> tuple[float, dict[str, Any]]:
        """:meth:`first`, waiting up to ``timeout`` s for it (the test fails after, or once ``alive`` is false)."""
        deadline = time.monotonic() + timeout
        while (found := self.first(match, after)) is None:
            if time.monotonic() > deadline or not alive():
                self.poll()
                found = self.first(match, after)
                if found is not None:
                    return found
                pytest.fail(
                    f"no matching metrics line within {timeout} s; lines: {[r for _, r in self.seen][-8:]}"
                )
            time.sleep(self.interval)
        return found

    def events(self, kind: str) -> list[dict[str, Any]]:
        """The ``{"event": kind, ...}`` lines seen, in order."""
        with self._lock:
            return [r for _, r in self.seen if r.get("event") == kind]


class Drained:
    """A background launch whose stdout and stderr are read as they come (by two threads), so a
    long run never blocks on a full pipe; :meth:`finish` waits for it and returns both texts."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self._chunks: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._readers = [
            threading.Thread(target=self._read, args=(name, stream), daemon=True)
            for name, stream in (("stdout", process.stdout), ("stderr", process.stderr))
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, name: str, stream: Any) -> None:
        for line in stream:
            self._chunks[name].append(line)

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""
        return self.process.poll()

    @property
    def returncode(self) -> int | None:
        """The exit code once it ended."""
        return self.process.returncode

    def finish(self, timeout: float) -> tuple[str, str]:
        """Wait up to ``timeout`` s for the launcher to end (killing it after), then its stdout and stderr."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for reader in self._readers:
            reader.join(10)
        return "".join(self._chunks["stdout"]), "".join(self._chunks["stderr"])

    def said(self) -> str:
        """What the launcher wrote so far: stdout (its console lines: losses, joins, re-plans, failed
        join checks), then stderr."""
        return "".join(list(self._chunks["stdout"])) + "".join(list(self._chunks["stderr"]))

    def kill(self) -> None:
        """Kill the launcher if it still runs (its stages stop with it, by its agents)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def stage_pids_on(lab: Lab, *hosts: Host) -> set[int]:
    """The stage processes (``shardpool.elastic.rank``) running in ``hosts`` now."""
    found: set[int] = set()
    for host in hosts:
        for pid in lab.host_pids(host):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"shardpool.elastic.rank" in argv:
                found.add(pid)
    return found


def stage_log_lines(host: Host, text: str) -> list[str]:
    """The lines holding ``text`` in the stage logs (``jobs/ID/rank-N.log``) of ``host``'s agent,
    whose work directory sits beside the host's ``SHARDPOOL_HOME`` (``<home>-work``)."""
    work_dir = host.home.with_name(host.home.name + "-work")
    return [
        line
        for log in sorted(work_dir.glob("jobs/*/rank-*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if text in line
    ]
