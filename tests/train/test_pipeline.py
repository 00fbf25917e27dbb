"""shardpool.train.pipeline: pipelined training equals single-device QLoRA.

Every run here is real: NF4 bases from bitsandbytes, peft LoRA, stage processes talking over
torch.distributed (gloo on loopback). The reference is a plain single-process peft + bitsandbytes
loop written out below, on the same NF4 base, the same starting adapter and the same micro-batches.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from rich.console import Console
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, get_scheduler

from shardpool.config import parse_config
from shardpool.contract.rebalance import FORCE_SHARES_ENV
from shardpool.contract.schedule import peak_in_flight, schedule_for
from shardpool.data.prepared_file import load_prepared
from shardpool.finetune import finetune
from shardpool.launch.run import RUN_DIR_NAME
from shardpool.model.nf4 import bnb_config, keep_exact_cpu_matmul
from tests.helpers.training import base_config, eval_logits_gap, random_start_adapter, read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def start_adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A starting adapter with random (non-zero) A and B, so every LoRA tensor gets gradients."""
    return random_start_adapter(tiny_model, tmp_path_factory.mktemp("start-adapter"), seed=11, scale=0.05)


def _train(config: dict[str, Any]) -> Path:
    return finetune(parse_config(config), console=Console(quiet=True))


@pytest.fixture(scope="module")
def runs(
    tiny_model: Path, completion_data: Path, start_adapter: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The same config trained with 1 stage and with 3 uneven stages [1, 3, 2] at a deeper 1F1B
    warm-up (lead 2: stages 0 and 1 run every forward of the step's 3 before their backwards)."""
    root = tmp_path_factory.mktemp("runs")
    common = {"lora_model_dir": str(start_adapter)}
    one = _train(base_config(tiny_model, completion_data, root / "one", **common, shardpool={"stages": 1}))
    three = _train(
        base_config(
            tiny_model,
            completion_data,
            root / "three",
            **common,
            shardpool={"layers": [1, 3, 2], "warmup_lead": 2},
        )
    )
    return {"one": one, "three": three}


def reference_training(
    model_dir: Path, adapter_dir: Path, data_file: Path, config: dict[str, Any]
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """A plain single-process peft + bitsandbytes QLoRA loop: the definition of correct."""
    data = load_prepared(data_file)
    base = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=bnb_config(), dtype=torch.float32
    )
    keep_exact_cpu_matmul(base)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    model.train()
    params = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config["learning_rate"], weight_decay=config["weight_decay"])
    scheduler = get_scheduler(
        config["lr_scheduler"],
        optimizer,
        num_warmup_steps=config["warmup_steps"],
        num_training_steps=config["max_steps"],
    )
    per_step = config["gradient_accumulation_steps"]
    size = config["micro_batch_size"]
    losses, norms = [], []
    for step in range(config["max_steps"]):
        microbatches = [
            data.train.select(range((step * per_step + index) * size, (step * per_step + index + 1) * size))
            for index in range(per_step)
        ]
        tokens = sum(int((rows.labels[:, 1:] != -100).sum()) for rows in microbatches)
        step_loss = 0.0
        for rows in microbatches:
            output = model(
                input_ids=rows.input_ids,
                attention_mask=rows.attention_mask,
                position_ids=rows.position_ids,
                labels=rows.labels,
                num_items_in_batch=torch.tensor(tokens),
            )
            output.loss.backward()
            step_loss += float(output.loss)
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, config["max_grad_norm"])))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    return losses, norms, dict(get_peft_model_state_dict(model))


def _assert_losses_close(left: list[float], right: list[float], *, rel: float) -> None:
    assert len(left) == len(right)
    for a, b in zip(left, right, strict=True):
        assert abs(a - b) <= rel * abs(b), f"losses differ: {left} vs {right}"


