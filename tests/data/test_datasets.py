"""shardpool.data: each dataset kind, masking, truncation, packing, split, order, schedule, errors."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpool.config import Config, parse_config
from shardpool.data.formats import format_alpaca_prompt
from shardpool.data.packing import block_causal_mask
from shardpool.data.prepare import prepare_data
from shardpool.data.prepared_file import load_prepared, save_prepared
from shardpool.data.rows import IGNORE_INDEX, PreparedData, TokenRows
from shardpool.data.steps import step_batches
from shardpool.data.tokenizing import load_tokenizer
from shardpool.errors import ShardpoolError
from shardpool.model.tinymodel import train_tokenizer

M = IGNORE_INDEX


def write_rows(path: Path, rows: list[Any]) -> str:
    path.write_text(
        "".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows), encoding="utf-8"
    )
    return str(path)


def make_config(model_dir: Path, datasets: list[dict[str, Any]], **overrides: Any) -> Config:
    raw: dict[str, Any] = {
        "base_model": str(model_dir),
        "lora_target_linear": True,
        "datasets": datasets,
        "sequence_len": 64,
        "shuffle_merged_datasets": False,
    }
    raw.update(overrides)
    return parse_config(raw)


def enc(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def pretok(
    tmp_path: Path, model_dir: Path, rows: list[Any], name: str = "pre.jsonl", **overrides: Any
) -> Config:
    path = write_rows(tmp_path / name, rows)
    return make_config(model_dir, [{"path": path}], **overrides)


def as_lists(rows: TokenRows) -> tuple[list[list[int]], ...]:
    return tuple(
        getattr(rows, name).tolist() for name in ("input_ids", "labels", "attention_mask", "position_ids")
    )


# ------------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------------


def test_tiny_tokenizer_special_ids(tok: Any) -> None:
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 3)


def test_load_tokenizer_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(ShardpoolError, match=r"base_model directory .*nope.* does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_load_tokenizer_dir_without_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ShardpoolError, match="cannot load a tokenizer") as error:
        load_tokenizer(tmp_path)
    assert "\n" not in str(error.value)


def test_load_tokenizer_pads_with_eos_when_no_pad(tmp_path: Path) -> None:
    tokenizer = train_tokenizer(["hello world"] * 3)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token_id == loaded.eos_token_id == 2


# ------------------------------------------------------------------------------------------------
# the three kinds
# ------------------------------------------------------------------------------------------------


ALPACA_WITH_INPUT = {"instruction": "Add the two numbers.", "input": "2 + 3", "output": "5"}
ALPACA_NO_INPUT = {"instruction": "Say hello.", "output": "Hello!"}
# axolotl's alpaca prompt (AlpacaPrompter in src/axolotl/prompters.py), preamble included.
RENDERED_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context."
    " Write a response that appropriately completes the request.\n\n"
    "### Instruction:\nAdd the two numbers.\n\n### Input:\n2 + 3\n\n### Response:\n"
)
RENDERED_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\nSay hello.\n\n### Response:\n"
)


def test_alpaca_prompt_is_axolotls() -> None:
    assert (
        format_alpaca_prompt(ALPACA_WITH_INPUT["instruction"], ALPACA_WITH_INPUT["input"])
        == RENDERED_WITH_INPUT
    )
    assert format_alpaca_prompt(ALPACA_NO_INPUT["instruction"]) == RENDERED_NO_INPUT
    assert format_alpaca_prompt("Say hello.", "") == RENDERED_NO_INPUT


def test_alpaca_rows_train_on_the_rendered_text(tmp_path: Path, model_dir: Path, tok: Any) -> None:
    """The tokens of each row decode to exactly the fixed prompt, then the response and eos."""
    rows = [ALPACA_WITH_INPUT, {**ALPACA_NO_INPUT, "input": None}]
    config = make_config(
        model_dir, [{"path": write_rows(tmp_path / "a.jsonl", rows), "type": "alpaca"}], sequence_len=256
    )
    ids, _, mask, _ = as_lists(prepare_data(config, tok).train)
    texts = [
        tok.decode([i for i, bit in zip(row, bits, strict=True) if bit])
        for row, bits in zip(ids, mask, strict=True)
    ]
    assert texts == ["<s>" + RENDERED_WITH_INPUT + "5</s>", "<s>" + RENDERED_NO_INPUT + "Hello!</s>"]


def test_alpaca_masks_prompt_and_padding(tmp_path: Path, model_dir: Path, tok: Any) -> None:
    rows = [ALPACA_WITH_INPUT, ALPACA_NO_INPUT]
    length = 256  # room for the preamble, which this tokenizer never saw whole
    config = make_config(
        model_dir, [{"path": write_rows(tmp_path / "a.jsonl", rows), "type": "alpaca"}], sequence_len=length
    )
    data = prepare_data(config, tok)
    ids, labels, mask, positions = as_lists(data.train)
    for row, (ids_row, labels_row, mask_row, positions_row) in zip(
        rows, zip(ids, labels, mask, positions, strict=True), strict=True
    ):
        prompt = [1] + enc(tok, format_alpaca_prompt(row["instruction"], row.get("input", "")))
        answer = enc(tok, row["output"]) + [2]
        padding = length - len(prompt) - len(answer)
        assert padding > 0
        assert ids_row == prompt + answer + [3] * padding
        assert labels_row == [M] * len(prompt) + answer + [M] * padding
        assert mask_row == [1] * (len(prompt) + len(answer)) + [0] * padding
        assert positions_row == list(range(length))
        assert tok.decode(answer) == row["output"] + "</s>"
    assert len(data.eval) == 0 and data.eval.sequence_len == length and not data.packed


def test_train_on_inputs_trains_the_prompt_too(tmp_path: Path, model_dir: Path, tok: Any) -> None:
    """axolotl's ``train_on_inputs: true``: every alpaca token is a label; padding still is not."""
    length = 256
    path = write_rows(tmp_path / "a.jsonl", [ALPACA_WITH_INPUT])
    masked, trained = (
        prepare_data(
            make_config(
                model_dir, [{"path": path, "type": "alpaca"}], sequence_len=length, train_on_inputs=flag
            ),
            tok,
        )
        for flag in (False, True)
    )
    ids, labels, mask, _ = (row[0] for row in as_lists(trained.train))
    assert ids == as_lists(masked.train)[0][0]
    used = sum(mask)
    assert labels == ids[:used] + [M] * (length - used)
    prompt = 1 + len(
        enc(tok, format_alpaca_prompt(ALPACA_WITH_INPUT["instruction"], ALPACA_WITH_INPUT["input"]))
    )
    assert as_lists(masked.train)[1][0][:used] == [M] * prompt + ids[prompt:used]


