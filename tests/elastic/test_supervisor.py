"""Keeping a mesh run going: lost-member detection in run_mesh_job, the step-boundary copies, the
policy, the re-plan after a loss and the join decision (fakes for members, agents and store)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shardpool.agent.client import AgentUnreachable
from shardpool.config import Config, parse_config
from shardpool.contract.job import Job
from shardpool.contract.liveness import LIVE_ROOT, live_dir
from shardpool.elastic.beats import BeatWatch
from shardpool.elastic.copies import complete_live_steps, copy_files_count, prune_live_copies
from shardpool.elastic.growth import GrowOrder, grown_job
from shardpool.elastic.joins import JoinCheckClock, join_gain_needed, look_for_joins, worth_joining
from shardpool.elastic.messages import decode_growth, encode_ready, grow_key, ready_key, step_key
from shardpool.elastic.policy import AttemptEnded, ReplanPolicy, does_not_fit_line, supervision_line
from shardpool.elastic.rebalancing import replanned_json
from shardpool.elastic.supervisor import Supervisor
from shardpool.errors import ShardpoolError
from shardpool.finetune import PreparedRun
from shardpool.launch.local_launcher import StageFailed
from shardpool.launch.mesh_launcher import Interrupted, MemberLost, MeshLauncher, run_mesh_job
from shardpool.launch.mesh_members import MeshMember
from shardpool.launch.run import keeps_state, trim_metrics
from shardpool.plan.result import Plan, PlannedStage
from shardpool.plan.stage_costs import StageCosts
from tests.helpers.jobs import MINIMAL_CONFIG, job_dict


class _Agent:
    """A member's agent: replies from a script, then the last reply forever."""

    url = "http://fake"

    def __init__(self, replies: list[dict[str, Any]] | None = None) -> None:
        self.replies = replies or [{"events": [], "exited": {}, "running": True}]
        self.stopped: list[str] = []

    def health(self) -> dict[str, Any]:
        return {}

    def start_job(
        self,
        job_id: str,
        job: dict[str, Any],
        ranks: list[int],
        *,
        files_secret: str | None = None,
        previous: str | None = None,
    ) -> dict[str, Any]:
        self.previous = previous
        return {"job_id": job_id}

    def events(self, job_id: str, *, after: int, wait: float = 1.0) -> dict[str, Any]:
        reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        return reply

    def stop_job(self, job_id: str, *, timeout: float = 10.0) -> dict[str, Any]:
        self.stopped.append(job_id)
        return {}


MIB = 2**20


def _members(*names: str) -> list[MeshMember]:
    return [
        MeshMember(name, f"198.51.100.{index + 1}", index == 0, _Agent()) for index, name in enumerate(names)
    ]


def _job(stages: int = 2, **fields: Any) -> Job:
    job = job_dict(stages=stages, **fields)
    for index, stage in enumerate(job["stages"]):
        stage["host"] = "abc"[index]
    return Job.model_validate(job)


def _exited(rank: int, code: int, events: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "events": [
            {"seq": index + 1, "rank": rank, "event": event} for index, event in enumerate(events or [])
        ],
        "exited": {str(rank): code},
        "running": False,
    }


def test_a_stage_killed_by_a_signal_is_a_lost_member() -> None:
    a, b = _members("a", "b")
    b.agent.replies = [_exited(1, -9)]  # type: ignore[attr-defined]
    with pytest.raises(MemberLost) as lost:
        run_mesh_job(_job(), "j", {"a": (a, [0]), "b": (b, [1])}, on_event=lambda event: None)
    assert lost.value.member == "b"
    assert "killed by signal 9" in str(lost.value)
    assert a.agent.stopped == ["j"], "the other members' stages are stopped"  # type: ignore[attr-defined]


def test_a_stage_error_is_not_a_member_loss_even_when_the_run_continues() -> None:
    a, b = _members("a", "b")
    error = {"event": "error", "rank": 1, "message": "ValueError: a bug"}
    b.agent.replies = [_exited(1, 1, [error])]  # type: ignore[attr-defined]
    watch = BeatWatch(beats=lambda rank: 0, ranks={"a": [0], "b": [1]}, member_timeout_s=30.0)
    with pytest.raises(StageFailed) as failed:
        run_mesh_job(
            _job(),
            "j",
            {"a": (a, [0]), "b": (b, [1])},
            on_event=lambda event: None,
            watch=watch,
            lost_after_s=0.2,
            neighbour_grace_s=0.5,
        )
    assert not isinstance(failed.value, MemberLost)
    assert "ValueError: a bug" in str(failed.value)


def test_a_neighbour_that_fails_first_is_not_blamed_for_the_member_lost_behind_it() -> None:
    a, b = _members("a", "b")
    error = {"event": "error", "rank": 1, "message": "RuntimeError: connection reset by peer"}
    b.agent.replies = [_exited(1, 1, [error])]  # type: ignore[attr-defined]
    running = {"events": [], "exited": {}, "running": True}
    a.agent.replies = [running, running, running, _exited(0, -9)]  # type: ignore[attr-defined]
    watch = BeatWatch(beats=lambda rank: 0, ranks={"a": [0], "b": [1]}, member_timeout_s=30.0)
    with pytest.raises(MemberLost) as lost:
        run_mesh_job(
            _job(),
            "j",
            {"a": (a, [0]), "b": (b, [1])},
            on_event=lambda event: None,
            watch=watch,
            lost_after_s=5.0,
        )
    assert lost.value.member == "a"


def _b_stops_beating(a: MeshMember, b: MeshMember) -> Any:
    """Run a job of ``a`` (rank 0, beating) and ``b`` (rank 1, silent) under a beat watch; the MemberLost raised."""
    clock = iter(float(second) for second in range(0, 10_000, 2))
    beats = {0: 1, 1: 1}

    def read(rank: int) -> int:
        if rank == 0:
            beats[0] += 1
        return beats[rank]

    watch = BeatWatch(
        beats=read, ranks={"a": [0], "b": [1]}, member_timeout_s=10.0, clock=lambda: next(clock)
    )
    with pytest.raises(MemberLost) as lost:
        run_mesh_job(_job(), "j", {"a": (a, [0]), "b": (b, [1])}, on_event=lambda event: None, watch=watch)
    return lost


