"""axolotl's own example configs train as they are: only base_model, the dataset paths and a
``shardpool:`` block change, and the model is a tiny local one of the same architecture.

The fixtures are copied unchanged from axolotl's repository (each file says from where). Their
sequence lengths, packing, schedules, optimizers, precision and cadence keys are all kept. Each
run trains one optimizer step (``max_steps: 1`` is the one other key set, for time).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console

from shardpool.config import load_config
from shardpool.finetune import finetune
from shardpool.model.tinymodel import make_tiny_llama
from tests.helpers.training import read_metrics, write_jsonl

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parent / "fixtures"
#: fixture -> the architecture of its base model
EXAMPLES: dict[str, str] = {
    "axolotl-tiny-llama-qlora.yml": "llama",
    "axolotl-llama-2-qlora.yml": "llama",
    "axolotl-llama-3-qlora.yml": "llama",
    "axolotl-llama-3-qlora-1b.yml": "llama",
    "axolotl-llama-3-lora-1b.yml": "llama",
    "axolotl-llama-3-lora-1b-kernels.yml": "llama",
    "axolotl-mistral-qlora.yml": "mistral",
    "axolotl-mistral-lora-mps.yml": "mistral",
    "axolotl-qwen3-8b-lora-fused-attn.yml": "qwen3",
    "axolotl-qwen3-8b-lora-fused-attn-compile.yml": "qwen3",
}


def _alpaca_rows(count: int) -> list[dict[str, str]]:
    words = "the quick brown fox jumps over the lazy dog while a cat sleeps".split()
    return [
        {
            "instruction": f"Continue the story number {i}.",
            "input": "",
            "output": " ".join(words[(i + k) % len(words)] for k in range(40)),
        }
        for i in range(count)
    ]


def _rows_for(raw: dict[str, Any]) -> int:
    """Enough rows (about 60 tokens each) for one optimizer step after the eval split."""
    per_step = int(raw["micro_batch_size"]) * int(raw["gradient_accumulation_steps"])
    rows_per_sequence = max(1, int(raw["sequence_len"]) // 64) if raw.get("sample_packing") else 1
    return math.ceil(per_step * rows_per_sequence / (1 - float(raw.get("val_set_size") or 0))) + 1


def _as_user_would_edit(raw: dict[str, Any], model: Path, data: Path) -> dict[str, Any]:
    """The example with only base_model, the dataset paths and a shardpool block changed, plus
    ``max_steps: 1``: the examples pack 16 rows of 4096 tokens per step, about 10 s a step on
    this CPU, and their whole runs (4 epochs) take minutes each, far past the suite's budget."""
    edited = {**raw, "max_steps": 1}
    edited["base_model"] = str(model)
    edited["datasets"] = [{**entry, "path": str(data)} for entry in raw["datasets"]]
    edited["shardpool"] = {"stages": 2, "threads_per_stage": 1}
    return edited


#: A Llama QLoRA and a Qwen3 LoRA example train in the default suite (Mistral's layers are
#: Llama's); ``pytest -m examples`` trains the other eight.
IN_DEFAULT_SUITE = {"axolotl-llama-3-qlora-1b.yml", "axolotl-qwen3-8b-lora-fused-attn.yml"}


@pytest.mark.parametrize(
    "fixture",
    [
        name if name in IN_DEFAULT_SUITE else pytest.param(name, marks=pytest.mark.examples)
        for name in sorted(EXAMPLES)
    ],
)
def test_an_axolotl_example_config_trains_unchanged(
    fixture: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = yaml.safe_load((FIXTURES / fixture).read_text(encoding="utf-8"))
    # The real base model's tokenizer has the tokens the example names (Llama 3's <|end_of_text|>).
    special_tokens = tuple((raw.get("special_tokens") or {}).values())
    model = make_tiny_llama(
        tmp_path / "model",
        num_layers=2,
        model_type=EXAMPLES[fixture],
        max_positions=max(1024, int(raw["sequence_len"])),
        extra_special_tokens=special_tokens,
    )
    data = write_jsonl(tmp_path / "alpaca.jsonl", _alpaca_rows(_rows_for(raw)))
    config_file = tmp_path / fixture
    config_file.write_text(yaml.safe_dump(_as_user_would_edit(raw, model, data)), encoding="utf-8")
    monkeypatch.chdir(tmp_path)  # output_dir stays as the example wrote it, relative to here
    output = finetune(load_config(config_file), console=Console(quiet=True))
    assert output == Path(raw["output_dir"])
    steps = [record for record in read_metrics(output) if "loss" in record]
    assert [record["step"] for record in steps] == [1] and math.isfinite(steps[0]["loss"])
    adapter = json.loads((output / "adapter_config.json").read_text())
    assert adapter["r"] == raw["lora_r"] and Path(adapter["base_model_name_or_path"]) == model.resolve()
    assert (output / "adapter_model.safetensors").stat().st_size > 0
