"""Prompt ids and completion text (shardpool.infer.text) with a real byte-level BPE tokenizer: text
released only when certain, half characters held, special tokens skipped, stop strings found
across tokens, and chat prompts tokenized as ``apply_chat_template(tokenize=True)`` does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardpool.data.templates import CHATML_TEMPLATE
from shardpool.errors import ShardpoolError
from shardpool.infer.text import TextStream, chat_prompt_ids, prompt_ids, stop_ids, stop_strings
from shardpool.model.tinymodel import DEFAULT_CORPUS, train_tokenizer

TEXT = "Héllo wörld 😀 The quick brown fox"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return train_tokenizer(DEFAULT_CORPUS)


def _completion_ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _push_all(stream: TextStream, ids: list[int]) -> list[str]:
    return [stream.push(token) for token in ids]


def test_pieces_join_to_the_decoded_text_and_never_hold_half_a_character(tokenizer: Any) -> None:
    ids = _completion_ids(tokenizer, TEXT)
    stream = TextStream(tokenizer)
    pieces = _push_all(stream, ids)
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) + stream.finish() == tokenizer.decode(ids) == TEXT == stream.text


def test_a_character_split_over_tokens_comes_out_with_its_last_byte(tokenizer: Any) -> None:
    ids = _completion_ids(tokenizer, "😀")
    assert len(ids) > 1  # the emoji's four bytes are separate tokens here
    stream = TextStream(tokenizer)
    assert _push_all(stream, ids) == [""] * (len(ids) - 1) + ["😀"]


def test_a_trailing_half_character_is_given_by_finish(tokenizer: Any) -> None:
    ids = _completion_ids(tokenizer, "ab😀")[:-1]
    stream = TextStream(tokenizer)
    assert "".join(_push_all(stream, ids)) == "ab"
    assert stream.finish() == tokenizer.decode(ids)[2:]


def test_special_tokens_are_skipped(tokenizer: Any) -> None:
    ids = [*_completion_ids(tokenizer, "The quick"), tokenizer.eos_token_id]
    stream = TextStream(tokenizer)
    assert "".join(_push_all(stream, ids)) + stream.finish() == "The quick"


def test_the_prompt_context_is_not_repeated(tokenizer: Any) -> None:
    prompt = tokenizer("The quick")["input_ids"]
    stream = TextStream(tokenizer, context=prompt)
    assert (
        "".join(_push_all(stream, _completion_ids(tokenizer, " brown fox"))) + stream.finish() == " brown fox"
    )


def test_a_stop_string_split_across_tokens_cuts_the_text_before_it(tokenizer: Any) -> None:
    ids = _completion_ids(tokenizer, "The quick brown fox")
    assert not any("ck br" in tokenizer.decode([token]) for token in ids)  # it spans tokens
    stream = TextStream(tokenizer, stop=["ck br"])
    pieces = _push_all(stream, ids)
    assert stream.stopped
    assert "".join(pieces) == stream.text == "The qui"
    assert stream.push(ids[0]) == "" and stream.finish() == ""


def test_text_that_may_start_a_stop_string_is_held_until_decided(tokenizer: Any) -> None:
    ids = _completion_ids(tokenizer, "The quick brown")
    stream = TextStream(tokenizer, stop=["quiet"])
    pieces = _push_all(stream, ids)
    assert not any(piece.endswith("q") or piece.endswith("qu") for piece in pieces)
    assert "".join(pieces) == "The quick brown" and not stream.stopped


def test_held_text_is_released_when_the_completion_ends(tokenizer: Any) -> None:
    ids = _completion_ids(tokenizer, "The qu")
    stream = TextStream(tokenizer, stop=["quiet"])
    assert "".join(_push_all(stream, ids)) == "The "
    assert stream.text == "The qu"
    assert stream.finish() == "qu"


def test_the_earliest_stop_string_wins(tokenizer: Any) -> None:
    stream = TextStream(tokenizer, stop=["fox", "quick", "brown"])
    assert "".join(_push_all(stream, _completion_ids(tokenizer, "The quick brown fox"))) == "The "


def test_stop_strings_are_checked() -> None:
    assert stop_strings(None) == ()
    assert stop_strings("x") == ("x",)
    assert stop_strings(["a", "", "b"]) == ("a", "b")
    with pytest.raises(ShardpoolError, match="at most 4"):
        stop_strings(["a", "b", "c", "d", "e"])
    with pytest.raises(ShardpoolError, match="string or a list of strings"):
        stop_strings([1])  # type: ignore[list-item]


def test_a_plain_prompt_gets_the_tokenizers_bos(tokenizer: Any) -> None:
    assert prompt_ids(tokenizer, "The quick") == tokenizer("The quick")["input_ids"]
    assert prompt_ids(tokenizer, "The quick")[0] == tokenizer.bos_token_id


def test_chat_prompts_are_tokenized_as_apply_chat_template_does(tokenizer: Any) -> None:
    tokenizer.chat_template = "{{ bos_token }}" + CHATML_TEMPLATE
    try:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        ids = chat_prompt_ids(tokenizer, messages)
        assert ids == list(expected)
        assert ids.count(tokenizer.bos_token_id) == 1  # the template's bos, not one more
        assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
        assert prompt_ids(tokenizer, "Say hello.", chat=True) == chat_prompt_ids(
            tokenizer, [{"role": "user", "content": "Say hello."}]
        )
    finally:
        tokenizer.chat_template = None


def test_a_tokenizer_without_a_chat_template_is_refused_in_one_line(tokenizer: Any) -> None:
    with pytest.raises(ShardpoolError, match="no chat template.*/v1/completions") as raised:
        chat_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}])
    assert "\n" not in str(raised.value)


def test_stop_ids_add_the_generation_configs_eos_ids(tokenizer: Any, tmp_path: Path) -> None:
    assert stop_ids(tokenizer) == {tokenizer.eos_token_id}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert stop_ids(tokenizer, tmp_path) == {tokenizer.eos_token_id, 7, 9}
