"""Chat datasets: rendering through the chat template, per-turn masks, sharegpt, templates, errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpool.config import parse_config
from shardpool.data.chat import CHATML_TEMPLATE, resolve_chat_template, use_config_chat_template
from shardpool.data.prepare import prepare_data
from shardpool.data.rows import IGNORE_INDEX
from shardpool.errors import ShardpoolError
from shardpool.model.tinymodel import DEFAULT_CORPUS, train_tokenizer
from tests.helpers.conversations import TWO_TURNS

M = IGNORE_INDEX
# The hand-checked rendering of TWO_TURNS with chatml.
TWO_TURNS_CHATML = (
    "<|im_start|>user\nAdd 2 and 3.<|im_end|>\n"
    "<|im_start|>assistant\n5<|im_end|>\n"
    "<|im_start|>user\nReverse: one two<|im_end|>\n"
    "<|im_start|>assistant\ntwo one<|im_end|>\n"
)


@pytest.fixture(scope="module")
def chatml_tok() -> Any:
    """A Qwen-style tokenizer: ``<|im_start|>`` and ``<|im_end|>`` are single tokens, eos is ``<|im_end|>``."""
    tokenizer = train_tokenizer(DEFAULT_CORPUS)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    return tokenizer


def write_rows(path: Path, rows: list[Any]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def chat_rows(
    tmp_path: Path,
    tokenizer: Any,
    rows: list[Any],
    dataset: dict[str, Any] | None = None,
    **overrides: Any,
) -> tuple[list[list[int]], list[list[int]]]:
    """The unpadded ids and labels prepare_data makes of ``rows`` (a chat_template dataset by default)."""
    entry = {"path": write_rows(tmp_path / "chat.jsonl", rows), "type": "chat_template", **(dataset or {})}
    raw: dict[str, Any] = {
        "base_model": "unused",
        "lora_target_linear": True,
        "datasets": [entry],
        "sequence_len": 256,
        "shuffle_merged_datasets": False,
        "chat_template": "chatml",
        **overrides,
    }
    data = prepare_data(parse_config(raw), tokenizer)
    ids, labels = [], []
    for row_ids, row_labels, mask in zip(
        data.train.input_ids.tolist(),
        data.train.labels.tolist(),
        data.train.attention_mask.tolist(),
        strict=True,
    ):
        length = sum(mask)
        ids.append(row_ids[:length])
        labels.append(row_labels[:length])
    return ids, labels


def trained(ids: list[int], labels: list[int]) -> list[int]:
    """Positions whose label is a token (and that token is the input token there)."""
    positions = [position for position, label in enumerate(labels) if label != M]
    assert all(labels[position] == ids[position] for position in positions)
    return positions


# ------------------------------------------------------------------------------------------------
# the hand-checked example
# ------------------------------------------------------------------------------------------------


def test_two_turns_with_chatml_render_and_mask_exactly_as_checked_by_hand(
    tmp_path: Path, chatml_tok: Any
) -> None:
    assert chatml_tok.apply_chat_template(TWO_TURNS, chat_template=CHATML_TEMPLATE, tokenize=False) == (
        TWO_TURNS_CHATML
    )
    [ids], [labels] = chat_rows(tmp_path, chatml_tok, [{"messages": TWO_TURNS}])
    assert ids == chatml_tok(TWO_TURNS_CHATML, add_special_tokens=False)["input_ids"]
    tokens = chatml_tok.convert_ids_to_tokens(ids)
    # <|im_start|> u s er \n Ad d Ġ2 Ġand Ġ3 . <|im_end|> \n          (positions 0-12)
    # <|im_start|> as s is t an t \n 5 <|im_end|> \n                  (13-23)
    # <|im_start|> u s er \n Re ver se : Ġo n e Ġtwo <|im_end|> \n   (24-38)
    # <|im_start|> as s is t an t \n t wo Ġo n e <|im_end|> \n       (39-53)
    assert len(ids) == 54
    assert [tokens[p] for p in (0, 11, 13, 21, 22, 24, 37, 39, 47, 52, 53)] == [
        "<|im_start|>", "<|im_end|>", "<|im_start|>", "5", "<|im_end|>", "<|im_start|>",
        "<|im_end|>", "<|im_start|>", "t", "<|im_end|>", "Ċ",
    ]  # fmt: skip
    # Trained: each assistant content and the eos (<|im_end|>) that ends it; nothing else.
    assert trained(ids, labels) == [21, 22, 47, 48, 49, 50, 51, 52]
    assert chatml_tok.decode([ids[p] for p in trained(ids, labels)]) == "5<|im_end|>two one<|im_end|>"
    assert all(label == M for label in labels[:21] + labels[23:47] + labels[53:])


def test_chatml_without_its_tokens_is_tokenized_as_text_and_trains_the_content(
    tmp_path: Path, tok: Any
) -> None:
    """The tiny Llama has no <|im_start|>: the markers are text pieces, the vocabulary does not grow."""
    size = len(tok)
    [ids], [labels] = chat_rows(tmp_path, tok, [{"messages": TWO_TURNS}])
    assert len(tok) == size
    assert ids == tok(TWO_TURNS_CHATML, add_special_tokens=False)["input_ids"]
    positions = trained(ids, labels)
    assert tok.decode([ids[p] for p in positions]) == "5two one"
    # the two trained runs are exactly the assistant contents (no eos: chatml never writes </s>)
    assert tok.decode(ids[positions[0] : positions[0] + 1]) == "5"
    assert tok.decode(ids[positions[1] : positions[-1] + 1]) == "two one"


def test_chat_tokens_equal_apply_chat_template_tokenized(tmp_path: Path, chatml_tok: Any) -> None:
    [ids], _ = chat_rows(tmp_path, chatml_tok, [{"messages": TWO_TURNS}])
    expected = chatml_tok.apply_chat_template(
        TWO_TURNS, chat_template=CHATML_TEMPLATE, tokenize=True, return_dict=False
    )
    assert ids == list(expected)


# ------------------------------------------------------------------------------------------------
# what is trained
# ------------------------------------------------------------------------------------------------

WITH_SYSTEM = [{"role": "system", "content": "Be brief."}, *TWO_TURNS]


@pytest.mark.parametrize(
    ("train_on_eos", "expected"),
    [
        ("turn", "5<|im_end|>two one<|im_end|>"),
        ("all", "<|im_end|><|im_end|>5<|im_end|><|im_end|>two one<|im_end|>"),
        ("last", "5two one<|im_end|>"),
        ("none", "5two one"),
    ],
)
def test_train_on_eos(tmp_path: Path, chatml_tok: Any, train_on_eos: str, expected: str) -> None:
    [ids], [labels] = chat_rows(
        tmp_path, chatml_tok, [{"messages": WITH_SYSTEM}], {"train_on_eos": train_on_eos}
    )
    assert chatml_tok.decode([ids[p] for p in trained(ids, labels)]) == expected


@pytest.mark.parametrize(
    ("roles_to_train", "expected"),
    [
        (["assistant"], "5<|im_end|>two one<|im_end|>"),
        (["user"], "Add 2 and 3.<|im_end|>Reverse: one two<|im_end|>"),
        (["system", "assistant"], "Be brief.<|im_end|>5<|im_end|>two one<|im_end|>"),
        (["gpt"], "5<|im_end|>two one<|im_end|>"),  # source names are mapped, as axolotl does
    ],
)
def test_roles_to_train(tmp_path: Path, chatml_tok: Any, roles_to_train: list[str], expected: str) -> None:
    [ids], [labels] = chat_rows(
        tmp_path, chatml_tok, [{"messages": WITH_SYSTEM}], {"roles_to_train": roles_to_train}
    )
    assert chatml_tok.decode([ids[p] for p in trained(ids, labels)]) == expected


def test_train_on_inputs_trains_every_turn_content_but_not_the_markup(
    tmp_path: Path, chatml_tok: Any
) -> None:
    [ids], [labels] = chat_rows(tmp_path, chatml_tok, [{"messages": TWO_TURNS}], train_on_inputs=True)
    text = chatml_tok.decode([ids[p] for p in trained(ids, labels)])
    assert text == "Add 2 and 3.<|im_end|>5<|im_end|>Reverse: one two<|im_end|>two one<|im_end|>"


def test_a_row_with_no_trained_turn_is_dropped(tmp_path: Path, chatml_tok: Any) -> None:
    rows = [{"messages": TWO_TURNS}, {"messages": TWO_TURNS[:1]}]
    ids, _ = chat_rows(tmp_path, chatml_tok, rows)
    assert len(ids) == 1


def test_drop_system_message(tmp_path: Path, chatml_tok: Any) -> None:
    [with_system], _ = chat_rows(tmp_path, chatml_tok, [{"messages": WITH_SYSTEM}])
    [without], _ = chat_rows(tmp_path, chatml_tok, [{"messages": WITH_SYSTEM}], {"drop_system_message": True})
    [plain], _ = chat_rows(tmp_path, chatml_tok, [{"messages": TWO_TURNS}])
    assert without == plain != with_system


def test_a_template_without_eos_warns_once(
    tmp_path: Path, tok: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="shardpool.data.chat"):
        chat_rows(tmp_path, tok, [{"messages": TWO_TURNS}] * 3)
    warnings = [r.getMessage() for r in caplog.records if r.name == "shardpool.data.chat"]
    assert len(warnings) == 1 and "never puts the tokenizer's eos token '</s>'" in warnings[0]


@pytest.fixture(scope="module")
def base_chatml_tok() -> Any:
    """A Qwen-base-style tokenizer: ChatML's tokens are single tokens, but eos is ``<|endoftext|>``."""
    tokenizer = train_tokenizer(DEFAULT_CORPUS)
    tokenizer.add_special_tokens(
        {"eos_token": "<|endoftext|>", "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|end|>"]}
    )
    return tokenizer


