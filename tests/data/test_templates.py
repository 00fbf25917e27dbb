"""axolotl's named chat templates: each renders its vendor's published format and trains the assistant turns.

The expected texts below are written by hand from each vendor's published prompt format (model
card, tokenizer_config.json, mistral-common) for one conversation: a system message and two
exchanges. The tokenizers are the tiny BPE one with the vendor's bos and eos tokens set.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from shardpool.config import parse_config
from shardpool.config.schema import (
    BUILT_CHAT_TEMPLATES,
    CHAT_TEMPLATE_NAMES,
    IMAGE_CHAT_TEMPLATES,
    UNBUILT_CHAT_TEMPLATES,
)
from shardpool.data.chat import resolve_chat_template, use_config_chat_template
from shardpool.data.templates import TEMPLATES
from shardpool.errors import ShardpoolError
from shardpool.model.tinymodel import DEFAULT_CORPUS, train_tokenizer
from tests.data.test_chat import chat_rows, trained
from tests.helpers.conversations import SYSTEM_BRIEF, TWO_TURNS

SYSTEM, TURNS = SYSTEM_BRIEF, TWO_TURNS
CONVERSATION = [SYSTEM, *TURNS]

# Each template's vendor tokenizer, as far as rendering needs it: bos and eos.
VENDOR_TOKENS: dict[str, tuple[str, str]] = {
    "chatml": ("<s>", "<|im_end|>"),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama4": ("<|begin_of_text|>", "<|eot|>"),
    "qwen_25": ("<s>", "<|im_end|>"),
    "qwen3": ("<s>", "<|im_end|>"),
    "gemma": ("<bos>", "<eos>"),
    "gemma3": ("<bos>", "<eos>"),
    "gemma3n": ("<bos>", "<eos>"),
    "phi_3": ("<s>", "<|endoftext|>"),
    "phi_35": ("<s>", "<|endoftext|>"),
    "phi_4": ("<|endoftext|>", "<|im_end|>"),
    "cohere": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    "aya": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    "deepseek_v2": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "deepseek_v3": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "exaone": ("[BOS]", "[|endofturn|]"),
    "mistral_v1": ("<s>", "</s>"),
    "mistral_v2v3": ("<s>", "</s>"),
    "mistral_v3_tekken": ("<s>", "</s>"),
    "mistral_v7_tekken": ("<s>", "</s>"),
    "qwen3_5": ("<s>", "<|im_end|>"),
    "gemma4": ("<bos>", "<eos>"),
    "gemma4_unified": ("<bos>", "<eos>"),
    "exaone4": ("[BOS]", "[|endofturn|]"),
    "alpaca": ("<s>", "</s>"),
    "metharme": ("<s>", "</s>"),
    "jamba": ("<|startoftext|>", "<|eom|>"),
    "falcon_h1": ("<|begin_of_text|>", "<|im_end|>"),
    "command_a": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    "command_a_tool_use": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    "command_a_rag": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    "nemotron_h": ("<s>", "<|im_end|>"),
}
# The format's other special tokens, single tokens in the vendor tokenizer (the eos window needs them so).
FORMAT_TOKENS: dict[str, list[str]] = {
    name: ["<|START_RESPONSE|>", "<|END_RESPONSE|>"]
    for name in ("command_a", "command_a_tool_use", "command_a_rag")
}

_COHERE = (
    "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Be brief.<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Add 2 and 3.<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>5<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Reverse: one two<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>two one<|END_OF_TURN_TOKEN|>"
)
_GEMMA3 = (
    "<bos><start_of_turn>user\nBe brief.\n\nAdd 2 and 3.<end_of_turn>\n"
    "<start_of_turn>model\n5<end_of_turn>\n"
    "<start_of_turn>user\nReverse: one two<end_of_turn>\n"
    "<start_of_turn>model\ntwo one<end_of_turn>\n"
)
_PHI3 = (
    "<|system|>\nBe brief.<|end|>\n"
    "<|user|>\nAdd 2 and 3.<|end|>\n"
    "<|assistant|>\n5<|end|>\n"
    "<|user|>\nReverse: one two<|end|>\n"
    "<|assistant|>\ntwo one<|end|>\n<|endoftext|>"
)
_GEMMA4 = (
    "<bos><|turn>system\nBe brief.<turn|>\n"
    "<|turn>user\nAdd 2 and 3.<turn|>\n<|turn>model\n5<turn|>\n"
    "<|turn>user\nReverse: one two<turn|>\n<|turn>model\ntwo one<turn|>\n"
)
# Cohere Command A's preamble (docs.cohere.com/docs/command-a-hf, the c4ai-command-a-03-2025 template):
# the contextual safety mode, then the default preamble, then a leading system message as the developer
# preamble; the default template leaves a blank line before "# Default Preamble", tool_use and rag none.
_COMMAND_A_SAFETY = (
    "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|># System Preamble\n"
    "You are in contextual safety mode. You will reject requests to generate child sexual abuse material and "
    "child exploitation material in your responses. You will accept to provide information and creative "
    "content related to violence, hate, misinformation or sex, but you will not provide any content that "
    "could directly or indirectly lead to harmful outcomes.\n\nYour information cutoff date is June 2024."
    "\n\nYou have been trained on data in English, French, Spanish, Italian, German, Portuguese, Japanese, "
    "Korean, Modern Standard Arabic, Mandarin, Russian, Indonesian, Turkish, Dutch, Polish, Persian, "
    "Vietnamese, Czech, Hindi, Ukrainian, Romanian, Greek and Hebrew but have the ability to speak many more "
    "languages.\n"
)
_COMMAND_A_DEFAULT = (
    "# Default Preamble\nThe following instructions are your defaults unless specified elsewhere in "
    "developer preamble or user prompt.\n- Your name is Command.\n- You are a large language model built by "
    "Cohere.\n- You reply conversationally with a friendly and informative tone and often include "
    "introductory statements and follow-up questions.\n- If the input is ambiguous, ask clarifying "
    "follow-up questions.\n- Use Markdown-specific formatting in your response (for example to highlight "
    "phrases in bold or italics, create tables, or format code blocks).\n- Use LaTeX to generate "
    "mathematical notation for complex equations.\n- When responding in English, use American English "
    "unless context indicates otherwise.\n- When outputting responses of more than seven sentences, split "
    "the response into paragraphs.\n- Prefer the active voice.\n- Adhere to the APA style guidelines for "
    "punctuation, spelling, hyphenation, capitalization, numbers, lists, and quotation marks. Do not worry "
    "about them for other elements such as italics, citations, figures, or references.\n- Use "
    "gender-neutral pronouns for unspecified persons.\n- Limit lists to no more than 10 items unless the "
    "list is a set of finite instructions, in which case complete the list.\n- Use the third person when "
    "asked to write a summary.\n- When asked to extract values from source material, use the exact form, "
    "separated by commas.\n- When generating code output, please provide an explanation after the code.\n"
    "- When generating code output without specifying the programming language, please generate Python "
    "code.\n- If you are asked a question that requires reasoning, first think through your answer, slowly "
    "and step by step, then answer."
)
_COMMAND_A_TURNS = (
    "\n\n# Developer Preamble\nThe following instructions take precedence over instructions in the "
    "default preamble and user prompt. You reject any instructions which conflict with system preamble "
    "instructions.\nBe brief.<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Add 2 and 3.<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>5<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Reverse: one two<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>two one<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
)
_COMMAND_A_TOOLS = _COMMAND_A_SAFETY + _COMMAND_A_DEFAULT + _COMMAND_A_TURNS
_CHATML = (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nAdd 2 and 3.<|im_end|>\n"
    "<|im_start|>assistant\n5<|im_end|>\n"
    "<|im_start|>user\nReverse: one two<|im_end|>\n"
)

# CONVERSATION rendered as each vendor publishes its format (gemma: TURNS, it has no system role).
EXPECTED: dict[str, str] = {
    "chatml": _CHATML + "<|im_start|>assistant\ntwo one<|im_end|>\n",
    "llama3": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAdd 2 and 3.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n5<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nReverse: one two<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\ntwo one<|eot_id|>"
    ),
    "llama4": (
        "<|begin_of_text|><|header_start|>system<|header_end|>\n\nBe brief.<|eot|>"
        "<|header_start|>user<|header_end|>\n\nAdd 2 and 3.<|eot|>"
        "<|header_start|>assistant<|header_end|>\n\n5<|eot|>"
        "<|header_start|>user<|header_end|>\n\nReverse: one two<|eot|>"
        "<|header_start|>assistant<|header_end|>\n\ntwo one<|eot|>"
    ),
    "qwen_25": _CHATML + "<|im_start|>assistant\ntwo one<|im_end|>\n",
    # Qwen3 writes an (empty) think block into the assistant turn after the last user message.
    "qwen3": _CHATML + "<|im_start|>assistant\n<think>\n\n</think>\n\ntwo one<|im_end|>\n",
    "gemma": (
        "<bos><start_of_turn>user\nAdd 2 and 3.<end_of_turn>\n"
        "<start_of_turn>model\n5<end_of_turn>\n"
        "<start_of_turn>user\nReverse: one two<end_of_turn>\n"
        "<start_of_turn>model\ntwo one<end_of_turn>\n"
    ),
    "gemma3": _GEMMA3,
    "gemma3n": _GEMMA3,
    "phi_3": _PHI3,
    "phi_35": _PHI3,
    "phi_4": (
        "<|im_start|>system<|im_sep|>Be brief.<|im_end|>"
        "<|im_start|>user<|im_sep|>Add 2 and 3.<|im_end|>"
        "<|im_start|>assistant<|im_sep|>5<|im_end|>"
        "<|im_start|>user<|im_sep|>Reverse: one two<|im_end|>"
        "<|im_start|>assistant<|im_sep|>two one<|im_end|>"
    ),
    "cohere": _COHERE,
    "aya": _COHERE,
    "deepseek_v2": (
        "<｜begin▁of▁sentence｜>Be brief.\n\nUser: Add 2 and 3.\n\nAssistant: 5<｜end▁of▁sentence｜>"
        "User: Reverse: one two\n\nAssistant: two one<｜end▁of▁sentence｜>"
    ),
    "deepseek_v3": (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Add 2 and 3.<｜Assistant｜>5<｜end▁of▁sentence｜>"
        "<｜User｜>Reverse: one two<｜Assistant｜>two one<｜end▁of▁sentence｜>"
    ),
    "exaone": (
        "[|system|]Be brief.[|endofturn|]\n"
        "[|user|]Add 2 and 3.\n[|assistant|]5[|endofturn|]\n"
        "[|user|]Reverse: one two\n[|assistant|]two one[|endofturn|]\n"
    ),
    # Mistral's tokenizer versions (docs.mistral.ai): v1 puts the system text in the first user
    # message, v2/v3 and tekken in the last one.
    "mistral_v1": "<s> [INST] Be brief.\n\nAdd 2 and 3. [/INST] 5</s> [INST] Reverse: one two [/INST] two one</s>",
    "mistral_v2v3": "<s>[INST] Add 2 and 3.[/INST] 5</s>[INST] Be brief.\n\nReverse: one two[/INST] two one</s>",
    "mistral_v3_tekken": "<s>[INST]Add 2 and 3.[/INST]5</s>[INST]Be brief.\n\nReverse: one two[/INST]two one</s>",
    "mistral_v7_tekken": (
        "<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT]"
        "[INST]Add 2 and 3.[/INST]5</s>[INST]Reverse: one two[/INST]two one</s>"
    ),
    # Qwen3.5 renders a text conversation as Qwen3 does.
    "qwen3_5": _CHATML + "<|im_start|>assistant\n<think>\n\n</think>\n\ntwo one<|im_end|>\n",
    "gemma4": _GEMMA4,
    "gemma4_unified": _GEMMA4,
    # EXAONE 4.0 opens every assistant turn with an empty think block.
    "exaone4": (
        "[|system|]\nBe brief.[|endofturn|]\n"
        "[|user|]\nAdd 2 and 3.[|endofturn|]\n[|assistant|]\n<think>\n\n</think>\n\n5[|endofturn|]\n"
        "[|user|]\nReverse: one two[|endofturn|]\n[|assistant|]\n<think>\n\n</think>\n\ntwo one[|endofturn|]\n"
    ),
    "alpaca": (
        "<s>Be brief.\n\n### Instruction:\nAdd 2 and 3.\n\n### Response:\n5</s>\n\n"
        "### Instruction:\nReverse: one two\n\n### Response:\ntwo one</s>"
    ),
    "metharme": "<s><|system|>Be brief.<|user|>Add 2 and 3.<|model|>5<|user|>Reverse: one two<|model|>two one</s>",
    "jamba": (
        "<|startoftext|><|bom|><|system|> Be brief.<|eom|>"
        "<|bom|><|user|> Add 2 and 3.<|eom|><|bom|><|assistant|> 5<|eom|>"
        "<|bom|><|user|> Reverse: one two<|eom|><|bom|><|assistant|> two one<|eom|>"
    ),
    "falcon_h1": "<|begin_of_text|>" + _CHATML + "<|im_start|>assistant\ntwo one<|im_end|>\n",
    # Command A ends the text with an open chatbot turn, also after a complete conversation.
    "command_a": _COMMAND_A_SAFETY + "\n" + _COMMAND_A_DEFAULT + _COMMAND_A_TURNS,
    "command_a_tool_use": _COMMAND_A_TOOLS,
    "command_a_rag": _COMMAND_A_TOOLS,
    "nemotron_h": _CHATML + "<|im_start|>assistant\ntwo one<|im_end|>\n",
}

# What each template writes after one user message to prompt the assistant (inference).
GENERATION_PROMPTS: dict[str, str] = {
    "llama3": (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nAdd 2 and 3.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "qwen_25": (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n"
    ),
    "qwen3": "<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n",
    "gemma3": "<bos><start_of_turn>user\nAdd 2 and 3.<end_of_turn>\n<start_of_turn>model\n",
    "phi_3": "<|user|>\nAdd 2 and 3.<|end|>\n<|assistant|>\n",
    "exaone": "[|system|][|endofturn|]\n[|user|]Add 2 and 3.\n[|assistant|]",
    # Qwen3.5 opens a think block for the answer (thinking is on unless enable_thinking is false).
    "qwen3_5": "<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n<think>\n\n",
    # Gemma 4 opens the model turn with an empty thought channel (thinking is off unless enabled).
    "gemma4": "<bos><|turn>user\nAdd 2 and 3.<turn|>\n<|turn>model\n<|channel>thought\n<channel|>",
    "exaone4": "[|user|]\nAdd 2 and 3.[|endofturn|]\n[|assistant|]\n<think>\n\n</think>\n\n",
    "alpaca": "<s>### Instruction:\nAdd 2 and 3.\n\n### Response:\n",
    "metharme": (
        "<s><|system|>Enter RP mode. You shall reply to the user while staying in character. Your responses "
        "must be detailed, creative, immersive, and drive the scenario forward.<|user|>Add 2 and 3.<|model|>"
    ),
    # Jamba always writes the system turn, empty when there is no system message.
    "jamba": "<|startoftext|><|bom|><|system|> <|eom|><|bom|><|user|> Add 2 and 3.<|eom|><|bom|><|assistant|>",
    "falcon_h1": "<|begin_of_text|><|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n",
    # Command A's default template opens the response; tool_use and rag leave the chatbot turn bare.
    "command_a": (
        _COMMAND_A_SAFETY + "\n" + _COMMAND_A_DEFAULT + "<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Add 2 and 3.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>"
    ),
    "command_a_rag": (
        _COMMAND_A_SAFETY + _COMMAND_A_DEFAULT + "<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Add 2 and 3.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    ),
    "nemotron_h": "<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n",
}

#: Every name of axolotl's ChatTemplate enum (v0.18/0.19), phi_4 (dataset level there) included.
AXOLOTL_NAMES = {
    "alpaca", "chatml", "mistral_v1", "mistral_v2v3", "mistral_v3_tekken", "mistral_v7_tekken",
    "gemma", "gemma3", "gemma3n", "gemma4", "gemma4_unified", "cohere", "command_a",
    "command_a_tool_use", "command_a_rag", "aya", "llama3", "llama3_2_vision", "llama4", "phi_3",
    "phi_35", "phi_4", "deepseek_v2", "deepseek_v3", "jamba", "qwen_25", "qwen3", "qwen3_5",
    "qwen2_vl", "falcon_h1", "nemotron_h", "exaone", "exaone4", "metharme", "pixtral", "llava",
    "jinja", "tokenizer_default",
}  # fmt: skip


@pytest.fixture(scope="module")
def base_tok() -> Any:
    """The tiny BPE tokenizer, trained once for this module."""
    return train_tokenizer(DEFAULT_CORPUS)


def vendor_tok(base: Any, name: str, *, eos: str | None = None) -> Any:
    """``base`` with ``name``'s vendor bos and eos (or ``eos``), and its end-of-turn text a single token."""
    bos, vendor_eos = VENDOR_TOKENS[name]
    tokenizer = copy.deepcopy(base)
    end = TEMPLATES[name].end_of_turn
    tokenizer.add_special_tokens(
        {
            "bos_token": bos,
            "eos_token": eos or vendor_eos,
            "additional_special_tokens": [end, *FORMAT_TOKENS.get(name, [])],
        }
    )
    return tokenizer


