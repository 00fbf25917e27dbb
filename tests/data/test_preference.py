"""Preference rows: each type's prompt/chosen/rejected text as axolotl makes it, and TRL's tokenization of them."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shardpool.data.chat import CHATML_TEMPLATE
from shardpool.data.preference import (
    PreferencePair,
    PreferenceTexts,
    chat_template_renderer,
    dpo_pairs,
    dpo_samples,
    fits_sequence_len,
    orpo_samples,
    preference_format,
    preference_texts,
)
from shardpool.data.rows import IGNORE_INDEX
from shardpool.data.templates import named_template
from shardpool.errors import ShardpoolError
from shardpool.model.tinymodel import DEFAULT_CORPUS, train_tokenizer

TINY_DATASET = Path(__file__).resolve().parents[2] / "configs" / "data" / "preference_tiny.jsonl"

IM = "<|im_start|>"
END = "<|im_end|>"
HEAD = "<|start_header_id|>"
HEND = "<|end_header_id|>"
EOT = "<|eot_id|>"


@pytest.fixture(scope="module")
def tok() -> Any:
    """A tiny BPE tokenizer that adds bos ``<s>``; eos is ``</s>``."""
    return train_tokenizer(DEFAULT_CORPUS)


@pytest.fixture(scope="module")
def chatml_tok() -> Any:
    """A Qwen-style tokenizer: ``<|im_start|>`` and ``<|im_end|>`` are single tokens, eos is ``<|im_end|>``."""
    tokenizer = train_tokenizer(DEFAULT_CORPUS)
    tokenizer.add_special_tokens({"additional_special_tokens": [IM, END]})
    tokenizer.eos_token = END
    return tokenizer


def texts(row: dict[str, Any], entry: dict[str, Any], rl: str = "dpo", render: Any = None) -> PreferenceTexts:
    """The texts of ``row`` under the dataset ``entry``."""
    return preference_texts(row, "prefs.jsonl:1", preference_format(entry, rl), render)


def chatml_prompt(user: str, system: str | None = None) -> str:
    """axolotl's chatml prompt, written out."""
    head = f"{IM}system\n{system}{END}\n" if system else ""
    return f"{head}{IM}user\n{user}{END}\n{IM}assistant\n"


def llama3_prompt(user: str, system: str | None = None) -> str:
    """axolotl's llama3 prompt, written out."""
    head = f"{HEAD}system{HEND}\n\n{system}{EOT}" if system else ""
    return f"{head}{HEAD}user{HEND}\n\n{user}{EOT}{HEAD}assistant{HEND}\n\n"


PAIR = [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"}]
WRONG = [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "6"}]

# (variant, row): axolotl's documented shape of each chatml.* / llama3.* type; each gives user text
# "Add 2 and 3.", answers "5" and "6", and the system message "Be brief." where the type reads one.
WRITTEN_ROWS = [
    (
        "default",
        {
            "system": "Be brief.",
            "instruction": "Add 2 and 3.",
            "chosen_response": "5",
            "rejected_response": "6",
        },
    ),
    ("default", {"system": "Be brief.", "prompt": "Add 2 and 3.", "chosen": "5", "rejected": "6"}),
    ("default", {"system": "Be brief.", "input": "Add 2 and 3.", "chosen": "5", "rejected": "6"}),
    ("default", {"system": "Be brief.", "question": "Add 2 and 3.", "chosen": "5", "rejected": "6"}),
    ("intel", {"system": "Be brief.", "question": "Add 2 and 3.", "chosen": "5", "rejected": "6"}),
    ("icr", {"system": "Be brief.", "input": "Add 2 and 3.", "chosen": "5", "rejected": "6"}),
    ("prompt_pairs", {"system": "Be brief.", "prompt": "Add 2 and 3.", "chosen": "5", "rejected": "6"}),
    ("ultra", {"system": "Be brief.", "prompt": "Add 2 and 3.", "chosen": PAIR, "rejected": WRONG}),
    ("argilla_chat", {"system": "Be brief.", "chosen": PAIR, "rejected": WRONG}),
]


