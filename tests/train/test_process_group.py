"""join_process_group and Wire in real processes: subgroups made only by their members, the wire
dtype cast on arrival, and every step-end collective on the host (issue 11).

The CPU test runs four gloo ranks that *claim* mixed devices (two CUDA ranks with NCCL, a Mac and a
CPU box without) so the group plan has an NCCL pair. Its ``new_group`` calls are recorded, and the
members of the NCCL pair build it with gloo, since this machine has no NCCL: what is shown is who
asks for which group and who builds it (the Mac and the CPU box never ask for NCCL and build only
their own replica group), that every rank gets through group creation, and what crosses the wire,
not that NCCL works. Rank 0 makes two groups and rank 2 one, which is the case that hung with
``use_local_synchronization=True`` (torch hashes a per-process group count into the group's name,
so rank 0 and rank 2 named their common group differently and both timed out). The tests that
need a GPU are skipped without one.
"""

from __future__ import annotations

import hmac
import multiprocessing
import subprocess
import sys
import textwrap
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardpool.elastic.messages import PeerKey, control_key
from shardpool.errors import ShardpoolError
from shardpool.train import process_group
from shardpool.train.loss import gather_timings, reduce_and_clip_gradients
from shardpool.train.process_group import Link, Wire, join_process_group
from shardpool.train.transport import RankDevice
from tests.helpers.training import REPO_ROOT

#: What each of the four ranks claims to be: 2 stages x 2 replicas, rank = replica * 2 + stage.
CLAIMED = [
    RankDevice("cuda", True, "A/cuda:0"),
    RankDevice("cuda", True, "A/cuda:1"),
    RankDevice("mps", False, "Mac/mps"),
    RankDevice("cpu", False, "B/cpu"),
]
#: Rank 2 sends in bf16; rank 3 computes in fp16: the tensor must arrive cast, not reinterpreted.
WIRE_DTYPE, RECEIVER_DTYPE = torch.bfloat16, torch.float16
#: Not exactly representable in bf16 or fp16, so a missing cast or a wrong wire dtype shows.
SENT = torch.tensor([[[1.0 + 2**-10, -3.14159, 1000.3, 2**-20]]])
TIMEOUT = timedelta(seconds=60)


def _claimed_rank(store_path: str, rank: int) -> dict[str, Any]:
    """One rank of the CPU test: join, record subgroup calls, move a tensor, reduce gradients."""
    calls: list[tuple[str, tuple[int, ...], bool]] = []
    real_new_group = dist.new_group

    def recording_new_group(ranks: list[int], *, backend: str, **kwargs: Any) -> Any:
        group = real_new_group(ranks, backend="gloo", **kwargs)  # no NCCL on this machine
        calls.append((backend, tuple(ranks), group is not dist.GroupMember.NON_GROUP_MEMBER))
        return group

    dist.new_group = recording_new_group  # type: ignore[assignment]
    process_group.local_rank_device = lambda device, place: CLAIMED[rank]  # type: ignore[assignment]
    store = dist.FileStore(store_path, len(CLAIMED))
    groups = join_process_group(
        store=store,
        rank=rank,
        world_size=4,
        num_stages=2,
        replicas=2,
        device=torch.device("cpu"),
        places=[claimed.place for claimed in CLAIMED],
        timeout=TIMEOUT,
    )
    report: dict[str, Any] = {"calls": calls}
    stage, replica = rank % 2, rank // 2
    compute = RECEIVER_DTYPE if rank == 3 else torch.float32
    wire = Wire.for_rank(
        groups,
        rank=rank,
        is_first=stage == 0,
        is_last=stage == 1,
        device=torch.device("cpu"),
        wire_dtype=WIRE_DTYPE,
        compute_dtype=compute,
    )
    link = wire.next if stage == 0 else wire.previous
    assert link is not None
    report["staged"] = link.staged
    if stage == 0:
        wire.send(SENT, link, tag=1)
        wire.flush()
        report["gradient"] = _plain(wire.recv(tuple(SENT.shape), link, tag=2))
        report["bytes_sent"] = wire.bytes_sent
    else:
        arrived = wire.recv(tuple(SENT.shape), link, tag=1)
        report["arrived"] = _plain(arrived)
        wire.send(arrived * 2, link, tag=2)
        wire.flush()
    # Gradients: replica r's are all (r + 1); the replica group sums them, the world adds norms.
    grads = [torch.full((3,), float(replica + 1)), torch.full((2, 2), float(replica + 1))]
    norm, loss, finite = reduce_and_clip_gradients(
        grads, groups.replicas(stage), loss=float(rank), replicas=2, max_grad_norm=0.0
    )
    report |= {"grads": [grad.tolist() for grad in grads], "norm": norm, "loss": loss, "finite": finite}
    report["timings"] = gather_timings(float(rank), 0.0, 0, 4)
    return report