def test_completion_default_and_named_field(tmp_path: Path, model_dir: Path, tok: Any) -> None:
    first = write_rows(tmp_path / "c1.jsonl", [{"text": "The quick brown fox."}])
    second = write_rows(tmp_path / "c2.jsonl", [{"body": "A small model."}])
    config = make_config(
        model_dir,
        [{"path": first, "type": "completion"}, {"path": second, "type": "completion", "field": "body"}],
        sequence_len=16,
    )
    ids, labels, mask, _ = as_lists(prepare_data(config, tok).train)
    for text, ids_row, labels_row, mask_row in zip(
        ["The quick brown fox.", "A small model."], ids, labels, mask, strict=True
    ):
        body = [1] + enc(tok, text) + [2]
        padding = 16 - len(body)
        assert ids_row == body + [3] * padding
        assert labels_row == body + [M] * padding
        assert mask_row == [1] * len(body) + [0] * padding


def test_pretokenized_used_as_given(tmp_path: Path, model_dir: Path, tok: Any) -> None:
    rows = [
        {"input_ids": [5, 6, 7], "labels": [M, 6, 7], "attention_mask": [1, 1, 0]},
        {"input_ids": [9, 10]},
    ]
    data = prepare_data(pretok(tmp_path, model_dir, rows, sequence_len=6), tok)
    assert as_lists(data.train) == (
        [[5, 6, 7, 3, 3, 3], [9, 10, 3, 3, 3, 3]],
        [[M, 6, 7, M, M, M], [9, 10, M, M, M, M]],
        [[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]],
        [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]],
    )


def test_truncation_counts_and_keeps_labels(tmp_path: Path, model_dir: Path, tok: Any) -> None:
    rows = [{"input_ids": list(range(10, 20))}, {"input_ids": [4, 5]}]
    data = prepare_data(pretok(tmp_path, model_dir, rows, sequence_len=4), tok)
    assert data.train.input_ids.tolist() == [[10, 11, 12, 13], [4, 5, 3, 3]]
    assert data.train.labels.tolist() == [[10, 11, 12, 13], [4, 5, M, M]]
    assert (data.truncated_rows, data.dropped_rows) == (1, 0)


