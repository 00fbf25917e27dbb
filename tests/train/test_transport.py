"""Which backend carries each boundary and each replica group, for every pair of device kinds.

These are the decisions that keep NCCL away from CPU tensors and from ranks whose torch has no
NCCL; the CUDA branches they choose run only on a GPU (scripts/gpu_check.py).
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from shardpool.train.transport import (
    DEVICE_KINDS,
    RankDevice,
    boundary_transport,
    decode_rank_device,
    encode_rank_device,
    plan_groups,
    staging_is_pinned,
)

GPU = {kind: RankDevice(kind, native_available=True) for kind in DEVICE_KINDS}

# (left kind, right kind) -> backend, for ranks whose torch has every native backend it could.
EXPECTED_BOUNDARY = {
    ("cuda", "cuda"): "nccl",
    ("rocm", "rocm"): "nccl",
    ("xpu", "xpu"): "xccl",
}


@pytest.mark.parametrize(("left", "right"), list(itertools.product(DEVICE_KINDS, repeat=2)))
def test_every_pair_of_kinds_gets_native_only_when_both_sides_share_a_gpu_library(
    left: str, right: str
) -> None:
    transport = boundary_transport(
        RankDevice(left, True, place="a"),
        RankDevice(right, True, place="b"),  # type: ignore[arg-type]
    )
    expected = EXPECTED_BOUNDARY.get((left, right), "gloo")
    assert transport.backend == expected
    assert transport.staged == (expected == "gloo")
    # symmetric: the two sides of a boundary must agree
    assert (
        boundary_transport(RankDevice(right, True, place="b"), RankDevice(left, True, place="a")).backend
        == expected  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("kind", ["cuda", "rocm", "xpu"])
def test_a_side_without_the_native_backend_falls_back_to_gloo(kind: str) -> None:
    with_backend = RankDevice(kind, True, place="a")  # type: ignore[arg-type]
    without = RankDevice(kind, False, place="b")  # type: ignore[arg-type]
    assert boundary_transport(with_backend, without).backend == "gloo"
    assert boundary_transport(without, with_backend).backend == "gloo"


def test_two_stages_on_one_gpu_use_gloo_because_nccl_refuses_duplicate_devices() -> None:
    same = boundary_transport(RankDevice("cuda", True, "h/cuda:0"), RankDevice("cuda", True, "h/cuda:0"))
    other = boundary_transport(RankDevice("cuda", True, "h/cuda:0"), RankDevice("cuda", True, "h/cuda:1"))
    assert same.backend == "gloo" and other.backend == "nccl"


def test_host_staging_is_pinned_only_for_devices_with_dma() -> None:
    assert [kind for kind in DEVICE_KINDS if staging_is_pinned(kind)] == ["cuda", "rocm", "xpu"]


def test_mixed_pipeline_makes_nccl_pairs_only_between_cuda_neighbours() -> None:
    # cuda:0 (A) -> cuda:0 (B) -> cpu (B) -> mps (Mac) -> cuda:1 (B)
    devices = [
        RankDevice("cuda", True, "A/cuda:0"),
        RankDevice("cuda", True, "B/cuda:0"),
        RankDevice("cpu", False, "B/cpu"),
        RankDevice("mps", False, "Mac/mps"),
        RankDevice("cuda", True, "B/cuda:1"),
    ]
    plan = plan_groups(devices, num_stages=5, replicas=1)
    assert plan.subgroups == (("nccl", (0, 1)), ("nccl", (1, 0)))  # one per direction
    assert [plan.boundaries[(i, i + 1)].backend for i in range(4)] == ["nccl", "gloo", "gloo", "gloo"]
    assert plan.replica_groups == {}
    # the Mac and the CPU rank belong to no subgroup, so they never construct an NCCL group
    assert plan.subgroups_of(2) == [] and plan.subgroups_of(3) == []
    assert plan.subgroups_of(1) == [("nccl", (0, 1)), ("nccl", (1, 0))]


def test_all_cuda_replicas_on_distinct_gpus_all_reduce_over_nccl() -> None:
    # 2 replicas × 2 stages, every rank on its own GPU of one host
    devices = [RankDevice("cuda", True, f"h/cuda:{index}") for index in range(4)]
    plan = plan_groups(devices, num_stages=2, replicas=2)
    assert plan.replica_groups == {0: ("nccl", (0, 2)), 1: ("nccl", (1, 3))}
    assert plan.subgroups == (
        ("nccl", (0, 1)),
        ("nccl", (1, 0)),
        ("nccl", (2, 3)),
        ("nccl", (3, 2)),
        ("nccl", (0, 2)),
        ("nccl", (1, 3)),
    )
    # every rank creates its groups in the same relative order
    assert plan.subgroups_of(0) == [("nccl", (0, 1)), ("nccl", (1, 0)), ("nccl", (0, 2))]
    assert plan.subgroups_of(2) == [("nccl", (2, 3)), ("nccl", (3, 2)), ("nccl", (0, 2))]


def test_replicas_that_mix_kinds_or_share_a_device_reduce_over_gloo() -> None:
    mixed = [RankDevice("cuda", True, "A/cuda:0"), RankDevice("rocm", True, "B/cuda:0")]
    assert plan_groups(mixed, num_stages=1, replicas=2).replica_groups == {0: ("gloo", (0, 1))}
    shared = [RankDevice("cuda", True, "A/cuda:0"), RankDevice("cuda", True, "A/cuda:0")]
    assert plan_groups(shared, num_stages=1, replicas=2).replica_groups == {0: ("gloo", (0, 1))}
    cpus = [RankDevice("cpu", False, "A/cpu"), RankDevice("cpu", False, "B/cpu")]
    assert plan_groups(cpus, num_stages=1, replicas=2).subgroups == (("gloo", (0, 1)),)


def test_no_rank_is_ever_put_in_a_group_of_a_backend_its_torch_lacks() -> None:
    kinds = [
        RankDevice(kind, native, f"h{index}/{kind}")
        for index, (kind, native) in enumerate(itertools.product(DEVICE_KINDS, (True, False)))
    ]
    for devices in itertools.product(kinds, repeat=3):
        for stages, replicas in ((3, 1), (1, 3)):
            plan = plan_groups(list(devices), num_stages=stages, replicas=replicas)
            for backend, ranks in plan.subgroups:
                if backend != "gloo":
                    assert all(devices[rank].native_backend == backend for rank in ranks), (devices, plan)


def test_every_rank_asks_for_every_subgroup_in_one_order_and_only_members_ask_natively() -> None:
    # A chain of three CUDA stages: the middle rank belongs to both NCCL pairs. torch names a group
    # from a per-process count, so every rank must make the same calls in the same order.
    plan = plan_groups(
        [RankDevice("cuda", True, f"h{index}/cuda:0") for index in range(3)], num_stages=3, replicas=1
    )
    calls = {rank: plan.creation_calls(rank) for rank in range(3)}
    assert {tuple(ranks for _, ranks, _ in calls[rank]) for rank in range(3)} == {
        ((0, 1), (1, 0), (1, 2), (2, 1))
    }
    assert calls[1] == [
        ("nccl", (0, 1), True),
        ("nccl", (1, 0), True),
        ("nccl", (1, 2), True),
        ("nccl", (2, 1), True),
    ]
    assert calls[2] == [
        ("gloo", (0, 1), False),
        ("gloo", (1, 0), False),
        ("nccl", (1, 2), True),
        ("nccl", (2, 1), True),
    ]
    # A rank whose torch has no NCCL never names it, whatever the plan.
    mixed = [
        RankDevice("cuda", True, "A/cuda:0"),
        RankDevice("cuda", True, "A/cuda:1"),
        RankDevice("mps", False, "M/mps"),
    ]
    plan = plan_groups(mixed, num_stages=3, replicas=1)
    assert plan.creation_calls(2) == [("gloo", (0, 1), False), ("gloo", (1, 0), False)]


def test_rank_device_codes_round_trip() -> None:
    for kind in DEVICE_KINDS:
        for native in (True, False):
            device = RankDevice(kind, native, "h/x")
            assert decode_rank_device(encode_rank_device(device), "h/x") == device
    with pytest.raises(ValueError, match="out of range"):
        decode_rank_device(99)


def test_the_transport_choice_imports_no_torch() -> None:
    code = "import sys, shardpool.train.transport; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