def _plain(tensor: torch.Tensor) -> tuple[str, list[Any]]:
    """A tensor as (dtype name, values): tensors put on a queue would be shared memory that dies with the rank."""
    return str(tensor.dtype).removeprefix("torch."), tensor.tolist()


def _tensor(plain: tuple[str, list[Any]]) -> torch.Tensor:
    name, values = plain
    return torch.tensor(values, dtype=getattr(torch, name))


def _rank_main(body: Any, store_path: str, rank: int, results: Any) -> None:
    """A rank's process: run ``body`` (it joins the group and returns the rank's report), leave the
    group together, and put the report (or the traceback) on ``results`` for the parent."""
    try:
        report = body(store_path, rank)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, report))
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, {"error": traceback.format_exc()}))


def _run_ranks(body: Any, world: int, tmp_path: Path) -> dict[int, dict[str, Any]]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    store_path = str(tmp_path / "store")
    processes = [
        context.Process(target=_rank_main, args=(body, store_path, rank, results)) for rank in range(world)
    ]
    for process in processes:
        process.start()
    reports = dict(results.get(timeout=180) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    errors = {rank: report["error"] for rank, report in reports.items() if "error" in report}
    assert not errors, errors
    return reports


@pytest.mark.slow
def test_subgroups_are_made_by_their_members_only_and_the_wire_casts_on_arrival(tmp_path: Path) -> None:
    reports = _run_ranks(_claimed_rank, 4, tmp_path)
    # Every rank asks for every subgroup in one order; only members build one (the third field).
    # The NCCL pair (0, 1) is built by ranks 0 and 1 alone; the Mac (2) and the CPU box (3) ask
    # for it as gloo and get torch's non-member placeholder. Replica groups mix kinds: gloo.
    # The NCCL boundary has one group per direction, (0, 1) for activations and (1, 0) for gradients.
    pair_member = [("nccl", (0, 1), True), ("nccl", (1, 0), True)]
    pair_outsider = [("gloo", (0, 1), False), ("gloo", (1, 0), False)]
    assert reports[0]["calls"] == [*pair_member, ("gloo", (0, 2), True), ("gloo", (1, 3), False)]
    assert reports[1]["calls"] == [*pair_member, ("gloo", (0, 2), False), ("gloo", (1, 3), True)]
    assert reports[2]["calls"] == [*pair_outsider, ("gloo", (0, 2), True), ("gloo", (1, 3), False)]
    assert reports[3]["calls"] == [*pair_outsider, ("gloo", (0, 2), False), ("gloo", (1, 3), True)]
    assert [reports[rank]["staged"] for rank in range(4)] == [False, False, True, True]
    # Rank 2 -> 3 crossed in bf16 (2 bytes each) and arrived cast to rank 3's fp16.
    arrived = _tensor(reports[3]["arrived"])
    assert arrived.dtype == RECEIVER_DTYPE
    assert torch.equal(arrived, SENT.to(WIRE_DTYPE).to(RECEIVER_DTYPE))
    assert not torch.equal(arrived.float(), SENT)
    assert reports[2]["bytes_sent"] == SENT.numel() * 2
    # The gradient came back through the wire dtype and arrived in rank 2's fp32.
    gradient = _tensor(reports[2]["gradient"])
    assert gradient.dtype == torch.float32
    assert torch.equal(gradient, (arrived * 2).to(WIRE_DTYPE).float())
    # Replica sums (1 + 2) on every rank, the global norm over both stages' summed gradients
    # (each stage: 7 elements of 3), divided as the replicas' mean; the loss summed over all ranks.
    for rank in range(4):
        report = reports[rank]
        assert report["grads"] == [[3.0] * 3, [[3.0, 3.0], [3.0, 3.0]]]
        assert report["norm"] == pytest.approx((2 * 2 * 7 * 9 / 2) ** 0.5)
        assert report["loss"] == 0 + 1 + 2 + 3 and report["finite"]
        assert report["timings"][0] == [0.0, 1.0, 2.0, 3.0]


def _pair_wire(
    store_path: str, rank: int, device: torch.device, places: list[str], wire_dtype: torch.dtype
) -> tuple[Wire, Link]:
    """Rank ``rank`` of a two-stage pipeline joined over ``store_path``: its wire (fp32 compute)
    and its link to the other rank."""
    store = dist.FileStore(store_path, 2)
    groups = join_process_group(
        store=store, rank=rank, world_size=2, num_stages=2, replicas=1,
        device=device, places=places, timeout=TIMEOUT,
    )  # fmt: skip
    wire = Wire.for_rank(
        groups, rank=rank, is_first=rank == 0, is_last=rank == 1, device=device,
        wire_dtype=wire_dtype, compute_dtype=torch.float32,
    )  # fmt: skip
    link = wire.next if rank == 0 else wire.previous
    assert link is not None
    return wire, link


def _pipeline_pair_rank(store_path: str, rank: int) -> dict[str, Any]:
    """Rank 0 sends four activations, each answered by a gradient before the next, and says each
    was delivered when its gradient came: it reports the sends it holds after each send."""
    wire, link = _pair_wire(store_path, rank, torch.device("cpu"), ["h/cpu", "g/cpu"], torch.float32)
    report: dict[str, Any] = {"held": [], "arrived": []}
    for index in range(4):
        if rank == 0:
            wire.send(torch.full((2, 3), float(index)), link, tag=1)
            report["held"].append(len(wire.pending))
            wire.recv((1,), link, tag=2)
            wire.delivered(link, 1, through=index)
        else:
            report["arrived"].append(wire.recv((2, 3), link, tag=1).tolist())
            wire.send(torch.ones(1), link, tag=2)
    report["held_at_flush"] = len(wire.pending)
    wire.flush()
    return report


@pytest.mark.slow
def test_over_gloo_an_activation_is_let_go_when_its_gradient_comes_back(tmp_path: Path) -> None:
    reports = _run_ranks(_pipeline_pair_rank, 2, tmp_path)
    # One activation held at a time, not 1, 2, 3, 4 until the step's end (gloo never reports a
    # send complete by itself: without delivered() this is [1, 2, 3, 4]).
    assert reports[0]["held"] == [1, 1, 1, 1] and reports[0]["held_at_flush"] == 0
    assert reports[1]["arrived"] == [[[float(index)] * 3] * 2 for index in range(4)]


def _cuda_cpu_rank(store_path: str, rank: int) -> dict[str, Any]:
    """One rank of the GPU test: rank 0 on cuda:0, rank 1 on the CPU, as a real run places them."""
    device = torch.device("cuda:0" if rank == 0 else "cpu")
    wire, link = _pair_wire(store_path, rank, device, ["h/cuda:0", "h/cpu"], torch.bfloat16)
    report: dict[str, Any] = {"staged": link.staged, "pinned": link.pinned}
    if rank == 0:
        wire.send(SENT.to(device), link, tag=1)
        wire.flush()
        back = wire.recv(tuple(SENT.shape), link, tag=2)
        report["back"] = (back.device.type, _plain(back))
    else:
        arrived = wire.recv(tuple(SENT.shape), link, tag=1)
        wire.send(arrived, link, tag=2)
        wire.flush()
    _, _, finite = reduce_and_clip_gradients(
        [torch.ones(3, device=device)], None, loss=1.0, replicas=1, max_grad_norm=1.0
    )
    report["finite"] = finite
    return report


@pytest.mark.slow
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (pinned staging of cuda<->cpu)"
)
def test_a_cuda_to_cpu_boundary_stages_through_pinned_host_memory(tmp_path: Path) -> None:
    reports = _run_ranks(_cuda_cpu_rank, 2, tmp_path)
    assert (reports[0]["staged"], reports[0]["pinned"]) == (True, True)
    assert (reports[1]["staged"], reports[1]["pinned"]) == (True, False)
    device_type, back = reports[0]["back"]
    assert device_type == "cuda" and torch.equal(_tensor(back), SENT.to(torch.bfloat16).float())
    assert reports[0]["finite"] and reports[1]["finite"]


