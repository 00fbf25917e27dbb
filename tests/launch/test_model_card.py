"""shardpool.launch.model_card: the README.md beside the adapter is a Hugging Face model card."""

from __future__ import annotations

from pathlib import Path

import yaml

from shardpool.config import parse_config
from shardpool.contract.job import StagePlacement
from shardpool.launch.model_card import TrainingOutcome, earlier_splits, render_model_card, write_model_card

CONFIG = {
    "base_model": "models/tiny",
    "datasets": [{"path": "data/train.jsonl", "type": "alpaca"}, {"path": "data/tokens.jsonl"}],
    "lora_r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.05,
    "lora_target_modules": ["q_proj", "v_proj"],
    "learning_rate": 0.0002,
    "micro_batch_size": 2,
    "gradient_accumulation_steps": 4,
    "sequence_len": 1024,
    "output_dir": "/runs/tiny-adapter",
    "shardpool": {"stages": 2},
}
PLACEMENTS = [
    StagePlacement(start=0, stop=4, device="cuda:0"),
    StagePlacement(start=4, stop=6, device="cpu", host="198.51.100.2"),
]


def _card(outcome: TrainingOutcome, earlier: tuple[str, ...] | list[str] = (), **overrides: object) -> str:
    return render_model_card(
        parse_config({**CONFIG, **overrides}),
        base_model="/abs/models/tiny",
        target_modules=("q_proj", "v_proj"),
        placements=PLACEMENTS,
        outcome=outcome,
        earlier=earlier,
    )


def test_the_card_has_hf_front_matter_and_says_what_was_trained_how_and_how_well() -> None:
    text = _card(
        TrainingOutcome(steps=150, final_train_loss=2.60312, eval_loss_before=8.0389, eval_loss_after=2.589)
    )
    assert text.startswith("---\n")
    front, body = text.removeprefix("---\n").split("\n---\n", 1)
    assert yaml.safe_load(front) == {
        "base_model": "/abs/models/tiny",
        "library_name": "peft",
        "tags": ["shardpool", "lora", "qlora"],
    }
    assert front.splitlines()[-1] == "tags: [shardpool, lora, qlora]"
    expected_lines = [
        "# tiny-adapter",
        "A QLoRA (NF4 base) adapter for `/abs/models/tiny`, trained with shardpool.",
        "- `data/train.jsonl` (alpaca)",
        "- `data/tokens.jsonl` (pre-tokenized)",
        "| lora_r | 16 |",
        "| lora_alpha | 32 |",
        "| lora_dropout | 0.05 |",
        "| lora_target_modules | q_proj, v_proj |",
        "| learning_rate | 0.0002 |",
        "| steps | 150 |",
        "| micro_batch_size | 2 |",
        "| gradient_accumulation_steps | 4 |",
        "| sequence_len | 1024 |",
        "| final train loss | 2.6031 |",
        "| eval loss before training | 8.0389 |",
        "| eval loss after training | 2.5890 |",
        "2 pipeline stages × 1 replica, schedule 1f1b:",
        "| 0 | cuda:0 | localhost | [0, 4) | 4 |",
        "| 1 | cpu | 198.51.100.2 | [4, 6) | 2 |",
        'model = AutoPeftModelForCausalLM.from_pretrained("/runs/tiny-adapter")',
        'tokenizer = AutoTokenizer.from_pretrained("/runs/tiny-adapter")',
    ]
    lines = body.splitlines()
    for line in expected_lines:
        assert line in lines, line
    assert [lines.index(line) for line in expected_lines] == sorted(
        lines.index(line) for line in expected_lines
    )


def test_a_lora_run_without_eval_is_tagged_lora_and_shows_no_eval_loss(tmp_path: Path) -> None:
    text = _card(
        TrainingOutcome(steps=3, final_train_loss=1.5, eval_loss_before=None, eval_loss_after=None),
        adapter="lora",
        load_in_4bit=False,
    )
    assert "tags: [shardpool, lora]\n" in text
    assert "| eval loss after training | - |" in text.splitlines()
    path = write_model_card(tmp_path, text)
    assert path == tmp_path / "README.md" and path.read_text(encoding="utf-8") == text


def test_a_run_whose_split_changed_shows_the_last_one_and_the_ones_before() -> None:
    history = [
        {"stages": [{"layers": [0, 5], "host": "b"}, {"layers": [5, 16], "host": "a"}], "source": "planner",
         "ended_at_step": 3},
        "not a plan",
        {"stages": [{"layers": [0, 11], "host": "a"}, {"layers": [11, 16], "host": "b"}], "source": "rebalance",
         "resumed_from_step": 8},
    ]  # fmt: skip
    earlier = earlier_splits(history)
    assert earlier == [
        "[0, 5) on b, [5, 16) on a (planner), until step 3",
        "[0, 11) on a, [11, 16) on b (rebalance), interrupted; resumed from step 8",
    ]
    text = _card(TrainingOutcome(steps=20, final_train_loss=None, eval_loss_before=None, eval_loss_after=None),
                 earlier=earlier)  # fmt: skip
    plan = text.split("## Plan\n\n", 1)[1].split("\n\n## Usage", 1)[0]
    assert plan.splitlines()[0] == "2 pipeline stages × 1 replica, schedule 1f1b, at the end of training:"
    assert "| 1 | cpu | 198.51.100.2 | [4, 6) | 2 |" in plan
    assert plan.endswith(
        "Earlier splits of this run:\n\n"
        "- [0, 5) on b, [5, 16) on a (planner), until step 3\n"
        "- [0, 11) on a, [11, 16) on b (rebalance), interrupted; resumed from step 8"
    )
    assert earlier_splits(None) == [] and earlier_splits({"stages": []}) == []
