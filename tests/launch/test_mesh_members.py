"""The launcher's view of the mesh (shardpool/launch/mesh_members.py): each member's device rows
become planner devices with their measured times and how they were measured; a row from an older
member's agent, without them, still plans with modeled times; the profile request carries only the
fields a profile depends on, so an agent from before a planner field was added still accepts it; a
card bitsandbytes' 4-bit probe failed on (an M40) takes layers on the PyTorch NF4 path unless the
config forces bitsandbytes."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shardpool.agent.client import AgentUnreachable
from shardpool.agent.profiling import _report_rows, devices_request
from shardpool.config import parse_config
from shardpool.launch.mesh_members import PROFILE_CONCURRENCY, MeshMember, mesh_fleet, mesh_planner
from shardpool.model.shape import ModelShape
from shardpool.plan import report
from shardpool.plan.costmodel import Workload
from shardpool.plan.device_facts import DeviceInfo, LayerProfile
from shardpool.plan.planner import plan_pipeline
from shardpool.plan.time_model import modeled_times

SHAPE_CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}  # fmt: skip
SHAPE = ModelShape.from_config_json(SHAPE_CONFIG, name="tiny")
WORKLOAD = Workload(sequence_len=16, lora_r=4, replicas=1, stages=2)
OLD_ROW = {"name": "cpu", "kind": "cpu", "label": "old cpu", "total_bytes": 8 << 30,
           "free_bytes": 4 << 30, "threads": 2, "seconds_per_layer": 0.5, "activation_bytes": 1024}  # fmt: skip
MEASURED = {"forward_seconds": 0.2, "embed_seconds": 0.01, "head_forward_seconds": 0.1,
            "head_backward_seconds": 0.12, "optimizer_seconds": 0.001, "runs": 5,
            "seconds_min": 0.45, "seconds_max": 0.6, "cpu_quota": 0.6, "ci95_rel": 0.03}  # fmt: skip


class FakeAgent:
    """A member's agent that answers /v1/devices with fixed rows and records the workload asked."""

    def __init__(self, name: str, rows: list[dict[str, Any]]) -> None:
        self.url = f"http://{name}:41000"
        self.rows = rows
        self.asked: list[dict[str, Any]] = []
        self.gone = False

    def health(self) -> dict[str, Any]:
        if self.gone:
            raise AgentUnreachable(f"agent at {self.url} did not answer GET /v1/health")
        return {"name": self.url}

    def devices(
        self, model_config: dict[str, Any], workload: dict[str, Any], *, timeout: float = 0
    ) -> list[dict[str, Any]]:
        if self.gone:
            pytest.fail("a member that failed its health check was asked to profile")
        self.asked.append(workload)
        return self.rows

    def probe(self, targets: dict[str, str], *, nbytes: int = 0) -> dict[str, dict[str, Any]]:
        return {name: {"bandwidth": 1e8, "latency": 1e-3} for name in targets}


def _fleet(new: FakeAgent, old: FakeAgent) -> Any:
    members = [MeshMember("new", "198.51.100.1", True, new), MeshMember("old", "198.51.100.2", False, old)]  # type: ignore[arg-type]
    return mesh_fleet(members, model_config={}, workload=WORKLOAD, say=lambda line: None)


def test_measured_fields_reach_the_planner_and_an_old_row_falls_back_to_modeled() -> None:
    new, old = FakeAgent("new", [{**OLD_ROW, **MEASURED, "label": "new cpu"}]), FakeAgent("old", [OLD_ROW])
    fleet = _fleet(new, old)
    measured, legacy = fleet.devices
    times = measured.times(SHAPE, WORKLOAD)
    assert (times.layer_forward_s, times.layer_backward_s) == pytest.approx((0.2, 0.3))
    assert (times.embed_s, times.head_forward_s, times.head_backward_s) == pytest.approx((0.01, 0.1, 0.12))
    assert times.optimizer_per_layer_s == pytest.approx(0.001)
    assert legacy.forward_seconds_per_layer is None and legacy.embed_seconds is None
    assert legacy.times(SHAPE, WORKLOAD) == modeled_times(SHAPE, WORKLOAD, layer_s=0.5, kind="cpu")

    plan = plan_pipeline(SHAPE, WORKLOAD, fleet)
    by_host = {stage["host"]: stage["measured"] for stage in plan.to_json()["stages"]}
    assert by_host["new"] == {
        "label": "new cpu", "threads": 2, "cpu_quota": 0.6, "runs": 5,
        "seconds_min": 0.45, "seconds_median": 0.5, "seconds_max": 0.6, "ci95_rel": 0.03, "co_run": None,
    }  # fmt: skip
    assert by_host["old"] == {
        "label": "old cpu", "threads": 2, "cpu_quota": None, "runs": None,
        "seconds_min": None, "seconds_median": 0.5, "seconds_max": None, "ci95_rel": None, "co_run": None,
    }  # fmt: skip