@pytest.mark.parametrize(
    ("train_on_eot", "expected"),
    [
        (None, "5<|im_end|>two one<|im_end|>"),  # follows train_on_eos (turn)
        ("turn", "5<|im_end|>two one<|im_end|>"),
        ("all", "<|im_end|><|im_end|>5<|im_end|><|im_end|>two one<|im_end|>"),
        ("last", "5two one<|im_end|>"),
        ("none", "5two one"),
    ],
)
def test_eot_tokens_train_the_templates_turn_end_when_it_is_not_the_eos(
    tmp_path: Path, base_chatml_tok: Any, train_on_eot: str | None, expected: str
) -> None:
    dataset = {} if train_on_eot is None else {"train_on_eot": train_on_eot}
    [ids], [labels] = chat_rows(
        tmp_path, base_chatml_tok, [{"messages": WITH_SYSTEM}], dataset, eot_tokens=["<|im_end|>"]
    )
    assert base_chatml_tok.decode([ids[p] for p in trained(ids, labels)]) == expected


def test_without_eot_tokens_only_the_eos_ends_a_turn(
    tmp_path: Path, base_chatml_tok: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="shardpool.data.chat"):
        [ids], [labels] = chat_rows(tmp_path, base_chatml_tok, [{"messages": WITH_SYSTEM}])
    assert base_chatml_tok.decode([ids[p] for p in trained(ids, labels)]) == "5two one"
    assert "set `eot_tokens`" in caplog.text


