"""The inference ring against peft's own ``generate``: greedy tokens equal, token for token, for
eight prompts at S = 1 and S = 3 and with requests in flight together; seeded sampling repeats;
a stage lost while generating fails the requests in one line and leaves no process behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from shardpool.errors import ShardpoolError
from shardpool.generate import local_placements
from shardpool.infer.engine import EngineFailed, GenerationRequest, PipelineEngine
from shardpool.infer.sampling import Sampling
from shardpool.infer.target import resolve_target
from tests.helpers.generation import PROMPTS, peft_greedy, random_adapter, varied_tiny_model

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 64


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("generation")
    model = varied_tiny_model(root / "model")
    return random_adapter(model, root / "adapter")


@pytest.fixture(scope="module")
def reference(adapter_dir: Path) -> list[list[int]]:
    target = resolve_target(adapter_dir)
    return peft_greedy(target.model_dir, adapter_dir, PROMPTS, MAX_NEW_TOKENS)


def _requests(adapter_dir: Path, **sampling: float) -> list[GenerationRequest]:
    target = resolve_target(adapter_dir)
    tokenizer = AutoTokenizer.from_pretrained(target.tokenizer_dir)
    return [
        GenerationRequest(
            tuple(tokenizer(prompt)["input_ids"]),
            MAX_NEW_TOKENS,
            Sampling(**sampling),  # type: ignore[arg-type]
            frozenset({tokenizer.eos_token_id}),
        )
        for prompt in PROMPTS
    ]


def _engine(adapter_dir: Path, stages: int, **options: int) -> PipelineEngine:
    target = resolve_target(adapter_dir)
    return PipelineEngine(target, local_placements(target.model_dir, stages, ["cpu"]), threads_per_process=1, **options)


def test_the_reference_does_not_repeat_one_token(reference: list[list[int]]) -> None:
    # Equal outputs mean something only when the model's continuations vary.
    assert all(len(set(tokens)) > 8 for tokens in reference), reference


@pytest.mark.parametrize("stages", [1, 3])
def test_greedy_tokens_equal_peft_generate(
    adapter_dir: Path, reference: list[list[int]], stages: int
) -> None:
    with _engine(adapter_dir, stages) as engine:
        outputs = [engine.generate(request) for request in _requests(adapter_dir)]
    assert outputs == reference


def test_requests_in_flight_together_equal_each_alone(adapter_dir: Path, reference: list[list[int]]) -> None:
    with _engine(adapter_dir, 3, max_slots=4) as engine:
        streams = [engine.submit(request) for request in _requests(adapter_dir)]  # 4 in flight, 4 waiting
        outputs = [stream.tokens() for stream in streams]
    assert outputs == reference
    assert {stream.finish_reason for stream in streams} <= {"stop", "length"}


def test_seeded_sampling_repeats_and_the_seed_matters(adapter_dir: Path) -> None:
    with _engine(adapter_dir, 2, max_slots=4) as engine:
        first = [
            engine.generate(request)
            for request in _requests(adapter_dir, temperature=0.9, top_p=0.95, seed=5)
        ]
        again = [
            engine.generate(request)
            for request in _requests(adapter_dir, temperature=0.9, top_p=0.95, seed=5)
        ]
        other = [
            engine.generate(request)
            for request in _requests(adapter_dir, temperature=0.9, top_p=0.95, seed=6)
        ]
    assert first == again
    assert first != other


def test_a_prompt_longer_than_the_context_is_refused_in_one_line(adapter_dir: Path) -> None:
    with _engine(adapter_dir, 1, max_context=32) as engine:
        request = GenerationRequest(tuple(range(3, 30)), 8)
        with pytest.raises(
            ShardpoolError, match=r"plus max_new_tokens \(8\) exceeds the context of 32 tokens"
        ):
            engine.submit(request)
        assert len(engine.generate(GenerationRequest((5, 6, 7), 4))) == 4  # still serving


def test_a_stage_lost_while_generating_fails_the_requests_and_leaves_no_process(adapter_dir: Path) -> None:
    engine = _engine(adapter_dir, 2, max_slots=2)
    try:
        streams = [engine.submit(GenerationRequest((5, 6, 7), 900)) for _ in range(2)]
        first = iter(streams[0])
        next(first)  # generating
        pids = [process.pid for process in engine.ring.processes]  # type: ignore[union-attr]
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(EngineFailed, match=r"stage 1 failed: killed by signal 9"):
            list(first)
        with pytest.raises(EngineFailed, match="stage 1 failed"):
            streams[1].tokens()
        with pytest.raises(EngineFailed, match="stage 1 failed"):
            engine.submit(GenerationRequest((5, 6, 7), 4))
    finally:
        engine.close()
    for pid in pids:
        assert (
            not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
        )


def test_a_stage_without_the_ring_key_never_joins(adapter_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that does not hold the engine's key (here: stage 0 given another one) can neither
    read the sealed rendezvous nor prove the key, so the ring never forms: one line, no process left."""
    import shardpool.infer.rings as rings_module

    started = []
    real_start = rings_module._start_local_stage

    def outsider_at_rank_0(job_file: Path, rank: int, log_dir: Path, secret: str, threads: int):  # type: ignore[no-untyped-def]
        process = real_start(job_file, rank, log_dir, "f" * 64 if rank == 0 else secret, threads)
        started.append(process)
        return process

    monkeypatch.setattr(rings_module, "_start_local_stage", outsider_at_rank_0)
    target = resolve_target(adapter_dir)
    with pytest.raises(EngineFailed, match=r"stage 0 failed|did not join the ring"):
        PipelineEngine(target, local_placements(target.model_dir, 2, ["cpu"]), threads_per_process=1, timeout_s=20)
    assert started and all(process.poll() is not None for process in started)