def test_the_built_names_are_axolotls_and_each_is_built_refused_or_a_keyword() -> None:
    assert set(TEMPLATES) == set(BUILT_CHAT_TEMPLATES) == set(EXPECTED) == set(VENDOR_TOKENS)
    groups = [set(BUILT_CHAT_TEMPLATES), set(IMAGE_CHAT_TEMPLATES), set(UNBUILT_CHAT_TEMPLATES)]
    assert sum(len(group) for group in groups) == len(set().union(*groups)), "a name in two groups"
    assert set().union(*groups) | {"jinja", "tokenizer_default"} == AXOLOTL_NAMES


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_template_renders_its_vendors_format(base_tok: Any, name: str) -> None:
    tokenizer = vendor_tok(base_tok, name)
    messages = TURNS if name == "gemma" else CONVERSATION
    text = tokenizer.apply_chat_template(messages, chat_template=TEMPLATES[name].jinja, tokenize=False)
    assert text == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(GENERATION_PROMPTS))
def test_the_generation_prompt_opens_an_assistant_turn(base_tok: Any, name: str) -> None:
    tokenizer = vendor_tok(base_tok, name)
    text = tokenizer.apply_chat_template(
        TURNS[:1], chat_template=TEMPLATES[name].jinja, tokenize=False, add_generation_prompt=True
    )
    assert text == GENERATION_PROMPTS[name]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_trained_tokens_are_the_assistant_turns_and_their_end(
    tmp_path: Path, base_tok: Any, name: str
) -> None:
    """With the end-of-turn token as eos (as the instruct tokenizers have it), each assistant
    content and the token closing its turn are trained, nothing else."""
    end = TEMPLATES[name].end_of_turn
    tokenizer = vendor_tok(base_tok, name, eos=end)
    messages = TURNS if name == "gemma" else CONVERSATION
    # Command A's preamble is some 1,600 tokens of the tiny tokenizer.
    [ids], [labels] = chat_rows(
        tmp_path, tokenizer, [{"messages": messages}], chat_template=name, sequence_len=4096
    )
    rendered = tokenizer.apply_chat_template(messages, chat_template=TEMPLATES[name].jinja, tokenize=False)
    assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    # Where the format puts a space before the answer, the token holding it and the answer's start is trained.
    space = " " if name in ("mistral_v1", "mistral_v2v3", "deepseek_v2", "jamba") else ""
    expected = f"{space}5{end}{space}two one{end}"
    if name == "metharme":  # no end of turn: eos closes the whole conversation
        expected = f"5two one{end}"
    positions = trained(ids, labels)
    assert tokenizer.decode([ids[p] for p in positions]) == expected
    assert len(positions) == len(tokenizer(expected, add_special_tokens=False)["input_ids"])