def test_a_stage_that_stopped_beating_is_a_lost_member_named_with_its_silence() -> None:
    a, b = _members("a", "b")
    lost = _b_stops_beating(a, b)
    assert lost.value.member == "b"
    assert "stopped beating for" in str(lost.value)
    assert lost.value.agent_answered, "b's agent answered the stop: b stalled, its machine is there"


class _Unreachable(_Agent):
    """An agent gone with its machine: it answers the launcher's polls from a script (the replies
    already in flight), then nothing; it does not answer the stop."""

    def stop_job(self, job_id: str, *, timeout: float = 10.0) -> dict[str, Any]:
        raise AgentUnreachable("timed out")


def test_a_silent_beat_whose_agent_does_not_answer_the_stop_is_a_machine_gone_not_a_stall() -> None:
    """A kill -9 of a whole host is often found by its beat before its agent's silence: the stop
    the launcher sends then tells the two apart (a stalled member is held back, a gone one not)."""
    a = _members("a")[0]
    lost = _b_stops_beating(a, MeshMember("b", "198.51.100.2", False, _Unreachable()))
    assert lost.value.member == "b" and "stopped beating for" in str(lost.value)
    assert not lost.value.agent_answered


def _copies(tmp_path: Path, *steps: int) -> None:
    for step in steps:
        (tmp_path / live_dir(step)).mkdir(parents=True)
        (tmp_path / live_dir(step) / "stage-0.safetensors").write_bytes(b"x")


def _whole_copy(tmp_path: Path, step: int, *, stages: int = 2, ranks: int = 2) -> None:
    """Every file of step ``step``'s copy, as the ranks upload them."""
    directory = tmp_path / live_dir(step)
    directory.mkdir(parents=True, exist_ok=True)
    names = [f"stage-{index}.safetensors" for index in range(stages)]
    for name in names + [f"rng-rank-{rank}.safetensors" for rank in range(ranks)]:
        (directory / name).write_bytes(b"x")


def test_the_newest_complete_copy_counts_and_older_ones_are_pruned(tmp_path: Path) -> None:
    _copies(tmp_path, 3, 4, 5, 6)
    counts = {3: 2, 4: 2, 5: 2, 6: 1}  # step 6 is still being written
    assert complete_live_steps(tmp_path, counts.__getitem__, 2) == [3, 4, 5]
    assert prune_live_copies(tmp_path, counts.__getitem__, 2) == [3]
    assert sorted(path.name for path in (tmp_path / LIVE_ROOT).iterdir()) == [
        "step-4",
        "step-5",
        "step-6",
    ]
    assert prune_live_copies(tmp_path, {4: 2, 5: 1, 6: 1}.__getitem__, 2) == []


def test_the_policy_stops_on_stop_too_few_members_and_too_many_replans() -> None:
    now = [0.0]
    assert ReplanPolicy("stop", 1, 6).refusal(3) == "shardpool.on_member_loss is stop"
    policy = ReplanPolicy("continue", 2, 2, clock=lambda: now[0])
    assert "fewer than shardpool.min_members (2)" in (policy.refusal(1) or "")
    assert policy.refusal(2) is None
    policy.note_replan()
    policy.note_replan()
    assert "max_replans_per_hour: 2" in (policy.refusal(2) or "")
    now[0] = 3601.0
    assert policy.refusal(2) is None, "re-plans older than an hour do not count"


def test_the_does_not_fit_line_is_one_line_with_the_missing_memory_and_the_kept_checkpoint() -> None:
    line = does_not_fit_line(
        "c",
        "tiny (8 layers) does not fit: about 1.50 GiB are missing\nmore",
        Path("/o/checkpoints/checkpoint-7"),
    )
    assert "\n" not in line
    assert "1.50 GiB are missing" in line
    assert "checkpoint-7 is kept" in line and "--resume" in line


def test_a_join_needs_a_step_at_least_ten_percent_faster() -> None:
    assert worth_joining(1.0, 0.9)
    assert worth_joining(1.0, 0.5)
    assert not worth_joining(1.0, 0.91)
    assert not worth_joining(1.0, 1.2)
    assert join_gain_needed({}) == 0.10
    assert join_gain_needed({"SHARDPOOL_TEST_JOIN_GAIN": "0"}) == 0.0
    assert join_gain_needed({"SHARDPOOL_TEST_JOIN_GAIN": "x"}) == 0.10
    anything = join_gain_needed({"SHARDPOOL_TEST_JOIN_GAIN": "-inf"})  # the netns test's: any plan using it
    assert worth_joining(1.0, 3.0, gain=anything)


def test_joins_are_checked_every_ten_steps_and_sixty_seconds_whichever_is_later() -> None:
    now = [0.0]
    clock = JoinCheckClock(clock=lambda: now[0])
    assert not clock.due(1)
    assert not clock.due(11), "ten steps but not a minute"
    now[0] = 61.0
    assert clock.due(11)
    now[0] = 200.0
    assert not clock.due(15)
    assert clock.due(21)


def test_the_test_hook_shortens_the_minute_between_join_checks() -> None:
    from shardpool.elastic.joins import REPLAN_CHECK_MIN_S, join_check_min_s

    assert join_check_min_s({}) == REPLAN_CHECK_MIN_S == 60.0
    assert join_check_min_s({"SHARDPOOL_TEST_JOIN_CHECK_MIN_S": "5"}) == 5.0
    assert join_check_min_s({"SHARDPOOL_TEST_JOIN_CHECK_MIN_S": "soon"}) == REPLAN_CHECK_MIN_S