def test_rows_without_trainable_token_are_dropped(tmp_path: Path, model_dir: Path, tok: Any, caplog) -> None:
    rows = [
        {"input_ids": [5, 6, 7], "labels": [M, M, 7]},
        {"input_ids": [5, 6, 7], "labels": [5, M, M]},  # label 0 is never predicted: nothing to train
        {"input_ids": [5, 6, 7], "labels": [M, M, M]},
    ]
    with caplog.at_level(logging.WARNING, logger="shardpool.data.prepare"):
        data = prepare_data(pretok(tmp_path, model_dir, rows), tok)
    assert data.train.labels[:, :3].tolist() == [[M, M, 7]]
    assert data.dropped_rows == 2
    assert "dropped 2 of 3 rows" in caplog.text and "pre.jsonl:2" in caplog.text


def test_alpaca_prompt_longer_than_sequence_len_is_dropped(tmp_path: Path, model_dir: Path, tok: Any) -> None:
    short = {"instruction": "Hi.", "output": "Hello."}
    # The short row fits with 4 tokens to spare; the long one's prompt alone is longer.
    length = 1 + len(enc(tok, format_alpaca_prompt("Hi."))) + len(enc(tok, "Hello.")) + 1 + 4
    rows = [{"instruction": "word " * length, "output": "x"}, short]
    path = write_rows(tmp_path / "a.jsonl", rows)
    data = prepare_data(make_config(model_dir, [{"path": path, "type": "alpaca"}], sequence_len=length), tok)
    assert len(data.train) == 1 and data.dropped_rows == 1


def test_sequence_len_too_small_for_any_response(tmp_path: Path, model_dir: Path, tok: Any) -> None:
    path = write_rows(
        tmp_path / "a.jsonl", [{"instruction": "Say hello to everyone here.", "output": "Hello."}]
    )
    with pytest.raises(
        ShardpoolError,
        match=r"no row has a trainable token within sequence_len 8 .*a\.jsonl:1.*raise `sequence_len`",
    ):
        prepare_data(make_config(model_dir, [{"path": path, "type": "alpaca"}], sequence_len=8), tok)


# ------------------------------------------------------------------------------------------------
# packing
# ------------------------------------------------------------------------------------------------


def test_packing_restarts_positions_and_masks_boundaries(tmp_path: Path, model_dir: Path, tok: Any) -> None:
    rows = [
        {"input_ids": [5, 6, 7]},
        {"input_ids": [8, 9]},
        {"input_ids": [10, 11, 12, 13]},
        {"input_ids": [14, 15, 16, 17, 18, 19, 20]},
    ]
    data = prepare_data(pretok(tmp_path, model_dir, rows, sequence_len=6, sample_packing=True), tok)
    assert data.packed
    assert as_lists(data.train) == (
        [[5, 6, 7, 8, 9, 3], [10, 11, 12, 13, 3, 3], [14, 15, 16, 17, 18, 19]],
        [[M, 6, 7, M, 9, M], [M, 11, 12, 13, M, M], [M, 15, 16, 17, 18, 19]],
        [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]],
        [[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]],
    )
    assert data.truncated_rows == 1


def test_block_causal_mask_separates_packed_samples() -> None:
    mask = block_causal_mask(torch.tensor([[0, 1, 0, 1, 2, 3]]), torch.tensor([[1, 1, 1, 1, 1, 0]]))
    assert mask.shape == (1, 1, 6, 6)
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 1, 1, 1, 0],
    ]


# ------------------------------------------------------------------------------------------------
# val split and order
# ------------------------------------------------------------------------------------------------


def numbered(n: int) -> list[dict[str, list[int]]]:
    return [{"input_ids": [10 + i, 200]} for i in range(n)]


def first_ids(rows: TokenRows) -> list[int]:
    return [ids[0] - 10 for ids in rows.input_ids.tolist()]


@pytest.mark.parametrize(
    ("rows", "val_set_size", "expected"),
    [
        (10, 0.0, 0),
        (10, 0.1, 1),
        (10, 0.25, 3),
        (10, 0.01, 1),
        (10, 0.94, 9),
        (10, 3, 3),
        (10, 9.0, 9),
        (7, 0.5, 4),
    ],
)
def test_val_split_sizes(
    tmp_path: Path, model_dir: Path, tok: Any, rows: int, val_set_size: float, expected: int
) -> None:
    data = prepare_data(
        pretok(tmp_path, model_dir, numbered(rows), val_set_size=val_set_size, sequence_len=4), tok
    )
    assert len(data.eval) == expected and len(data.train) == rows - expected
    train, evals = first_ids(data.train), first_ids(data.eval)
    assert sorted(train + evals) == list(range(rows))
    assert evals == sorted(evals) and train == sorted(train)  # both keep file order without shuffling


