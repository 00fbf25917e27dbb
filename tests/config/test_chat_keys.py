"""The chat keys of a config: chat datasets, their mappings and the chat template, checked before torch."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from shardpool.config import parse_config
from shardpool.errors import ShardpoolError

BASE: dict[str, Any] = {"base_model": "m", "lora_target_linear": True}


def _config(dataset: dict[str, Any], **top: Any) -> Any:
    return parse_config({**BASE, "datasets": [{"path": "d.jsonl", **dataset}], **top})


def _error(dataset: dict[str, Any], **top: Any) -> str:
    with pytest.raises(ShardpoolError) as caught:
        _config(dataset, **top)
    return str(caught.value)


def test_axolotls_documented_chat_config_validates() -> None:
    """The migration example of axolotl's docs/dataset-formats/conversation.qmd, paths changed."""
    raw = yaml.safe_load(
        """
base_model: m
lora_target_linear: true
chat_template: chatml
datasets:
  - path: data/chat.jsonl
    type: chat_template
    field_messages: conversations
    message_property_mappings:
      role: from
      content: value
    roles_to_train: ["assistant"]
    train_on_eos: turn
    roles:
      user: [human]
      assistant: [gpt]
  - path: data/old.jsonl
    type: sharegpt
"""
    )
    config = parse_config(raw)
    chat, sharegpt = config.datasets
    assert config.chat_template == "chatml"
    assert chat.message_property_mappings == {"role": "from", "content": "value"}
    assert chat.roles == {"user": ["human"], "assistant": ["gpt"]} and chat.is_chat and sharegpt.is_chat


@pytest.mark.parametrize(
    "top",
    [
        {"chat_template": "tokenizer_default"},
        {"chat_template": "tokenizer_default_fallback_chatml"},
        {"chat_template": "nemotron_h"},
        {"chat_template": "tokenizer_default_fallback_command_a_rag"},
        {"chat_template": "jinja", "chat_template_jinja": "{{ messages }}"},
        {"chat_template_jinja": "templates/mine.jinja"},
        {"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"},
        {"chat_template": None, "chat_template_jinja": None},
    ],
)
def test_chat_template_choices(top: dict[str, Any]) -> None:
    _config({"type": "chat_template"}, **top)


@pytest.mark.parametrize(
    ("dataset", "top", "expected"),
    [
        (
            {"type": "alpaca", "roles_to_train": ["assistant"]},
            {},
            "`roles_to_train` only applies to `type: chat_template`",
        ),
        ({"field_messages": "messages"}, {}, "`field_messages` only applies to"),
        (
            {"type": "chat_template"},
            {"chat_template": "granite"},
            "chat_template `granite` is not built into shardpool",
        ),
        (
            {"type": "chat_template", "chat_template": "tokenizer_default_fallback_granite"},
            {},
            "`datasets[0]`: chat_template `tokenizer_default_fallback_granite` is not built",
        ),
        (
            {"type": "chat_template", "chat_template": "llava"},
            {},
            "`datasets[0]`: chat_template `llava` is for conversations with images, which shardpool does not support",
        ),
        (
            {"type": "chat_template"},
            {"chat_template": "tokenizer_default_fallback_qwen2_vl"},
            "chat_template `tokenizer_default_fallback_qwen2_vl` is for conversations with images",
        ),
        ({"type": "chat_template"}, {"chat_template": "jinja"}, "`chat_template: jinja` needs the template"),
        (
            {"type": "chat_template"},
            {"chat_template": "chatml", "chat_template_jinja": "{{ x }}"},
            "`chat_template_jinja` is used only with `chat_template: jinja`",
        ),
        (
            {
                "type": "chat_template",
                "message_field_role": "from",
                "message_property_mappings": {"role": "speaker"},
            },
            {},
            "`message_field_role: from` and `message_property_mappings.role: speaker` disagree",
        ),
        ({"type": "chat_template", "train_on_eos": "always"}, {}, "`datasets[0].train_on_eos`"),
        ({"type": "chat_template", "train_on_eot": "always"}, {}, "`datasets[0].train_on_eot`"),
        (
            {"type": "completion", "train_on_eot": "turn"},
            {},
            "`train_on_eot` only applies to `type: chat_template`",
        ),
        ({"type": "chat_template", "roles": {"user": "human"}}, {}, "`datasets[0].roles.user`"),
        (
            {"type": "chat_template", "message_field_training": "train"},
            {},
            "`datasets[0].message_field_training`",
        ),
        ({"type": "sharegpt", "conversation": "chatml"}, {}, "set `chat_template: chatml`"),
        (
            {"type": "chat_template"},
            {"chat_template_kwargs": {"x": 1}},
            "`chat_template_kwargs` is not supported",
        ),
    ],
)
def test_bad_chat_keys_are_one_line(dataset: dict[str, Any], top: dict[str, Any], expected: str) -> None:
    message = _error(dataset, **top)
    assert expected in message and "\n" not in message


@pytest.mark.parametrize(
    "dataset",
    [
        {
            "type": "chat_template",
            "message_field_training_detail": None,
            "message_field_training": None,
            "conversation": None,
        },
        {"type": "sharegpt", "field_tools": "", "split_thinking": None},
    ],
)
def test_unbuilt_chat_keys_are_accepted_when_off(dataset: dict[str, Any]) -> None:
    kept = {key: value for key, value in dataset.items() if key == "type"}
    assert _config(dataset) == _config(kept)


def test_axolotls_documented_eot_config_validates() -> None:
    """The eot example of axolotl's docs/dataset-formats/conversation.qmd, path changed."""
    raw = yaml.safe_load(
        """
base_model: m
lora_target_linear: true
eot_tokens:
  - "[/INST]"
datasets:
  - path: data/chat.jsonl
    type: chat_template
    train_on_eos: last
    train_on_eot: turn
"""
    )
    config = parse_config(raw)
    assert config.eot_tokens == ["[/INST]"]
    assert (config.datasets[0].train_on_eos, config.datasets[0].train_on_eot) == ("last", "turn")


def test_chat_keys_default_to_null() -> None:
    dataset = _config({"type": "chat_template"}).datasets[0]
    assert (dataset.roles_to_train, dataset.train_on_eos, dataset.field_messages) == (None, None, None)
