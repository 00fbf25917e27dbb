"""An agent cannot be starved into stopping its jobs (issue 39, finding 2), nor buffer unbounded events.

The agent's listeners share one bounded pool of handler threads, and a job nobody polls for the
heartbeat timeout is stopped. Probes and profiles used to hold threads for minutes (a probe took
64 targets, duplicates and the agent itself included; a profile waited on a lock for the one run
under way), so a flood of either took every thread and the job's polls waited until it was stopped
for "heartbeat timeout". Now each costly route holds only its share of the pool and a request
beyond it is refused at once, probes name each other member once, the local socket bounds what one
user holds, and a job's buffered events are bounded in bytes.

Real agents with a small pool (16 threads) and a 3 s heartbeat; the honest launcher polls once a
second as the real one does.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mesh.control.directory import Member
from mesh.http.server import Limits
from shardpool.agent.jobs import Job
from shardpool.agent.service import Agent
from tests.helpers.agents import (
    LAUNCH_GID,
    PROFILE_CONFIG,
    PROFILE_WORKLOAD,
    group_member,
    local_call,
    make_agent,
    shared_dir,
    signed,
    write_worker,
)
from tests.helpers.jobs import job_dict

QUIET_WORKER = """
import json, time
print("@shardpool " + json.dumps({"event": "ready", "total_steps": 1, "first_step": 0}), flush=True)
time.sleep(600)
"""

#: A device report that answers only once the test lets it (the file ``release`` appears).
SLOW_REPORT = """
import json, os, sys, time
json.load(sys.stdin)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
row = {"name": "cpu", "kind": "cpu", "label": "test cpu", "total_bytes": 8, "free_bytes": 4,
       "threads": 2, "seconds_per_layer": 0.5, "activation_bytes": 1024}
print(json.dumps({"devices": [row]}))
"""

CONFIG, WORKLOAD = PROFILE_CONFIG, PROFILE_WORKLOAD

SMALL_POOL = Limits(handler_threads=16)
HEARTBEAT_S = 3.0
FLOOD_S = 2 * HEARTBEAT_S
QUICK_S = 2.0  # a refusal comes at once; an honest poll within its 1 s wait and this


class BlackHole:
    """A member's agent port that accepts connections and never answers (until closed)."""

    def __init__(self, host: str) -> None:
        self.listener = socket.create_server((host, 0), backlog=512)
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.held: list[socket.socket] = []
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closing.is_set():
            try:
                connection, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.held.append(connection)

    def close(self) -> None:
        """Refuse every further connection and drop the held ones (a stuck probe then ends fast)."""
        self.closing.set()
        self.thread.join(timeout=5)
        self.listener.close()
        for connection in self.held:
            connection.close()


@pytest.fixture
def shared() -> Iterator[Path]:
    with shared_dir() as path:
        yield path


def _start_job(agent: Agent, job_id: str) -> None:
    status, reply = signed(agent.url, "POST", "/v1/jobs", {"job_id": job_id, "job": job_dict(), "ranks": [0]})
    assert status == 201, reply


class HonestLauncher:
    """Long-polls a job with a 1 s wait, back to back as the launcher does, noting how long each took."""

    def __init__(self, agent: Agent, job_id: str) -> None:
        self.url, self.job_id = agent.url, job_id
        self.times: list[float] = []
        self.replies: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                status, reply = signed(
                    self.url, "GET", f"/v1/jobs/{self.job_id}/events?after=1&wait=1", timeout=10
                )
            except Exception:  # noqa: BLE001 - a poll that got no answer counts as a slow one
                status, reply = 0, {}
            self.times.append(time.monotonic() - started)
            if status == 200:
                self.replies.append(reply)

    def __enter__(self) -> HonestLauncher:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=15)


def _flood(request: Callable[[], tuple[int, Any]], count: int) -> list[tuple[float, int, str]]:
    """``count`` copies of ``request`` at once, each until it answers or gives up: (seconds, status, error)."""
    results: list[tuple[float, int, str]] = []

    def one() -> None:
        started = time.monotonic()
        try:
            status, reply = request()
            error = reply.get("error", "") if isinstance(reply, dict) else str(reply)
        except Exception as failure:  # noqa: BLE001 - a flood request that gave up
            status, error = 0, str(failure)
        results.append((time.monotonic() - started, status, error))

    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=FLOOD_S)
    return results


def _job_kept_its_heartbeat(agent: Agent, launcher: HonestLauncher, job_id: str) -> None:
    job = agent.job(job_id)
    assert job.stopped_by is None and job.running, (
        f"the job was stopped ({job.stopped_by}) while the flood ran"
    )
    assert launcher.replies, "no honest poll got through"
    assert max(launcher.times) < QUICK_S, f"an honest poll took {max(launcher.times):.1f} s under the flood"


