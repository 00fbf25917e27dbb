"""Preference tuning across pipeline stages equals TRL's trainers: ``rl: dpo`` and ``ipo`` its
DPOTrainer, ``rl: orpo`` its ORPOTrainer, ``rl: simpo`` its CPOTrainer with ``loss_type: simpo``.

Every run is real: an NF4 base from bitsandbytes, peft LoRA, stage processes over gloo. The
reference is TRL's own trainer (a test-only dependency, pinned in pyproject.toml) on one process:
the same NF4 base, the same starting adapter, the same pairs in the same order; for DPO the
reference model is the base with the adapter disabled (``ref_model=None``), as in shardpool.
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
from transformers import AutoModelForCausalLM

from shardpool.config import parse_config
from shardpool.data.prepare import preference_rows, prepare_data
from shardpool.data.steps import pair_rows
from shardpool.data.tokenizing import load_tokenizer
from shardpool.finetune import finetune
from shardpool.model.nf4 import bnb_config, keep_exact_cpu_matmul
from shardpool.train.preference import PairLogps, PreferenceObjective, pair_losses
from tests.helpers.training import base_config, random_start_adapter, read_metrics

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[2] / "configs" / "data" / "preference_tiny.jsonl"
#: The metrics a DPO step logs (TRL's DPOTrainer names).
METRICS = PreferenceObjective("sigmoid", 0.1).metrics
STEPS = 3


@pytest.fixture(scope="module")
def start_adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A starting adapter with non-zero A and B: the policy differs from the base at step 1."""
    return random_start_adapter(tiny_model, tmp_path_factory.mktemp("dpo-start"), seed=5, scale=0.2)


def _config(model: Path, adapter: Path, output: Path, **overrides: Any) -> dict[str, Any]:
    return base_config(
        model,
        DATA,
        output,
        datasets=overrides.pop("datasets", [{"path": str(DATA), "type": "chatml.intel"}]),
        lora_model_dir=overrides.pop("lora_model_dir", str(adapter)),
        sequence_len=256,
        micro_batch_size=2,
        gradient_accumulation_steps=overrides.pop("gradient_accumulation_steps", 2),
        max_steps=overrides.pop("max_steps", STEPS),
        **{"rl": "dpo", "val_set_size": 0, **overrides},
    )


def _train(config: dict[str, Any]) -> Path:
    return finetune(parse_config(config), console=Console(quiet=True))


