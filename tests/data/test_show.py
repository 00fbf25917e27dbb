"""`validate --show`: every dataset type shown as the model sees it, its trained spans checked by decoding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardpool.config import Config, parse_config
from shardpool.data.prepare import configure_tokenizer, samples_per_dataset
from shardpool.data.rows import Sample
from shardpool.data.show import ShownRow, marked_text, shown_rows
from shardpool.data.tokenizer_file import load_tokenizer_file
from shardpool.data.tokenizing import load_tokenizer
from shardpool.errors import ShardpoolError
from shardpool.model.tinymodel import DEFAULT_CORPUS, train_tokenizer
from tests.helpers.conversations import SYSTEM_BRIEF, TWO_TURNS
from tests.helpers.trained_spans import check_shown_row
from tests.helpers.training import REPO_ROOT

QUICKSTART = REPO_ROOT / "models" / "quickstart"
ALPACA = [
    {"instruction": "Add the two numbers.", "input": "24 + 48", "output": "72"},
    {"instruction": "Say hello.", "output": "Hello, world!"},
]
COMPLETION = [
    {"text": "Pipeline stages pass activations forward and gradients backward."},
    {"text": "Un café, s'il vous plaît."},
]
CONVERSATIONS = [
    {"messages": [SYSTEM_BRIEF, *TWO_TURNS]},
    {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": " hi there "}]},
]
SHAREGPT = [
    {"conversations": [{"from": "human", "value": "Add 2 and 3."}, {"from": "gpt", "value": "5"}]},
]
PRETOKENIZED = [
    {"input_ids": [1, 300, 301, 302, 303, 2], "labels": [-100, -100, -100, 302, 303, 2]},
    {"input_ids": [1, 310, 311, 312, 2]},
]
# A template that writes the tokenizer's own bos and eos, so its eos is trained after each turn.
EOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
)


def metaspace_tokenizer() -> Any:
    """A sentencepiece-style tokenizer (▁ for spaces, bos added): its offsets and decoding treat spaces apart."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    alphabet = [f"<0x{byte:02X}>" for byte in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *alphabet], show_progress=False
    )
    backend.train_from_iterator(
        [*DEFAULT_CORPUS, *(json.dumps(row) for row in ALPACA + COMPLETION + CONVERSATIONS)], trainer=trainer
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def chatml_tokenizer() -> Any:
    """A Qwen-style tokenizer: ``<|im_start|>`` and ``<|im_end|>`` are tokens and eos is ``<|im_end|>``."""
    tokenizer = train_tokenizer(DEFAULT_CORPUS)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    return tokenizer


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    """The tokenizers the rows are shown with: the quickstart's as validate loads it, and two in memory."""
    return {
        "quickstart": load_tokenizer_file(QUICKSTART),
        "metaspace": metaspace_tokenizer(),
        "chatml": chatml_tokenizer(),
    }


@pytest.fixture(scope="module")
def quickstart_reference() -> Any:
    """The quickstart's tokenizer as training loads it (AutoTokenizer), to decode the training ids."""
    return load_tokenizer(QUICKSTART)


def write_rows(path: Path, rows: list[Any]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def make_config(tmp_path: Path, datasets: list[tuple[list[Any], dict[str, Any]]], **overrides: Any) -> Config:
    """A config over ``datasets`` (rows, dataset keys), each written to its own file."""
    entries = [
        {"path": write_rows(tmp_path / f"data{index}.jsonl", rows), **keys}
        for index, (rows, keys) in enumerate(datasets)
    ]
    raw = {
        "base_model": "unused",
        "lora_target_linear": True,
        "datasets": entries,
        "sequence_len": 256,
        **overrides,
    }
    return parse_config(raw)


def shown_and_checked(
    config: Config, tokenizer: Any, count: int, reference: Any = None
) -> tuple[list[ShownRow], list[list[Sample]]]:
    """The rows shown, each checked against the training samples by decoding with ``reference``."""
    configure_tokenizer(config, tokenizer)
    per_dataset = samples_per_dataset(config, tokenizer)
    shown = shown_rows(config, tokenizer, per_dataset, count)
    by_row = {
        (index, number): sample
        for index, rows in enumerate(per_dataset)
        for number, sample in enumerate(rows, 1)
    }
    for row in shown:
        check_shown_row(
            row.to_json(), by_row[(row.dataset, row.row)], reference or tokenizer, config.sequence_len
        )
    return shown, per_dataset


DATASETS: dict[str, tuple[list[Any], dict[str, Any], dict[str, Any]]] = {
    "completion": (COMPLETION, {"type": "completion"}, {}),
    "completion_field": (
        [{"body": row["text"]} for row in COMPLETION],
        {"type": "completion", "field": "body"},
        {},
    ),
    "alpaca": (ALPACA, {"type": "alpaca"}, {}),
    "alpaca_train_on_inputs": (ALPACA, {"type": "alpaca"}, {"train_on_inputs": True}),
    "chat_chatml": (CONVERSATIONS, {"type": "chat_template"}, {"chat_template": "chatml"}),
    "chat_eos_template": (CONVERSATIONS, {"type": "chat_template", "chat_template_jinja": EOS_TEMPLATE}, {}),
    "chat_all_roles": (
        CONVERSATIONS,
        {"type": "chat_template", "roles_to_train": ["user", "assistant"], "train_on_eos": "all"},
        {"chat_template": "chatml"},
    ),
    "sharegpt": (SHAREGPT, {"type": "sharegpt"}, {"chat_template": "chatml"}),
    "pretokenized": (PRETOKENIZED, {}, {}),
}


@pytest.mark.parametrize("tokenizer_name", ["quickstart", "metaspace", "chatml"])
@pytest.mark.parametrize("kind", list(DATASETS))
def test_every_dataset_type_marks_exactly_the_trained_tokens(
    tmp_path: Path, tokenizers: dict[str, Any], quickstart_reference: Any, kind: str, tokenizer_name: str
) -> None:
    rows, keys, overrides = DATASETS[kind]
    config = make_config(tmp_path, [(rows, keys)], **overrides)
    reference = quickstart_reference if tokenizer_name == "quickstart" else None
    shown, per_dataset = shown_and_checked(config, tokenizers[tokenizer_name], 5, reference)
    assert [row.row for row in shown] == list(range(1, len(rows) + 1))
    assert [row.tokens for row in shown] == [len(sample.input_ids) for sample in per_dataset[0]]
    assert all(row.trained for row in shown)


def test_alpaca_text_is_the_prompt_and_response_between_bos_and_eos(
    tmp_path: Path, tokenizers: dict[str, Any]
) -> None:
    config = make_config(tmp_path, [(ALPACA[1:], {"type": "alpaca"})])
    (row,) = shown_and_checked(config, tokenizers["quickstart"], 1)[0]
    prompt = (
        "Below is an instruction that describes a task. Write a response that appropriately completes "
        "the request.\n\n### Instruction:\nSay hello.\n\n### Response:\n"
    )
    assert row.text == f"<s>{prompt}Hello, world!</s>"
    assert row.trained == ((len("<s>") + len(prompt), len(row.text)),)
    assert marked_text(row) == f"<s>{prompt}⟦Hello, world!</s>⟧"


def test_completion_trains_everything_the_bos_included(tmp_path: Path, tokenizers: dict[str, Any]) -> None:
    config = make_config(tmp_path, [(COMPLETION[1:], {"type": "completion"})])
    (row,) = shown_and_checked(config, tokenizers["quickstart"], 1)[0]
    assert row.to_json() == {
        "dataset": 0,
        "row": 1,
        "text": "<s>Un café, s'il vous plaît.</s>",
        "trained": [[0, len(row.text)]],
        "tokens": row.tokens,
    }


def test_chat_trains_assistant_contents_and_their_eos(tmp_path: Path, tokenizers: dict[str, Any]) -> None:
    config = make_config(tmp_path, [(CONVERSATIONS[:1], {"type": "chat_template"})], chat_template="chatml")
    (row,) = shown_and_checked(config, tokenizers["chatml"], 1)[0]
    assert marked_text(row) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAdd 2 and 3.<|im_end|>\n"
        "<|im_start|>assistant\n⟦5<|im_end|>⟧\n<|im_start|>user\nReverse: one two<|im_end|>\n"
        "<|im_start|>assistant\n⟦two one<|im_end|>⟧\n"
    )


def test_pretokenized_rows_show_their_ids_decoded(tmp_path: Path, quickstart_reference: Any) -> None:
    tokenizer = load_tokenizer_file(QUICKSTART)
    ids = tokenizer("Hello there, friend.", add_special_tokens=True)["input_ids"]
    labels = [-100] * 3 + ids[3:]
    config = make_config(tmp_path, [([{"input_ids": ids, "labels": labels}], {})])
    (row,) = shown_and_checked(config, tokenizer, 1, quickstart_reference)[0]
    assert row.text == tokenizer.decode(ids)
    assert row.text[row.trained[0][0] : row.trained[0][1]].strip() == tokenizer.decode(ids[3:]).strip()


def test_a_row_cut_by_sequence_len_is_shown_up_to_the_cut(tmp_path: Path, tokenizers: dict[str, Any]) -> None:
    long = {"text": " ".join(["pipeline"] * 40)}
    tokenizer = tokenizers["quickstart"]
    ids = tokenizer(long["text"])["input_ids"]
    config = make_config(
        tmp_path,
        [([long], {"type": "completion"}), ([{"input_ids": ids, "labels": ids}], {})],
        sequence_len=12,
    )
    shown, _ = shown_and_checked(config, tokenizer, 1)
    for row in shown:
        assert row.tokens > 12 and row.trained_tokens == 12
        assert row.trained == ((0, row.seen),)
        assert 0 < row.seen < len(row.text)
        assert marked_text(row) == f"⟦{row.text[: row.seen]}⟧"


def test_the_first_n_rows_of_each_dataset_in_order(tmp_path: Path, tokenizers: dict[str, Any]) -> None:
    config = make_config(
        tmp_path,
        [(COMPLETION * 3, {"type": "completion"}), (ALPACA, {"type": "alpaca"})],
        shuffle_merged_datasets=True,
    )
    shown, _ = shown_and_checked(config, tokenizers["quickstart"], 4)
    assert [(row.dataset, row.row) for row in shown] == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (1, 2)]
    assert shown[2].text == shown[0].text  # file order, not the shuffled training order
    assert [row.where for row in shown][:2] == [
        f"{tmp_path / 'data0.jsonl'}:1",
        f"{tmp_path / 'data0.jsonl'}:2",
    ]