@pytest.mark.parametrize(
    ("train_on_eos", "expected"),
    [("turn", "5<|end|>two one<|end|><|endoftext|>"), ("none", "5<|end|>two one<|end|>")],
)
def test_eot_tokens_and_the_eos_are_each_trained_by_their_own_key(
    tmp_path: Path, base_chatml_tok: Any, train_on_eos: str, expected: str
) -> None:
    """Phi-3 ends each turn with <|end|> and the conversation with eos: both are turn ends."""
    [ids], [labels] = chat_rows(
        tmp_path,
        base_chatml_tok,
        [{"messages": WITH_SYSTEM}],
        {"train_on_eos": train_on_eos, "train_on_eot": "turn"},
        chat_template="phi_3",
        eot_tokens=["<|end|>"],
    )
    assert base_chatml_tok.decode([ids[p] for p in trained(ids, labels)]) == expected


def test_an_eot_token_of_several_tokens_is_refused_in_one_line(tmp_path: Path, tok: Any) -> None:
    with pytest.raises(
        ShardpoolError, match=r"^`eot_tokens` entry '<\|im_end\|>' is \d+ tokens .*, not one;"
    ):
        chat_rows(tmp_path, tok, [{"messages": TWO_TURNS}], eot_tokens=["<|im_end|>"])