@pytest.mark.slow
def test_a_probe_flood_neither_stops_a_job_nor_holds_the_agents_threads(shared: Path) -> None:
    hole = BlackHole("127.0.0.2")  # member c's agent: accepts and never answers
    agent = make_agent(
        shared / "work",
        write_worker(shared, QUIET_WORKER),
        limits=SMALL_POOL,
        heartbeat_timeout_s=HEARTBEAT_S,
        peer_port=hole.port,
    )
    try:
        with agent:
            _start_job(agent, "probed")
            body = {"targets": [{"name": "c", "url": f"http://127.0.0.2:{hole.port}"}], "bytes": 1024}
            with HonestLauncher(agent, "probed") as launcher:
                results = _flood(lambda: signed(agent.url, "POST", "/v1/probe", body, timeout=FLOOD_S), 24)
            _job_kept_its_heartbeat(agent, launcher, "probed")
            refused = [r for r in results if r[1] == 429]
            assert len(refused) >= 22, f"the flood's probes were not refused: {results}"
            assert all(seconds < QUICK_S for seconds, _, _ in refused), refused
            assert "already running a probe" in refused[0][2]
            hole.close()
    finally:
        hole.close()


@pytest.mark.slow
def test_a_profile_flood_neither_stops_a_job_nor_holds_the_agents_threads(shared: Path) -> None:
    release = shared / "release"
    script = shared / "report.py"
    script.write_text(SLOW_REPORT)
    script.chmod(0o644)
    agent = make_agent(
        shared / "work",
        write_worker(shared, QUIET_WORKER),
        limits=SMALL_POOL,
        heartbeat_timeout_s=HEARTBEAT_S,
        profile_command=[sys.executable, str(script), str(release)],
        profile_timeout_s=30.0,
    )
    with agent:
        try:
            _start_job(agent, "profiled")

            def devices(hidden: int = 64) -> Callable[[], tuple[int, Any]]:
                body = {"model_config": {**CONFIG, "hidden_size": hidden}, "workload": WORKLOAD}
                return lambda: signed(agent.url, "POST", "/v1/devices", body, timeout=FLOOD_S)

            with HonestLauncher(agent, "profiled") as launcher:
                other = _flood(devices(128), 4)  # while the first of them is measured
                same = _flood(devices(), 20)
            _job_kept_its_heartbeat(agent, launcher, "profiled")
            refused = [r for r in same + other if r[1] == 503]
            assert len(refused) >= 22, f"the flood's profiles were not refused: {same + other}"
            assert all(seconds < QUICK_S for seconds, _, _ in refused), refused
            assert any("profiling another model shape" in error for _, _, error in refused), refused
            release.touch()  # the profile under way ends, and its report is kept
            body = {"model_config": {**CONFIG, "hidden_size": 128}, "workload": WORKLOAD}
            deadline = time.monotonic() + 10.0
            while (answer := signed(agent.url, "POST", "/v1/devices", body))[0] == 503:
                assert time.monotonic() < deadline, answer
                time.sleep(0.1)
            assert answer[0] == 200 and answer[1]["devices"][0]["name"] == "cpu", answer
        finally:
            release.touch()


@pytest.mark.slow
def test_a_flood_of_long_polls_on_one_job_does_not_stop_another(shared: Path) -> None:
    agent = make_agent(
        shared / "work",
        write_worker(shared, QUIET_WORKER),
        limits=SMALL_POOL,
        heartbeat_timeout_s=HEARTBEAT_S,
    )
    with agent:
        _start_job(agent, "flooder")
        _start_job(agent, "victim")
        ends = time.monotonic() + FLOOD_S

        def long_polls() -> tuple[int, Any]:
            while time.monotonic() < ends:
                answer = signed(agent.url, "GET", "/v1/jobs/flooder/events?after=1&wait=30", timeout=FLOOD_S)
            return answer

        with HonestLauncher(agent, "victim") as launcher:
            _flood(long_polls, 24)
        _job_kept_its_heartbeat(agent, launcher, "victim")
        assert agent.job("flooder").stopped_by is None, "the flooder's own polls kept its job alive too"


def test_the_profile_cache_is_bounded_and_keeps_the_most_recently_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from shardpool.agent import profiling

    profiler = profiling.DeviceProfiler(SimpleNamespace(), SimpleNamespace(running=True))  # type: ignore[arg-type]
    measured: list[int] = []

    def measure(shape: Any, workload: Any) -> list[dict[str, Any]]:
        measured.append(shape.hidden_size)
        return [{"name": "cpu", "hidden": shape.hidden_size}]

    monkeypatch.setattr(profiler, "_measure", measure)

    def ask(hidden: int) -> None:
        profiler.devices({"model_config": {**CONFIG, "hidden_size": hidden}, "workload": WORKLOAD})

    ask(64)
    for index in range(1, 24):
        ask(64 + 4 * index)
        ask(64)  # used again each time: it stays
    assert len(profiler._reports) <= 16, "the agent keeps a report of every shape ever asked for"
    assert measured.count(64) == 1, "the most recently used shape was evicted"
    ask(68)  # the oldest other shape was evicted: measured again
    assert measured.count(68) == 2