def test_the_test_hook_shortens_the_ten_steps_between_join_checks() -> None:
    from shardpool.elastic.joins import REPLAN_CHECK_EVERY_STEPS, join_check_every_steps

    assert join_check_every_steps({}) == REPLAN_CHECK_EVERY_STEPS == 10
    assert join_check_every_steps({"SHARDPOOL_TEST_JOIN_CHECK_EVERY_STEPS": "2"}) == 2
    assert join_check_every_steps({"SHARDPOOL_TEST_JOIN_CHECK_EVERY_STEPS": "0"}) == 1
    assert join_check_every_steps({"SHARDPOOL_TEST_JOIN_CHECK_EVERY_STEPS": "often"}) == 10


def test_the_supervision_line_has_who_when_why_and_the_steps_lost() -> None:
    line = supervision_line(
        "member_lost", member="c", step=7, reason="killed", steps_lost=1, unreported_steps_redone=2,
        now=lambda: 5.0,
    )  # fmt: skip
    assert line == {
        "event": "member_lost",
        "member": "c",
        "step": 7,
        "reason": "killed",
        "steps_lost": 1,
        "unreported_steps_redone": 2,
        "time": 5.0,
    }


def test_trim_keeps_the_history_events(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"step": 5, "loss": 1.0}, {"event": "member_lost", "step": 7}, {"step": 7, "loss": 0.5}]
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
    trim_metrics(metrics, keep_through_step=6)
    assert [json.loads(line) for line in metrics.read_text().splitlines()] == lines[:2]


# --- the re-plan after a loss -------------------------------------------------------------


def _plan(
    hosts: list[str],
    predicted: float = 1.0,
    *,
    counts: list[int] | None = None,
    layer_mib: float | None = None,
) -> Plan:
    """A plan of 6 layers on ``hosts`` (one CPU stage each): split evenly, or by ``counts``; with
    stage costs of ``layer_mib`` MiB a layer when given (no memory model otherwise)."""
    counts = counts or [6 // len(hosts)] * len(hosts)
    bounds = [0, *itertools.accumulate(counts)]
    stages = [
        PlannedStage(device="cpu", host=host, start=start, stop=stop,
                     predicted_ms_per_microbatch=1.0, memory_bytes=0, free_bytes=0, slot=f"{host}/cpu",
                     costs=None if layer_mib is None else _costs(layer_mib))
        for host, start, stop in zip(hosts, bounds, bounds[1:], strict=False)
    ]  # fmt: skip
    return Plan(stages=stages, predicted_step_s=predicted, bubble_fraction=0.0, microbatches=3,
                recommended_microbatches=12, num_layers=6)  # fmt: skip


def _costs(layer_mib: float) -> StageCosts:
    """Stage costs whose modelled peak grows by ``layer_mib`` MiB a layer (and 5 % of it, the reserve)."""
    return StageCosts(forward_fixed_s=0.0, forward_per_layer_s=0.01, backward_fixed_s=0.0,
                      backward_per_layer_s=0.02, fixed_bytes=0.0, per_layer_bytes=layer_mib * MIB,
                      capacity_bytes=64 * 2**30, kind="cpu", in_flight=1)  # fmt: skip


def _config(tmp_path: Path, **shardpool: Any) -> Config:
    return parse_config(
        {
            "base_model": "m",
            "lora_target_linear": True,
            "datasets": [{"path": "d.jsonl", "type": "completion"}],
            "output_dir": str(tmp_path),
            "shardpool": {"placement": "mesh", **shardpool},
        }
    )


class _Checkpoints:
    def __init__(self, root: Path) -> None:
        self.root = root / "checkpoints"
        self.finalized: list[tuple[Path, int, float | None]] = []

    def partial(self, step: int) -> Path:
        return self.root / f"checkpoint-{step}.partial"

    def finalize(self, partial: Path, step: int, eval_before: float | None) -> Path:
        final = partial.with_name(f"checkpoint-{step}")
        partial.rename(final)
        (final / "checkpoint.json").write_text(json.dumps({"step": step, "eval_before": eval_before}))
        self.finalized.append((final, step, eval_before))
        return final

    def newest(self) -> Path | None:
        found = sorted(self.root.glob("checkpoint-*[0-9]"), key=self.step_of) if self.root.is_dir() else []
        return found[-1] if found else None

    def step_of(self, checkpoint: Path) -> int:
        return int(json.loads((checkpoint / "checkpoint.json").read_text())["step"])

    def eval_before_of(self, checkpoint: Path) -> float | None:
        return json.loads((checkpoint / "checkpoint.json").read_text())["eval_before"]


def _supervisor(tmp_path: Path, config: Config, seen: dict[str, list[Any]]) -> Supervisor:
    return Supervisor(
        config=config,
        policy=ReplanPolicy(config.shardpool.on_member_loss, config.shardpool.min_members, 6),
        checkpoints=_Checkpoints(tmp_path),
        say=seen.setdefault("say", []).append,
        emit=lambda kind, **fields: seen.setdefault("emit", []).append((kind, fields)),
        record=seen.setdefault("record", []).append,
        trim=seen.setdefault("trim", []).append,
        write_plan=seen.setdefault("plan", []).append,
        output_dir=tmp_path,
    )


def _run(config: Config, plan: Plan) -> PreparedRun:
    return PreparedRun(
        config=config, model=None, lora=None, placements=[], data=None, total_steps=20,  # type: ignore[arg-type]
        resume_from=None, plan=plan.to_json() | {"replicas": 1, "source": "planner"}, planned=plan,
    )  # fmt: skip


def _c_lost_with_copies_of_5_and_6(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ended: AttemptEnded
) -> tuple[PreparedRun, MeshLauncher, dict[str, list[Any]]]:
    """The supervisor's next attempt after ``ended`` (c lost), with complete copies of steps 5 and 6."""
    config = _config(tmp_path)
    monkeypatch.setattr(MeshLauncher, "plan", lambda self, config: _plan([m.name for m in self.members], 1.5))
    seen: dict[str, list[Any]] = {}
    supervisor = _supervisor(tmp_path, config, seen)
    _copies(tmp_path, 5, 6)
    launcher = MeshLauncher(_members("a", "b", "c"), say=print)
    following, successor = supervisor.next_attempt(_run(config, _plan(["a", "b", "c"])), launcher, ended)
    return following, successor, seen


def test_after_a_loss_the_newest_complete_copy_becomes_the_checkpoint_and_the_rest_replan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ended = AttemptEnded("member_lost", member="c", reason="killed by signal 9", step=7, newest_copy=6)

    following, successor, seen = _c_lost_with_copies_of_5_and_6(tmp_path, monkeypatch, ended)

    assert [member.name for member in successor.members] == ["a", "b"]
    assert following.first_step == 6
    assert following.resume_from == tmp_path / "checkpoints" / "checkpoint-6"
    assert not (tmp_path / ".shardpool" / "live").exists(), "every copy is gone once one is restored"
    assert [stage.host for stage in following.placements] == ["a", "b"]
    assert seen["trim"] == [6]
    kinds = [line["event"] for line in seen["record"]]
    assert kinds == ["member_lost", "replan"]
    assert seen["record"][0]["steps_lost"] == 1 and seen["record"][0]["member"] == "c"
    assert [kind for kind, _ in seen["emit"]] == kinds
    written = seen["plan"][-1]
    assert written["source"] == "replan"
    assert written["history"][0]["ended_at_step"] == 7
    assert [stage["host"] for stage in written["history"][0]["stages"]] == ["a", "b", "c"]
    assert any("lost member 'c' at step 7" in line for line in seen["say"])


def test_a_step_whose_copy_was_in_flight_is_trained_again_unreported_not_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # step 7 finished, but its copy was in flight: the gate had reported up to step 6 only
    ended = AttemptEnded(
        "member_lost", member="c", reason="killed by signal 9", step=7, newest_copy=6, reported_step=6
    )

    following, _, seen = _c_lost_with_copies_of_5_and_6(tmp_path, monkeypatch, ended)

    assert following.first_step == 6
    lost = seen["record"][0]
    assert (lost["steps_lost"], lost["unreported_steps_redone"]) == (0, 1)
    assert any("1 unreported step (copy in flight) trained again" in line for line in seen["say"]), seen[
        "say"
    ]


def test_with_no_copy_the_newest_regular_checkpoint_is_the_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path)
    monkeypatch.setattr(MeshLauncher, "plan", lambda self, config: _plan([m.name for m in self.members]))
    checkpoint = tmp_path / "checkpoints" / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "checkpoint.json").write_text(json.dumps({"step": 4, "eval_before": 2.5}))
    supervisor = _supervisor(tmp_path, config, {})
    ended = AttemptEnded("member_lost", member="c", reason="gone", step=5, newest_copy=None)
    following, _ = supervisor.next_attempt(
        _run(config, _plan(["a", "b", "c"])), MeshLauncher(_members("a", "b", "c"), say=print), ended
    )
    assert (following.first_step, following.resume_from, following.eval_before) == (4, checkpoint, 2.5)