def test_the_eos_in_eot_tokens_needs_both_keys_to_agree(tmp_path: Path, chatml_tok: Any) -> None:
    with pytest.raises(ShardpoolError, match=r"`train_on_eot: all` and `train_on_eos: turn` disagree"):
        chat_rows(
            tmp_path,
            chatml_tok,
            [{"messages": TWO_TURNS}],
            {"train_on_eot": "all"},
            eot_tokens=["<|im_end|>"],
        )


def test_an_eot_token_the_template_never_writes_is_left_out_with_a_warning(
    tmp_path: Path, chatml_tok: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="shardpool.data.chat"):
        rows = chat_rows(tmp_path, chatml_tok, [{"messages": TWO_TURNS}], eot_tokens=["<|end|>"])
    assert rows == chat_rows(tmp_path, chatml_tok, [{"messages": TWO_TURNS}])
    assert "never writes eot token '<|end|>'" in caplog.text


# ------------------------------------------------------------------------------------------------
# field and role mappings, sharegpt
# ------------------------------------------------------------------------------------------------

SHAREGPT = [
    {"from": "system", "value": "Be brief."},
    {"from": "human", "value": "Add 2 and 3."},
    {"from": "gpt", "value": "5"},
]
OPENAI = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Add 2 and 3."},
    {"role": "assistant", "content": "5"},
]


def test_sharegpt_gives_the_same_tokens_as_the_equivalent_chat_template_row(
    tmp_path: Path, chatml_tok: Any
) -> None:
    sharegpt = chat_rows(tmp_path, chatml_tok, [{"conversations": SHAREGPT}], {"type": "sharegpt"})
    openai = chat_rows(tmp_path, chatml_tok, [{"messages": OPENAI}])
    assert sharegpt == openai
    [ids], [labels] = openai
    assert chatml_tok.decode([ids[p] for p in trained(ids, labels)]) == "5<|im_end|>"


@pytest.mark.parametrize(
    "dataset",
    [
        {
            "field_messages": "conversations",
            "message_property_mappings": {"role": "from", "content": "value"},
        },
        {"field_messages": "conversations", "message_field_role": "from", "message_field_content": "value"},
    ],
)
def test_chat_template_with_sharegpt_field_names(
    tmp_path: Path, chatml_tok: Any, dataset: dict[str, Any]
) -> None:
    mapped = chat_rows(tmp_path, chatml_tok, [{"conversations": SHAREGPT}], dataset)
    assert mapped == chat_rows(tmp_path, chatml_tok, [{"messages": OPENAI}])


def test_custom_roles(tmp_path: Path, chatml_tok: Any) -> None:
    messages = [{"role": "asker", "content": "Add 2 and 3."}, {"role": "bot", "content": "5"}]
    dataset = {"roles": {"user": ["asker"], "assistant": ["bot"]}}
    assert chat_rows(tmp_path, chatml_tok, [{"messages": messages}], dataset) == chat_rows(
        tmp_path, chatml_tok, [{"messages": OPENAI[1:]}]
    )


