"""Chat training is exact: a 2-stage pipeline on chat data equals a single-process reference.

The rows the run trains on are first checked to be the rendered conversations themselves (the ids
``apply_chat_template(tokenize=True)`` gives, with only assistant content and its eos trained); then the
plain peft + bitsandbytes loop of tests/train/test_pipeline.py trains on the same rows, and the
losses, gradient norms and adapter must agree.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from safetensors.torch import load_file

from shardpool.config import parse_config
from shardpool.data.prepared_file import load_prepared
from shardpool.data.tokenizing import load_tokenizer
from shardpool.finetune import finetune
from shardpool.launch.run import RUN_DIR_NAME
from tests.helpers.training import WORDS, base_config, read_metrics, write_jsonl
from tests.train.test_pipeline import reference_training, start_adapter  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

# A compact template that ends every turn with eos, so the tiny Llama's rows stay short and the
# eos after each assistant turn is trained too.
TEMPLATE = "{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"


def conversations(count: int) -> list[dict[str, Any]]:
    """Conversations of one or two exchanges, some with a system message, of varied length."""
    rows = []
    for index in range(count):
        words = [WORDS[(index * 5 + k * 3) % len(WORDS)] for k in range(1 + index % 4)]
        messages = [{"role": "system", "content": "Be brief."}] if index % 3 == 0 else []
        messages += [
            {"role": "user", "content": "Repeat: " + " ".join(words)},
            {"role": "assistant", "content": " ".join(words)},
        ]
        if index % 2:
            messages += [
                {"role": "user", "content": "Reverse it."},
                {"role": "assistant", "content": " ".join(reversed(words))},
            ]
        rows.append({"messages": messages})
    return rows


def test_two_stage_chat_training_equals_the_single_process_reference(
    tiny_model: Path,
    start_adapter: Path,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
) -> None:
    rows = conversations(24)
    data_path = write_jsonl(tmp_path / "chat.jsonl", rows)
    raw = base_config(
        tiny_model,
        data_path,
        tmp_path / "out",
        datasets=[{"path": str(data_path), "type": "chat_template"}],
        chat_template=TEMPLATE,
        val_set_size=0,
        sequence_len=96,
        lora_model_dir=str(start_adapter),
        shardpool={"stages": 2},
    )
    output_dir = finetune(parse_config(raw), console=Console(quiet=True))
    data_file = output_dir / RUN_DIR_NAME / "data.safetensors"

    # The run's rows are the rendered conversations, in file order, trained only on assistant content.
    tokenizer = load_tokenizer(tiny_model)
    train = load_prepared(data_file).train
    assert len(train) == len(rows)
    for row, ids, labels, mask in zip(
        rows, train.input_ids.tolist(), train.labels.tolist(), train.attention_mask.tolist(), strict=True
    ):
        expected = tokenizer.apply_chat_template(
            row["messages"], chat_template=TEMPLATE, tokenize=True, return_dict=False
        )
        assert ids[: sum(mask)] == list(expected)
        answers = "".join(m["content"] + "</s>" for m in row["messages"] if m["role"] == "assistant")
        assert tokenizer.decode([token for token in labels if token != -100]) == answers

    losses, norms, reference = reference_training(tiny_model, start_adapter, data_file, raw)
    metrics = [record for record in read_metrics(output_dir) if "loss" in record]
    assert len(metrics) == len(losses) == 3
    for record, loss, norm in zip(metrics, losses, norms, strict=True):
        assert math.isclose(record["loss"], loss, rel_tol=1e-5)
        assert math.isclose(record["grad_norm"], norm, rel_tol=1e-4)
    trained = load_file(str(output_dir / "adapter_model.safetensors"))
    start = load_file(str(start_adapter / "adapter_model.safetensors"))
    assert max(float((trained[key] - start[key]).abs().max()) for key in trained) > 1e-3
    assert max(float((trained[key] - reference[key]).abs().max()) for key in trained) < 1e-4
    saved = load_tokenizer(output_dir)
    assert saved.chat_template == TEMPLATE