def _trl_run(
    trainer_class: type,
    settings: dict[str, Any],
    model_dir: Path,
    adapter_dir: Path,
    config: dict[str, Any],
    *,
    fp32_from_ref_copy: bool = False,
) -> tuple[list[float], list[dict[str, Any]], dict[str, Any]]:
    """Train a TRL trainer (``settings``: its config's own keys, the rest from ``config``) on one
    process over the same texts in file order, from the same NF4 base and starting adapter; return
    its per-step losses, its log and its final adapter.

    ``fp32_from_ref_copy``: TRL 1.16's DPOTrainer casts a QLoRA adapter to bf16 (the QLoRA paper's
    advice); shardpool trains it in fp32, so the comparison restores the starting adapter in fp32
    before the optimizer is made (the "ref" copy TRL made of it kept fp32).
    """
    from datasets import Dataset
    from torch.utils.data import SequentialSampler

    parsed = parse_config(config)
    tokenizer = load_tokenizer(model_dir)
    texts = [text for _, text in preference_rows(parsed, parsed.datasets[0], 0, tokenizer)]
    dataset = Dataset.from_list(
        [{"prompt": t.prompt, "chosen": t.chosen, "rejected": t.rejected} for t in texts]
    )
    base = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=bnb_config(), dtype=torch.float32
    )
    keep_exact_cpu_matmul(base)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    step_losses: list[float] = []
    micro: list[float] = []
    accumulation = config["gradient_accumulation_steps"]

    class InOrder(trainer_class):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if fp32_from_ref_copy:
                params = dict(self.model.named_parameters())
                for name, param in params.items():
                    if param.requires_grad:
                        param.data = params[name.replace(".default.", ".ref.")].data.float().clone()

        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> SequentialSampler:
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(*args, **kwargs)
            micro.append(float(loss))
            if len(micro) == accumulation:
                step_losses.append(sum(micro) / accumulation)
                micro.clear()
            return loss

    args = settings.pop("config_class")(
        output_dir=str(Path(config["output_dir"]).parent / f"trl-{trainer_class.__name__}"),
        max_length=config["sequence_len"],
        per_device_train_batch_size=config["micro_batch_size"],
        gradient_accumulation_steps=accumulation,
        max_steps=config["max_steps"],
        learning_rate=config["learning_rate"],
        lr_scheduler_type=config["lr_scheduler"],
        warmup_steps=config["warmup_steps"],
        max_grad_norm=config["max_grad_norm"],
        weight_decay=config["weight_decay"],
        optim="adamw_torch",
        seed=config["seed"],
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        bf16=False,  # TRL turns bf16 autocast on by default; the shardpool run computes in fp32 (bf16: false)
        **settings,
    )
    trainer = InOrder(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    return step_losses, trainer.state.log_history, dict(get_peft_model_state_dict(model))


def trl_reference(
    model_dir: Path, adapter_dir: Path, config: dict[str, Any], *, precompute: bool = False
) -> tuple[list[float], list[dict[str, Any]], dict[str, Any]]:
    """TRL's DPOTrainer (``ref_model=None``: the starting adapter is the reference) over the same pairs."""
    trl = pytest.importorskip("trl")
    parsed = parse_config(config)
    settings = {
        "config_class": trl.DPOConfig,
        "beta": parsed.preference_beta,
        "loss_type": [parsed.preference_loss],
        "precompute_ref_log_probs": precompute,
    }
    return _trl_run(trl.DPOTrainer, settings, model_dir, adapter_dir, config, fp32_from_ref_copy=True)


@pytest.fixture(scope="module")
def runs(tiny_model: Path, start_adapter: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dpo-runs")
    return {
        "one": _train(_config(tiny_model, start_adapter, root / "one", shardpool={"stages": 1})),
        "three": _train(_config(tiny_model, start_adapter, root / "three", shardpool={"layers": [1, 3, 2]})),
    }


def _adapter(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "adapter_model.safetensors")


def _max_difference(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> float:
    assert left.keys() == right.keys()
    return max(float((left[key] - right[key]).abs().max()) for key in left)


def test_dpo_on_one_and_on_three_stages_equals_trl(
    runs: dict[str, Path], tiny_model: Path, start_adapter: Path, tmp_path: Path
) -> None:
    """Per-step DPO losses within 1e-5 relative of TRL's and the final adapter within 1e-4, on one
    stage and on three uneven ones; the first step's log-probabilities too; the adapter moved and
    peft loads it."""
    losses, logged, adapter = trl_reference(
        tiny_model, start_adapter, _config(tiny_model, start_adapter, tmp_path / "x")
    )
    assert len(losses) == STEPS
    trl_first = next(record for record in logged if record.get("step") == 1 and "logps/chosen" in record)
    for name, output in runs.items():
        records = read_metrics(output)
        print(json.dumps({"placement": name, "ours": [r["loss"] for r in records], "trl": losses}))
        assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-5), name
        for metric in ("logps/chosen", "logps/rejected"):
            assert records[0][metric] == pytest.approx(trl_first[metric], rel=1e-5), (name, metric)
        trained = _adapter(output)
        assert _max_difference(trained, {key: value.float() for key, value in adapter.items()}) < 1e-4, name
        for record in records:
            assert set(METRICS) <= set(record), record
            assert 0.0 <= record["rewards/accuracies"] <= 1.0
            assert record["rewards/margins"] == pytest.approx(
                record["rewards/chosen"] - record["rewards/rejected"], abs=1e-6
            )
        assert abs(records[-1]["loss"] - records[0]["loss"]) > 1e-4, "the loss moved"
        assert _max_difference(trained, _adapter(start_adapter)) > 1e-3, "the adapter moved"
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), runs["three"])