def test_too_few_members_stop_with_one_line_and_keep_the_checkpoint(tmp_path: Path) -> None:
    config = _config(tmp_path, min_members=3)
    supervisor = _supervisor(tmp_path, config, {})
    _copies(tmp_path, 6)
    ended = AttemptEnded("member_lost", member="c", reason="gone", step=6, newest_copy=6)
    with pytest.raises(ShardpoolError) as stopped:
        supervisor.next_attempt(
            _run(config, _plan(["a", "b", "c"])), MeshLauncher(_members("a", "b", "c"), say=print), ended
        )
    message = str(stopped.value)
    assert "\n" not in message
    assert "min_members (3)" in message and "checkpoint-6 is kept" in message
    assert (tmp_path / "checkpoints" / "checkpoint-6").is_dir()


def test_a_model_that_no_longer_fits_stops_with_the_missing_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_fit(self: MeshLauncher, config: Config) -> Plan:
        raise ShardpoolError("tiny (6 layers) does not fit: about 0.75 GiB are missing; add memory")

    monkeypatch.setattr(MeshLauncher, "plan", no_fit)
    config = _config(tmp_path)
    _copies(tmp_path, 3)
    ended = AttemptEnded("member_lost", member="c", reason="gone", step=3, newest_copy=3)
    with pytest.raises(
        ShardpoolError, match=r"losing member 'c'.*0\.75 GiB are missing.*checkpoint-3 is kept"
    ):
        _supervisor(tmp_path, config, {}).next_attempt(
            _run(config, _plan(["a", "b", "c"])), MeshLauncher(_members("a", "b", "c"), say=print), ended
        )


def _plans_by_size(speeds: dict[int, float]) -> Any:
    """A fake ``MeshLauncher.plans_with_and_without``: a plan's predicted step by its member count."""

    def plans(self: MeshLauncher, config: Config, left_out: set[str]) -> tuple[Plan, Plan]:
        every = [member.name for member in self.members]
        kept = [name for name in every if name not in left_out]
        return _plan(every, speeds[len(every)]), _plan(kept, speeds[len(kept)])

    return plans