def test_val_split_is_seeded(tmp_path: Path, model_dir: Path, tok: Any) -> None:
    def held_out(seed: int) -> list[int]:
        return first_ids(
            prepare_data(pretok(tmp_path, model_dir, numbered(40), val_set_size=0.2, seed=seed), tok).eval
        )

    assert held_out(1) == held_out(1)
    assert held_out(1) != held_out(2)


@pytest.mark.parametrize("val_set_size", [10, 0.999])
def test_val_split_leaving_nothing_to_train(
    tmp_path: Path, model_dir: Path, tok: Any, val_set_size: float
) -> None:
    with pytest.raises(ShardpoolError, match=r"holds out 10 of 10 rows .*lower `val_set_size`"):
        prepare_data(pretok(tmp_path, model_dir, numbered(10), val_set_size=val_set_size), tok)


def test_seeded_shuffle_is_reproducible_and_depends_on_seed(
    tmp_path: Path, model_dir: Path, tok: Any
) -> None:
    def order(seed: int) -> list[int]:
        return first_ids(
            prepare_data(
                pretok(tmp_path, model_dir, numbered(30), shuffle_merged_datasets=True, seed=seed), tok
            ).train
        )

    assert order(7) == order(7)
    assert order(7) != order(8)
    assert sorted(order(7)) == list(range(30)) and order(7) != list(range(30))


def test_curriculum_consumes_file_order(tmp_path: Path, model_dir: Path, tok: Any) -> None:
    first = write_rows(tmp_path / "one.jsonl", numbered(5))
    second = write_rows(tmp_path / "two.jsonl", [{"input_ids": [10 + i, 200]} for i in range(5, 12)])
    config = make_config(
        model_dir,
        [{"path": first}, {"path": second}],
        curriculum_sampling=True,
        shuffle_merged_datasets=False,
    )
    assert first_ids(prepare_data(config, tok).train) == list(range(12))


def test_shuffle_happens_before_packing(tmp_path: Path, model_dir: Path, tok: Any) -> None:
    config = pretok(
        tmp_path,
        model_dir,
        numbered(12),
        sequence_len=4,
        sample_packing=True,
        shuffle_merged_datasets=True,
        seed=3,
    )
    data = prepare_data(config, tok)
    assert len(data.train) == 6
    starts = [ids[0] - 10 for ids in data.train.input_ids.tolist()] + [
        ids[2] - 10 for ids in data.train.input_ids.tolist()
    ]
    assert sorted(starts) == list(range(12)) and starts[:6] != [0, 2, 4, 6, 8, 10]


# ------------------------------------------------------------------------------------------------
# step_batches
# ------------------------------------------------------------------------------------------------


def plan(num_rows: int, **overrides: Any) -> list[list[list[int]]]:
    options: dict[str, Any] = {
        "micro_batch_size": 2,
        "micro_batches_per_step": 2,
        "num_epochs": 1.0,
        "max_steps": None,
        "shuffle_each_epoch": False,
        "seed": 0,
    }
    options.update(overrides)
    return step_batches(num_rows, **options)


def test_step_batches_one_epoch_drops_the_tail() -> None:
    assert plan(10) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_step_batches_carries_leftover_rows_into_next_epoch() -> None:
    assert plan(6, num_epochs=2) == [[[0, 1], [2, 3]], [[4, 5], [0, 1]], [[2, 3], [4, 5]]]


def test_step_batches_fractional_epochs_and_max_steps() -> None:
    assert len(plan(100, num_epochs=0.5)) == 12  # 50 rows / 4 per step
    assert len(plan(100, num_epochs=0.29)) == 7  # 29 rows
    assert len(plan(100, num_epochs=3, max_steps=10)) == 10
    assert len(plan(100, num_epochs=1, max_steps=1000)) == 25  # max_steps caps, it does not extend
    assert len(plan(10, num_epochs=float("inf"), max_steps=9)) == 9


