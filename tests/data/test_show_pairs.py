"""`validate --show` of preference pairs: each pair's chosen and rejected sequence, its answer marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shardpool.config import Config
from shardpool.data.prepare import configure_tokenizer, preference_pairs
from shardpool.data.rows import Sample
from shardpool.data.show import ShownRow, marked_text, shown_pairs
from shardpool.data.tokenizer_file import load_tokenizer_file
from shardpool.errors import ShardpoolError
from tests.data.test_show import QUICKSTART, chatml_tokenizer, make_config
from tests.helpers.trained_spans import check_shown_row

INTEL = [
    {"system": "Be brief.", "question": "Add 2 and 3.", "chosen": "5", "rejected": "6"},
    {"system": "", "question": "Reverse: one two", "chosen": "two one", "rejected": "one two"},
]
MESSAGES = [
    {
        "messages": [{"role": "user", "content": "Add 2 and 3."}],
        "chosen": {"role": "assistant", "content": "5"},
        "rejected": {"role": "assistant", "content": "six"},
    },
    {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}],
        "chosen": "Hello!",
        "rejected": [{"role": "assistant", "content": "Go away."}],
    },
]
DATASETS: dict[str, tuple[list[Any], dict[str, Any], dict[str, Any]]] = {
    "chatml.intel": (INTEL, {"type": "chatml.intel"}, {}),
    "chat_template.default": (MESSAGES, {"type": "chat_template.default"}, {"chat_template": "chatml"}),
    "user_defined": (
        [{"q": "Say hi.", "good": "hi", "bad": "no"}],
        {
            "type": {
                "field_prompt": "q",
                "field_chosen": "good",
                "field_rejected": "bad",
                "prompt_format": "Q: {prompt}\nA:",
            }
        },
        {},
    ),
}


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    """The quickstart's tokenizer as validate loads it (bos added, no chatml tokens) and a chatml one."""
    return {"quickstart": load_tokenizer_file(QUICKSTART), "chatml": chatml_tokenizer()}


def pairs_config(tmp_path: Path, kind: str, **overrides: Any) -> Config:
    rows, keys, extra = DATASETS[kind]
    return make_config(tmp_path, [(rows, keys)], rl="dpo", **{**extra, **overrides})


def training_pairs(config: Config, tokenizer: Any) -> list[list[tuple[Sample, Sample]]]:
    """The pairs of each dataset, as training makes them."""
    configure_tokenizer(config, tokenizer)
    return [preference_pairs(config, spec, i, tokenizer)[0] for i, spec in enumerate(config.datasets)]


def shown_and_checked(
    config: Config, tokenizer: Any, count: int, uncut: Config | None = None
) -> tuple[list[ShownRow], list[list[tuple[Sample, Sample]]]]:
    """The pairs shown, each sequence checked against its training sample by decoding the ids.

    ``uncut``: the same rows under a longer ``sequence_len``, whose samples are checked against
    where ``config`` cuts sequences (the checker wants them whole).
    """
    per_dataset = training_pairs(config, tokenizer)
    shown = shown_pairs(config, tokenizer, per_dataset, count)
    whole = training_pairs(uncut, tokenizer) if uncut else per_dataset
    samples = [sample for pairs in whole for pair in pairs[:count] for sample in pair]
    for sequence, sample in zip(shown, samples, strict=True):
        line = sequence.to_json()
        assert line.pop("pair") == sequence.pair
        check_shown_row(line, sample, tokenizer, config.sequence_len)
    return shown, per_dataset


@pytest.mark.parametrize("tokenizer_name", ["quickstart", "chatml"])
@pytest.mark.parametrize("kind", list(DATASETS))
def test_each_sequence_of_a_pair_marks_exactly_its_answer_tokens(
    tmp_path: Path, tokenizers: dict[str, Any], kind: str, tokenizer_name: str
) -> None:
    config = pairs_config(tmp_path, kind)
    shown, per_dataset = shown_and_checked(config, tokenizers[tokenizer_name], 5)
    rows = len(DATASETS[kind][0])
    assert [(row.row, row.pair) for row in shown] == [
        (number, pair) for number in range(1, rows + 1) for pair in ("chosen", "rejected")
    ]
    assert all(row.trained and row.trained[-1][1] == len(row.text) for row in shown), (
        "the answer ends the text"
    )
    assert all(row.kind == ("user_defined.default" if kind == "user_defined" else kind) for row in shown)


