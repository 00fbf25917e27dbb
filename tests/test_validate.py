"""`shardpool validate`: the config, the model and the data checked as finetune would, without torch."""

from __future__ import annotations

import json
import os
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
from tests.helpers.conversations import SYSTEM_BRIEF, TWO_TURNS
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


#: What `shardpool validate configs/quickstart.yaml` reports, line by line.
QUICKSTART_REPORT = [
    "configs/quickstart.yaml: valid",
    "model models/quickstart: llama, 4 layers, max_position_embeddings 1024",
    "datasets[0] configs/data/quickstart.jsonl: 480 rows (alpaca)",
    "rows: 480 (432 train, 48 eval)",
    "tokens per row: min 46, median 56, max 64",
    "truncated at sequence_len 64: 0 of 480 rows",
]


def test_quickstart_is_valid_and_the_report_says_what_a_run_gets() -> None:
    result = run_cli("validate", "configs/quickstart.yaml", timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == QUICKSTART_REPORT
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


# `validate --show N`: the first rows of each dataset as the model sees them.

QUICKSTART_ROW_1 = [
    "datasets[0] configs/data/quickstart.jsonl:1 (alpaca): 56 tokens, 2 trained",
    "<s>Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.",
    "",
    "### Instruction:",
    "Add the two numbers.",
    "",
    "### Input:",
    "24 + 48",
    "",
    "### Response:",
    "⟦72</s>⟧",
]
EVERY_TYPE = [
    ({"type": "completion"}, [{"text": "Pipeline stages pass activations forward."}, {"text": "Un café."}]),
    ({"type": "alpaca"}, ALPACA_ROWS),
    (
        {"type": "chat_template", "roles_to_train": ["assistant"]},
        [{"messages": [SYSTEM_BRIEF, *TWO_TURNS]}],
    ),
    (
        {"type": "sharegpt"},
        [{"conversations": [{"from": "human", "value": "Hi."}, {"from": "gpt", "value": "Hello!"}]}],
    ),
    (
        {},
        [
            {"input_ids": [1, 300, 301, 302, 2], "labels": [-100, -100, 301, 302, 2]},
            {"input_ids": [1, 310, 2]},
        ],
    ),
]


def _every_type_config(tmp_path: Path) -> Path:
    """The quickstart model with one small dataset of each type shardpool reads."""
    datasets = [
        {"path": str(write_jsonl(tmp_path / f"data{index}.jsonl", rows)), **keys}
        for index, (keys, rows) in enumerate(EVERY_TYPE)
    ]
    return _quickstart_with(
        tmp_path,
        datasets=datasets,
        chat_template="chatml",
        sequence_len=256,
        val_set_size=0,
        output_dir=str(tmp_path / "out"),
    )


def test_show_prints_the_first_rows_with_the_trained_text_between_brackets_when_piped() -> None:
    result = run_cli("validate", "configs/quickstart.yaml", "--show", "2", timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:7] == [*QUICKSTART_REPORT, ""]
    assert lines[7:10] == [
        "rows as the model sees them (trained text between ⟦ and ⟧):",
        "",
        *QUICKSTART_ROW_1[:1],
    ]
    assert lines[9:21] == [*QUICKSTART_ROW_1, ""]
    assert lines[21] == "datasets[0] configs/data/quickstart.jsonl:2 (alpaca): 62 tokens, 5 trained"
    assert lines[-1] == "⟦orange rabbit lamp river</s>⟧"
    assert result.stderr == ""


def test_show_json_marks_exactly_the_trained_tokens_of_every_dataset_type(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardpool.cli import main
    from shardpool.config import load_config
    from shardpool.data.prepare import configure_tokenizer
    from tests.helpers.trained_spans import check_shown_row

    config_path = _every_type_config(tmp_path)
    assert main(["validate", str(config_path), "--show", "5", "--json"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines()[0] == f"{config_path}: valid"
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(row["dataset"], row["row"]) for row in rows] == [
        (index, number) for index, (_, data) in enumerate(EVERY_TYPE) for number in range(1, len(data) + 1)
    ]
    config = load_config(config_path)
    reference = load_tokenizer(config.base_model)  # training's tokenizer decodes training's ids
    configure_tokenizer(config, reference)
    samples = samples_per_dataset(config, reference)
    for row in rows:
        check_shown_row(row, samples[row["dataset"]][row["row"] - 1], reference, config.sequence_len)
    chat = next(row for row in rows if row["dataset"] == 2)
    assert [chat["text"][start:end] for start, end in chat["trained"]] == ["5", "two one"]


def test_show_colours_the_trained_text_green_on_a_terminal() -> None:
    plain = {key: value for key, value in os.environ.items() if key not in ("NO_COLOR", "FORCE_COLOR")}

    def show(**env: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "shardpool", "validate", "configs/quickstart.yaml", "--show", "1"],
            capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env={**plain, **env},
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return result.stdout

    terminal = show(FORCE_COLOR="1", TERM="xterm-256color")  # rich treats stdout as a terminal
    no_color = show(FORCE_COLOR="1", TERM="xterm-256color", NO_COLOR="1")
    assert "rows as the model sees them (trained text in green):" in terminal
    assert "\x1b[32m72</s>\x1b[0m" in terminal and "⟦" not in terminal
    assert "⟦72</s>⟧" in no_color and "\x1b[" not in no_color


@pytest.mark.parametrize("count", ["0", "-2", "three", "1.5", ""])
def test_a_bad_show_count_is_one_line(count: str, capsys: pytest.CaptureFixture[str]) -> None:
    from shardpool.cli import main

    assert main(["validate", "configs/quickstart.yaml", "--show", count]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"shardpool: error: --show takes how many rows of each dataset to print (1 or more), got {count!r}; "
        "e.g. `shardpool validate CONFIG --show 3`"
    ]


def test_json_without_show_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from shardpool.cli import main

    assert main(["validate", "configs/quickstart.yaml", "--json"]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", "shardpool: error: --json prints the rows that --show picks; add --show N\n")


def test_show_never_imports_torch_and_writes_nothing(tmp_path: Path) -> None:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(REPO_ROOT / "models" / "quickstart", model)
    config_path = _every_type_config(tmp_path)
    config = yaml.safe_load(config_path.read_text())
    config["base_model"] = str(model)
    write_config(config_path, config)
    home = tmp_path / "home"
    home.mkdir()

    def snapshot() -> dict[str, tuple[int, int]]:
        return {
            str(path.relative_to(tmp_path)): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in tmp_path.rglob("*")
        }

    before = snapshot()
    code = (
        "import sys\n"
        "from shardpool.cli import main\n"
        f"codes = [main(['validate', {str(config_path)!r}, '--show', '3'] + extra) for extra in ([], ['--json'])]\n"
        "heavy = [m for m in ('torch', 'peft', 'bitsandbytes', 'safetensors') if m in sys.modules]\n"
        "print(codes, heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env={**os.environ, "HOME": str(home), "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[0, 0] []"
    assert snapshot() == before
    assert not (tmp_path / "out").exists()


def test_the_show_output_in_docs_data_md_is_what_validate_prints(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardpool.cli import main

    document = (REPO_ROOT / "docs" / "data.md").read_text(encoding="utf-8")
    start = document.index("```text\nrows as the model sees them")
    documented = document[start + len("```text\n") : document.index("```", start + 3)]
    monkeypatch.chdir(REPO_ROOT)
    assert main(["validate", "configs/chat.yaml", "--show", "1"]) == 0
    assert capsys.readouterr().out.endswith("\n" + documented)