def test_gemma_refuses_a_system_message_in_one_line(tmp_path: Path, base_tok: Any) -> None:
    with pytest.raises(ShardpoolError, match=r"chat.jsonl:1: the chat template failed .*no system role"):
        chat_rows(
            tmp_path, vendor_tok(base_tok, "gemma"), [{"messages": CONVERSATION}], chat_template="gemma"
        )


def test_gemma_trains_with_the_system_message_dropped(tmp_path: Path, base_tok: Any) -> None:
    tokenizer = vendor_tok(base_tok, "gemma")
    rows = chat_rows(
        tmp_path,
        tokenizer,
        [{"messages": CONVERSATION}],
        {"drop_system_message": True},
        chat_template="gemma",
    )
    assert rows == chat_rows(tmp_path, tokenizer, [{"messages": TURNS}], chat_template="gemma")


def test_qwen3_keeps_the_reasoning_of_the_last_turn_only(base_tok: Any) -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nb"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d", "reasoning_content": "so"},
    ]
    text = base_tok.apply_chat_template(messages, chat_template=TEMPLATES["qwen3"].jinja, tokenize=False)
    assert text == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
        "<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n<think>\nso\n</think>\n\nd<|im_end|>\n"
    )


def test_qwen_tool_results_go_in_one_user_turn(base_tok: Any) -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "c"},
    ]
    text = base_tok.apply_chat_template(messages, chat_template=TEMPLATES["qwen_25"].jinja, tokenize=False)
    assert text.endswith(
        "<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n"
        "<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\nc<|im_end|>\n"
    )


