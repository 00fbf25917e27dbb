"""A process outside the job cannot steer a run through the rendezvous store or its gloo ports
(issue 39, finding 1).

Any local user can reach the launcher's store and every rank's gloo listening port. In a real
local 2-stage run (re-sharded after step 2, the step-boundary copies and the grow check on):

* an outsider writes a grow decision of its own (it would move the ranks to a job of its making,
  stage 0 swapped for stage 1) and a garbled re-balance answer into the store before the ranks read
  them: each is refused in one logged line, and the run trains exactly what a clean run trains;
* a stranger keeps connecting to the ranks' gloo ports and sending garbage: same adapter; and
  those ports listen on loopback only.

And with a real store and real beat threads under the launcher's own supervisor: an outsider that
adds to a stalled rank's beat key, or sets older sealed beats back, does not hide the stall; one
that adds to the joining ranks' ready count, or sets a joining rank's ready key unsealed, does not
make the launcher publish the growth before the rank is ready.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch.distributed as dist
from rich.console import Console
from safetensors.torch import load_file

from shardpool.config import parse_config
from shardpool.contract.job import Job
from shardpool.contract.rebalance import FORCE_ENV
from shardpool.elastic import messages
from shardpool.elastic.messages import (
    ControlStore,
    beat_key,
    control_key,
    decision_key,
    decode_growth,
    encode_growth,
    grow_key,
)
from shardpool.elastic.rank import KEEP_STATE_HOOK
from shardpool.elastic.rank_liveness import start_beat, store_client
from shardpool.finetune import finetune
from shardpool.launch.mesh_launcher import MeshLauncher
from shardpool.launch.run import RUN_DIR_NAME
from shardpool.train.rendezvous import rendezvous_store
from tests.elastic.test_supervisor import (
    _c_found_while_a_b_train,
    _job_on,
    _members,
    _plan,
    _run,
    _supervisor,
)
from tests.elastic.test_supervisor import _config as _supervisor_config
from tests.helpers.training import base_config

pytestmark = pytest.mark.slow

STEPS = 5
CHECK_AT = 2


def _config(model: Path, data: Path, out: Path) -> Any:
    return parse_config(
        base_config(
            model,
            data,
            out,
            max_steps=STEPS,
            val_set_size=0,
            shardpool={"layers": [3, 3], "rebalance": "auto"},
        )
    )


@pytest.fixture
def steered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both runs re-shard to 2 + 4 after step 2 and make step-boundary copies (rank 0 then looks for
    grow decisions after every step)."""
    monkeypatch.setenv(FORCE_ENV, f"{CHECK_AT}:0-2,2-6")
    monkeypatch.setenv(KEEP_STATE_HOOK, "1")


def _adapter_difference(one: Path, other: Path) -> float:
    reference = load_file(str(one / "adapter_model.safetensors"))
    adapter = load_file(str(other / "adapter_model.safetensors"))
    assert adapter.keys() == reference.keys()
    return max(float((adapter[key] - reference[key]).abs().max()) for key in reference)


def _job_when_written(out: Path, stop: threading.Event) -> Job | None:
    job_file = out / RUN_DIR_NAME / "job.json"
    while not stop.is_set():
        if job_file.is_file():
            try:
                return Job.read(job_file)
            except Exception:  # noqa: BLE001 - still being written
                pass
        time.sleep(0.02)
    return None


def _forge(out: Path, stop: threading.Event, done: list[str]) -> None:
    """The outsider: once the store is up, write a forged grow decision and a garbled re-balance answer."""
    job = _job_when_written(out, stop)
    if job is None:
        return
    store = dist.TCPStore(job.master_addr, job.master_port, is_master=False, timeout=timedelta(seconds=10))
    own = job.model_dump(mode="json") | {"generation": 1, "joining": False, "rebalance_at": None}
    own["stages"] = [dict(own["stages"][0], start=0, stop=5), dict(own["stages"][1], start=5, stop=6)]
    forged = encode_growth(own, {0: 1, 1: 0}, [(0, 3), (3, 6)]).encode()
    store.set(grow_key(1), forged)
    store.set(decision_key(CHECK_AT), b'{"layers": [[0, 1], [1, 6]')  # garbled
    done.append("forged")


