"""`shardpool validate`: the config, the model and the data checked as finetune would, without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardpool.config import parse_config
from shardpool.data.prepare import samples_per_dataset
from shardpool.data.tokenizer_file import load_tokenizer_file
from shardpool.data.tokenizing import load_tokenizer
from tests.helpers.training import (
    REPO_ROOT,
    base_config,
    completion_rows,
    run_cli,
    write_config,
    write_jsonl,
)

QUICKSTART = REPO_ROOT / "configs" / "quickstart.yaml"
ALPACA_ROWS = [
    {"instruction": "Add the two numbers.", "input": "2 + 3", "output": "5"},
    {"instruction": "Say hello.", "output": "Hello!"},
    {"instruction": "Write a long list of words.", "output": " ".join(["word"] * 60)},
]


def _quickstart_with(tmp_path: Path, **changes: Any) -> Path:
    config = yaml.safe_load(QUICKSTART.read_text())
    config.update(changes)
    return write_config(tmp_path / "run.yaml", config)


def test_quickstart_is_valid_and_the_report_says_what_a_run_gets() -> None:
    result = run_cli("validate", "configs/quickstart.yaml", timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "configs/quickstart.yaml: valid",
        "model models/quickstart: llama, 4 layers, max_position_embeddings 1024",
        "datasets[0] configs/data/quickstart.jsonl: 480 rows (alpaca)",
        "rows: 480 (432 train, 48 eval)",
        "tokens per row: min 46, median 56, max 64",
        "truncated at sequence_len 64: 0 of 480 rows",
    ]
    assert result.stderr == ""


def test_validate_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "from shardpool.cli import main\n"
        "code = main(['validate', 'configs/quickstart.yaml'])\n"
        "heavy = [m for m in ('torch', 'peft', 'bitsandbytes', 'safetensors') if m in sys.modules]\n"
        "print(code, heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "0 []"


def test_rows_truncated_at_sequence_len_are_counted(tmp_path: Path) -> None:
    result = run_cli("validate", str(_quickstart_with(tmp_path, sequence_len=50)), timeout=120)
    assert result.returncode == 0, result.stderr
    truncated = [line for line in result.stdout.splitlines() if line.startswith("truncated")]
    tokens = [line for line in result.stdout.splitlines() if line.startswith("tokens per row")]
    assert tokens == ["tokens per row: min 46, median 56, max 64"]
    count = int(truncated[0].split(": ")[1].split(" of ")[0])
    assert truncated == [f"truncated at sequence_len 50: {count} of 480 rows"]
    assert 240 < count < 480


def test_config_problems_exit_2_with_every_problem(tmp_path: Path) -> None:
    config = _quickstart_with(tmp_path, learning_rat=0.1, micro_batch_size="eight")
    result = run_cli("validate", str(config), timeout=120)
    assert result.returncode == 2
    assert result.stdout == ""
    header, *problems = result.stderr.splitlines()
    assert header == f"shardpool: error: {config} has 2 problems; fix them all, then run again:"
    assert sorted(problems) == [
        "  - `micro_batch_size`: input should be a valid integer (got 'eight'); fix its value",
        "  - unknown key `learning_rat`; did you mean `learning_rate`?",
    ]


def test_sequence_len_above_the_model_limit_is_refused(tmp_path: Path) -> None:
    config = _quickstart_with(tmp_path, sequence_len=2048)
    result = run_cli("validate", str(config), timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"shardpool: error: {config}: `sequence_len` 2048 is above the model's max_position_embeddings "
        "1024 (models/quickstart/config.json); lower `sequence_len` to 1024 or less"
    ]


def test_a_non_utf8_dataset_is_one_line_naming_the_file_and_line(tmp_path: Path) -> None:
    data = tmp_path / "latin1.jsonl"
    good = json.dumps(ALPACA_ROWS[0]) + "\n"
    data.write_bytes(good.encode() + '{"instruction": "Say café.", "output": "Café!"}\n'.encode("latin-1"))
    config = _quickstart_with(tmp_path, datasets=[{"path": str(data), "type": "alpaca"}], val_set_size=0)
    result = run_cli("validate", str(config), timeout=120)
    assert result.returncode == 2
    offset = len(good) + len('{"instruction": "Say caf')
    assert result.stderr.splitlines() == [
        f"shardpool: error: {data}:2: not UTF-8 (byte 0xe9 at byte offset {offset}); "
        f"re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 {data} > fixed.jsonl`"
    ]
    assert "Traceback" not in result.stderr


def test_a_model_directory_without_weights_is_refused_as_finetune_refuses_it(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((REPO_ROOT / "models" / "quickstart" / name).read_bytes())
    result = run_cli("validate", str(_quickstart_with(tmp_path, base_model=str(model))), timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"shardpool: error: {model} has no .safetensors files; "
        "re-save the model with save_pretrained(safe_serialization=True)"
    ]


@pytest.mark.parametrize("model_name", ["quickstart", "tiny"])
@pytest.mark.parametrize("kind", ["alpaca", "completion", "alpaca_on_inputs"])
def test_token_ids_are_the_ones_training_uses(
    tmp_path: Path, tiny_model: Path, model_name: str, kind: str
) -> None:
    """The tokenizers-only tokenizer gives the ids and labels AutoTokenizer gives (bos, eos, masks)."""
    model = REPO_ROOT / "models" / "quickstart" if model_name == "quickstart" else tiny_model
    if kind == "completion":
        data = write_jsonl(tmp_path / "data.jsonl", completion_rows(12))
        spec = {"path": str(data), "type": "completion"}
    else:
        data = write_jsonl(tmp_path / "data.jsonl", ALPACA_ROWS)
        spec = {"path": str(data), "type": "alpaca"}
    raw = base_config(model, data, tmp_path / "out", datasets=[spec])
    raw["train_on_inputs"] = kind == "alpaca_on_inputs"
    config = parse_config(raw)
    light, full = load_tokenizer_file(model), load_tokenizer(model)
    assert (light.bos_token_id, light.eos_token_id, light.pad_token_id, len(light)) == (
        full.bos_token_id,
        full.eos_token_id,
        full.pad_token_id,
        len(full),
    )
    assert samples_per_dataset(config, light) == samples_per_dataset(config, full)


def test_chat_templates_render_as_transformers_renders_them() -> None:
    model = REPO_ROOT / "models" / "quickstart"
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    messages = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"}]
    light, full = load_tokenizer_file(model), load_tokenizer(model)
    for options in ({"tokenize": False}, {"tokenize": False, "add_generation_prompt": True}):
        assert light.apply_chat_template(messages, chat_template=template, **options) == (
            full.apply_chat_template(messages, chat_template=template, **options)
        )
    text = light.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert light([text], add_special_tokens=False, return_offsets_mapping=True) == {
        key: list(map(list, value)) if key == "input_ids" else [list(map(tuple, row)) for row in value]
        for key, value in full([text], add_special_tokens=False, return_offsets_mapping=True).items()
        if key in ("input_ids", "offset_mapping")
    }


def test_special_tokens_are_applied_as_training_applies_them(tmp_path: Path, tiny_model: Path) -> None:
    from shardpool.data.special_tokens import apply_special_tokens
    from shardpool.model.tinymodel import PAD, UNK

    data = write_jsonl(tmp_path / "data.jsonl", ALPACA_ROWS)
    config = parse_config(
        base_config(tiny_model, data, tmp_path / "out", datasets=[{"path": str(data), "type": "alpaca"}])
    )
    light, full = load_tokenizer_file(tiny_model), load_tokenizer(tiny_model)
    for tokenizer in (light, full):
        apply_special_tokens(tokenizer, {"eos_token": PAD, "pad_token": UNK}, source="tiny")
    assert (light.eos_token_id, light.pad_token_id, len(light)) == (
        full.eos_token_id,
        full.pad_token_id,
        len(full),
    )
    assert samples_per_dataset(config, light) == samples_per_dataset(config, full)


def test_special_tokens_that_would_grow_the_vocabulary_are_refused(tmp_path: Path) -> None:
    config = _quickstart_with(tmp_path, special_tokens={"pad_token": "<|new_pad|>"})
    result = run_cli("validate", str(config), timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "shardpool: error: special_tokens ['<|new_pad|>'] are not in the tokenizer of models/quickstart: "
        "adding tokens would grow the vocabulary, which shardpool does not train; use tokens it has, or remove them"
    ]


def test_chat_data_is_rendered_and_masked_as_training_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_ROOT)
    from shardpool.config import load_config
    from shardpool.data.prepare import configure_tokenizer

    config = load_config("configs/chat.yaml")
    light, full = load_tokenizer_file(config.base_model), load_tokenizer(config.base_model)
    for tokenizer in (light, full):
        configure_tokenizer(config, tokenizer)
    assert light.chat_template == full.chat_template
    chat = samples_per_dataset(config, light)
    assert chat == samples_per_dataset(config, full)
    assert any(label != -100 for label in chat[0][0].labels)