def _max_adapter_diff(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> float:
    assert left.keys() == right.keys()
    return max(float((left[key] - right[key]).abs().max()) for key in left)


def test_one_stage_and_three_uneven_stages_train_identically(runs: dict[str, Path]) -> None:
    one, three = read_metrics(runs["one"]), read_metrics(runs["three"])
    assert [record["step"] for record in one] == [1, 2, 3]
    _assert_losses_close([r["loss"] for r in three], [r["loss"] for r in one], rel=1e-5)
    adapter_one = load_file(str(runs["one"] / "adapter_model.safetensors"))
    adapter_three = load_file(str(runs["three"] / "adapter_model.safetensors"))
    assert _max_adapter_diff(adapter_three, adapter_one) < 1e-4
    assert len(three[0]["stage_compute_s"]) == 3
    assert json.loads((runs["three"] / "plan.json").read_text())["warmup_lead"] == 2
    # What the stages held in flight (at M = 3 leads 1 and 2 hold the same; the next test tells them apart).
    assert [record["stage_in_flight"] for record in three] == [[3, 3, 1]] * 3
    assert [record["stage_in_flight"] for record in one] == [[1]] * 3


def test_the_stages_run_the_warm_up_lead_of_their_job(
    tiny_model: Path, completion_data: Path, tmp_path: Path
) -> None:
    """At M = 4 over three stages, lead 2 has stage 1 hold all 4 micro-batches in flight, where the
    textbook lead 1 holds 3: the runtime runs the order the plan chose, not lead 1."""
    out = _train(
        base_config(
            tiny_model, completion_data, tmp_path / "lead2", gradient_accumulation_steps=4, max_steps=1,
            shardpool={"layers": [1, 3, 2], "warmup_lead": 2},
        )
    )  # fmt: skip
    expected = {
        lead: [
            peak_in_flight(schedule_for("1f1b", stage=stage, num_stages=3, num_microbatches=4, lead=lead))
            for stage in range(3)
        ]
        for lead in (1, 2)
    }
    assert expected == {1: [4, 3, 1], 2: [4, 4, 1]}
    assert json.loads((out / "plan.json").read_text())["warmup_lead"] == 2
    assert [record["stage_in_flight"] for record in read_metrics(out) if "loss" in record] == [expected[2]]


def test_replicas_on_shares_of_the_step_train_as_one_stage_before_and_after_the_shares_move(
    runs: dict[str, Path],
    tiny_model: Path,
    completion_data: Path,
    start_adapter: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Data parallelism with shares: two whole-model replicas train 2 and 1 of the step's 3
    micro-batches and sum their gradients, which is one stage training all 3. Re-balancing moves
    only their shares (after step 1, 2/1 becomes 1/2), and the run still equals that stage."""
    monkeypatch.setenv(FORCE_SHARES_ENV, "1:1,2")
    moved = _train(
        base_config(
            tiny_model, completion_data, tmp_path / "moved", lora_model_dir=str(start_adapter),
            shardpool={"devices": ["cpu", "cpu"], "shares": [2, 1], "rebalance": "auto"},
        )
    )  # fmt: skip
    records, one = read_metrics(moved), read_metrics(runs["one"])
    events = [r for r in records if r.get("event") == "rebalance"]
    assert [(e["step"], e["shares_from"], e["shares_to"]) for e in events] == [(1, [2, 1], [1, 2])]
    steps = [r for r in records if "loss" in r]
    _assert_losses_close([r["loss"] for r in steps], [r["loss"] for r in one], rel=1e-5)
    assert [len(r["stage_compute_s"]) for r in steps] == [2] * len(steps)  # one rank per replica
    assert all(len(r["stage_sync_s"]) == 2 and min(r["stage_sync_s"]) >= 0 for r in steps)
    adapter_one = load_file(str(runs["one"] / "adapter_model.safetensors"))
    assert _max_adapter_diff(load_file(str(moved / "adapter_model.safetensors")), adapter_one) < 1e-4
    summaries = [json.loads((run / "run_summary.json").read_text()) for run in (moved, runs["one"])]
    assert summaries[0]["eval_loss_after"] == pytest.approx(summaries[1]["eval_loss_after"], rel=1e-5)
    plan = json.loads((moved / "plan.json").read_text())
    assert plan["shares"] == [1, 2] and plan["history"][0]["shares"] == [2, 1]
    assert [s["layers"] for s in plan["data_parallel"]] == [[0, 6], [0, 6]]
    card = (moved / "README.md").read_text()
    assert "data parallel: 2 replicas of the whole model" in card and "| 1 | cpu |" in card
    assert "Earlier splits of this run" in card and "2 micro-batches on " in card


def test_pipeline_equals_plain_peft_bitsandbytes_loop(
    runs: dict[str, Path], tiny_model: Path, start_adapter: Path, completion_data: Path
) -> None:
    config = base_config(tiny_model, completion_data, runs["one"])
    data_file = runs["one"] / RUN_DIR_NAME / "data.safetensors"
    data = load_prepared(data_file)
    first_step = [data.train.select(range(i * 2, i * 2 + 2)) for i in range(3)]
    counts = [int((rows.labels[:, 1:] != -100).sum()) for rows in first_step]
    assert len(set(counts)) > 1, f"micro-batches should carry unequal token counts, got {counts}"

    losses, norms, reference = reference_training(tiny_model, start_adapter, data_file, config)
    assert all(norm > config["max_grad_norm"] for norm in norms), "clipping must be active in this test"
    start = load_file(str(start_adapter / "adapter_model.safetensors"))
    assert _max_adapter_diff(reference, start) > 1e-3, "training must move the adapter"
    for run in ("one", "three"):
        metrics = read_metrics(runs[run])
        _assert_losses_close([r["loss"] for r in metrics], losses, rel=1e-5)
        for record, norm in zip(metrics, norms, strict=True):
            assert math.isclose(record["grad_norm"], norm, rel_tol=1e-4)
        trained = load_file(str(runs[run] / "adapter_model.safetensors"))
        assert _max_adapter_diff(trained, reference) < 1e-4


def test_adapter_loads_with_peft_and_reproduces_pipeline_logits(
    runs: dict[str, Path], tiny_model: Path
) -> None:
    output_dir = runs["three"]
    base = AutoModelForCausalLM.from_pretrained(
        tiny_model, quantization_config=bnb_config(), dtype=torch.float32
    )
    keep_exact_cpu_matmul(base)
    model = PeftModel.from_pretrained(base, output_dir)
    expected_keys = set(get_peft_model_state_dict(model).keys())
    saved_keys = set(load_file(str(output_dir / "adapter_model.safetensors")).keys())
    assert saved_keys == expected_keys, "no missing and no unexpected adapter keys"
    assert any(".layers.5." in key for key in saved_keys), "keys use global layer indices"
    assert eval_logits_gap(model, output_dir) < 1e-4


#: Two stages, two steps, no eval: the 1F1B run that the replica and the schedule tests compare with.
TWO_STAGE_STEPS = {"max_steps": 2, "val_set_size": 0, "gradient_accumulation_steps": 4}


@pytest.fixture(scope="module")
def two_stage_1f1b(
    tiny_model: Path, completion_data: Path, start_adapter: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """One replica of 2 stages on the 1F1B schedule, 4 micro-batches a step (trained once, compared twice)."""
    return _train(
        base_config(
            tiny_model, completion_data, tmp_path_factory.mktemp("two-stage") / "out",
            lora_model_dir=str(start_adapter), **TWO_STAGE_STEPS, shardpool={"stages": 2, "replicas": 1},
        )
    )  # fmt: skip


def test_two_replicas_equal_one_replica_with_double_accumulation(
    tiny_model: Path, completion_data: Path, start_adapter: Path, two_stage_1f1b: Path, tmp_path: Path
) -> None:
    common = {"lora_model_dir": str(start_adapter), **TWO_STAGE_STEPS, "gradient_accumulation_steps": 2}
    replicated = _train(
        base_config(
            tiny_model, completion_data, tmp_path / "r2", **common, shardpool={"stages": 2, "replicas": 2}
        )
    )
    single = two_stage_1f1b
    _assert_losses_close(
        [r["loss"] for r in read_metrics(replicated)], [r["loss"] for r in read_metrics(single)], rel=1e-5
    )
    left = load_file(str(replicated / "adapter_model.safetensors"))
    right = load_file(str(single / "adapter_model.safetensors"))
    assert _max_adapter_diff(left, right) < 1e-4
    assert len(read_metrics(replicated)[0]["stage_compute_s"]) == 4


def test_gpipe_schedule_matches_1f1b(
    tiny_model: Path, completion_data: Path, start_adapter: Path, two_stage_1f1b: Path, tmp_path: Path
) -> None:
    common = {"lora_model_dir": str(start_adapter), **TWO_STAGE_STEPS}
    gpipe = _train(
        base_config(
            tiny_model,
            completion_data,
            tmp_path / "g",
            **common,
            shardpool={"stages": 2, "schedule": "gpipe"},
        )
    )
    one_f = two_stage_1f1b
    _assert_losses_close(
        [r["loss"] for r in read_metrics(gpipe)], [r["loss"] for r in read_metrics(one_f)], rel=1e-6
    )
