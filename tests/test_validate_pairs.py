"""`shardpool validate` of a preference run (`rl`): the pairs counted, and `--show` shows them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardpool.cli import main
from shardpool.config import load_config
from shardpool.data.prepare import configure_tokenizer, preference_pairs
from shardpool.data.tokenizer_file import load_tokenizer_file
from tests.helpers.trained_spans import check_shown_row
from tests.helpers.training import REPO_ROOT, write_config, write_jsonl

PAIRS = "configs/data/preference_tiny.jsonl"


def _config(tmp_path: Path, **changes: Any) -> Path:
    """The quickstart config made a dpo run over ``configs/data/preference_tiny.jsonl`` (chatml.intel)."""
    config = yaml.safe_load((REPO_ROOT / "configs" / "quickstart.yaml").read_text())
    config.update(
        rl="dpo",
        datasets=[{"path": PAIRS, "type": "chatml.intel"}],
        val_set_size=0,
        sequence_len=128,
        output_dir=str(tmp_path / "out"),
    )
    config.update(changes)
    return write_config(tmp_path / "dpo.yaml", config)


def _validate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["validate", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _in_the_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_ROOT)  # the config's paths are relative to the repository


def test_the_report_counts_pairs_and_tokens_per_sequence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path)
    assert _validate(capsys, str(config)) == (
        0,
        f"{config}: valid\n"
        "model models/quickstart: llama, 4 layers, max_position_embeddings 1024\n"
        f"datasets[0] {PAIRS}: 12 pairs (chatml.intel)\n"
        "pairs: 12 (rl: dpo), 24 sequences (chosen and rejected)\n"
        "tokens per sequence: min 62, median 87, max 117\n"
        "truncated at sequence_len 128: 0 of 24 sequences\n"
        "left out (do not fit sequence_len): 0 of 12 rows\n",
        "",
    )


def test_rows_that_do_not_fit_sequence_len_are_counted_as_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At 64 tokens 8 rows are left out; 3 of the kept sequences lose their eos (axolotl's filter
    counts neither the bos nor the eos that TRL adds)."""
    code, out, _ = _validate(capsys, str(_config(tmp_path, sequence_len=64)))
    assert code == 0
    assert out.splitlines()[2:] == [
        f"datasets[0] {PAIRS}: 4 pairs (chatml.intel), 8 rows left out",
        "pairs: 4 (rl: dpo), 8 sequences (chosen and rejected)",
        "tokens per sequence: min 62, median 62.5, max 65",
        "truncated at sequence_len 64: 3 of 8 sequences",
        "left out (do not fit sequence_len): 8 of 12 rows",
    ]


def test_show_prints_each_pair_as_its_chosen_then_its_rejected_sequence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _validate(capsys, str(_config(tmp_path)), "--show", "1")
    assert code == 0
    prompt = [
        "<s><|im_start|>system",
        "Answer with the result only.<|im_end|>",
        "<|im_start|>user",
        "Add the two numbers.",
        "24 + 48<|im_end|>",
        "<|im_start|>assistant",
    ]
    assert out.split("\n\n", 1)[1].splitlines() == [
        "pairs as the model sees them, chosen then rejected (trained text between ⟦ and ⟧):",
        "",
        f"datasets[0] {PAIRS}:1 (chatml.intel), chosen: 102 tokens, 11 trained",
        *prompt,
        "⟦72<|im_end|></s>⟧",
        "",
        f"datasets[0] {PAIRS}:1 (chatml.intel), rejected: 102 tokens, 11 trained",
        *prompt,
        "⟦62<|im_end|></s>⟧",
    ]


def test_show_json_marks_exactly_the_answer_tokens_training_uses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = _config(tmp_path, sequence_len=64)
    code, out, err = _validate(capsys, str(config_path), "--show", "3", "--json")
    assert code == 0 and err.startswith(f"{config_path}: valid\n")
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(line["row"], line.pop("pair")) for line in lines] == [
        (row, pair) for row in (2, 4, 8) for pair in ("chosen", "rejected")
    ]
    config = load_config(config_path)
    tokenizer = load_tokenizer_file(config.base_model)
    configure_tokenizer(config, tokenizer)
    pairs, _ = preference_pairs(
        config.model_copy(update={"sequence_len": 1024}), config.datasets[0], 0, tokenizer
    )
    by_row = {int(chosen.where.rsplit(":", 1)[1]): (chosen, rejected) for chosen, rejected in pairs}
    for index, line in enumerate(lines):
        check_shown_row(line, by_row[line["row"]][index % 2], tokenizer, config.sequence_len)


def test_a_broken_row_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_jsonl(
        tmp_path / "pairs.jsonl",
        [
            {"question": "Add 2 and 3.", "chosen": "5", "rejected": "6"},
            {"question": "Say hi.", "chosen": "hi"},
        ],
    )
    config = _config(tmp_path, datasets=[{"path": str(data), "type": "chatml.intel"}])
    for extra in ([], ["--show", "1"], ["--show", "1", "--json"]):
        assert _validate(capsys, str(config), *extra) == (
            2,
            "",
            f"shardpool: error: {data}:2: the row has no `rejected` (it has `question`, `chosen`); "
            "`type: chatml.intel` rows need it\n",
        )


def test_no_row_that_fits_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _validate(capsys, str(_config(tmp_path, sequence_len=16)), "--show", "1") == (
        2,
        "",
        "shardpool: error: no preference row fits sequence_len 16; raise sequence_len or shorten the rows\n",
    )


def test_the_pairs_output_in_docs_data_md_is_what_validate_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = (REPO_ROOT / "docs" / "data.md").read_text(encoding="utf-8")
    start = document.index("```text\ndpo.yaml: valid\n") + len("```text\n")
    documented = document[start : document.index("```", start)].splitlines()
    code, out, _ = _validate(capsys, str(_config(tmp_path)), "--show", "1")
    assert code == 0
    assert out.splitlines()[1:] == documented[1:]  # the first line names the config's path