def test_ipo_on_two_stages_equals_trl(tiny_model: Path, start_adapter: Path, tmp_path: Path) -> None:
    """``rl: ipo`` (TRL's ``loss_type: ipo``, the per-token margin squared): losses within 1e-5
    relative of TRL's and the adapter within 1e-4."""
    config = _config(tiny_model, start_adapter, tmp_path / "ipo", rl="ipo", shardpool={"layers": [2, 4]})
    losses, _, adapter = trl_reference(
        tiny_model, start_adapter, _config(tiny_model, start_adapter, tmp_path / "x", rl="ipo")
    )
    output = _train(config)
    ours = [record["loss"] for record in read_metrics(output)]
    assert ours == pytest.approx(losses, rel=1e-5)
    assert ours[0] == pytest.approx(25.0, rel=1e-6)  # the policy starts at the reference: (0 - 1/(2 * 0.1))^2
    assert _max_difference(_adapter(output), {key: value.float() for key, value in adapter.items()}) < 1e-4


def test_the_eval_loss_is_the_preference_loss_over_the_held_out_pairs(
    tiny_model: Path, start_adapter: Path, tmp_path: Path
) -> None:
    """``val_set_size`` holds out pairs; the eval loss before training is log 2 (the policy is the
    reference), and after it equals the DPO loss that a single peft model with the trained adapter
    computes over the same held-out pairs, against the starting adapter."""
    config = _config(
        tiny_model, start_adapter, tmp_path / "eval", val_set_size=4, shardpool={"layers": [3, 3]}
    )
    output = _train(config)
    summary = json.loads((output / "run_summary.json").read_text())
    assert summary["eval_loss_before"] == pytest.approx(math.log(2), rel=1e-6)
    parsed = parse_config(config)
    held_out = prepare_data(parsed, load_tokenizer(tiny_model)).eval
    assert len(held_out) == 8  # 4 pairs, chosen then rejected

    rows = held_out.select(pair_rows([0, 1, 2, 3], 4))

    def logps(adapter: Path) -> PairLogps:
        base = AutoModelForCausalLM.from_pretrained(
            tiny_model, quantization_config=bnb_config(), dtype=torch.float32
        )
        keep_exact_cpu_matmul(base)
        model = PeftModel.from_pretrained(base, adapter).eval()
        with torch.no_grad():
            logits = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask).logits
        return PairLogps.of(logits, rows.labels)

    losses, _ = pair_losses(PreferenceObjective("sigmoid", 0.1), logps(output), logps(start_adapter))
    assert summary["eval_loss_after"] == pytest.approx(float(losses.mean()), rel=1e-5)
    assert abs(summary["eval_loss_after"] - math.log(2)) > 1e-5


def test_dpo_on_three_uneven_stages_trains_as_on_one(runs: dict[str, Path]) -> None:
    """The pipeline changes nothing: losses within 1e-5 relative and adapters within 1e-4."""
    one, three = read_metrics(runs["one"]), read_metrics(runs["three"])
    assert [r["loss"] for r in three] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert _max_difference(_adapter(runs["three"]), _adapter(runs["one"])) < 1e-4


def test_three_stages_log_the_same_trl_metrics_as_one(runs: dict[str, Path]) -> None:
    one, three = read_metrics(runs["one"]), read_metrics(runs["three"])
    for left, right in zip(one, three, strict=True):
        for name in METRICS:
            assert right[name] == pytest.approx(left[name], rel=1e-5, abs=1e-6), name