def _stranger(stop: threading.Event, hits: list[int], addresses: set[str]) -> None:
    """The stranger: connect to every listening port of the stage processes and send garbage;
    ``addresses`` collects the addresses those ports listen on."""
    me = psutil.Process()
    while not stop.is_set():
        ports: set[int] = set()
        for child in me.children(recursive=True):
            try:
                if "shardpool.elastic.rank" in " ".join(child.cmdline()):
                    listening = [c.laddr for c in child.net_connections(kind="tcp") if c.status == "LISTEN"]
                    ports |= {address.port for address in listening}
                    addresses |= {address.ip for address in listening}
            except psutil.Error:
                continue
        for port in ports:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as connection:
                    connection.sendall(os.urandom(256))
                hits.append(port)
            except OSError:
                pass
        time.sleep(0.05)


def test_a_forged_grow_decision_and_a_garbled_rebalance_answer_change_nothing(
    tmp_path: Path, tiny_model: Path, completion_data: Path, steered: None
) -> None:
    clean = finetune(_config(tiny_model, completion_data, tmp_path / "clean"), console=Console(quiet=True))
    out = tmp_path / "forged"
    forged: list[str] = []
    stop = threading.Event()
    outsider = threading.Thread(target=_forge, args=(out, stop, forged), daemon=True)
    outsider.start()
    try:
        attacked = finetune(_config(tiny_model, completion_data, out), console=Console(quiet=True))
    finally:
        stop.set()
        outsider.join(timeout=15)
    assert forged == ["forged"]
    rank0 = (attacked / RUN_DIR_NAME / "logs" / "rank-0.log").read_text()
    assert "grew in place" not in rank0, "the outsider's grow decision was acted on"
    assert "refused a value in the rendezvous store: store value at 'shardpool/grow/1' is not sealed" in rank0
    assert "re-sharded layers [0, 3) -> [0, 2)" in rank0, "the launcher's own answer was taken"
    assert _adapter_difference(clean, attacked) < 1e-4


def test_a_stranger_on_the_ranks_gloo_ports_changes_nothing(
    tmp_path: Path, tiny_model: Path, completion_data: Path, steered: None
) -> None:
    clean = finetune(_config(tiny_model, completion_data, tmp_path / "clean"), console=Console(quiet=True))
    hits: list[int] = []
    addresses: set[str] = set()
    stop = threading.Event()
    stranger = threading.Thread(target=_stranger, args=(stop, hits, addresses), daemon=True)
    stranger.start()
    try:
        attacked = finetune(
            _config(tiny_model, completion_data, tmp_path / "strange"), console=Console(quiet=True)
        )
    finally:
        stop.set()
        stranger.join(timeout=15)
    assert hits, "the stranger reached a gloo port"
    assert addresses == {"127.0.0.1"}, "a local run's ranks listen on loopback only"
    assert _adapter_difference(clean, attacked) < 1e-4


# ----- beats and readiness: sealed values an outsider cannot raise (the counters they replaced) ----
def _sealing_client(port: int, secret: str) -> Any:
    """A factory of sealing clients of the store at ``port``, as a rank or the launcher holds one."""
    connect = store_client("127.0.0.1", port, timeout_s=10.0)
    key = control_key(secret, addr="127.0.0.1", port=port)
    return lambda: ControlStore(connect(), key)


