"""A process outside the job cannot steer a run through the rendezvous store or its gloo ports
(issue 39, finding 1).

Any local user can reach the launcher's store and every rank's gloo listening port. In a real
local 2-stage run (re-sharded after step 2, the step-boundary copies and the grow check on):

* an outsider writes a grow decision of its own (it would move the ranks to a job of its making,
  stage 0 swapped for stage 1) and a garbled re-balance answer into the store before the ranks read
  them: each is refused in one logged line, and the run trains exactly what a clean run trains;
* a stranger keeps connecting to the ranks' gloo ports and sending garbage: same adapter; and
  those ports listen on loopback only.
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
from shardpool.elastic.messages import decision_key, encode_growth, grow_key
from shardpool.elastic.rank import KEEP_STATE_HOOK
from shardpool.finetune import finetune
from shardpool.launch.run import RUN_DIR_NAME
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