def test_a_member_back_online_is_taken_when_the_plan_is_ten_percent_faster(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = _config(tmp_path)
    speeds = {2: 1.0, 3: 0.85}
    monkeypatch.setattr(MeshLauncher, "plans_with_and_without", _plans_by_size(speeds))
    launcher = MeshLauncher(_members("a", "b"), say=print)
    launcher.list_members = lambda: _members("a", "b", "c")
    found = look_for_joins(launcher, config, step=10, say=print).found
    assert found is not None
    successor, plan, joined, reason = found
    assert joined == ["c"] and "15% faster" in reason
    assert [member.name for member in successor.members] == ["a", "b", "c"]
    speeds[3] = 0.95
    slow = look_for_joins(launcher, config, step=10, say=print)
    assert slow.found is None, "5% is not worth a restart"
    assert slow.candidates == ("c",)
    assert "predicts 0.950 s/step vs 1.000 without (5% faster, needs 10%" in slow.why
    assert slow.why.endswith("; not taken")
    launcher.list_members = lambda: _members("a", "b")
    alone = look_for_joins(launcher, config, step=10, say=print)
    assert alone.found is None and alone.candidates == ()
    assert alone.why == "no member online outside the plan (online: a, b)"


def test_a_join_check_compares_plans_from_one_measurement_of_the_fleet(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Links probed minutes apart differ by tens of percent on a busy host: the plan without the
    member that came back is made again from the same profiles and probes as the plan with it."""
    from shardpool.launch import mesh_members
    from shardpool.plan.fleet import Device, Fleet, LinkSpec

    measured: list[list[str]] = []

    def fleet(members: list[MeshMember], **_: Any) -> Fleet:
        measured.append([member.name for member in members])
        devices = tuple(
            Device(name=f"{name}/cpu", memory_bytes=8 << 30, host=name, kind="cpu", seconds_per_layer=0.01)
            for name in ("a", "b", "c")
        )
        slow = LinkSpec(bandwidth=1e6, latency=0.5)
        return Fleet(devices=devices, links={frozenset(("a", "c")): slow, frozenset(("a", "b")): slow})

    monkeypatch.setattr(mesh_members, "mesh_fleet", fleet)
    model = tmp_path / "model"
    model.mkdir()
    shape = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 6,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}  # fmt: skip
    (model / "config.json").write_text(json.dumps(shape))
    config = _config(tmp_path, stages=3).model_copy(update={"base_model": str(model)})
    with_c, without_c = mesh_members.plans_with_and_without(
        _members("a", "b", "c"), config, left_out={"c"}, say=print
    )
    assert measured == [["a", "b", "c"]], "one measurement for both plans"
    assert {stage.host for stage in with_c.stages} == {"a", "b", "c"}
    assert {stage.host for stage in without_c.stages} == {"a", "b"}


def test_only_a_continuing_mesh_run_of_several_processes_keeps_state(tmp_path: Path) -> None:
    assert keeps_state(_config(tmp_path), 2)
    assert not keeps_state(_config(tmp_path), 1)
    assert not keeps_state(_config(tmp_path, on_member_loss="stop"), 3)
    assert not keeps_state(_config(tmp_path, placement="local"), 3)


def test_a_join_stops_the_stages_only_once_the_copy_of_the_last_step_is_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path)
    monkeypatch.setattr(MeshLauncher, "plans_with_and_without", _plans_by_size({2: 1.0, 3: 2.0 / 3}))
    seen: dict[str, list[Any]] = {}
    supervisor = _supervisor(tmp_path, config, seen)
    launcher = MeshLauncher(_members("a", "b"), say=print)
    launcher.list_members = lambda: _members("a", "b", "c")
    counts: dict[int, int] = {}

    class _Store:
        def add(self, key: str, amount: int) -> int:
            return counts.get(int(key.rsplit("/", 1)[1]), 0) if "live" in key else 1

    run = _run(config, _plan(["a", "b"]))
    supervisor.begin(launcher, run, Job.model_validate(job_dict(stages=2)), _Store())
    supervisor._look_for_joins(launcher, 10)  # what the join check's thread does
    supervisor._last_step = 11
    _whole_copy(tmp_path, 10)
    _copies(tmp_path, 11)
    counts.update({10: 2, 11: 2})  # a process outside the job counted step 11 (counters carry no MAC)
    assert not supervisor.interrupt(), "step 11's copy is still being written: its files decide"
    _whole_copy(tmp_path, 11)
    assert supervisor.interrupt()
    ended = supervisor.ended(Interrupted("stopped"))
    assert (ended.kind, ended.member, ended.newest_copy) == ("member_joined", "c", 11)
    following, successor = supervisor.next_attempt(run, launcher, ended)
    assert [member.name for member in successor.members] == ["a", "b", "c"]
    assert following.first_step == 11
    assert [line["event"] for line in seen["record"]] == ["member_joined", "replan"]
    assert seen["record"][0]["steps_lost"] == 0


def test_a_copy_whose_files_are_all_on_disk_counts_whatever_the_store_says(tmp_path: Path) -> None:
    """A rank stopped between its last file and its count leaves a whole copy: the files decide."""
    job = _job(stages=2)
    directory = tmp_path / live_dir(4)
    directory.mkdir(parents=True)
    for name in ("stage-0.safetensors", "stage-1.safetensors", "rng-rank-0.safetensors"):
        (directory / name).write_bytes(b"x")
    assert copy_files_count(tmp_path, 4, job) == 0  # rank 1's RNG file is missing
    (directory / "rng-rank-1.safetensors").write_bytes(b"x")
    assert copy_files_count(tmp_path, 4, job) == job.world_size == 2
    assert complete_live_steps(tmp_path, lambda step: copy_files_count(tmp_path, step, job), 2) == [4]


def test_a_join_check_says_why_a_member_online_or_lost_is_not_taken_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Users want to know why a returning member is not used: every "no" about one is a console line."""
    config = _config(tmp_path)
    speeds = {2: 1.0, 3: 0.95}
    monkeypatch.setattr(MeshLauncher, "plans_with_and_without", _plans_by_size(speeds))
    seen: dict[str, list[Any]] = {}
    supervisor = _supervisor(tmp_path, config, seen)
    launcher = MeshLauncher(_members("a", "b"), say=print)
    online = [_members("a", "b")]
    launcher.list_members = lambda: online[0]
    supervisor.begin(launcher, _run(config, _plan(["a", "b"])), Job.model_validate(job_dict(stages=2)), None)

    supervisor._look_for_joins(launcher, 10)
    assert not seen["say"], "nothing joined, nothing lost: nothing to say"

    supervisor._lost.append("c")
    supervisor._look_for_joins(launcher, 20)
    assert seen["say"][-1].startswith("join check after step 20 (")
    assert seen["say"][-1].endswith(
        "'c' (lost in this run) not back: no member online outside the plan (online: a, b)"
    )

    online[0] = _members("a", "b", "c")
    supervisor._look_for_joins(launcher, 30)
    assert (
        "'c' online, the plan with 'c' predicts 0.950 s/step vs 1.000 without (5% faster, needs 10%"
        in seen["say"][-1]
    )
    assert seen["say"][-1].endswith("; not taken") and supervisor._found is None

    def unreachable(self: MeshLauncher, config: Config, left_out: set[str]) -> tuple[Plan, Plan]:
        raise ShardpoolError("no mesh member's agent answered")

    monkeypatch.setattr(MeshLauncher, "plans_with_and_without", unreachable)
    supervisor._look_for_joins(launcher, 40)
    assert seen["say"][-1].endswith("failed: no mesh member's agent answered")

    monkeypatch.setattr(MeshLauncher, "plans_with_and_without", _plans_by_size({2: 1.0, 3: 0.8}))
    supervisor._look_for_joins(launcher, 50)
    assert supervisor._found is not None and supervisor._found.members == ["c"]
    assert seen["say"][-1].endswith("taking it")


class _Gone(_Agent):
    """An agent that does not answer (its machine was restarting)."""

    def health(self) -> dict[str, Any]:
        raise AgentUnreachable("timed out")


def _watching_after(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    ended: AttemptEnded,
    seen: dict[str, list[Any]],
    *,
    online: Callable[[], list[MeshMember]],
    clock: Callable[[], float] | None = None,
) -> tuple[Supervisor, MeshLauncher]:
    """The supervisor's next attempt after ``ended`` (c lost) begun, its agent listing ``online``;
    a plan over three members predicts half the step of one over two."""
    config = _config(tmp_path)
    monkeypatch.setattr(MeshLauncher, "plan", lambda self, config: _plan([m.name for m in self.members]))
    monkeypatch.setattr(MeshLauncher, "plans_with_and_without", _plans_by_size({2: 1.0, 3: 0.5}))
    supervisor = _supervisor(tmp_path, config, seen)
    if clock is not None:
        supervisor.clock = clock
    following, launcher = supervisor.next_attempt(
        _run(config, _plan(["a", "b", "c"])), MeshLauncher(_members("a", "b", "c"), say=print), ended
    )
    launcher.list_members = online
    supervisor.begin(launcher, following, Job.model_validate(job_dict(stages=2)), None)
    return supervisor, launcher


def test_a_member_lost_while_its_agent_answered_is_taken_back_only_once_it_was_away_or_after_the_hold_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stalled member looks healthy once its stage is stopped: no flapping back into the run."""
    now = [100.0]
    seen: dict[str, list[Any]] = {}
    stalled = AttemptEnded(
        "member_lost", member="c", reason="stopped beating", step=3, newest_copy=None, agent_answered=True
    )
    online = [_members("a", "b", "c")]
    supervisor, launcher = _watching_after(
        tmp_path, monkeypatch, stalled, seen, clock=lambda: now[0], online=lambda: online[0]
    )

    supervisor._look_for_joins(launcher, 10)
    assert supervisor._found is None
    assert "'c' held back: lost 0 s ago while its agent answered" in seen["say"][-1]

    online[0] = [*_members("a", "b"), MeshMember("c", "198.51.100.3", False, _Gone())]
    supervisor._look_for_joins(launcher, 12)
    assert supervisor._found is None, "away now: not taken while it does not answer"
    assert seen["say"][-1].endswith(
        "'c' listed online but its agent does not answer: seen away, taken back once it answers"
    )
    online[0] = _members("a", "b", "c")
    supervisor._look_for_joins(launcher, 14)
    assert supervisor._found is not None and supervisor._found.members == ["c"], "back after being away"

    # the same stall again, and this time c never goes away: taken back after the hold-off
    supervisor._found = None
    supervisor._held["c"] = now[0]
    now[0] += 599.0
    supervisor._look_for_joins(launcher, 16)
    assert supervisor._found is None
    now[0] += 2.0
    supervisor._look_for_joins(launcher, 18)
    assert supervisor._found is not None


def test_a_member_lost_with_its_agent_is_taken_back_as_soon_as_it_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    killed = AttemptEnded(
        "member_lost", member="c", reason="its agent stopped answering", step=3, newest_copy=None
    )
    supervisor, launcher = _watching_after(
        tmp_path, monkeypatch, killed, {}, online=lambda: _members("a", "b", "c")
    )
    supervisor._look_for_joins(launcher, 10)
    assert supervisor._found is not None and supervisor._found.members == ["c"]


def _job_on(hosts: list[str], **fields: Any) -> Job:
    """A 6-layer job split evenly over ``hosts`` (one CPU stage each), as :func:`_plan` splits it."""
    per = 6 // len(hosts)
    stages = [
        {"start": index * per, "stop": (index + 1) * per, "device": "cpu", "host": host}
        for index, host in enumerate(hosts)
    ]
    return Job.model_validate(job_dict(stages=len(hosts), **fields) | {"stages": stages})


def test_a_job_grows_in_place_when_every_running_member_keeps_its_stages() -> None:
    grown = grown_job(_job_on(["a", "b"], keep_state=True, rebalance_at=3), _plan(["a", "c", "b"]))
    assert grown is not None
    job, renumber = grown
    assert renumber == {0: 0, 1: 2}
    assert [stage.host for stage in job.stages] == ["a", "c", "b"]
    assert (job.generation, job.joining, job.rebalance_at, job.keep_state) == (1, True, None, True)
    assert grown_job(_job_on(["a", "b"]), _plan(["a", "a", "c"])) is None, "b would lose its stage"
    deeper = replace(_plan(["a", "c", "b"]), warmup_lead=2)
    assert grown_job(_job_on(["a", "b"], keep_state=True), deeper) is None, (
        "the running ranks keep their lead"
    )


def test_replicas_on_shares_never_grow_in_place() -> None:
    """A data-parallel job, or a data-parallel plan to grow into, restarts from the step copy."""
    whole = {"start": 0, "stop": 6, "device": "cpu"}
    replicas = Job.model_validate(
        job_dict(stages=1, replicas=2, keep_state=True, config={**MINIMAL_CONFIG, "gradient_accumulation_steps": 3})
        | {"stages": [whole | {"host": "a"}], "replica_places": [whole | {"host": "a"}, whole | {"host": "b"}],
           "shares": [2, 1]}
    )  # fmt: skip
    assert [replicas.placement(rank).host for rank in range(2)] == ["a", "b"]
    assert grown_job(replicas, _plan(["a", "c", "b"])) is None
    three = _plan(["a"], counts=[6])
    into_replicas = replace(three, data_parallel=[three.stages[0]] * 3, shares=[1, 1, 1])
    assert grown_job(_job_on(["a", "b"], keep_state=True), into_replicas) is None


class _DictStore:
    """The rendezvous store's calls the supervisor makes, on a dict."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def add(self, key: str, amount: int) -> int:
        value = int(self.values.get(key, b"0")) + amount
        self.values[key] = str(value).encode()
        return value

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]

    def peek(self, key: str) -> bytes | None:
        return self.values.get(key)

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)