def test_step_batches_reshuffles_later_epochs_with_seed_plus_epoch() -> None:
    import random

    steps = plan(
        8, micro_batch_size=4, micro_batches_per_step=1, num_epochs=3, shuffle_each_epoch=True, seed=5
    )
    flat = [index for step in steps for micro in step for index in micro]
    assert flat[:8] == list(range(8))
    for epoch in (1, 2):
        expected = list(range(8))
        random.Random(5 + epoch).shuffle(expected)
        assert flat[8 * epoch : 8 * (epoch + 1)] == expected
    assert flat[8:16] != flat[16:24]
    assert steps == plan(
        8, micro_batch_size=4, micro_batches_per_step=1, num_epochs=3, shuffle_each_epoch=True, seed=5
    )


def test_step_batches_without_reshuffle_repeats_row_order() -> None:
    flat = [
        i
        for step in plan(8, micro_batch_size=4, micro_batches_per_step=1, num_epochs=2)
        for micro in step
        for i in micro
    ]
    assert flat == list(range(8)) * 2


def test_step_batches_too_few_rows() -> None:
    with pytest.raises(
        ShardpoolError,
        match=r"dataset has 5 training rows but one step needs 8 .*lower micro_batch_size or gradient_accumulation_steps",
    ):
        plan(5, micro_batch_size=4)


def test_step_batches_too_few_epochs() -> None:
    with pytest.raises(
        ShardpoolError, match=r"num_epochs 0.1 covers 1 rows but one step needs 4; raise `num_epochs`"
    ):
        plan(10, num_epochs=0.1)