@pytest.mark.parametrize(("variant", "row"), WRITTEN_ROWS)
def test_chatml_types_write_the_prompt_in_chatml(variant: str, row: dict[str, Any]) -> None:
    """The system message is kept except by argilla_chat, which reads only the two conversations."""
    system = None if variant == "argilla_chat" else "Be brief."
    got = texts(row, {"type": f"chatml.{variant}"})
    assert got == PreferenceTexts(chatml_prompt("Add 2 and 3.", system), f"5{END}", f"6{END}")


@pytest.mark.parametrize(("variant", "row"), WRITTEN_ROWS)
def test_llama3_types_write_the_prompt_in_llama3_without_bos(variant: str, row: dict[str, Any]) -> None:
    system = None if variant == "argilla_chat" else "Be brief."
    got = texts(row, {"type": f"llama3.{variant}"})
    assert got == PreferenceTexts(llama3_prompt("Add 2 and 3.", system), f"5{EOT}", f"6{EOT}")


@pytest.mark.parametrize("system", [None, "", "absent"])
def test_an_empty_or_missing_system_message_is_left_out(system: str | None) -> None:
    row: dict[str, Any] = {"question": "Hi?", "chosen": "Hello.", "rejected": "Go."}
    if system != "absent":
        row["system"] = system
    assert texts(row, {"type": "chatml.intel"}).prompt == f"{IM}user\nHi?{END}\n{IM}assistant\n"


def test_a_one_part_type_means_its_default() -> None:
    row = {"prompt": "Hi?", "chosen": "Hello.", "rejected": "Go."}
    assert texts(row, {"type": "chatml"}) == texts(row, {"type": "chatml.default"})
    assert texts(row, {"type": "llama3"}).chosen == f"Hello.{EOT}"


def test_user_defined_fills_the_formats_with_the_rows_fields() -> None:
    spec = {
        "field_prompt": "question",
        "field_system": "sys",
        "field_chosen": "good",
        "field_rejected": "bad",
        "prompt_format": "[{system}] Q: {prompt}\nA:",
        "chosen_format": " {chosen}.",
        "rejected_format": " {rejected}!",
    }
    row = {"sys": "math", "question": "2+3", "good": "5", "bad": "6"}
    assert texts(row, {"type": spec}) == PreferenceTexts("[math] Q: 2+3\nA:", " 5.", " 6!")
    assert texts({**row, "sys": None}, {"type": spec}).prompt == "[] Q: 2+3\nA:"


def test_user_defined_defaults_pass_the_fields_through() -> None:
    row = {"system": "ignored without {system}", "prompt": "P", "chosen": "C", "rejected": "R"}
    assert texts(row, {"type": {}}) == PreferenceTexts("P", "C", "R")


# chat_template.* through the chatml template: the prompt ends with the generation prompt, each answer
# is its content and end of turn, the newline after it stripped.
def test_chat_template_default_renders_the_documented_row(chatml_tok: Any) -> None:
    render = chat_template_renderer(chatml_tok, CHATML_TEMPLATE)
    row = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3."}],
        "chosen": {"role": "assistant", "content": "5"},
        "rejected": {"role": "assistant", "content": "6"},
    }
    got = texts(row, {"type": "chat_template.default"}, render=render)
    assert got == PreferenceTexts(chatml_prompt("Add 2 and 3.", "Be brief."), f"5{END}", f"6{END}")


def test_chat_template_default_reads_strings_lists_and_mapped_fields(chatml_tok: Any) -> None:
    """A string prompt is a user message, a string answer an assistant one, a list's last message the answer."""
    render = chat_template_renderer(chatml_tok, CHATML_TEMPLATE)
    entry = {
        "type": "chat_template.default",
        "field_messages": "conversation",
        "field_chosen": "good",
        "field_rejected": "bad",
        "message_property_mappings": {"role": "from", "content": "value"},
        "roles": {"user": ["human", "user"], "assistant": ["gpt", "assistant"]},
    }
    row = {
        "conversation": [{"from": "human", "value": "Add 2 and 3."}],
        "good": [{"from": "human", "value": "ignored"}, {"from": "gpt", "value": "5"}],
        "bad": "6",
    }
    assert texts(row, entry, render=render) == PreferenceTexts(
        chatml_prompt("Add 2 and 3."), f"5{END}", f"6{END}"
    )
    assert texts({**row, "conversation": "Add 2 and 3."}, entry, render=render).prompt == chatml_prompt(
        "Add 2 and 3."
    )