def _c_found_while_a_b_train(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    seen: dict[str, list[Any]],
    *,
    started: Plan | None = None,
    with_c: Plan | None = None,
    resharded: Plan | None = None,
) -> tuple[Supervisor, MeshLauncher, _DictStore, PreparedRun]:
    """A supervised job on a and b at step 10 whose join check found c: the job starts with
    ``started`` (default: 3 + 3 layers), re-shards to ``resharded`` after step 3 when given, and the
    plan with c is ``with_c`` (default: 2 + 2 + 2 layers, twice as fast)."""
    config = _config(tmp_path)
    if with_c is None:
        monkeypatch.setattr(MeshLauncher, "plans_with_and_without", _plans_by_size({2: 1.0, 3: 0.5}))
    else:
        plans = (with_c, started or _plan(["a", "b"]))
        monkeypatch.setattr(MeshLauncher, "plans_with_and_without", lambda self, config, left_out: plans)
    supervisor = _supervisor(tmp_path, config, seen)
    launcher = MeshLauncher(_members("a", "b"), say=print)
    launcher.list_members = lambda: _members("a", "b", "c")
    store = _DictStore()
    run = _run(config, started or _plan(["a", "b"]))
    supervisor.begin(launcher, run, _job_on(["a", "b"], keep_state=True, rebalance_at=3), store)
    if resharded is not None:  # what the re-balance check tells it (RebalanceCheck.resharded)
        supervisor.resharded(resharded, replanned_json(run.plan, resharded, ended_at_step=3))
    supervisor._look_for_joins(launcher, 10)  # what the join check's thread does
    supervisor._last_step = 10
    return supervisor, launcher, store, run