# ------------------------------------------------------------------------------------------------
# templates
# ------------------------------------------------------------------------------------------------

EOS_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"


def test_jinja_template_text_renders_and_trains_its_eos(tmp_path: Path, tok: Any) -> None:
    [ids], [labels] = chat_rows(tmp_path, tok, [{"messages": OPENAI[1:]}], chat_template=EOS_TEMPLATE)
    assert tok.decode(ids) == "user: Add 2 and 3.</s>\nassistant: 5</s>\n"
    # "Ġ5" holds the template's space and the content's "5": a token that overlaps the content is trained
    assert tok.convert_ids_to_tokens([ids[p] for p in trained(ids, labels)]) == ["Ġ5", "</s>"]


@pytest.mark.parametrize("how", ["jinja", "implied", "file", "dataset"])
def test_the_ways_to_give_a_jinja_template_agree(tmp_path: Path, tok: Any, how: str) -> None:
    rows = [{"messages": OPENAI[1:]}]
    reference = chat_rows(tmp_path, tok, rows, chat_template=EOS_TEMPLATE)
    template_file = tmp_path / "template.jinja"
    template_file.write_text(EOS_TEMPLATE, encoding="utf-8")
    ways: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
        "jinja": ({}, {"chat_template": "jinja", "chat_template_jinja": EOS_TEMPLATE}),
        "implied": ({}, {"chat_template": None, "chat_template_jinja": EOS_TEMPLATE}),
        "file": ({}, {"chat_template": "jinja", "chat_template_jinja": str(template_file)}),
        "dataset": ({"chat_template": EOS_TEMPLATE}, {"chat_template": "chatml"}),
    }
    dataset, overrides = ways[how]
    assert chat_rows(tmp_path, tok, rows, dataset, **overrides) == reference


def test_tokenizer_default_uses_the_tokenizers_template(tmp_path: Path) -> None:
    tokenizer = train_tokenizer(DEFAULT_CORPUS)
    tokenizer.chat_template = EOS_TEMPLATE
    rows = [{"messages": OPENAI[1:]}]
    for choice in ("tokenizer_default", "tokenizer_default_fallback_chatml", None):
        ids, _ = chat_rows(tmp_path, tokenizer, rows, chat_template=choice)
        assert tokenizer.decode(ids[0]).startswith("user: Add")


def test_tokenizer_default_without_a_template_is_one_line(tmp_path: Path, tok: Any) -> None:
    with pytest.raises(
        ShardpoolError, match=r"tokenizer has no chat template .* set `chat_template: chatml`"
    ):
        chat_rows(tmp_path, tok, [{"messages": OPENAI}], chat_template=None)


def test_fallback_chatml_without_a_tokenizer_template(tok: Any) -> None:
    assert resolve_chat_template("tokenizer_default_fallback_chatml", None, tok) == CHATML_TEMPLATE


def test_the_configs_template_goes_into_the_saved_tokenizer(chatml_tok: Any) -> None:
    tokenizer = train_tokenizer(DEFAULT_CORPUS)
    config = parse_config(
        {
            "base_model": "m",
            "lora_target_linear": True,
            "datasets": [{"path": "d"}],
            "chat_template": "chatml",
        }
    )
    use_config_chat_template(config, tokenizer)
    assert tokenizer.chat_template == CHATML_TEMPLATE