def test_message_field_role_and_content_are_the_older_spelling_of_the_mappings(chatml_tok: Any) -> None:
    render = chat_template_renderer(chatml_tok, CHATML_TEMPLATE)
    entry = {"type": "chat_template.default", "message_field_role": "r", "message_field_content": "t"}
    row = {
        "messages": [{"r": "user", "t": "Add 2 and 3."}],
        "chosen": {"r": "assistant", "t": "5"},
        "rejected": "6",
    }
    assert texts(row, entry, render=render) == PreferenceTexts(
        chatml_prompt("Add 2 and 3."), f"5{END}", f"6{END}"
    )
    with pytest.raises(
        ShardpoolError, match=r"`message_field_role: r` conflicts with `message_property_mappings.role: x`"
    ):
        preference_format({**entry, "message_property_mappings": {"role": "x"}}, "dpo")


def test_chat_template_argilla_chat_takes_the_prompt_from_chosen(chatml_tok: Any) -> None:
    render = chat_template_renderer(chatml_tok, CHATML_TEMPLATE)
    history = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Add 2 and 3."},
    ]
    row = {
        "chosen": [*history, {"role": "assistant", "content": "5"}],
        "rejected": [*history, {"role": "assistant", "content": "6"}],
    }
    got = texts(row, {"type": "chat_template.argilla_chat"}, render=render)
    prompt = f"{IM}user\nHi.{END}\n{IM}assistant\nHello.{END}\n" + chatml_prompt("Add 2 and 3.")
    assert got == PreferenceTexts(prompt, f"5{END}", f"6{END}")


def test_chat_template_with_llama3_keeps_the_templates_bos_text(tok: Any) -> None:
    """llama3's template writes bos as text: the prompt starts with it (and TRL adds the tokenizer's too)."""
    render = chat_template_renderer(tok, named_template("llama3").jinja)
    row = {"messages": [{"role": "user", "content": "Add 2 and 3."}], "chosen": "5", "rejected": "6"}
    got = texts(row, {"type": "chat_template.default"}, render=render)
    assert got == PreferenceTexts("<s>" + llama3_prompt("Add 2 and 3."), f"5{EOT}", f"6{EOT}")


def test_an_answer_also_found_in_the_role_header_is_cut_at_the_answer(chatml_tok: Any) -> None:
    """axolotl searches the rendering for the answer, so for "e" it would start in the role header
    (``user\\n[[dummy_message]]...``); the answer itself is what is kept here."""
    render = chat_template_renderer(chatml_tok, CHATML_TEMPLATE)
    row = {"messages": "Which letter?", "chosen": "e", "rejected": "x"}
    assert texts(row, {"type": "chat_template.default"}, render=render).chosen == f"e{END}"


def test_orpo_argilla_renders_every_turn_but_the_last_answer_as_the_prompt(chatml_tok: Any) -> None:
    render = chat_template_renderer(chatml_tok, CHATML_TEMPLATE)
    row = {
        "system": "Be brief.",
        "chosen": [
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Add 2 and 3."},
            {"role": "assistant", "content": "5"},
        ],
        "rejected": [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "6"}],
    }
    got = texts(row, {"type": "chat_template.argilla"}, rl="orpo", render=render)
    prompt = f"{IM}system\nBe brief.{END}\n{IM}user\nHi.{END}\n{IM}assistant\nHello.{END}\n" + chatml_prompt(
        "Add 2 and 3."
    )
    # Unlike DPO's chat_template types, the answer keeps the newline the template puts after its turn.
    assert got == PreferenceTexts(prompt, f"5{END}\n", f"6{END}\n")


def test_orpo_argilla_uses_the_rows_prompt_for_every_user_turn(chatml_tok: Any) -> None:
    render = chat_template_renderer(chatml_tok, CHATML_TEMPLATE)
    row = {"prompt": "Add 2 and 3.", "chosen": PAIR, "rejected": WRONG}
    got = texts(row, {"type": "chat_template.argilla"}, rl="orpo", render=render)
    assert got == PreferenceTexts(chatml_prompt("Add 2 and 3."), f"5{END}\n", f"6{END}\n")