LONE_STAGE = textwrap.dedent(
    """
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from shardpool.train.process_group import (
        join_process_group, leave_process_group, others_in_world, world_barrier,
    )

    groups = join_process_group(
        store=None, rank=0, world_size=1, num_stages=1, replicas=1, device=torch.device("cpu"),
        places=["local/cpu"], timeout=timedelta(seconds=10),
    )
    assert not dist.is_initialized()
    assert groups.replicas(0) is None and groups.created == {}
    assert not others_in_world()
    world_barrier()
    leave_process_group()
    names = {open(f"/proc/self/task/{tid}/comm").read().strip() for tid in os.listdir("/proc/self/task")}
    assert not any(name.startswith(("gloo", "pt_gloo", "pt_tcpstore")) for name in names), names
    print("ok")
    """
)


@pytest.mark.slow
def test_a_lone_stage_joins_no_group_and_starts_no_transport_thread() -> None:
    result = subprocess.run(
        [sys.executable, "-c", LONE_STAGE], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize(
    ("device", "selected"),
    [("cuda:1", "cuda:1"), ("xpu:1", "xpu:1"), ("cpu", None), ("mps", None)],
)
def test_a_rank_makes_its_own_gpu_current_before_its_groups(
    monkeypatch: pytest.MonkeyPatch, device: str, selected: str | None
) -> None:
    """NCCL and XCCL build a rank's communicators on the current device: an XPU rank left at
    xpu:0 would put every rank's on the first card."""
    calls: list[torch.device] = []

    class _Module:
        @staticmethod
        def set_device(chosen: torch.device) -> None:
            calls.append(chosen)

    monkeypatch.setattr(process_group.torch, "get_device_module", lambda _: _Module)
    process_group.select_device(torch.device(device))
    assert calls == ([] if selected is None else [torch.device(selected)])


# ----- peers prove the run's key (issue 39) -------------------------------------------------------
#: The control key of the run the honest ranks belong to, and one a stranger might hold.
RUN_KEY, OTHER_KEY = (
    control_key("r" * 64, addr="127.0.0.1", port=1),
    control_key("x" * 64, addr="127.0.0.1", port=1),
)


class _Recorded:
    """The run's :class:`PeerKey` (``key``), noting every proof this rank checked (group, prover)."""

    def __init__(self, key: bytes) -> None:
        self.peers = PeerKey(hmac.new(key, b"peer", "sha256").digest(), 0)
        self.checked: list[tuple[str, int]] = []

    def challenge(self) -> bytes:
        return self.peers.challenge()

    def answer(self, group: str, *, prover: int, verifier: int, nonce: bytes) -> bytes:
        return self.peers.answer(group, prover=prover, verifier=verifier, nonce=nonce)

    def check(self, group: str, *, prover: int, verifier: int, nonce: bytes, proof: bytes) -> None:
        self.checked.append((group, prover))
        self.peers.check(group, prover=prover, verifier=verifier, nonce=nonce, proof=proof)


def _proving_rank(store_path: str, rank: int, *, world: int, replicas: int, key: bytes) -> dict[str, Any]:
    peers = _Recorded(key)
    try:
        join_process_group(
            store=dist.FileStore(store_path, world), rank=rank, world_size=world,
            num_stages=world // replicas, replicas=replicas, device=torch.device("cpu"),
            places=[f"h{index}/cpu" for index in range(world)], timeout=TIMEOUT, peers=peers,
        )  # fmt: skip
    except ShardpoolError as error:
        return {"refused": str(error), "checked": peers.checked}
    return {"checked": peers.checked}


def _honest_rank(store_path: str, rank: int) -> dict[str, Any]:
    return _proving_rank(store_path, rank, world=4, replicas=2, key=RUN_KEY)


def _rank_2_holds_another_key(store_path: str, rank: int) -> dict[str, Any]:
    return _proving_rank(store_path, rank, world=3, replicas=1, key=OTHER_KEY if rank == 2 else RUN_KEY)


@pytest.mark.slow
def test_every_pair_of_the_world_and_of_each_gloo_subgroup_proves_the_runs_key(tmp_path: Path) -> None:
    reports = _run_ranks(_honest_rank, 4, tmp_path)
    assert all("refused" not in report for report in reports.values())
    # 2 stages x 2 replicas on CPUs: the world, and the replica groups (0, 2) and (1, 3), all gloo.
    assert reports[0]["checked"] == [("world", 1), ("world", 2), ("world", 3), ("gloo[0, 2]", 2)]
    assert reports[3]["checked"] == [("world", 0), ("world", 1), ("world", 2), ("gloo[1, 3]", 1)]


@pytest.mark.slow
def test_a_rank_without_the_runs_key_is_refused_by_every_peer_in_one_line(tmp_path: Path) -> None:
    reports = _run_ranks(_rank_2_holds_another_key, 3, tmp_path)
    line = "rank 2 of group world (generation 0) did not prove the run's key: a process outside the run took its place"
    assert reports[0]["refused"] == line and reports[1]["refused"] == line
    assert reports[2]["refused"].startswith(
        "rank 0 of group world (generation 0) did not prove the run's key"
    )
