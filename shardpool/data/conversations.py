"""Conversation rows (``type: chat_template`` and ``type: sharegpt``) as lists of chat messages.

A row holds its messages under ``field_messages``; each message's properties are read from the
fields ``message_property_mappings`` names (``role`` and ``content`` at least), and each role
value is mapped through ``roles`` to the role the chat template sees, as axolotl does. sharegpt is
the same with other defaults: ``conversations`` of ``{"from", "value"}`` with human/gpt/system.

Every problem is one :class:`ShardpoolError` line naming the row (``file:line``) and the message;
nothing is rendered or tokenized here (see :mod:`shardpool.data.chat`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardpool.config import DatasetSpec
from shardpool.errors import ShardpoolError

__all__ = ["ChatSettings", "Message", "chat_settings", "conversation"]

#: One chat message as the template sees it: at least ``role`` and ``content``.
Message = dict[str, Any]

#: axolotl's default role mapping (source value -> role), used when ``roles`` is not set.
DEFAULT_ROLES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "system": "system",
    "tool": "tool",
}
#: Roles every chat template knows; a role value that is one of these passes unmapped.
STANDARD_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatSettings:
    """How one chat dataset's rows become messages and which turns are trained."""

    field_messages: str
    properties: dict[str, str]  # message property -> field of the source message
    roles: dict[str, str]  # source role value -> role
    roles_to_train: frozenset[str]
    train_on_eos: str
    train_on_eot: str
    drop_system_message: bool


def chat_settings(spec: DatasetSpec) -> ChatSettings:
    """The settings of a chat dataset, axolotl's defaults filled in (sharegpt's for ``type: sharegpt``)."""
    sharegpt = spec.type == "sharegpt"
    properties = dict(spec.message_property_mappings or {})
    properties.setdefault("role", spec.message_field_role or ("from" if sharegpt else "role"))
    properties.setdefault("content", spec.message_field_content or ("value" if sharegpt else "content"))
    if spec.roles:
        roles = {source: role for role, sources in spec.roles.items() for source in sources}
    else:
        roles = dict(DEFAULT_ROLES)
    to_train = ["assistant"] if spec.roles_to_train is None else spec.roles_to_train
    return ChatSettings(
        field_messages=spec.field_messages or ("conversations" if sharegpt else "messages"),
        properties=properties,
        roles=roles,
        roles_to_train=frozenset(roles.get(role, role) for role in to_train),
        train_on_eos=spec.train_on_eos or "turn",
        train_on_eot=spec.train_on_eot or spec.train_on_eos or "turn",
        drop_system_message=bool(spec.drop_system_message),
    )


def conversation(row: dict[str, Any], where: str, settings: ChatSettings) -> list[Message]:
    """The messages of one row, each with its role mapped; one line naming the row if anything is off."""
    raw = row.get(settings.field_messages)
    if raw is None:
        present = ", ".join(f"`{key}`" for key in list(row)[:5]) or "no fields"
        raise ShardpoolError(
            f"{where}: the row has no `{settings.field_messages}` (it has {present}); "
            "set `field_messages` on the dataset to the field that holds the messages"
        )
    if not isinstance(raw, list) or not raw:
        shown = "an empty list" if raw == [] else type(raw).__name__
        raise ShardpoolError(
            f"{where}: `{settings.field_messages}` must be a non-empty list of messages, got {shown}; fix the row"
        )
    messages = [_message(item, f"{where}: message {number}", settings) for number, item in enumerate(raw, 1)]
    if settings.drop_system_message and messages[0]["role"] == "system":
        messages = messages[1:]
    if not messages:
        raise ShardpoolError(f"{where}: the row holds only a system message; remove the row")
    return messages


def _message(item: Any, where: str, settings: ChatSettings) -> Message:
    """One source message as a template message: mapped properties, the role mapped to a known one."""
    if not isinstance(item, dict):
        raise ShardpoolError(f"{where}: expected a JSON object, got {type(item).__name__}; fix the row")
    message: Message = {}
    for prop, field in settings.properties.items():
        value = item.get(field)
        if value is not None:
            message[prop] = value
    for prop in ("role", "content"):
        field = settings.properties[prop]
        if prop not in message:
            raise ShardpoolError(
                f"{where}: has no `{field}` (its {prop}); give every message one, or set "
                f"`message_property_mappings: {{{prop}: FIELD}}` on the dataset"
            )
        if not isinstance(message[prop], str):
            raise ShardpoolError(
                f"{where}: `{field}` (its {prop}) must be a string, got {type(message[prop]).__name__}; "
                "content parts (lists) are not supported"
            )
    message["role"] = _role(message["role"], where, settings)
    return message


def _role(value: str, where: str, settings: ChatSettings) -> str:
    """The role ``value`` stands for: mapped through ``roles``, or already a known role."""
    if value in settings.roles:
        return settings.roles[value]
    if value in settings.roles.values() or value in STANDARD_ROLES:
        return value
    known = ", ".join(sorted(set(settings.roles) | set(STANDARD_ROLES)))
    raise ShardpoolError(
        f"{where}: unknown role {value!r} (known: {known}); map it on the dataset, e.g. "
        f"`roles: {{user: [{value}]}}`"
    )