@pytest.mark.parametrize(
    ("entry", "rl", "message"),
    [
        (
            {"type": "chatml.nope"},
            "dpo",
            r"unknown preference dataset type `chatml.nope` for rl: dpo; use one of",
        ),
        (
            {"type": "chatml.intel"},
            "orpo",
            r"type `chatml.intel` for rl: orpo; use one of chat_template.argilla$",
        ),
        ({"type": "chat_template.argilla"}, "dpo", r"type `chat_template.argilla` for rl: dpo"),
        ({"type": "chatml.argilla"}, "dpo", r"no longer exists in axolotl; `chatml.default` reads"),
        ({"type": {"field_prompt": "q"}}, "orpo", r"mapping \(user_defined.default\) is for rl: dpo"),
        ({"type": {"prompt_format": "{input}"}}, "dpo", r"`prompt_format` uses \{input\}; it may use only"),
        ({}, "dpo", r"needs a `type` \(rl: dpo\)"),
    ],
)
def test_unknown_types_are_refused_in_one_line(entry: dict[str, Any], rl: str, message: str) -> None:
    with pytest.raises(ShardpoolError, match=message) as caught:
        preference_format(entry, rl)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("type_name", "row", "message"),
    [
        (
            "chatml.intel",
            {"chosen": "a", "rejected": "b"},
            r"has no `question` .*`type: chatml.intel` rows need it",
        ),
        ("llama3.icr", {"input": "q", "chosen": "a"}, r"has no `rejected` .*`type: llama3.icr` rows need it"),
        ("chatml.default", {"prompt": "q", "chosen": "a"}, r"has no `rejected_response`"),
        (
            "chatml.ultra",
            {"prompt": "q", "chosen": "a", "rejected": [1]},
            r"`chosen` must be a non-empty list",
        ),
        (
            "chatml.argilla_chat",
            {"chosen": PAIR[:1], "rejected": WRONG},
            r"`chosen` has 1 message\(s\).*reads message 2",
        ),
        (
            "chatml.prompt_pairs",
            {"prompt": 3, "chosen": "a", "rejected": "b"},
            r"`prompt` must be a string, got int",
        ),
    ],
)
def test_rows_missing_a_field_name_the_row_type_and_field(
    type_name: str, row: dict[str, Any], message: str
) -> None:
    with pytest.raises(ShardpoolError, match=r"^prefs.jsonl:1: .*" + message) as caught:
        texts(row, {"type": type_name})
    assert "\n" not in str(caught.value)


def test_chat_template_rows_name_unknown_roles_and_missing_answers(chatml_tok: Any) -> None:
    render = chat_template_renderer(chatml_tok, CHATML_TEMPLATE)
    entry = {"type": "chat_template.default"}
    row = {"messages": [{"role": "human", "content": "Hi."}], "chosen": "a", "rejected": "b"}
    # axolotl's preference role map has no human/gpt unless `roles` says so
    with pytest.raises(
        ShardpoolError, match=r"prefs.jsonl:1: unknown role 'human' in `messages`.*roles: \{user"
    ):
        texts(row, entry, render=render)
    with pytest.raises(ShardpoolError, match=r"prefs.jsonl:1: the row has no `rejected`"):
        texts({"messages": "Hi.", "chosen": "a"}, entry, render=render)
    with pytest.raises(ShardpoolError, match=r"`chosen` has empty content"):
        texts({"messages": "Hi.", "chosen": "", "rejected": "b"}, entry, render=render)
    with pytest.raises(ShardpoolError, match=r"renders rows with the chat template, but none was given"):
        texts({"messages": "Hi.", "chosen": "a", "rejected": "b"}, entry)


def test_an_answer_the_template_trims_is_its_rendered_text(tok: Any) -> None:
    """llama3 trims the content: axolotl would not find " 5 " and keep only the rendering's last character."""
    render = chat_template_renderer(tok, named_template("llama3").jinja)
    row = {"messages": "Add 2 and 3.", "chosen": " 5 ", "rejected": "6"}
    assert texts(row, {"type": "chat_template.default"}, render=render).chosen == f"5{EOT}"


def test_orpo_argilla_needs_user_assistant_pairs(chatml_tok: Any) -> None:
    render = chat_template_renderer(chatml_tok, CHATML_TEMPLATE)
    row = {"chosen": PAIR[:1], "rejected": WRONG}
    with pytest.raises(
        ShardpoolError, match=r"prefs.jsonl:1: `chosen` has 1 messages .*user/assistant pairs"
    ):
        texts(row, {"type": "chat_template.argilla"}, rl="orpo", render=render)