def _argilla_data(directory: Path) -> Path:
    """The tiny pairs as ORPO's ``chat_template.argilla`` rows: each answer closing a conversation."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    path = directory / "argilla.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    key: [
                        {"role": "user", "content": row["question"]},
                        {"role": "assistant", "content": row[key]},
                    ]
                    for key in ("chosen", "rejected")
                }
            )
            + "\n"
            for row in rows
        )
    )
    return path


def trl_cpo_family_reference(
    kind: str, model_dir: Path, adapter_dir: Path, config: dict[str, Any]
) -> tuple[list[float], list[dict[str, Any]], dict[str, Any]]:
    """TRL's ORPOTrainer (``kind`` orpo) or CPOTrainer with ``loss_type: simpo`` over the same texts."""
    pytest.importorskip("trl")
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    parsed = parse_config(config)
    if kind == "orpo":
        return _trl_run(
            ORPOTrainer,
            {"config_class": ORPOConfig, "beta": parsed.preference_beta},
            model_dir,
            adapter_dir,
            config,
        )
    settings = {
        "config_class": CPOConfig,
        "beta": parsed.preference_beta,
        "loss_type": "simpo",
        "simpo_gamma": parsed.simpo_gamma,
        "cpo_alpha": parsed.cpo_alpha,
    }
    return _trl_run(CPOTrainer, settings, model_dir, adapter_dir, config)


@pytest.mark.parametrize(
    ("kind", "layers", "extra"),
    [
        ("orpo", [1, 3, 2], {"orpo_alpha": 0.3, "chat_template": "chatml"}),
        ("orpo", [6], {"orpo_alpha": 0.3, "chat_template": "chatml"}),
        ("simpo", [2, 4], {"rl_beta": 2.0, "simpo_gamma": 0.4, "cpo_alpha": 0.5}),
    ],
)
def test_orpo_and_simpo_across_stages_equal_trl(
    kind: str, layers: list[int], extra: dict[str, Any], tiny_model: Path, start_adapter: Path, tmp_path: Path
) -> None:
    """``rl: orpo`` (TRL's ORPOTrainer, ``orpo_alpha`` its beta) on three uneven stages and on one,
    ``rl: simpo`` (TRL's CPOTrainer, ``loss_type: simpo``) on two: per-step losses within 1e-5 relative,
    the first step's metrics as TRL logs them, the adapter within 1e-4; no reference pass is needed."""
    overrides: dict[str, Any] = {"rl": kind, **extra}
    if kind == "orpo":
        overrides["datasets"] = [{"path": str(_argilla_data(tmp_path)), "type": "chat_template.argilla"}]
    losses, logged, adapter = trl_cpo_family_reference(
        kind, tiny_model, start_adapter, _config(tiny_model, start_adapter, tmp_path / "x", **overrides)
    )
    output = _train(
        _config(tiny_model, start_adapter, tmp_path / kind, shardpool={"layers": layers}, **overrides)
    )
    records = read_metrics(output)
    print(json.dumps({"rl": kind, "ours": [r["loss"] for r in records], "trl": losses}))
    assert len(losses) == STEPS
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-5)
    trl_first = next(record for record in logged if record.get("step") == 1 and "logps/chosen" in record)
    names = ["rewards/chosen", "rewards/margins", "logps/chosen", "logps/rejected", "nll_loss"]
    names += ["log_odds_ratio", "log_odds_chosen"] if kind == "orpo" else []
    for name in names:
        # abs: TRL means its metrics in fp32, a margin of two near rewards keeps ~1e-7 of it
        assert records[0][name] == pytest.approx(trl_first[name], rel=1e-5, abs=1e-6), name
    trained = _adapter(output)
    assert _max_difference(trained, {key: value.float() for key, value in adapter.items()}) < 1e-4
    assert _max_difference(trained, _adapter(start_adapter)) > 1e-3, "the adapter moved"