# ---------------------------------------------------------------------- probe targets


@pytest.fixture
def agent(shared: Path) -> Iterator[Agent]:
    with make_agent(shared / "work", None) as running:
        yield running


def _probe(agent: Agent, *urls: str) -> tuple[int, Any]:
    targets = [{"name": f"t{index}", "url": url} for index, url in enumerate(urls)]
    return signed(agent.url, "POST", "/v1/probe", {"targets": targets, "bytes": 1024}, timeout=10)


def test_a_probe_of_the_agent_itself_is_refused(agent: Agent) -> None:
    status, reply = _probe(agent, agent.url)
    assert status == 400 and "is this member" in reply["error"], reply


def test_a_probe_naming_a_member_twice_is_refused(agent: Agent) -> None:
    started = time.monotonic()
    status, reply = _probe(agent, "http://127.0.0.2:9", "http://127.0.0.2:10")
    assert status == 400 and "named twice" in reply["error"], reply
    assert time.monotonic() - started < QUICK_S, "the probe measured before refusing"


def test_a_probe_of_a_non_member_is_refused(agent: Agent) -> None:
    status, reply = _probe(agent, "http://192.0.2.99:7710")
    assert status == 403 and "not a mesh member" in reply["error"], reply


def test_a_probe_moves_at_most_its_echo_cap(agent: Agent) -> None:
    targets = [{"name": "c", "url": "http://127.0.0.2:9"}]
    status, reply = signed(agent.url, "POST", "/v1/probe", {"targets": targets, "bytes": 32 * 2**20})
    assert status == 400 and "bytes must be an integer from 1 to 16777216" in reply["error"], reply


# ---------------------------------------------------------------------- the local socket

#: Opens ``count`` connections to the agent's socket as this process's uid and trickles their
#: bodies, one byte a second, until killed: each holds a handler thread that reads its body.
TRICKLER = """
import socket, sys, time
path, count = sys.argv[1], int(sys.argv[2])
held = []
for _ in range(count):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(b"POST /v1/local/forward HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 1000\\r\\n\\r\\n{")
    held.append(sock)
print("ready", flush=True)
while True:
    time.sleep(1)
    for sock in held:
        try:
            sock.send(b" ")
        except OSError:
            pass
"""


@pytest.mark.slow
def test_one_user_cannot_hold_the_local_sockets_threads(shared: Path) -> None:
    socket_path = shared / "run" / "agent.sock"
    socket_path.parent.mkdir(mode=0o755)
    agent = make_agent(shared / "work", None, socket_path=socket_path)
    with agent:
        trickler = subprocess.Popen(
            [sys.executable, "-I", "-c", TRICKLER, str(socket_path), "80"],
            stdout=subprocess.PIPE, text=True, user=65534, group=LAUNCH_GID, cwd="/",
        )  # fmt: skip
        try:
            assert trickler.stdout is not None and trickler.stdout.readline().strip() == "ready"
            time.sleep(0.5)  # the held requests have reached their handlers
            started = time.monotonic()
            status, reply = local_call(socket_path, "GET", "/v1/local/members", **group_member(65533))
            elapsed = time.monotonic() - started
            assert status == 200 and reply["self"] == "b", reply
            assert elapsed < QUICK_S, f"another user waited {elapsed:.1f} s for a free handler thread"
        finally:
            trickler.kill()
            trickler.wait()


# ---------------------------------------------------------------------- buffered events


def test_a_jobs_buffered_events_are_bounded_in_bytes(caplog: pytest.LogCaptureFixture) -> None:
    job = Job("chatty", Path("/nonexistent"), 10_000, Member("a", "127.0.0.1", "k", True))
    big = {"event": "eval", "filler": "x" * (512 * 1024)}
    for index in range(64):  # 32 MiB of events, far beyond what a job keeps
        job.add_event(0, {**big, "i": index})
    kept = sum(len(json.dumps(entry["event"])) for entry in job.events)
    assert kept <= 8 * 2**20, f"the job buffers {kept >> 20} MiB of events"
    assert job.events[-1]["event"]["i"] == 63, "the newest event is kept"
    snapshot = job.snapshot(0)
    assert snapshot["lost"] == 64 - len(job.events) > 0 and snapshot["events"][0]["seq"] == 65 - len(
        job.events
    )
    assert "dropping the oldest" in caplog.text