def test_a_member_that_joins_is_grown_into_the_running_job_without_stopping_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, list[Any]] = {}
    supervisor, launcher, store, run = _c_found_while_a_b_train(tmp_path, monkeypatch, seen)
    assert not supervisor.interrupt(), "a join the job can grow into does not stop the stages"

    order = supervisor.grow()
    assert order is not None and supervisor.grow() is order
    assert {name: ranks for name, (_, ranks) in order.joined.items()} == {"c": [2]}
    assert order.renumber == {0: 0, 1: 1} and order.job.joining
    order.started = True  # the event loop started c's rank
    supervisor._tick()
    assert grow_key(1) not in store.values, "published only once the joining rank is ready"
    store.set(ready_key(1, 2), encode_ready(2))  # c's rank 2 is ready
    supervisor._tick()
    growth = decode_growth(store.get(grow_key(1)))
    assert growth.ranks == {0: 0, 1: 1} and growth.old_layers == [(0, 3), (3, 6)]
    assert growth.job["joining"] is False and growth.job["generation"] == 1
    assert not order.grown and not seen["record"]

    store.set(step_key(1), "12")  # rank 0: the stages grew after step 12
    supervisor._tick()
    assert order.grown and order.watch is not None
    assert [line["event"] for line in seen["record"]] == ["member_joined", "replan"]
    assert seen["record"][0]["step"] == 12 and seen["record"][0]["steps_lost"] == 0
    assert seen["record"][0]["reason"].endswith("; in place")
    assert "grown in place (no restart)" in seen["record"][1]["reason"]
    plan_json = seen["plan"][-1]
    assert [stage["host"] for stage in plan_json["stages"]] == ["a", "b", "c"]
    assert plan_json["history"][-1]["ended_at_step"] == 12
    assert [member.name for member in launcher.members] == ["a", "b", "c"]
    assert (supervisor._ranks_at(11), supervisor._ranks_at(12)) == (2, 3), "step 12's copy is the grown job's"
    assert [placement.host for placement in supervisor.current(run).placements] == ["a", "b", "c"]
    order.applied = True
    assert supervisor.grow() is None