@pytest.mark.parametrize(("placement", "layers"), [("three", [1, 3, 2]), ("one", [6])])
def test_precomputed_reference_log_probs_equal_trls_and_the_per_step_pass(
    placement: str,
    layers: list[int],
    runs: dict[str, Path],
    tiny_model: Path,
    start_adapter: Path,
    tmp_path: Path,
) -> None:
    """``precompute_ref_log_probs: true`` on three uneven stages and on one: one reference pass over every pair
    before training (its seconds in run_summary.json), then per-step losses within 1e-5 relative of
    TRL's DPOTrainer with its own precompute, and of the run that passes in each step; the adapter
    within 1e-4 of both."""
    config = _config(
        tiny_model,
        start_adapter,
        tmp_path / "pre",
        precompute_ref_log_probs=True,
        shardpool={"layers": layers},
    )
    output = _train(config)
    losses, _, adapter = trl_reference(
        tiny_model, start_adapter, _config(tiny_model, start_adapter, tmp_path / "x"), precompute=True
    )
    ours = [record["loss"] for record in read_metrics(output)]
    print(json.dumps({"precomputed": ours, "trl": losses}))
    assert ours == pytest.approx(losses, rel=1e-5)
    assert ours == pytest.approx([record["loss"] for record in read_metrics(runs[placement])], rel=1e-5)
    trained = _adapter(output)
    assert _max_difference(trained, {key: value.float() for key, value in adapter.items()}) < 1e-4
    assert _max_difference(trained, _adapter(runs[placement])) < 1e-4
    ranks = json.loads((output / "run_summary.json").read_text())["ranks"]
    print(json.dumps({"reference_pass_s": [entry["reference_pass_s"] for entry in ranks]}))
    assert len(ranks) == len(layers) and all(entry["reference_pass_s"] > 0 for entry in ranks)
    unprecomputed = json.loads((runs[placement] / "run_summary.json").read_text())["ranks"]
    assert all(entry.get("reference_pass_s") is None for entry in unprecomputed)


def test_a_fresh_adapters_reference_folded_into_the_schedule_equals_the_precomputed_one(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Without ``lora_model_dir`` the reference is the base with the adapter disabled, and each
    micro-batch's reference forward runs in the schedule just before its forward (its own wire
    channel). On three uneven stages that equals the reference computed in one pass before
    training (``precompute_ref_log_probs``) and on one stage: losses within 1e-5, adapters 1e-4."""
    runs = {}
    for name, settings in {
        "folded": {"shardpool": {"layers": [1, 3, 2]}},
        "precomputed": {"shardpool": {"layers": [1, 3, 2]}, "precompute_ref_log_probs": True},
        "one": {"shardpool": {"stages": 1}},
    }.items():
        config = _config(tiny_model, tmp_path, tmp_path / name, lora_model_dir=None, **settings)
        runs[name] = _train(config)
    losses = {name: [record["loss"] for record in read_metrics(output)] for name, output in runs.items()}
    print(json.dumps(losses))
    assert losses["folded"][0] == pytest.approx(math.log(2), rel=1e-6)  # a fresh adapter is the reference
    assert abs(losses["folded"][-1] - math.log(2)) > 1e-4, "the loss moved"
    for other in ("precomputed", "one"):
        assert losses["folded"] == pytest.approx(losses[other], rel=1e-5), other
        assert _max_difference(_adapter(runs["folded"]), _adapter(runs[other])) < 1e-4, other


def test_dpo_with_two_replicas_or_resumed_from_a_checkpoint_trains_as_one_uninterrupted_run(
    tiny_model: Path, tmp_path: Path
) -> None:
    """DPO data-parallel (two replicas of two stages, one micro-batch each a step) equals one
    replica with two micro-batches a step; a run resumed from the uninterrupted run's step-1
    checkpoint, with ``precompute_ref_log_probs`` (its table made again after the restore), ends
    with the same steps' losses and adapter: losses within 1e-5 relative, adapters within 1e-4."""
    common: dict[str, Any] = {"lora_model_dir": None, "save_steps": 1}
    single = _train(_config(tiny_model, tmp_path, tmp_path / "single", shardpool={"stages": 2}, **common))
    replicated = _train(
        _config(
            tiny_model, tmp_path, tmp_path / "replicas", gradient_accumulation_steps=1,
            shardpool={"stages": 2, "replicas": 2}, **common,
        )
    )  # fmt: skip
    resumed = _train(
        _config(
            tiny_model, tmp_path, tmp_path / "resumed", shardpool={"stages": 2}, precompute_ref_log_probs=True,
            resume_from_checkpoint=str(single / "checkpoints" / "checkpoint-1"), **common,
        )
    )  # fmt: skip
    expected = {record["step"]: record["loss"] for record in read_metrics(single)}
    print(
        json.dumps(
            {"single": expected, "replicas": read_metrics(replicated), "resumed": read_metrics(resumed)}
        )
    )
    assert abs(expected[STEPS] - math.log(2)) > 1e-4, "the loss moved"
    assert [r["loss"] for r in read_metrics(replicated)] == pytest.approx(list(expected.values()), rel=1e-5)
    assert read_metrics(replicated)[-1]["rewards/margins"] == pytest.approx(
        read_metrics(single)[-1]["rewards/margins"], rel=1e-4, abs=1e-7
    )
    after = {record["step"]: record["loss"] for record in read_metrics(resumed)}
    assert sorted(after) == list(range(2, STEPS + 1))
    assert list(after.values()) == pytest.approx([expected[step] for step in after], rel=1e-5)
    for other in (replicated, resumed):
        assert _max_difference(_adapter(other), _adapter(single)) < 1e-4, other.name