def test_fits_sequence_len_counts_prompt_and_each_answer_apart(tok: Any) -> None:
    pair = PreferenceTexts("Add 2 and 3.", " 5", " six is the answer")
    prompt, chosen, rejected = (
        len(tok(text, add_special_tokens=False)["input_ids"]) for text in vars(pair).values()
    )
    assert fits_sequence_len(pair, tok, prompt + max(chosen, rejected))
    assert not fits_sequence_len(pair, tok, prompt + max(chosen, rejected) - 1)


def test_tiny_dataset_rows_are_chatml_intel_rows() -> None:
    fmt = preference_format({"type": "chatml.intel"}, "dpo")
    lines = TINY_DATASET.read_text(encoding="utf-8").splitlines()
    assert 8 <= len(lines) <= 16
    for number, line in enumerate(lines, 1):
        got = preference_texts(json.loads(line), f"preference_tiny.jsonl:{number}", fmt)
        assert got.chosen != got.rejected


def test_dpo_samples_train_only_the_answer_and_cut_at_max_length() -> None:
    pair = PreferencePair([1, 10, 11], [20, 21, 2], [30, 2], "x:1")
    chosen, rejected = dpo_samples(pair, max_length=5)
    assert (chosen.input_ids, chosen.labels) == ([1, 10, 11, 20, 21], [-100, -100, -100, 20, 21])
    assert (rejected.input_ids, rejected.labels) == ([1, 10, 11, 30, 2], [-100, -100, -100, 30, 2])
    assert chosen.attention_mask == [1] * 5


# Against TRL's own code: the same rows through DPOTrainer._prepare_dataset, DataCollatorForPreference
# and the ORPO trainer's tokenize_row.

# Rows of several types; the last two end their prompt mid-word, so tokens merge across the boundary.
TRL_ROWS: list[tuple[str, dict[str, Any]]] = [
    ("chatml.intel", {"system": "Be brief.", "question": "Add 2 and 3.", "chosen": "5", "rejected": "six"}),
    ("llama3.ultra", {"prompt": "Reverse: one two", "chosen": PAIR, "rejected": WRONG}),
    (
        "user_defined.default",
        {"prompt": "the quick brown fox jumps over the lazy dog", "chosen": " yes", "rejected": " no"},
    ),
    (
        "user_defined.default",
        {"prompt": "Q: reverse the words\nA: wor", "chosen": "ds reversed", "rejected": "ds kept"},
    ),
    # merges so that prompt + rejected has fewer tokens than the prompt: ORPO refuses it
    ("user_defined.default", {"prompt": "Q: reverse the words\nA: wor", "chosen": "ds", "rejected": "d"}),
]


def trl_texts() -> list[tuple[str, PreferenceTexts]]:
    """The texts of TRL_ROWS, each with its ``where``."""
    out = []
    for number, (type_name, row) in enumerate(TRL_ROWS, 1):
        entry = {"type": {}} if type_name == "user_defined.default" else {"type": type_name}
        out.append((f"rows:{number}", texts(row, entry)))
    return out


def trl_prepared(
    tokenizer: Any, rows: list[tuple[str, PreferenceTexts]], max_length: int | None
) -> list[dict]:
    """TRL's DPOTrainer._prepare_dataset on ``rows`` (it reads only the tokenizer and these args of self)."""
    datasets = pytest.importorskip("datasets")
    from trl.trainer.dpo_trainer import DPOTrainer

    dataset = datasets.Dataset.from_list([vars(t) for _, t in rows])
    args = SimpleNamespace(dataset_num_proc=None, max_length=max_length, truncation_mode="keep_start")
    prepared = DPOTrainer._prepare_dataset(
        SimpleNamespace(_tokenizer=tokenizer), dataset, tokenizer, args, "train"
    )
    return list(prepared)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["tok", "chatml_tok"])
def test_dpo_pairs_match_trls_dpo_trainer(which: str, request: pytest.FixtureRequest) -> None:
    pytest.importorskip("trl")
    tokenizer = request.getfixturevalue(which)
    rows = trl_texts()
    ours = dpo_pairs(rows, tokenizer, max_length=None)
    theirs = trl_prepared(tokenizer, rows, None)
    assert [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in ours] == [
        (t["prompt_ids"], t["chosen_ids"], t["rejected_ids"]) for t in theirs
    ]
    # the merge row: its prompt's last token is not a prefix of prompt + answer, so the answer starts earlier
    merged = ours[3]
    assert len(merged.prompt_ids) < len(tokenizer(rows[3][1].prompt)["input_ids"])


