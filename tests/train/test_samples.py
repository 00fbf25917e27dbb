"""Samples during training (``shardpool.sample_prompts``): the keys, the contract, the lines the
launcher writes, and the greedy completions themselves, which equal peft's ``generate`` of the
adapter token for token on one stage and on three."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from shardpool.config import parse_config
from shardpool.console import format_sample_lines
from shardpool.contract.events import SamplesEvent, StageEvent, parse_stage_event
from shardpool.contract.job import Job
from shardpool.contract.names import ContractError
from shardpool.errors import ShardpoolError
from shardpool.launch.run import METRICS_FILE, RunRecord, sample_decoder
from shardpool.trackers import open_trackers
from shardpool.train.samples import TokenRoute, greedy_samples, report_samples
from tests.helpers.generation import peft_greedy
from tests.helpers.jobs import MINIMAL_CONFIG, job_dict
from tests.helpers.shared_runs import FP32_TWO_STAGES, trained_once
from tests.helpers.training import base_config

PROMPTS = ["The quick brown", "Once"]
NEW_TOKENS = 8


def _shardpool(**keys: Any) -> Any:
    return parse_config({**MINIMAL_CONFIG, "output_dir": "o", "shardpool": keys}).shardpool


def test_the_keys_default_to_no_samples_and_take_prompts() -> None:
    assert _shardpool().sample_prompts == [] and _shardpool().sample_max_new_tokens == 32
    settings = _shardpool(sample_prompts=PROMPTS, sample_max_new_tokens=1024)
    assert settings.sample_prompts == PROMPTS and settings.sample_max_new_tokens == 1024


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        ({"sample_prompts": ["ok", "  "]}, "a sample prompt is empty"),
        ({"sample_prompts": ["p"] * 17}, "at most 16 items"),
        ({"sample_prompts": ["x" * 4001]}, "at most 4000"),
        ({"sample_prompts": "one prompt"}, "valid list"),
        ({"sample_max_new_tokens": 0}, "greater than or equal to 1"),
        ({"sample_max_new_tokens": 1025}, "less than or equal to 1024"),
    ],
)
def test_bad_sample_keys_are_one_line_errors(keys: dict[str, Any], named: str) -> None:
    with pytest.raises(ShardpoolError) as caught:
        _shardpool(**keys)
    message = str(caught.value)
    assert "\n" not in message and "shardpool.sample_" in message and named in message


def test_the_samples_event_is_closed_and_capped() -> None:
    event = parse_stage_event({"event": "samples", "step": 3, "token_ids": [[5, 6, 2], []]})
    assert isinstance(event, SamplesEvent) and event.token_ids == [[5, 6, 2], []]
    for bad in (
        {"token_ids": [[1]] * 17},  # more completions than prompts can be
        {"token_ids": [[1] * 1025]},  # longer than sample_max_new_tokens can be
        {"token_ids": [[-1]]},
        {"token_ids": []},
        {"token_ids": [[1]], "text": "smuggled"},
    ):
        with pytest.raises(ContractError):
            parse_stage_event({"event": "samples", "step": 3, "token_ids": [[1]], **bad})


def test_the_job_carries_the_prompt_ids_capped() -> None:
    job = Job.model_validate(job_dict(sample_prompt_ids=[[1, 315], [1]], eos_token_ids=[2]))
    assert job.sample_prompt_ids == [[1, 315], [1]] and job.eos_token_ids == [2]
    assert Job.model_validate(job_dict()).sample_prompt_ids == []
    for bad in ({"sample_prompt_ids": [[]]}, {"sample_prompt_ids": [[1]] * 17}, {"eos_token_ids": [-2]}):
        with pytest.raises(ValueError):
            Job.model_validate(job_dict(**bad))


def test_only_replica_0_samples_and_no_prompts_do_nothing() -> None:
    """Ranks with nothing to sample return before touching their pipe (None here)."""
    emitted: list[dict[str, Any]] = []
    quiet = Job.model_validate(job_dict(stages=2))
    report_samples(None, quiet, step=1, rank=0, emit=emitted.append)  # type: ignore[arg-type]
    replicated = Job.model_validate(job_dict(stages=2, replicas=2, sample_prompt_ids=[[1, 5]]))
    for rank in (2, 3):  # replica 1
        report_samples(None, replicated, step=1, rank=rank, emit=emitted.append)  # type: ignore[arg-type]
    assert emitted == []
    assert TokenRoute.of_pipeline(replicated, replica=0) == TokenRoute(last=1, others=(0,))


def test_the_launcher_writes_a_samples_line_and_shows_it(tmp_path: Path) -> None:
    lines: list[dict[str, Any]] = []
    record = RunRecord(
        tmp_path, 1, 4, 0, on_metrics=lines.append, sample_prompts=PROMPTS, decode=lambda ids: f"<{ids}>"
    )
    record.record({"event": StageEvent.SAMPLES, "step": 2, "token_ids": [[7, 8], [9]]})
    written = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert (
        written
        == lines
        == [
            {
                "event": "samples",
                "step": 2,
                "samples": [
                    {"prompt": "The quick brown", "completion": "<[7, 8]>", "token_ids": [7, 8]},
                    {"prompt": "Once", "completion": "<[9]>", "token_ids": [9]},
                ],
            }
        ]
    )
    assert format_sample_lines(written[0]) == [
        "sample 1/2 @ step 2: 'The quick brown' → '<[7, 8]>'",
        "sample 2/2 @ step 2: 'Once' → '<[9]>'",
    ]
    bare = RunRecord(tmp_path / "bare", 1, 4, 0).samples_line({"step": 2, "token_ids": [[7]]})
    assert bare["samples"] == [{"prompt": None, "completion": None, "token_ids": [7]}]
    assert format_sample_lines(bare) == ["sample 1/1 @ step 2: ? → ids [7]"]


def test_the_decoder_skips_special_tokens(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    ids = tokenizer("hello world")["input_ids"] + [tokenizer.eos_token_id]
    decode = sample_decoder(tokenizer)
    assert decode is not None and decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)
    assert "</s>" not in decode(ids) and sample_decoder(None) is None


def test_tensorboard_gets_the_samples_as_text(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = parse_config({**MINIMAL_CONFIG, "output_dir": str(tmp_path), "use_tensorboard": True})
    sinks = open_trackers(config, tmp_path)
    sinks.log(
        {"step": 1, "epoch": 0.5, "loss": 3.0, "learning_rate": 1e-4, "grad_norm": 0.5, "tokens_per_s": 1.0}
    )
    sinks.log(
        {
            "event": "samples",
            "step": 2,
            "samples": [{"prompt": "a|b", "completion": "c\nd", "token_ids": [5]}],
        }
    )
    sinks.close()
    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    (text,) = events.Tensors("samples/text_summary")
    assert text.step == 2
    table = text.tensor_proto.string_val[0].decode()
    assert "| step | prompt | completion |" in table and "| 2 | a\\|b | c<br>d |" in table
    assert [event.step for event in events.Scalars("train/loss")] == [1]


@pytest.mark.slow
def test_wandb_gets_the_samples_as_a_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An offline W&B run holds the samples table (wandb's binary log, searched for its bytes)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = parse_config({**MINIMAL_CONFIG, "output_dir": str(tmp_path), "wandb_project": "shardpool-test"})
    sinks = open_trackers(config, tmp_path)
    sinks.log(
        {
            "event": "samples",
            "step": 2,
            "samples": [{"prompt": "Once upon", "completion": " a midnight dreary", "token_ids": [5]}],
        }
    )
    sinks.close()
    (table,) = tmp_path.glob("wandb/offline-run-*/files/media/table/samples_*.table.json")
    assert json.loads(table.read_text())["data"] == [[2, "Once upon", " a midnight dreary"]]


@pytest.mark.slow
def test_greedy_samples_on_a_lone_stage_are_generates_and_stop_at_eos(tiny_model: Path) -> None:
    """One stage in-process: peft's generate of the same adapter, the end-of-sequence id ends a
    sample (and is kept), the stage goes back to training mode, and a foreign id is refused."""
    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from shardpool.model.lora import LoraSettings, peft_config
    from shardpool.model.nf4 import bnb_config, keep_exact_cpu_matmul
    from shardpool.model.stage import BaseSettings, StageSpec, build_stage
    from shardpool.train.pipeline import StagePipe
    from shardpool.train.process_group import Wire

    lora = LoraSettings(
        r=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj", "down_proj"), init_from=None
    )
    spec = StageSpec(0, 1, 0, 6, "cpu")
    stage = build_stage(tiny_model, spec, BaseSettings(), lora, seed=5)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in stage.named_lora_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    cpu = torch.device("cpu")
    wire = Wire(cpu, torch.float32, torch.float32, previous=None, next=None)
    pipe = StagePipe(stage, spec, wire, cpu, int(stage.hf_config.hidden_size), packed=False)
    prompts = [[1, 315, 480, 427], [1, 393]]
    alone = TokenRoute(last=0, others=())
    stage.train()
    samples = greedy_samples(pipe, prompts, max_new_tokens=12, stop_ids=(), route=alone)
    assert stage.training

    base = AutoModelForCausalLM.from_pretrained(
        tiny_model, quantization_config=bnb_config(), dtype=torch.float32
    )
    keep_exact_cpu_matmul(base)
    reference = get_peft_model(base, peft_config(lora))
    assert not set_peft_model_state_dict(reference, stage.lora_state_dict()).unexpected_keys
    reference.eval()
    for prompt, sample in zip(prompts, samples, strict=True):
        ids = torch.tensor([prompt])
        generated = reference.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        assert sample == generated[0, len(prompt) :].tolist()

    stop = samples[0][2]
    (stopped,) = greedy_samples(pipe, prompts[:1], max_new_tokens=12, stop_ids={stop}, route=alone)
    assert stopped == samples[0][: samples[0].index(stop) + 1]
    with pytest.raises(ShardpoolError, match="outside the model's vocabulary"):
        greedy_samples(pipe, [[1, 10**6]], max_new_tokens=2, stop_ids=(), route=alone)


def _samples_lines(output_dir: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in (output_dir / METRICS_FILE).read_text().splitlines()]
    return [line for line in lines if line.get("event") == "samples"]


@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 3])
def test_the_last_samples_equal_generate_of_the_adapter(
    tiny_model: Path, completion_data: Path, tmp_path: Path, stages: int
) -> None:
    """A run samples at each periodic eval (step 2) and at the end (step 3); the end's are peft's
    generate of the written adapter, token for token, whether one stage or three computed them."""
    from shardpool.finetune import finetune

    config = base_config(
        tiny_model, completion_data, tmp_path / "out", eval_steps=2, learning_rate=0.05,
        shardpool={"stages": stages, "sample_prompts": PROMPTS, "sample_max_new_tokens": NEW_TOKENS},
    )  # fmt: skip
    output_dir = finetune(parse_config(config), console=Console(quiet=True))
    lines = _samples_lines(output_dir)
    assert [line["step"] for line in lines] == [2, 3]
    final = lines[-1]["samples"]
    assert [sample["token_ids"] for sample in final] == peft_greedy(
        tiny_model, output_dir, tuple(PROMPTS), NEW_TOKENS
    )
    assert all(
        len(sample["token_ids"]) == NEW_TOKENS for sample in final
    )  # no eos in this tiny model's picks
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert [sample["prompt"] for sample in final] == list(PROMPTS)
    assert [sample["completion"] for sample in final] == [
        tokenizer.decode(sample["token_ids"], skip_special_tokens=True) for sample in final
    ]
    job = json.loads((output_dir / ".shardpool" / "job.json").read_text())
    assert len(job["sample_prompt_ids"]) == 2 and job["eos_token_ids"] == [2]


@pytest.mark.slow
def test_a_run_without_sample_prompts_samples_nothing(
    tiny_model: Path, completion_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    output_dir = trained_once(tmp_path_factory, tiny_model, completion_data, **FP32_TWO_STAGES)
    assert _samples_lines(output_dir) == []
    job = json.loads((output_dir / ".shardpool" / "job.json").read_text())
    assert job["sample_prompt_ids"] == [] and job["eos_token_ids"] == []
