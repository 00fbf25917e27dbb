"""shardpool.data.reading: JSON lines, JSON arrays, parquet, directories with `split` / `data_files`, non-UTF-8."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardpool.config import Config, parse_config
from shardpool.data.prepare import prepare_data
from shardpool.errors import ShardpoolError
from tests.helpers.training import base_config, run_cli, write_config

ROWS = [
    {"instruction": "Add the two numbers.", "input": "2 + 3", "output": "5"},
    {"instruction": "Say hello.", "output": "Hello!"},
    {"instruction": "Say goodbye.", "input": "", "output": "Goodbye."},
]


def alpaca_config(model_dir: Path, path: Path, **entry: Any) -> Config:
    return parse_config(
        {
            "base_model": str(model_dir),
            "lora_target_linear": True,
            "datasets": [{"path": str(path), "type": "alpaca", **entry}],
            "sequence_len": 256,
            "shuffle_merged_datasets": False,
        }
    )


def one_line_error(model_dir: Path, tok: Any, path: Path, **entry: Any) -> str:
    with pytest.raises(ShardpoolError) as error:
        prepare_data(alpaca_config(model_dir, path, **entry), tok)
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_json_array_reads_like_the_same_rows_as_jsonl(tmp_path: Path, model_dir: Path, tok: Any) -> None:
    lines = tmp_path / "rows.jsonl"
    lines.write_text("".join(json.dumps(row) + "\n" for row in ROWS), encoding="utf-8")
    array = tmp_path / "rows.json"
    array.write_text(json.dumps(ROWS, indent=2), encoding="utf-8")
    from_lines = prepare_data(alpaca_config(model_dir, lines), tok).train
    from_array = prepare_data(alpaca_config(model_dir, array), tok).train
    assert len(from_array) == len(ROWS)
    assert from_array.input_ids.tolist() == from_lines.input_ids.tolist()
    assert from_array.labels.tolist() == from_lines.labels.tolist()


@pytest.fixture
def private_datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`datasets` caches what it reads under ~/.cache; these tests keep theirs in tmp_path."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


def _write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([{"input": "", **row} for row in rows]), path)
    return path


def _train_ids(model_dir: Path, tok: Any, path: Path, **entry: Any) -> list[list[int]]:
    return prepare_data(alpaca_config(model_dir, path, **entry), tok).train.input_ids.tolist()


@pytest.mark.usefixtures("private_datasets_cache")
def test_parquet_file_and_a_directorys_split_and_data_files(
    tmp_path: Path, model_dir: Path, tok: Any
) -> None:
    rows_jsonl = tmp_path / "rows.jsonl"
    rows_jsonl.write_text("".join(json.dumps({"input": "", **row}) + "\n" for row in ROWS), encoding="utf-8")
    expected = _train_ids(model_dir, tok, rows_jsonl)
    assert _train_ids(model_dir, tok, _write_parquet(tmp_path / "rows.parquet", ROWS)) == expected

    # A directory laid out as a dataset repository: split from the file names, `train` by default.
    repo = tmp_path / "repo"
    _write_parquet(repo / "data" / "train-00000-of-00001.parquet", ROWS[:2])
    _write_parquet(repo / "data" / "test-00000-of-00001.parquet", ROWS[2:])
    assert _train_ids(model_dir, tok, repo) == expected[:2]
    assert _train_ids(model_dir, tok, repo, split="test") == expected[2:]
    assert _train_ids(model_dir, tok, repo, data_files=["data/test-00000-of-00001.parquet"]) == expected[2:]

    message = one_line_error(model_dir, tok, repo, split="validation")
    assert message.startswith(f"cannot read dataset {str(repo)!r} (datasets[0]) with split 'validation': ")
    assert message.endswith("; check path, data_files, split and name")


def test_json_file_of_json_lines_is_read_as_lines(tmp_path: Path, model_dir: Path, tok: Any) -> None:
    path = tmp_path / "rows.json"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS), encoding="utf-8")
    assert len(prepare_data(alpaca_config(model_dir, path), tok).train) == len(ROWS)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            json.dumps([ROWS[0], 5]),
            "rows.json row 2: expected a JSON object in the array, got int; wrap the row",
        ),
        (json.dumps([ROWS[0], {"instruction": "x"}]), "rows.json row 2: the row has no `output`"),
        (
            '[\n  {"instruction": "x",\n   "output": }\n]',
            "rows.json:3: invalid JSON (Expecting value at column",
        ),
        ("[]", "rows.json' has no rows"),
        ('{\n  "instruction": "x",\n  "output": "y"\n}', "rows.json:1: invalid JSON"),
    ],
)
def test_json_array_errors_name_file_and_row(
    tmp_path: Path, model_dir: Path, tok: Any, text: str, expected: str
) -> None:
    path = tmp_path / "rows.json"
    path.write_text(text, encoding="utf-8")
    assert expected in one_line_error(model_dir, tok, path)


def test_pretty_printed_object_in_json_file_says_what_a_json_file_holds(
    tmp_path: Path, model_dir: Path, tok: Any
) -> None:
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(ROWS[0], indent=2), encoding="utf-8")
    assert one_line_error(model_dir, tok, path).endswith(
        "a .json file holds one JSON array of row objects, or one object per line"
    )


def test_utf8_byte_order_mark_is_allowed(tmp_path: Path, model_dir: Path, tok: Any) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(row) + "\n" for row in ROWS).encode())
    assert len(prepare_data(alpaca_config(model_dir, path), tok).train) == len(ROWS)


def test_line_separator_inside_a_string_does_not_split_the_line(
    tmp_path: Path, model_dir: Path, tok: Any
) -> None:
    path = tmp_path / "sep.jsonl"
    row = {"instruction": "Join\u2028these.", "output": "ok"}
    path.write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    assert len(prepare_data(alpaca_config(model_dir, path), tok).train) == 1


LATIN1 = (
    json.dumps(ROWS[0])
    + "\n"
    + json.dumps({"instruction": "Say café.", "output": "Café!"}, ensure_ascii=False)
    + "\n"
).encode("latin-1")
# The first byte that is not UTF-8: the "é" of "café" on line 2.
BAD_OFFSET = LATIN1.index(b"\xe9")


def test_non_utf8_file_is_one_line_naming_file_line_and_offset(
    tmp_path: Path, model_dir: Path, tok: Any
) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(LATIN1)
    assert one_line_error(model_dir, tok, path) == (
        f"{path}:2: not UTF-8 (byte 0xe9 at byte offset {BAD_OFFSET}); "
        f"re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 {path} > fixed.jsonl`"
    )


@pytest.mark.slow
def test_non_utf8_file_through_the_real_cli(tmp_path: Path, model_dir: Path) -> None:
    """`shardpool finetune` prints the one line, exits 2 and writes nothing; no traceback."""
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(LATIN1)
    config = base_config(model_dir, data, tmp_path / "out")
    config["datasets"] = [{"path": str(data), "type": "alpaca"}]
    config["sequence_len"] = 256
    result = run_cli("finetune", str(write_config(tmp_path / "config.yaml", config)), timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"shardpool: error: {data}:2: not UTF-8 (byte 0xe9 at byte offset {BAD_OFFSET}); "
        f"re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 {data} > fixed.jsonl`"
    ]
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "out").exists()