def test_the_profile_request_leaves_planner_only_fields_at_home() -> None:
    new, old = FakeAgent("new", [OLD_ROW]), FakeAgent("old", [OLD_ROW])
    _fleet(new, old)
    assert new.asked == old.asked == [WORKLOAD.profile_request()]
    assert not {"replicas", "stages", "max_stages", "gradient_accumulation_steps", "layers"} & set(
        new.asked[0]
    )


def test_shardpool_layers_on_the_mesh_keeps_the_split_and_puts_the_big_stage_on_the_fast_member(
    tmp_path: Path,
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SHAPE_CONFIG))
    fast, slow = FakeAgent("fast", [{**OLD_ROW, "seconds_per_layer": 0.1}]), FakeAgent("slow", [OLD_ROW])
    members = [
        MeshMember("fast", "198.51.100.1", True, fast),  # type: ignore[arg-type]
        MeshMember("slow", "198.51.100.2", False, slow),  # type: ignore[arg-type]
    ]
    config = parse_config(
        {"base_model": str(tmp_path), "datasets": [{"path": "x.jsonl", "type": "completion"}],
         "sequence_len": 16, "lora_r": 4, "lora_target_linear": True,
         "shardpool": {"placement": "mesh", "layers": [3, 1]}}
    )  # fmt: skip
    plan = mesh_planner(members, say=lambda line: None)(config)
    assert [(stage.host, stage.num_layers) for stage in plan.stages] == [("fast", 3), ("slow", 1)]
    assert plan.search == "given"


def test_a_member_that_fails_its_health_check_is_skipped_before_any_profile_request() -> None:
    here, gone = FakeAgent("here", [OLD_ROW]), FakeAgent("gone", [OLD_ROW])
    gone.gone = True
    said: list[str] = []
    members = [
        MeshMember("here", "198.51.100.1", True, here),  # type: ignore[arg-type]
        MeshMember("gone", "198.51.100.3", False, gone),  # type: ignore[arg-type]
    ]
    fleet = mesh_fleet(members, model_config={}, workload=WORKLOAD, say=said.append)
    assert [device.host for device in fleet.devices] == ["here"]
    assert any("skipping member 'gone'" in line for line in said), said


def test_a_members_device_that_cannot_run_nf4_is_left_out_with_one_line() -> None:
    refused = {"name": "cuda:1", "kind": "cuda", "label": "Tesla M40", "total_bytes": 24 << 30,
               "free_bytes": 23 << 30, "threads": 0, "compute_capability": "5.2", "bf16": False,
               "nf4_error": "Error named symbol not found"}  # fmt: skip
    lab = FakeAgent("lab", [refused, OLD_ROW])
    said: list[str] = []
    fleet = mesh_fleet(
        [MeshMember("lab", "198.51.100.1", True, lab)], model_config={}, workload=WORKLOAD, say=said.append
    )  # type: ignore[arg-type]
    assert [device.torch_device for device in fleet.devices] == ["cpu"]
    assert said == [
        "lab/cuda:1 (Tesla M40, 5.2) cannot run bitsandbytes 4-bit: Error named symbol not found; it gets no layers"
    ]


#: A member's Maxwell card: bitsandbytes' 4-bit probe failed there, and its agent profiled the
#: NF4 layer in plain PyTorch (``plan.report``).
M40_ROW = {"name": "cuda:1", "kind": "cuda", "label": "Tesla M40", "total_bytes": 24 << 30,
           "free_bytes": 23 << 30, "threads": 0, "seconds_per_layer": 0.2, "activation_bytes": 2048,
           "compute_capability": "5.2", "bf16": False, "nf4_error": "Error named symbol not found"}  # fmt: skip