def _outsider(port: int, keys: list[str], stop: threading.Event, tries: list[int]) -> None:
    """Add to each of ``keys`` (what raised the old counters), and set each key back to an older
    value it read there (a replay), until ``stop``; a client the store drops is replaced."""
    connect = store_client("127.0.0.1", port, timeout_s=10.0)
    client, seen = connect(), {key: [] for key in keys}  # type: dict[str, list[bytes]]
    while not stop.is_set():
        for key in keys:
            try:
                if client.check([key]):
                    seen[key].append(bytes(client.get(key)))
                    client.set(key, seen[key][max(len(seen[key]) - 5, 0)])
                tries.append(1)
                client.add(key, 1)
            except RuntimeError:  # the store drops a client that adds to a value that is not a number
                client = connect()
        time.sleep(0.02)


def test_an_outsider_adding_to_or_replaying_a_stalled_ranks_beat_does_not_hide_the_stall(
    tmp_path: Path,
) -> None:
    server, secret = rendezvous_store("127.0.0.1", timeout_s=10.0), "s" * 64
    connect = _sealing_client(server.port, secret)
    config = _supervisor_config(tmp_path, member_timeout_s=5.0)
    supervisor = _supervisor(tmp_path, config, {})
    job = _job_on(["a", "b"], keep_state=True)
    supervisor.begin(
        MeshLauncher(_members("a", "b"), say=print), _run(config, _plan(["a", "b"])), job, connect()
    )
    watch = supervisor.watch(job)
    assert watch is not None and watch.bound_s == 5.0
    beats = [
        start_beat(connect, rank, interval_s=0.1, key=lambda rank=rank: beat_key(rank)) for rank in (0, 1)
    ]
    stop, tries = threading.Event(), []  # type: threading.Event, list[int]
    outsider = threading.Thread(target=_outsider, args=(server.port, [beat_key(1)], stop, tries), daemon=True)
    try:
        time.sleep(1.0)
        assert watch.stalled() is None
        outsider.start()
        beats[1][1].set()  # rank 1 stalls (a SIGSTOP); rank 0 beats on
        stalled_at, found = time.monotonic(), None
        while found is None and time.monotonic() - stalled_at < 12.0:
            found = watch.stalled()
            found_after = time.monotonic() - stalled_at  # before the threads are joined below
            time.sleep(0.2)
    finally:
        stop.set()
        for _, stopping in beats:
            stopping.set()
        outsider.join(timeout=10)
    assert len(tries) > 10, "the outsider kept at it"
    assert found is not None, "the outsider's adds and replays hid rank 1's stall"
    assert found[0] == "b" and "(rank 1) stopped beating" in found[1]
    assert found_after < 9.0, "found within the bound, as if no one had touched the beat"


def test_an_outsider_adding_to_the_ready_count_does_not_start_a_growth_before_its_ranks_are_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, secret = rendezvous_store("127.0.0.1", timeout_s=10.0), "s" * 64
    connect = _sealing_client(server.port, secret)
    supervisor, _, _, _ = _c_found_while_a_b_train(tmp_path, monkeypatch, {})
    supervisor._store = launcher_store = connect()  # the launcher's sealed client of a real store
    order = supervisor.grow()
    assert order is not None and {name: ranks for name, (_, ranks) in order.joined.items()} == {"c": [2]}
    order.started = True  # the event loop started c's rank 2, which is still building its stage
    outsider = store_client("127.0.0.1", server.port, timeout_s=10.0)()
    outsider.add("shardpool/grow/1/ready", 5)  # the old shared counter
    outsider.set("shardpool/grow/1/ready/2", b'{"ready": 2}')  # rank 2's own key, unsealed
    supervisor._tick()
    assert launcher_store.peek(grow_key(1)) is None, "the grow decision went out before rank 2 was ready"
    connect().set(messages.ready_key(1, 2), messages.encode_ready(2))  # rank 2 is ready (sealed)
    supervisor._tick()
    growth = launcher_store.peek(grow_key(1))
    assert growth is not None and decode_growth(growth).ranks == {0: 0, 1: 1}