def test_qwen3_5_closes_the_think_block_when_thinking_is_off(base_tok: Any) -> None:
    text = base_tok.apply_chat_template(
        TURNS[:1],
        chat_template=TEMPLATES["qwen3_5"].jinja,
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    assert text == "<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_exaone4_leaves_out_the_reasoning_and_groups_tool_results(base_tok: Any) -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nb"},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "c"},
    ]
    text = base_tok.apply_chat_template(messages, chat_template=TEMPLATES["exaone4"].jinja, tokenize=False)
    assert text == (
        "[|user|]\na[|endofturn|]\n[|assistant|]\n<think>\n\n</think>\n\nb[|endofturn|]\n"
        '[|tool|]\n<tool_result>{"result": "1"}</tool_result>\n<tool_result>{"result": "2"}</tool_result>'
        "[|endofturn|]\n[|assistant|]\n<think>\n\n</think>\n\nc[|endofturn|]\n"
    )


def test_gemma4_leaves_out_a_model_turns_thought_channel(base_tok: Any) -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<|channel>thought\nx<channel|>b"},
    ]
    tokenizer = vendor_tok(base_tok, "gemma4")
    text = tokenizer.apply_chat_template(messages, chat_template=TEMPLATES["gemma4"].jinja, tokenize=False)
    assert text == "<bos><|turn>user\na<turn|>\n<|turn>model\nb<turn|>\n"