def test_chatml_intel_text_is_the_prompt_and_answer_with_the_eos_trl_appends(
    tmp_path: Path, tokenizers: dict[str, Any]
) -> None:
    config = pairs_config(tmp_path, "chatml.intel")
    chosen, rejected, *_ = shown_and_checked(config, tokenizers["quickstart"], 1)[0]
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n"
    # the bos the tokenizer adds is written out; the eos is text TRL appends to the answer
    assert marked_text(chosen) == f"<s>{prompt}⟦5<|im_end|></s>⟧"
    assert marked_text(rejected) == f"<s>{prompt}⟦6<|im_end|></s>⟧"
    assert chosen.to_json() == {
        "dataset": 0,
        "row": 1,
        "text": f"<s>{prompt}5<|im_end|></s>",
        "trained": [[len("<s>" + prompt), len(chosen.text)]],
        "tokens": chosen.tokens,
        "pair": "chosen",
    }


def test_chat_template_answers_end_with_their_turn_and_no_second_eos(
    tmp_path: Path, tokenizers: dict[str, Any]
) -> None:
    config = pairs_config(tmp_path, "chat_template.default")
    shown, _ = shown_and_checked(config, tokenizers["chatml"], 1)
    prompt = "<s><|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n"
    assert [marked_text(row) for row in shown] == [f"{prompt}⟦5<|im_end|>⟧", f"{prompt}⟦six<|im_end|>⟧"]


def test_left_out_rows_are_not_shown_and_rows_keep_their_number(
    tmp_path: Path, tokenizers: dict[str, Any]
) -> None:
    long = {**INTEL[0], "chosen": " ".join(["pipeline"] * 60)}
    config = make_config(tmp_path, [([long, *INTEL], {"type": "chatml.intel"})], rl="dpo", sequence_len=64)
    shown, per_dataset = shown_and_checked(config, tokenizers["chatml"], 1)
    assert len(per_dataset[0]) == 2
    assert [(row.row, row.where) for row in shown] == [(2, f"{tmp_path / 'data0.jsonl'}:2")] * 2


def test_a_sequence_cut_by_sequence_len_is_shown_up_to_the_cut(
    tmp_path: Path, tokenizers: dict[str, Any]
) -> None:
    """axolotl's filter counts no special tokens, so the bos and eos TRL adds can pass sequence_len."""
    tokenizer = tokenizers["quickstart"]
    uncut = make_config(tmp_path, [(INTEL[:1], {"type": "chatml.intel"})], rl="dpo")
    text = shown_and_checked(uncut, tokenizer, 1)[0][0].text
    exact = len(
        tokenizer(text.removeprefix("<s>").removesuffix("</s>"), add_special_tokens=False)["input_ids"]
    )
    cut = make_config(tmp_path, [(INTEL[:1], {"type": "chatml.intel"})], rl="dpo", sequence_len=exact)
    chosen, rejected = shown_and_checked(cut, tokenizer, 1, uncut)[0]
    for row in (chosen, rejected):
        assert row.tokens == exact + 2 and row.seen < len(row.text)
        start, end = row.trained[-1]
        assert end == row.seen and row.text[start:].startswith("5" if row is chosen else "6")
        assert marked_text(row).endswith(f"⟦{row.text[start : row.seen]}⟧")


def test_ids_that_differ_from_the_pairs_text_are_refused_in_one_line(
    tmp_path: Path, tokenizers: dict[str, Any]
) -> None:
    config = pairs_config(tmp_path, "chatml.intel")
    tokenizer = tokenizers["chatml"]
    configure_tokenizer(config, tokenizer)
    pairs, _ = preference_pairs(config, config.datasets[0], 0, tokenizer)
    chosen, rejected = pairs[0]
    pairs[0] = (
        chosen,
        Sample(rejected.input_ids[:-2] + [7, 7], rejected.labels, rejected.attention_mask, rejected.where),
    )
    with pytest.raises(
        ShardpoolError, match=r"^\S+data0.jsonl:1: cannot show this pair: its text does not tokenize"
    ) as refused:
        shown_pairs(config, tokenizer, [pairs], 1)
    assert "\n" not in str(refused.value)