M40_IN_PYTORCH = (
    "lab/cuda:1, Tesla M40 (compute capability 5.2): bitsandbytes' 4-bit probe failed "
    "(Error named symbol not found); NF4 in plain PyTorch"
)
M40_REFUSED = "lab/cuda:1 (Tesla M40, 5.2) cannot run bitsandbytes 4-bit: Error named symbol not found; it gets no layers"


def _lab_fleet(workload: Workload, rows: list[dict[str, Any]] | None = None) -> tuple[Any, list[str]]:
    """The fleet of one member, ``lab``, with the M40 and a CPU (or ``rows``), and what was said."""
    lab = FakeAgent("lab", [M40_ROW, OLD_ROW] if rows is None else rows)
    said: list[str] = []
    members = [MeshMember("lab", "198.51.100.1", True, lab)]  # type: ignore[arg-type]
    return mesh_fleet(members, model_config={}, workload=workload, say=said.append), said


def test_a_members_m40_profiled_in_pytorch_takes_layers_on_the_pytorch_path() -> None:
    fleet, said = _lab_fleet(WORKLOAD)
    m40 = fleet.device("lab/cuda:1")
    assert (m40.nf4_backend, m40.nf4_reason, m40.seconds_per_layer) == ("torch", M40_IN_PYTORCH, 0.2)
    assert said == [M40_IN_PYTORCH]  # once, and no refusal
    plan = plan_pipeline(SHAPE, WORKLOAD, fleet)
    (stage,) = [stage for stage in plan.stages if stage.slot == "lab/cuda:1"]
    assert stage.num_layers >= 1 and (stage.nf4_backend, stage.nf4_reason) == ("torch", M40_IN_PYTORCH)
    assert stage.memory_breakdown["torch_dequantize"] > 0


def test_a_members_m40_is_refused_with_one_line_under_forced_bitsandbytes() -> None:
    fleet, said = _lab_fleet(replace(WORKLOAD, nf4_backend="bitsandbytes"))
    assert [device.name for device in fleet.devices] == ["lab/cpu"]
    assert said == [M40_REFUSED]


def test_a_per_stage_list_gives_a_members_m40_pytorch_unless_it_forces_bitsandbytes_on_a_stage() -> None:
    fleet, said = _lab_fleet(replace(WORKLOAD, nf4_backend=("auto", "torch")))
    assert fleet.device("lab/cuda:1").nf4_backend == "torch" and said == [M40_IN_PYTORCH]
    fleet, said = _lab_fleet(replace(WORKLOAD, nf4_backend=("auto", "bitsandbytes")))
    assert [device.name for device in fleet.devices] == ["lab/cpu"] and said == [M40_REFUSED]


def test_an_unquantized_base_takes_a_members_m40_as_any_device() -> None:
    fleet, said = _lab_fleet(replace(WORKLOAD, quantize=False))
    m40 = fleet.device("lab/cuda:1")
    assert (m40.nf4_backend, m40.nf4_reason, m40.seconds_per_layer) == (None, "", 0.2) and said == []


def test_a_members_device_its_torch_cannot_run_stays_refused_whatever_the_workload() -> None:
    unprofiled = {
        key: value for key, value in M40_ROW.items() if key not in ("seconds_per_layer", "activation_bytes")
    }
    for workload in (WORKLOAD, replace(WORKLOAD, quantize=False), replace(WORKLOAD, nf4_backend="torch")):
        fleet, said = _lab_fleet(workload, [unprofiled, OLD_ROW])
        assert [device.name for device in fleet.devices] == ["lab/cpu"] and said == [M40_REFUSED]