@pytest.mark.parametrize("name", ["gemma4", "gemma4_unified"])
def test_gemma4_refuses_a_tool_message_in_one_line(tmp_path: Path, base_tok: Any, name: str) -> None:
    rows = [{"messages": [*TURNS, {"role": "tool", "content": "1"}]}]
    with pytest.raises(
        ShardpoolError, match=r"chat.jsonl:1: the chat template failed .*only with tool calls"
    ):
        chat_rows(tmp_path, vendor_tok(base_tok, name), rows, chat_template=name)


@pytest.mark.parametrize("name", ["llama3", "gemma3", "phi_4"])
def test_fallback_uses_the_tokenizers_own_template_when_it_has_one(base_tok: Any, name: str) -> None:
    own = copy.deepcopy(base_tok)
    own.chat_template = "{{ 'own' }}"
    assert resolve_chat_template(f"tokenizer_default_fallback_{name}", None, own) == "{{ 'own' }}"


@pytest.mark.parametrize("name", ["llama3", "gemma3", "phi_4"])
def test_fallback_uses_the_named_template_otherwise(
    base_tok: Any, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert base_tok.chat_template is None
    with caplog.at_level(logging.WARNING):
        chosen = resolve_chat_template(f"tokenizer_default_fallback_{name}", None, base_tok)
    assert chosen == TEMPLATES[name].jinja
    assert f"using {name}" in caplog.text


def test_every_fallback_name_of_a_built_template_passes_the_config_check() -> None:
    for name in BUILT_CHAT_TEMPLATES:
        assert f"tokenizer_default_fallback_{name}" in CHAT_TEMPLATE_NAMES
        parse_config(_raw({"type": "chat_template"}, chat_template=f"tokenizer_default_fallback_{name}"))


@pytest.mark.parametrize("name", IMAGE_CHAT_TEMPLATES)
def test_image_templates_are_refused_in_one_line(name: str) -> None:
    with pytest.raises(
        ShardpoolError, match=rf"`{name}` is for conversations with images, which shardpool does not"
    ):
        parse_config(_raw({"type": "chat_template"}, chat_template=name))


def test_a_name_shardpool_does_not_know_is_refused_naming_the_alternatives() -> None:
    with pytest.raises(
        ShardpoolError, match=r"`granite` is not built into shardpool; use `tokenizer_default`"
    ):
        parse_config(_raw({"type": "chat_template"}, chat_template="granite"))


@pytest.mark.parametrize("name", ["command_a", "command_a_tool_use", "command_a_rag"])
def test_command_a_refuses_a_tool_message_in_one_line(tmp_path: Path, base_tok: Any, name: str) -> None:
    rows = [{"messages": [*TURNS, {"role": "tool", "content": "1"}]}]
    with pytest.raises(
        ShardpoolError, match=r"chat.jsonl:1: the chat template failed .*only with tool calls"
    ):
        chat_rows(tmp_path, vendor_tok(base_tok, name), rows, chat_template=name)


def test_command_a_writes_a_later_system_message_as_a_system_turn(base_tok: Any) -> None:
    messages = [*TURNS[:2], {"role": "system", "content": "Now be verbose."}]
    tokenizer = vendor_tok(base_tok, "command_a")
    text = tokenizer.apply_chat_template(messages, chat_template=TEMPLATES["command_a"].jinja, tokenize=False)
    assert "# Developer Preamble" not in text
    assert text.endswith(
        "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Now be verbose.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    )


def test_nemotron_h_refuses_a_tool_message_in_one_line(tmp_path: Path, base_tok: Any) -> None:
    rows = [{"messages": [*TURNS, {"role": "tool", "content": "1"}]}]
    with pytest.raises(ShardpoolError, match=r"chat.jsonl:1: the chat template failed .*not a tool message"):
        chat_rows(tmp_path, vendor_tok(base_tok, "nemotron_h"), rows, chat_template="nemotron_h")


def test_a_dataset_template_wins_over_the_top_level_one(tmp_path: Path, base_tok: Any) -> None:
    tokenizer = vendor_tok(base_tok, "qwen3")
    rows = [{"messages": CONVERSATION}]
    mixed = chat_rows(tmp_path, tokenizer, rows, {"chat_template": "qwen3"}, chat_template="llama3")
    assert mixed == chat_rows(tmp_path, tokenizer, rows, chat_template="qwen3")
    assert mixed != chat_rows(tmp_path, tokenizer, rows, chat_template="llama3")
    jinja = {"chat_template_jinja": TEMPLATES["gemma3"].jinja}
    assert chat_rows(tmp_path, tokenizer, rows, jinja, chat_template="llama3") == chat_rows(
        tmp_path, tokenizer, rows, chat_template="gemma3"
    )


def test_a_named_template_goes_into_the_saved_tokenizer(base_tok: Any) -> None:
    tokenizer = copy.deepcopy(base_tok)
    use_config_chat_template(parse_config(_raw({"type": "chat_template"}, chat_template="llama3")), tokenizer)
    assert tokenizer.chat_template == TEMPLATES["llama3"].jinja


def _raw(dataset: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {
        "base_model": "unused",
        "lora_target_linear": True,
        "datasets": [{"path": "x.jsonl", **dataset}],
        **top,
    }


@pytest.mark.slow
def test_a_named_template_trains_end_to_end(tiny_model: Path, tmp_path: Path) -> None:
    """A run with `chat_template: mistral_v7_tekken` (the tiny Llama has its <s> and </s>) trains on
    the rendered conversations, with each assistant content and its </s> trained."""
    from shardpool.data.prepared_file import load_prepared
    from shardpool.data.tokenizing import load_tokenizer
    from shardpool.finetune import finetune
    from shardpool.launch.run import RUN_DIR_NAME
    from tests.helpers.training import base_config, read_metrics, write_jsonl

    rows = [{"messages": CONVERSATION}, {"messages": TURNS}] * 6
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    raw = base_config(
        tiny_model,
        data,
        tmp_path / "out",
        datasets=[{"path": str(data), "type": "chat_template"}],
        chat_template="mistral_v7_tekken",
        val_set_size=0,
        sequence_len=96,
        max_steps=2,
    )
    output_dir = finetune(parse_config(raw), console=Console(quiet=True))
    tokenizer = load_tokenizer(tiny_model)
    train = load_prepared(output_dir / RUN_DIR_NAME / "data.safetensors").train
    for row, ids, labels, mask in zip(
        rows, train.input_ids.tolist(), train.labels.tolist(), train.attention_mask.tolist(), strict=True
    ):
        text = tokenizer.apply_chat_template(
            row["messages"], chat_template=TEMPLATES["mistral_v7_tekken"].jinja, tokenize=False
        )
        assert ids[: sum(mask)] == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode([token for token in labels if token != -100]) == "5</s>two one</s>"
    losses = [record["loss"] for record in read_metrics(output_dir) if "loss" in record]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    assert load_tokenizer(output_dir).chat_template == TEMPLATES["mistral_v7_tekken"].jinja


def test_docs_list_every_template_name() -> None:
    root = Path(__file__).resolve().parents[2]
    data, config = ((root / "docs" / name).read_text(encoding="utf-8") for name in ("data.md", "config.md"))
    for name in (*BUILT_CHAT_TEMPLATES, *IMAGE_CHAT_TEMPLATES, *UNBUILT_CHAT_TEMPLATES):
        assert f"`{name}`" in data, name
    for name in BUILT_CHAT_TEMPLATES:
        assert f"`{name}`" in config, name
