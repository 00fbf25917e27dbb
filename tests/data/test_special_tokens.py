"""axolotl's special_tokens: existing tokens re-pointed, new ones refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardpool.config import DatasetSpec
from shardpool.data.special_tokens import apply_special_tokens
from shardpool.data.tokenizing import dataset_samples, load_tokenizer
from shardpool.errors import ShardpoolError
from shardpool.model.tinymodel import PAD, UNK


def test_an_existing_token_becomes_eos_and_ends_every_trained_row(model_dir: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(model_dir)
    size = len(tokenizer)
    apply_special_tokens(tokenizer, {"eos_token": PAD, "pad_token": UNK}, source="tiny")
    assert (tokenizer.eos_token, tokenizer.pad_token, len(tokenizer)) == (PAD, UNK, size)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"instruction": "say hi", "output": "hi there"}\n', encoding="utf-8")
    sample = dataset_samples(DatasetSpec(path=str(rows), type="alpaca"), 0, tokenizer)[0]
    assert sample.input_ids[-1] == tokenizer.convert_tokens_to_ids(PAD)
    assert sample.labels[-1] == sample.input_ids[-1], "the new eos is trained, as the old one was"
    saved = tmp_path / "saved"
    tokenizer.save_pretrained(saved)
    assert load_tokenizer(saved).eos_token == PAD, "the tokenizer beside the adapter carries the setting"


def test_a_token_outside_the_vocabulary_is_refused_in_one_line(model_dir: Path) -> None:
    tokenizer = load_tokenizer(model_dir)
    size = len(tokenizer)
    with pytest.raises(ShardpoolError) as caught:
        apply_special_tokens(tokenizer, {"pad_token": "<|new_pad|>", "eos_token": PAD}, source="tiny")
    message = str(caught.value)
    assert "['<|new_pad|>'] are not in the tokenizer of tiny" in message and "\n" not in message
    assert len(tokenizer) == size and tokenizer.eos_token != PAD, "nothing is changed when refused"