# ------------------------------------------------------------------------------------------------
# bad rows: one line naming the row
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "dataset", "expected"),
    [
        (
            {"conversation": OPENAI},
            {},
            r"chat\.jsonl:2: the row has no `messages` \(it has `conversation`\); set `field_messages`",
        ),
        (
            {"messages": []},
            {},
            r"chat\.jsonl:2: `messages` must be a non-empty list of messages, got an empty list",
        ),
        ({"messages": "hi"}, {}, r"chat\.jsonl:2: `messages` must be a non-empty list of messages, got str"),
        ({"messages": [{"role": "user"}]}, {}, r"chat\.jsonl:2: message 1: has no `content` \(its content\)"),
        ({"messages": [{"content": "x"}]}, {}, r"chat\.jsonl:2: message 1: has no `role`"),
        (
            {"messages": [{"role": "user", "content": ["a"]}]},
            {},
            r"message 1: `content` .* must be a string, got list",
        ),
        ({"messages": ["hi"]}, {}, r"chat\.jsonl:2: message 1: expected a JSON object, got str"),
        (
            {"messages": [*OPENAI[:2], {"role": "narrator", "content": "x"}]},
            {},
            r"chat\.jsonl:2: message 3: unknown role 'narrator' \(known: .*\); map it on the dataset, e.g. `roles: \{user: \[narrator\]\}`",
        ),
        (
            {"conversations": [{"from": "bot", "value": "x"}]},
            {"type": "sharegpt"},
            r"chat\.jsonl:2: message 1: unknown role 'bot'",
        ),
        (
            {"conversations": [{"role": "user", "content": "x"}]},
            {"type": "sharegpt"},
            r"chat\.jsonl:2: message 1: has no `from` \(its role\)",
        ),
    ],
)
def test_bad_rows_give_one_line_naming_the_row(
    tmp_path: Path, chatml_tok: Any, row: dict[str, Any], dataset: dict[str, Any], expected: str
) -> None:
    first = {"conversations": SHAREGPT} if dataset.get("type") == "sharegpt" else {"messages": OPENAI}
    with pytest.raises(ShardpoolError, match=expected) as caught:
        chat_rows(tmp_path, chatml_tok, [first, row], dataset)
    assert "\n" not in str(caught.value)


def test_a_template_that_fails_on_a_row_is_one_line(tmp_path: Path, chatml_tok: Any) -> None:
    failing = "{% for m in messages %}{{ raise_exception('no ' + m['role']) }}{% endfor %}"
    with pytest.raises(
        ShardpoolError, match=r"chat\.jsonl:1: the chat template failed on this row \(no user\)"
    ):
        chat_rows(tmp_path, chatml_tok, [{"messages": OPENAI[1:]}], chat_template=failing)


def test_the_docs_chat_example_prepares_from_the_repository_root(monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    import yaml

    from shardpool.data.tokenizing import load_tokenizer

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    text = (repo / "docs" / "data.md").read_text(encoding="utf-8")
    section = text[text.index("## Chat data") :]
    block = re.findall(r"```yaml\n(.*?)```", section, flags=re.DOTALL)[0]
    config = parse_config(yaml.safe_load(block), source="docs/data.md chat example")
    data = prepare_data(config, load_tokenizer(config.base_model))
    assert len(data.train) == 48 and (data.dropped_rows, data.truncated_rows) == (0, 0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["system", "user", "assistant"]),
            st.text(alphabet="abcdefgh ijk.,:?!é\n0123456789", max_size=20),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_trained_tokens_are_exactly_the_assistant_contents_and_their_eos(
    chatml_tok: Any, turns: list[tuple[str, str]]
) -> None:
    """For any conversation, chatml's trained tokens decode to each assistant content plus <|im_end|>."""
    from shardpool.config import DatasetSpec
    from shardpool.data.chat import chat_samples

    messages = [{"role": role, "content": content} for role, content in turns]
    spec = DatasetSpec(path="-", type="chat_template")
    [sample] = chat_samples(
        [("row", {"messages": messages})], chatml_tok, spec, CHATML_TEMPLATE, train_on_inputs=False, label="d"
    )
    assert sample.input_ids == list(
        chatml_tok.apply_chat_template(
            messages, chat_template=CHATML_TEMPLATE, tokenize=True, return_dict=False
        )
    )
    decoded = chatml_tok.decode([token for token in sample.labels if token != M])
    assert decoded == "".join(content + "<|im_end|>" for role, content in turns if role == "assistant")