def test_the_folded_reference_under_the_gpipe_schedule_equals_1f1b(tiny_model: Path, tmp_path: Path) -> None:
    """Each micro-batch's reference forward takes its slot in either schedule (GPipe: every
    forward first; 1F1B: interleaved with the backwards): the same losses within 1e-5, adapters 1e-4."""
    runs = {
        schedule: _train(
            _config(
                tiny_model,
                tmp_path,
                tmp_path / schedule,
                lora_model_dir=None,
                shardpool={"layers": [2, 4], "schedule": schedule},
            )
        )  # fmt: skip
        for schedule in ("gpipe", "1f1b")
    }
    losses = {
        schedule: [record["loss"] for record in read_metrics(output)] for schedule, output in runs.items()
    }
    assert abs(losses["gpipe"][-1] - math.log(2)) > 1e-4, "the loss moved"
    assert losses["gpipe"] == pytest.approx(losses["1f1b"], rel=1e-5)
    assert _max_difference(_adapter(runs["gpipe"]), _adapter(runs["1f1b"])) < 1e-4


@pytest.mark.parametrize("precompute", [False, True])
def test_dpo_resharded_in_place_trains_as_the_kept_plan(
    precompute: bool, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A re-balance after step 1 moves the layers of three stages ([0, 2) [2, 4) [4, 6) to [0, 1)
    [1, 3) [3, 6)) in place, the stages rebuilt: the reference folded into the schedule, or with
    ``precompute_ref_log_probs`` the table made again by the rebuilt stages, gives the same losses
    (1e-5 relative) and adapter (1e-4) as the plan kept all along."""
    from shardpool.contract.rebalance import FORCE_ENV

    settings: dict[str, Any] = {"lora_model_dir": None, "precompute_ref_log_probs": precompute}
    kept = _train(
        _config(
            tiny_model,
            tmp_path,
            tmp_path / "kept",
            shardpool={"layers": [2, 2, 2], "rebalance": "off"},
            **settings,
        )
    )
    monkeypatch.setenv(FORCE_ENV, "1:0-1,1-3,3-6")
    moved = _train(
        _config(
            tiny_model,
            tmp_path,
            tmp_path / "moved",
            shardpool={"layers": [2, 2, 2], "rebalance": "auto"},
            **settings,
        )
    )
    events = [line for line in read_metrics(moved) if line.get("event") == "rebalance"]
    assert len(events) == 1, read_metrics(moved)
    losses = {
        name: [r["loss"] for r in read_metrics(out) if "loss" in r]
        for name, out in (("kept", kept), ("moved", moved))
    }
    print(json.dumps(losses))
    assert abs(losses["kept"][-1] - math.log(2)) > 1e-4, "the loss moved"
    assert losses["moved"] == pytest.approx(losses["kept"], rel=1e-5)
    assert _max_difference(_adapter(moved), _adapter(kept)) < 1e-4
    if precompute:
        ranks = json.loads((moved / "run_summary.json").read_text())["ranks"]
        assert all(entry["reference_pass_s"] > 0 for entry in ranks)