@pytest.mark.slow
def test_dpo_pairs_leave_out_the_same_rows_as_trl_when_the_prompt_fills_max_length(tok: Any) -> None:
    pytest.importorskip("trl")
    rows = trl_texts()
    lengths = [len(p.prompt_ids) for p in dpo_pairs(rows, tok, max_length=None)]
    max_length = sorted(lengths)[2]  # the third shortest prompt fills it exactly: kept are the two shortest
    assert sorted(lengths)[1] < max_length
    ours = dpo_pairs(rows, tok, max_length=max_length)
    theirs = trl_prepared(tok, rows, max_length)
    assert len(ours) == 2
    assert [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in ours] == [
        (t["prompt_ids"], t["chosen_ids"], t["rejected_ids"]) for t in theirs
    ]


@pytest.mark.slow
@pytest.mark.parametrize("max_length", [None, 12, 20])
def test_dpo_samples_match_trls_collator(tok: Any, max_length: int | None) -> None:
    pytest.importorskip("trl")
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    pairs = dpo_pairs(trl_texts(), tok, max_length=None)
    collator = DataCollatorForPreference(pad_token_id=tok.pad_token_id, max_length=max_length)
    batch = collator(
        [
            {"prompt_ids": p.prompt_ids, "chosen_ids": p.chosen_ids, "rejected_ids": p.rejected_ids}
            for p in pairs
        ]
    )
    samples = [dpo_samples(p, max_length=max_length) for p in pairs]
    ours = [s for s, _ in samples] + [s for _, s in samples]  # TRL's batch: every chosen, then every rejected
    for row, sample in enumerate(ours):
        length = int(batch["attention_mask"][row].sum())
        ids = batch["input_ids"][row][:length].tolist()
        mask = batch["completion_mask"][row][:length].tolist()
        assert sample.input_ids == ids
        assert sample.labels == [token if bit else IGNORE_INDEX for token, bit in zip(ids, mask, strict=True)]


def legacy_trainer(name: str) -> Any:
    """TRL's ORPO trainer, or its CPO trainer (axolotl's ``rl: simpo``): both tokenize rows alike."""
    if name == "orpo":
        from trl.experimental.orpo.orpo_trainer import ORPOTrainer

        return ORPOTrainer
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    return CPOTrainer


@pytest.mark.slow
@pytest.mark.parametrize("trainer_name", ["orpo", "cpo"])
@pytest.mark.parametrize("which", ["tok", "chatml_tok"])
@pytest.mark.parametrize("max_length", [1024, 14])
def test_orpo_samples_match_trls_orpo_and_cpo_trainers(
    trainer_name: str, which: str, max_length: int, request: pytest.FixtureRequest
) -> None:
    pytest.importorskip("trl")
    cls = legacy_trainer(trainer_name)
    tokenizer = request.getfixturevalue(which)
    # tokenize_row reads only these attributes of the trainer
    trainer = SimpleNamespace(is_encoder_decoder=False, processing_class=tokenizer, max_length=max_length)
    trainer.build_tokenized_answer = partial(cls.build_tokenized_answer, trainer)
    compared = 0
    for where, pair in trl_texts():
        try:
            theirs = cls.tokenize_row(trainer, vars(pair))
        except ValueError:  # the prompt has more tokens than prompt + answer (the last row)
            with pytest.raises(ShardpoolError, match=rf"^{where}: the prompt has more tokens"):
                orpo_samples(pair, tokenizer, where, max_length=max_length)
            continue
        chosen, rejected = orpo_samples(pair, tokenizer, where, max_length=max_length)
        assert (chosen.input_ids, chosen.labels) == (theirs["chosen_input_ids"], theirs["chosen_labels"])
        assert (rejected.input_ids, rejected.labels) == (
            theirs["rejected_input_ids"],
            theirs["rejected_labels"],
        )
        assert chosen.attention_mask == theirs["chosen_attention_mask"]
        compared += 1
    assert compared == len(TRL_ROWS) - 1