def test_ids_that_differ_from_the_rendered_texts_are_refused_in_one_line(
    tmp_path: Path, tokenizers: dict[str, Any]
) -> None:
    config = make_config(tmp_path, [(COMPLETION, {"type": "completion"})])
    tokenizer = tokenizers["quickstart"]
    per_dataset = samples_per_dataset(config, tokenizer)
    first = per_dataset[0][0]
    per_dataset[0][0] = Sample(
        first.input_ids[:-2] + first.input_ids[-1:], first.labels[:-1], first.attention_mask[:-1], first.where
    )
    with pytest.raises(
        ShardpoolError, match=r"^\S+data0.jsonl:1: cannot show this row: its text does not tokenize"
    ):
        shown_rows(config, tokenizer, per_dataset, 1)


TEXT = st.text(
    st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="\ue000\ue003") | st.just("\n"),
    max_size=30,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(instruction=TEXT, extra=TEXT, output=TEXT, question=TEXT, answer=TEXT)
def test_any_text_marks_exactly_the_trained_tokens(
    tmp_path_factory: pytest.TempPathFactory,
    tokenizers: dict[str, Any],
    instruction: str,
    extra: str,
    output: str,
    question: str,
    answer: str,
) -> None:
    conversation = {
        "messages": [
            {"role": "system", "content": extra},
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
    }
    config = make_config(
        tmp_path_factory.mktemp("any"),
        [
            ([{"instruction": instruction, "input": extra, "output": output}], {"type": "alpaca"}),
            ([{"text": instruction + output}], {"type": "completion"}),
            ([conversation], {"type": "chat_template"}),
        ],
        chat_template="chatml",
    )
    shown, _ = shown_and_checked(config, tokenizers["chatml"], 1)
    assert len(shown) == 3


def test_a_row_cut_by_sequence_len_inside_a_character_is_marked_exactly(
    tmp_path: Path, tokenizers: dict[str, Any]
) -> None:
    """A 4-byte character whose bytes the cut splits: the span takes the whole character."""
    output = "000000" + "\xa0" * 13 + "\U00010000" * 40
    config = make_config(
        tmp_path,
        [([{"instruction": "", "input": "", "output": output}], {"type": "alpaca"})],
        chat_template="chatml",
    )
    shown, _ = shown_and_checked(config, tokenizers["chatml"], 1)
    assert shown[0].text.endswith("\U00010000" * 40 + "<|im_end|>")
    assert shown[0].seen < len(shown[0].text), "the row is cut"