@settings(max_examples=60, deadline=None)
@given(
    num_rows=st.integers(1, 50),
    micro=st.integers(1, 4),
    per_step=st.integers(1, 4),
    epochs=st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]),
    shuffle=st.booleans(),
)
def test_step_batches_shape_property(
    num_rows: int, micro: int, per_step: int, epochs: float, shuffle: bool
) -> None:
    if num_rows < micro * per_step or int(num_rows * epochs) < micro * per_step:
        with pytest.raises(ShardpoolError):
            plan(
                num_rows,
                micro_batch_size=micro,
                micro_batches_per_step=per_step,
                num_epochs=epochs,
                shuffle_each_epoch=shuffle,
            )
        return
    steps = plan(
        num_rows,
        micro_batch_size=micro,
        micro_batches_per_step=per_step,
        num_epochs=epochs,
        shuffle_each_epoch=shuffle,
    )
    assert len(steps) == int(num_rows * epochs) // (micro * per_step)
    assert all(len(step) == per_step and all(len(batch) == micro for batch in step) for step in steps)
    flat = [i for step in steps for batch in step for i in batch]
    assert all(0 <= i < num_rows for i in flat)
    whole = [flat[e * num_rows : (e + 1) * num_rows] for e in range(len(flat) // num_rows)]
    assert all(
        sorted(epoch) == list(range(num_rows)) for epoch in whole
    )  # every full epoch sees each row once


# ------------------------------------------------------------------------------------------------
# save / load
# ------------------------------------------------------------------------------------------------


def test_save_load_round_trip_is_exact(tmp_path: Path, model_dir: Path, tok: Any) -> None:
    data = prepare_data(
        pretok(tmp_path, model_dir, numbered(9), sample_packing=True, val_set_size=2, sequence_len=5), tok
    )
    target = tmp_path / "out" / "prepared.safetensors"
    save_prepared(data, target)
    assert sorted(path.name for path in target.parent.iterdir()) == [
        "prepared.safetensors"
    ]  # no temp file left
    loaded = load_prepared(target)
    assert isinstance(loaded, PreparedData) and loaded.packed is True
    assert (loaded.dropped_rows, loaded.truncated_rows) == (data.dropped_rows, data.truncated_rows)
    for split in ("train", "eval"):
        for name in ("input_ids", "labels", "attention_mask", "position_ids"):
            assert torch.equal(getattr(getattr(loaded, split), name), getattr(getattr(data, split), name))
    assert target.read_bytes()[:8] != b"\x80\x04\x95"  # not a pickle


def test_save_load_empty_eval(tmp_path: Path, model_dir: Path, tok: Any) -> None:
    data = prepare_data(pretok(tmp_path, model_dir, numbered(3), sequence_len=4), tok)
    save_prepared(data, tmp_path / "p.safetensors")
    loaded = load_prepared(tmp_path / "p.safetensors")
    assert len(loaded.eval) == 0 and loaded.eval.sequence_len == 4 and not loaded.packed


def test_load_prepared_rejects_foreign_files(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    with pytest.raises(ShardpoolError, match="does not exist"):
        load_prepared(tmp_path / "missing.safetensors")
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ShardpoolError, match="not shardpool prepared data"):
        load_prepared(tmp_path / "other.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(ShardpoolError, match="not a readable safetensors file"):
        load_prepared(tmp_path / "junk.safetensors")


def test_token_rows_select() -> None:
    rows = TokenRows(*(torch.arange(12).reshape(4, 3) + k for k in range(4)))
    picked = rows.select([2, 0])
    assert len(picked) == 2 and picked.input_ids.tolist() == [[6, 7, 8], [0, 1, 2]]
    assert picked.position_ids.tolist() == [[9, 10, 11], [3, 4, 5]]
    assert len(rows.select([])) == 0


# ------------------------------------------------------------------------------------------------
# bad input: one line naming file:line and the fix
# ------------------------------------------------------------------------------------------------

GOOD_ALPACA = {"instruction": "Hi.", "output": "Hello."}


@pytest.mark.parametrize(
    ("kind", "bad_line", "pattern"),
    [
        ("alpaca", '{"instruction": "x", "output": ', r"invalid JSON .*; fix the line"),
        ("alpaca", "[1, 2]", r"expected a JSON object per line"),
        ("alpaca", {"output": "x"}, r"the row has no `instruction`; alpaca rows need"),
        ("alpaca", {"instruction": "x"}, r"the row has no `output`"),
        ("alpaca", {"instruction": "x", "output": 5}, r"`output` must be a string, got int"),
        (
            "alpaca",
            {"instruction": "x", "input": ["a"], "output": "y"},
            r"`input` must be a string, got list",
        ),
        ("completion", {"content": "x"}, r"the row has no `text`; .*set `field:`"),
        ("completion", {"text": None}, r"the row has no `text`"),
        (None, {"instruction": "x", "output": "y"}, r"has no `input_ids`; set `type: alpaca`"),
        (None, {"text": "x"}, r"has no `input_ids`; set `type: completion`"),
        (None, {"input_ids": [1, 2.5]}, r"`input_ids` must be a list of integers"),
        (None, {"input_ids": [1, True]}, r"`input_ids` must be a list of integers"),
        (None, {"input_ids": []}, r"`input_ids` is empty"),
        (
            None,
            {"input_ids": [1, 99999]},
            r"token id 99999 is outside the tokenizer's vocabulary \(0\.\.\d+\)",
        ),
        (None, {"input_ids": [1, -1]}, r"token id -1 is outside"),
        (None, {"input_ids": [1, 2], "labels": [1]}, r"`labels` has 1 entries but `input_ids` has 2"),
        (None, {"input_ids": [1, 2], "labels": [1, 99999]}, r"label 99999 is neither -100 nor a token id"),
        (None, {"input_ids": [1, 2], "attention_mask": [1, 2]}, r"`attention_mask` must hold only 0 and 1"),
        (None, {"input_ids": [1, 2], "attention_mask": [1]}, r"`attention_mask` has 1 entries"),
    ],
)
def test_bad_rows_name_file_and_line(
    tmp_path: Path, model_dir: Path, tok: Any, kind: str | None, bad_line: Any, pattern: str
) -> None:
    good = (
        GOOD_ALPACA
        if kind == "alpaca"
        else {"text": "fine"}
        if kind == "completion"
        else {"input_ids": [5, 6]}
    )
    path = write_rows(tmp_path / "bad.jsonl", [good, "", bad_line, good])  # the blank line still counts
    spec: dict[str, Any] = {"path": path} if kind is None else {"path": path, "type": kind}
    with pytest.raises(ShardpoolError) as error:
        prepare_data(make_config(model_dir, [spec]), tok)
    message = str(error.value)
    assert message.startswith(f"{path}:3: ") and "\n" not in message
    assert re.search(pattern, message), message


def test_missing_dataset_file(model_dir: Path, tok: Any, tmp_path: Path) -> None:
    config = make_config(model_dir, [{"path": str(tmp_path / "nowhere.jsonl"), "type": "alpaca"}])
    with pytest.raises(
        ShardpoolError,
        match=r"dataset file .*nowhere\.jsonl.* \(datasets\[0\]\.path\) does not exist; check the path",
    ):
        prepare_data(config, tok)


def test_empty_dataset_file(model_dir: Path, tok: Any, tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(
        ShardpoolError, match=r"empty\.jsonl' has no rows; add JSON lines or remove it from `datasets`"
    ):
        prepare_data(make_config(model_dir, [{"path": str(path), "type": "completion"}]), tok)