def test_a_job_re_sharded_by_its_check_grows_from_the_layers_its_stages_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The re-balance check moved a and b to 4 + 2 layers: the grow decision tells the joining rank
    that (it takes its layers' state by them), and plan.json keeps both earlier plans."""
    seen: dict[str, list[Any]] = {}
    resharded = _plan(["a", "b"], 0.8, counts=[4, 2])
    supervisor, _, store, run = _c_found_while_a_b_train(tmp_path, monkeypatch, seen, resharded=resharded)
    assert supervisor.current(run).planned is resharded
    order = supervisor.grow()
    assert order is not None
    order.started = True
    store.set(ready_key(1, 2), encode_ready(2))  # c's rank 2 is ready
    supervisor._tick()
    assert decode_growth(store.get(grow_key(1))).old_layers == [(0, 4), (4, 6)]
    store.set(step_key(1), "12")
    supervisor._tick()
    history = seen["plan"][-1]["history"]
    assert [
        (entry["ended_at_step"], [stage["layers"] for stage in entry["stages"]]) for entry in history
    ] == [
        (3, [[0, 3], [3, 6]]),
        (12, [[0, 4], [4, 6]]),
    ]


def test_a_growth_beyond_a_running_ranks_room_restarts_the_job_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan with c gives a 4 layers instead of 3 (105 MiB more: a layer and its reserve), and
    a's rank measured 50 MiB of room after its newest step: the job is not grown in place but
    restarted with c once the copy of the last step is complete, as when it cannot grow in place."""
    seen: dict[str, list[Any]] = {}
    started = _plan(["a", "b"], layer_mib=100)
    with_c = _plan(["a", "c", "b"], 0.5, counts=[4, 1, 1], layer_mib=100)
    supervisor, _, store, _ = _c_found_while_a_b_train(
        tmp_path, monkeypatch, seen, started=started, with_c=with_c
    )
    supervisor.observe({"event": "step", "step": 10, "stage_room_bytes": [50 * MIB, 2**30]})
    supervisor.observe({"event": "step", "step": 10, "stage_room_bytes": [2**30] * 3})  # not this job's ranks
    assert supervisor.grow() is None
    assert seen["say"][-1] == (
        "growing the job in place would need more memory than its stages have (rank 0 (a/cpu) needs "
        "105.0 MiB more for 4 layers and has 50.0 MiB of room): restarting it with c from the newest "
        "step copy instead"
    )
    assert supervisor.grow() is None, "said once"
    assert len([line for line in seen["say"] if "would need more memory" in line]) == 1
    _whole_copy(tmp_path, 10)
    assert supervisor.interrupt(), "restarted with c once step 10's copy is complete"


def test_a_growth_within_the_rooms_measured_goes_ahead_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, list[Any]] = {}
    started = _plan(["a", "b"], layer_mib=100)
    with_c = _plan(["a", "c", "b"], 0.5, counts=[4, 1, 1], layer_mib=100)
    supervisor, _, _, _ = _c_found_while_a_b_train(
        tmp_path, monkeypatch, seen, started=started, with_c=with_c
    )
    supervisor.observe({"event": "step", "step": 10, "stage_room_bytes": [105 * MIB, 0]})
    order = supervisor.grow()
    assert order is not None and not supervisor.interrupt(), "b gives layers away and needs no room"


def _growing_a_b_with_c() -> tuple[list[MeshMember], Job, GrowOrder]:
    """Members a, b, c; a job on a and b; the order that grows it with c in the middle."""
    a, b, c = members = _members("a", "b", "c")
    job = _job_on(["a", "b"], keep_state=True)
    grown, renumber = grown_job(job, _plan(["a", "c", "b"]))  # type: ignore[misc]
    return members, job, GrowOrder(grown, {"c": (c, [1])}, renumber)


def _exits_once(agent: Any, rank: int, code: int, when: Callable[[], bool]) -> None:
    """Make a fake agent report its stage ``rank`` running, and exited with ``code`` once ``when()``."""
    running = {"events": [], "exited": {}, "running": True}
    agent.events = lambda job_id, **kwargs: _exited(rank, code) if when() else running


def test_the_event_loop_starts_the_joining_ranks_and_follows_the_grown_job() -> None:
    (a, b, c), job, order = _growing_a_b_with_c()
    _exits_once(b.agent, 1, -9, lambda: order.applied)  # b's stage is killed once the job has grown

    def grow() -> GrowOrder | None:
        if order.started:
            order.grown = True  # what the supervisor's tick does once the stages moved
        return None if order.applied else order

    with pytest.raises(MemberLost) as lost:
        run_mesh_job(job, "j", {"a": (a, [0]), "b": (b, [1])}, on_event=lambda event: None, grow=grow)
    assert order.applied
    assert (lost.value.member, lost.value.rank, lost.value.stage) == ("b", 2, 2), "b's rank is renumbered"
    assert c.agent.stopped == ["j"], "the joined member's stages are stopped with the rest"  # type: ignore[attr-defined]


def test_a_run_that_ends_before_it_could_grow_stops_the_joining_ranks_and_succeeds() -> None:
    (a, b, c), job, order = _growing_a_b_with_c()
    for agent, rank in ((a.agent, 0), (b.agent, 1)):
        _exits_once(agent, rank, 0, lambda: order.started)
    run_mesh_job(job, "j", {"a": (a, [0]), "b": (b, [1])}, on_event=lambda event: None, grow=lambda: order)
    assert order.failed == "the run finished before its stages could grow"
    assert c.agent.stopped == ["j"]  # type: ignore[attr-defined]


def test_a_joining_stage_that_fails_leaves_the_running_job_as_it_was() -> None:
    (a, b, c), job, order = _growing_a_b_with_c()
    error = {"event": "error", "rank": 1, "message": "OutOfMemoryError: building layers 2-4"}
    c.agent.replies = [_exited(1, 1, [error])]  # type: ignore[attr-defined]
    for agent, rank in ((a.agent, 0), (b.agent, 1)):
        _exits_once(agent, rank, 0, lambda: order.failed is not None)
    run_mesh_job(job, "j", {"a": (a, [0]), "b": (b, [1])}, on_event=lambda event: None, grow=lambda: order)
    assert order.failed == "member 'c''s joining stage (rank 1) failed: OutOfMemoryError: building layers 2-4"
    assert not order.grown and c.agent.stopped == ["j"]  # type: ignore[attr-defined]


def test_a_member_whose_stages_failed_to_join_is_held_back_before_it_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, list[Any]] = {}
    supervisor, launcher, _, _ = _c_found_while_a_b_train(tmp_path, monkeypatch, seen)
    now = [1000.0]
    supervisor.clock = lambda: now[0]
    order = supervisor.grow()
    assert order is not None
    order.failed = "member 'c''s joining stage (rank 2) failed: OutOfMemoryError"  # what the event loop found
    supervisor._tick()
    assert supervisor.grow() is None and supervisor._found is None
    assert seen["say"][-1] == (
        "growing in place failed, the run goes on as it is: member 'c''s joining stage (rank 2) failed: "
        "OutOfMemoryError"
    )
    supervisor._look_for_joins(launcher, 12)
    assert supervisor._found is None, "not tried again at once"
    assert "'c' held back: its stages failed to join 0 s ago" in seen["say"][-1]
    now[0] += 601.0
    supervisor._look_for_joins(launcher, 30)
    assert supervisor._found is not None, "tried again after the hold-off"