def test_the_report_of_a_member_with_an_m40_plans_it_on_the_pytorch_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """End to end: the member's report rows, checked by its agent, become the launcher's M40 device."""
    m40_info = DeviceInfo("cuda:1", "cuda", "Tesla M40", 24 << 30, 23 << 30, compute_capability="5.2",
                          bf16=False, nf4_error="Error named symbol not found")  # fmt: skip
    monkeypatch.setattr(report, "list_devices", lambda: [m40_info])
    asked: list[object] = []

    def stand_in_profile(
        shape: object, workload: Workload, *, device: str, threads: int | None
    ) -> LayerProfile:
        asked.append(workload.nf4_backend)
        return LayerProfile(0.2, 2048, None, device, "Tesla M40", threads, 3)

    monkeypatch.setattr(report, "profile_layer", stand_in_profile)
    _, requested = devices_request({"model_config": SHAPE_CONFIG, "workload": WORKLOAD.profile_request()})
    rows = _report_rows(json.dumps({"devices": report.device_rows(SHAPE, requested)}).encode())
    fleet, said = _lab_fleet(WORKLOAD, rows)
    assert asked == ["torch"] and said == [M40_IN_PYTORCH]
    assert fleet.device("lab/cuda:1").nf4_backend == "torch"


class MeetingAgent(FakeAgent):
    """An agent whose profile returns only once ``meeting`` has every party, so that members asked
    one after the other never return; ``after`` (if any) must be set before it answers."""

    def __init__(self, name: str, meeting: threading.Barrier, after: threading.Event | None = None) -> None:
        super().__init__(name, [OLD_ROW])
        self.meeting, self.after, self.answered = meeting, after, threading.Event()

    def devices(
        self, model_config: dict[str, Any], workload: dict[str, Any], *, timeout: float = 0
    ) -> list[dict[str, Any]]:
        self.meeting.wait()
        if self.after is not None:
            assert self.after.wait(timeout=10), "the other member never answered"
        self.answered.set()
        return super().devices(model_config, workload, timeout=timeout)


def test_members_profile_at_the_same_time_and_their_devices_keep_the_members_order() -> None:
    meeting = threading.Barrier(2, timeout=10)  # asked one after the other, the first waits in vain
    second = MeetingAgent("second", meeting)
    first = MeetingAgent("first", meeting, after=second.answered)  # answers last
    members = [
        MeshMember("first", "198.51.100.1", True, first),  # type: ignore[arg-type]
        MeshMember("second", "198.51.100.2", False, second),  # type: ignore[arg-type]
    ]
    said: list[str] = []
    fleet = mesh_fleet(members, model_config={}, workload=WORKLOAD, say=said.append)
    assert [device.host for device in fleet.devices] == ["first", "second"]
    assert not [line for line in said if "skipping" in line]


class CountingAgent(FakeAgent):
    """An agent that records how many profiles run at once across every agent sharing ``counter``."""

    def __init__(self, name: str, counter: dict[str, Any]) -> None:
        super().__init__(name, [OLD_ROW])
        self.counter = counter

    def devices(
        self, model_config: dict[str, Any], workload: dict[str, Any], *, timeout: float = 0
    ) -> list[dict[str, Any]]:
        with self.counter["lock"]:
            self.counter["now"] += 1
            self.counter["most"] = max(self.counter["most"], self.counter["now"])
        time.sleep(0.05)
        with self.counter["lock"]:
            self.counter["now"] -= 1
        return super().devices(model_config, workload, timeout=timeout)


def test_at_most_profile_concurrency_members_profile_at_once() -> None:
    counter: dict[str, Any] = {"lock": threading.Lock(), "now": 0, "most": 0}
    names = [f"m{index}" for index in range(PROFILE_CONCURRENCY + 3)]
    members = [
        MeshMember(name, f"198.51.100.{index + 1}", index == 0, CountingAgent(name, counter))  # type: ignore[arg-type]
        for index, name in enumerate(names)
    ]
    fleet = mesh_fleet(members, model_config={}, workload=WORKLOAD, say=lambda line: None)
    assert [device.host for device in fleet.devices] == names
    assert 1 <= counter["most"] <= PROFILE_CONCURRENCY


def test_an_unexpected_error_of_one_members_profile_reaches_the_launcher() -> None:
    broken = FakeAgent("broken", [OLD_ROW])
    broken.devices = lambda *args, **kwargs: {}["devices"]  # type: ignore[method-assign]
    members = [
        MeshMember("here", "198.51.100.1", True, FakeAgent("here", [OLD_ROW])),  # type: ignore[arg-type]
        MeshMember("broken", "198.51.100.2", False, broken),  # type: ignore[arg-type]
    ]
    with pytest.raises(KeyError, match="devices"):
        mesh_fleet(members, model_config={}, workload=WORKLOAD, say=lambda line: None)
