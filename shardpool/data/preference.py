"""Preference datasets (``rl: dpo | ipo | simpo | orpo``): rows as prompt, chosen and rejected text, then tokens.

Each dataset ``type`` turns one row into three strings exactly as axolotl's prompt strategy of the
same name does (``src/axolotl/prompt_strategies/dpo/*.py`` and ``orpo/chat_template.py``):

* ``chatml.*`` and ``llama3.*`` (``default``, ``intel``, ``icr``, ``prompt_pairs``, ``ultra``,
  ``argilla_chat``) write the prompt in that format themselves, with the system message when the
  row has a non-empty one, and end both answers with the format's end-of-turn text;
* ``chat_template.default`` and ``chat_template.argilla_chat`` render messages through the chat
  template (a :data:`Render` function): the prompt with the generation prompt, each answer as the
  text from its content to the end of its turn, trailing whitespace removed;
* ``user_defined.default`` (the dataset's ``type`` given as a mapping) fills ``prompt_format``,
  ``chosen_format`` and ``rejected_format`` with the row's fields;
* under ``rl: orpo`` the only type is ``chat_template.argilla``: every earlier turn of ``chosen``
  becomes the prompt, each answer is what its full rendering adds after the prompt.

The strings are then tokenized as TRL 1.16 does: :func:`dpo_pairs` and :func:`dpo_samples` as its
``DPOTrainer`` (``rl: dpo``, ``ipo``: ``_prepare_dataset`` and ``DataCollatorForPreference``),
:func:`orpo_samples` as its ORPO and CPO trainers (``rl: orpo``, and ``simpo``, which axolotl trains
with CPO; both ``tokenize_row`` alike). :func:`fits_sequence_len` is axolotl's own length filter,
applied before TRL's. Every problem is one :class:`ShardpoolError` line naming the row
(``file:line``), the type and what is missing.
"""

from __future__ import annotations

import logging
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardpool.config.schema import PREFERENCE_TYPES
from shardpool.data.conversations import Message
from shardpool.data.rows import IGNORE_INDEX, Sample
from shardpool.errors import ShardpoolError

__all__ = [
    "DPO_TYPES",
    "ORPO_TYPES",
    "PreferenceFormat",
    "PreferencePair",
    "PreferenceTexts",
    "Render",
    "chat_template_renderer",
    "dpo_pairs",
    "dpo_samples",
    "fits_sequence_len",
    "orpo_samples",
    "preference_format",
    "preference_texts",
    "with_eos",
]

log = logging.getLogger(__name__)

#: Renders messages to text with the chat template: ``render(messages, add_generation_prompt)``.
Render = Callable[[list[Message], bool], str]

_VARIANTS = ("default", "intel", "icr", "prompt_pairs", "ultra", "argilla_chat")
#: The types of ``rl: dpo``, ``ipo`` and ``simpo`` (a mapping ``type`` means ``user_defined.default``).
#: The types of ``rl: orpo``.
ORPO_TYPES: tuple[str, ...] = ("chat_template.argilla",)
DPO_TYPES: tuple[str, ...] = tuple(name for name in PREFERENCE_TYPES if name not in ORPO_TYPES)

# axolotl's chat_template strategy renders each answer after this user message, then cuts before the answer.
_DUMMY_USER = "[[dummy_message]]"
# Stands in for an answer's content; private-use characters, so no content starts with both.
_PLACEHOLDERS = ("\ue000\ue001", "\ue002\ue003")
# axolotl's default role mapping for preference datasets: each role stands only for itself.
_DEFAULT_ROLES = {role: role for role in ("user", "assistant", "system", "tool")}


@dataclass(frozen=True)
class PreferenceTexts:
    """One row as TRL reads a preference example: the prompt and the two answers that follow it."""

    prompt: str
    chosen: str
    rejected: str


@dataclass(frozen=True)
class PreferenceFormat:
    """How one dataset's rows become :class:`PreferenceTexts`: its type and the fields it reads."""

    type: str
    field_messages: str = "messages"
    field_chosen: str = "chosen"
    field_rejected: str = "rejected"
    role_field: str = "role"
    content_field: str = "content"
    roles: dict[str, str] = field(default_factory=lambda: dict(_DEFAULT_ROLES))  # source value -> role
    user_defined: dict[str, str] = field(default_factory=dict)  # user_defined.default's fields and formats

    @property
    def renders(self) -> bool:
        """Whether rows of this type are rendered with the chat template (a :data:`Render` is needed)."""
        return self.type.startswith("chat_template.")


@dataclass(frozen=True)
class PreferencePair:
    """One row tokenized as TRL's DPOTrainer tokenizes it; the answers follow ``prompt_ids``."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    where: str


def preference_format(entry: Mapping[str, Any], rl: str) -> PreferenceFormat:
    """The format of the dataset ``entry`` (its keys as in the config) under ``rl``, as axolotl reads it.

    A one-part ``type`` means its ``.default``; a mapping means ``user_defined.default``. Keys set to
    None count as absent. ``message_field_role`` / ``message_field_content`` are the older spelling
    of ``message_property_mappings``.
    """
    raw_type = entry.get("type")
    if isinstance(raw_type, Mapping):
        if rl == "orpo":
            raise ShardpoolError(
                "a dataset `type` given as a mapping (user_defined.default) is for rl: dpo, ipo or simpo; "
                "under rl: orpo use `type: chat_template.argilla`"
            )
        return PreferenceFormat("user_defined.default", user_defined=_user_defined(raw_type))
    if not isinstance(raw_type, str) or not raw_type:
        raise ShardpoolError(
            f"a preference dataset needs a `type` (rl: {rl}); one of {', '.join(_known(rl))}, or a mapping"
        )
    name = raw_type if "." in raw_type else f"{raw_type}.default"
    # axolotl's docs still list these two; its code reads their rows' shape in `.default`.
    if rl != "orpo" and name in ("chatml.argilla", "llama3.argilla"):
        raise ShardpoolError(
            f"`type: {raw_type}` no longer exists in axolotl; `{name.split('.')[0]}.default` reads rows with "
            "instruction, chosen_response and rejected_response"
        )
    if name not in _known(rl):
        raise ShardpoolError(
            f"unknown preference dataset type `{raw_type}` for rl: {rl}; use one of {', '.join(_known(rl))}"
        )
    mappings = dict(entry.get("message_property_mappings") or {})
    for prop in ("role", "content"):
        legacy = entry.get(f"message_field_{prop}")
        if legacy is not None and mappings.get(prop, legacy) != legacy:
            raise ShardpoolError(
                f"`message_field_{prop}: {legacy}` conflicts with `message_property_mappings.{prop}: "
                f"{mappings[prop]}`; keep only message_property_mappings"
            )
        mappings.setdefault(prop, legacy or prop)
    roles = entry.get("roles")
    return PreferenceFormat(
        name,
        field_messages=entry.get("field_messages") or "messages",
        field_chosen=entry.get("field_chosen") or "chosen",
        field_rejected=entry.get("field_rejected") or "rejected",
        role_field=mappings["role"],
        content_field=mappings["content"],
        roles={source: role for role, sources in roles.items() for source in sources}
        if roles
        else dict(_DEFAULT_ROLES),
    )


def _known(rl: str) -> tuple[str, ...]:
    return ORPO_TYPES if rl == "orpo" else DPO_TYPES


def _user_defined(spec: Mapping[str, Any]) -> dict[str, str]:
    """user_defined.default's field names and formats, axolotl's defaults filled in, each format checked."""
    settings = {
        "field_prompt": spec.get("field_prompt") or "prompt",
        "field_system": spec.get("field_system") or "system",
        "field_chosen": spec.get("field_chosen") or "chosen",
        "field_rejected": spec.get("field_rejected") or "rejected",
        "prompt_format": spec.get("prompt_format") or "{prompt}",
        "chosen_format": spec.get("chosen_format") or "{chosen}",
        "rejected_format": spec.get("rejected_format") or "{rejected}",
    }
    allowed = {
        "prompt_format": {"prompt", "system"},
        "chosen_format": {"chosen"},
        "rejected_format": {"rejected"},
    }
    for key, names in allowed.items():
        try:
            used = {name for _, name, _, _ in string.Formatter().parse(settings[key]) if name is not None}
        except ValueError as error:
            raise ShardpoolError(
                f"user_defined `{key}` {settings[key]!r} is not a valid format ({error})"
            ) from None
        if not used <= names:
            wrong = ", ".join(sorted("{" + name + "}" for name in used - names))
            raise ShardpoolError(
                f"user_defined `{key}` uses {wrong}; it may use only {', '.join('{' + n + '}' for n in sorted(names))}"
            )
    return settings


def preference_texts(
    row: Mapping[str, Any], where: str, fmt: PreferenceFormat, render: Render | None = None
) -> PreferenceTexts:
    """The prompt, chosen and rejected text of one row, as axolotl's strategy for ``fmt.type`` makes them.

    ``render`` is needed by the ``chat_template.*`` types (see :func:`chat_template_renderer`).
    """
    family, variant = fmt.type.split(".")
    if fmt.renders:
        if render is None:
            raise ShardpoolError(
                f"`type: {fmt.type}` renders rows with the chat template, but none was given"
            )
        if fmt.type == "chat_template.argilla":
            return _orpo_argilla(row, where, fmt, render)
        return _chat_template(row, where, fmt, render, argilla=variant == "argilla_chat")
    if family == "user_defined":
        return _user_defined_texts(row, where, fmt)
    return _written(row, where, fmt.type, _CHATML if family == "chatml" else _LLAMA3, variant)


@dataclass(frozen=True)
class _Format:
    """A prompt format the chatml.* / llama3.* strategies write by hand."""

    system: str  # holds {text}
    user: str  # holds {text}; ends with the assistant header
    end: str  # closes each answer


_CHATML = _Format(
    system="<|im_start|>system\n{text}<|im_end|>\n",
    user="<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
    end="<|im_end|>",
)
_LLAMA3 = _Format(
    system="<|start_header_id|>system<|end_header_id|>\n\n{text}<|eot_id|>",
    user="<|start_header_id|>user<|end_header_id|>\n\n{text}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    end="<|eot_id|>",
)
# Where each variant reads the user text; "default" takes the first of these fields the row has.
_PROMPT_FIELDS = {
    "intel": ("question",),
    "icr": ("input",),
    "prompt_pairs": ("prompt",),
    "ultra": ("prompt",),
}
_DEFAULT_PROMPT_FIELDS = ("prompt", "input", "question", "instruction")


def _written(
    row: Mapping[str, Any], where: str, type_name: str, form: _Format, variant: str
) -> PreferenceTexts:
    """chatml.* and llama3.*: the prompt written in ``form``, each answer closed with its end-of-turn text."""
    if variant == "argilla_chat":
        user = _turn_content(row, "chosen", 0, where, type_name)
        chosen = _turn_content(row, "chosen", 1, where, type_name)
        rejected = _turn_content(row, "rejected", 1, where, type_name)
        return PreferenceTexts(form.user.format(text=user), chosen + form.end, rejected + form.end)
    if variant == "default":
        prompt_key = next((key for key in _DEFAULT_PROMPT_FIELDS if key in row), "instruction")
        chosen_key = "chosen" if "chosen" in row else "chosen_response"
        rejected_key = "rejected" if "rejected" in row else "rejected_response"
    else:
        prompt_key, chosen_key, rejected_key = _PROMPT_FIELDS[variant][0], "chosen", "rejected"
    user = _text(row, prompt_key, where, type_name)
    if variant == "ultra":
        chosen = _turn_content(row, "chosen", 1, where, type_name)
        rejected = _turn_content(row, "rejected", 1, where, type_name)
    else:
        chosen = _text(row, chosen_key, where, type_name)
        rejected = _text(row, rejected_key, where, type_name)
    system = row.get("system")
    prompt = form.user.format(text=user)
    if system:  # axolotl leaves out an empty or null system message
        prompt = form.system.format(text=_text(row, "system", where, type_name)) + prompt
    return PreferenceTexts(prompt, chosen + form.end, rejected + form.end)


def _user_defined_texts(row: Mapping[str, Any], where: str, fmt: PreferenceFormat) -> PreferenceTexts:
    """user_defined.default: the three formats filled with the row's fields (a null system is empty)."""
    settings, name = fmt.user_defined, fmt.type
    prompt = _text(row, settings["field_prompt"], where, name)
    system = row.get(settings["field_system"]) or ""
    if not isinstance(system, str):
        raise ShardpoolError(
            f"{where}: `{settings['field_system']}` must be a string, got {type(system).__name__} (type: {name})"
        )
    return PreferenceTexts(
        settings["prompt_format"].format(system=system, prompt=prompt),
        settings["chosen_format"].format(chosen=_text(row, settings["field_chosen"], where, name)),
        settings["rejected_format"].format(rejected=_text(row, settings["field_rejected"], where, name)),
    )


def _chat_template(
    row: Mapping[str, Any], where: str, fmt: PreferenceFormat, render: Render, *, argilla: bool
) -> PreferenceTexts:
    """chat_template.default and .argilla_chat: the prompt messages rendered, each answer cut from its own rendering.

    ``argilla_chat`` takes the prompt from every message of ``field_chosen`` but the last; ``default``
    from ``field_messages`` (a string there is one user message). An answer is a string (an
    assistant message), a message, or a list whose last message is the answer.
    """
    name = fmt.type
    if argilla:
        history = _message_list(row, fmt.field_chosen, where, name)
        messages = [_mapped(item, where, fmt, fmt.field_chosen) for item in history[:-1]]
    else:
        raw = row.get(fmt.field_messages)
        if isinstance(raw, str):  # the prompt as one user message
            raw = [{fmt.role_field: "user", fmt.content_field: raw}]
        else:
            raw = _message_list(row, fmt.field_messages, where, name)
        messages = [_mapped(item, where, fmt, fmt.field_messages) for item in raw]
    chosen = _mapped(_answer(row, fmt.field_chosen, where, fmt), where, fmt, fmt.field_chosen)
    rejected = _mapped(_answer(row, fmt.field_rejected, where, fmt), where, fmt, fmt.field_rejected)
    return PreferenceTexts(
        _render(render, messages, True, where, name),
        _rendered_answer(chosen, render, where, name, fmt.field_chosen),
        _rendered_answer(rejected, render, where, name, fmt.field_rejected),
    )


def _answer(row: Mapping[str, Any], key: str, where: str, fmt: PreferenceFormat) -> Any:
    """The answer message of ``row[key]``: a string as an assistant message, a message, or a list's last."""
    raw = row.get(key)
    if isinstance(raw, str):
        return {fmt.role_field: "assistant", fmt.content_field: raw}
    if isinstance(raw, dict):
        return raw
    return _message_list(row, key, where, fmt.type)[-1]


def _rendered_answer(answer: Message, render: Render, where: str, name: str, key: str) -> str:
    """The answer's text from its content to the end of its turn, rendered after a stand-in user message.

    The content starts where this rendering and one with the content swapped for a placeholder
    first differ. axolotl instead searches the rendering for the content: the same text whenever the
    content is found there first, but an answer that also occurs earlier (``e`` in a role header)
    would take in the template text before it, and one the template changes (trimmed whitespace)
    would not be found; both get the answer's own text here.
    """
    content = answer["content"]
    if not content:
        raise ShardpoolError(f"{where}: `{key}` has empty content (type: {name}); remove the row")
    dummy = {"role": "user", "content": _DUMMY_USER}
    text = _render(render, [dummy, answer], False, where, name)
    placeholder = next(p for p in _PLACEHOLDERS if p[0] != content[0])
    other = _render(render, [dummy, {**answer, "content": placeholder}], False, where, name)
    return text[_common_prefix(text, other) :].rstrip()


def _orpo_argilla(
    row: Mapping[str, Any], where: str, fmt: PreferenceFormat, render: Render
) -> PreferenceTexts:
    """ORPO's chat_template.argilla: ``chosen`` holds the conversation, its last message the chosen answer.

    The prompt is the system message (if any) and every exchange of ``chosen`` but the last answer,
    each user text replaced by the row's ``prompt`` when it has one; each answer is what the full
    rendering (prompt messages and answer) adds after the rendered prompt.
    """
    name = fmt.type
    chosen = _message_list(row, "chosen", where, name)
    rejected = _message_list(row, "rejected", where, name)
    if len(chosen) % 2:
        raise ShardpoolError(
            f"{where}: `chosen` has {len(chosen)} messages (type: {name}); it needs user/assistant pairs"
        )
    messages: list[Message] = []
    system = row.get("system")
    if system:
        messages.append({"role": "system", "content": _text(row, "system", where, name), "label": False})
    turns = len(chosen) // 2
    for turn in range(turns):
        if "prompt" in row:
            user = _text(row, "prompt", where, name)
        else:
            user = _turn_content(row, "chosen", 2 * turn, where, name)
        messages.append({"role": "user", "content": user, "label": False})
        if turn < turns - 1:
            answer = _turn_content(row, "chosen", 2 * turn + 1, where, name)
            messages.append({"role": "assistant", "content": answer, "label": False})
    prompt = _render(render, messages, True, where, name)
    answers = []
    for key, conversation in (("chosen", chosen), ("rejected", rejected)):
        last = _turn_content(row, key, len(conversation) - 1, where, name)
        full = _render(
            render, [*messages, {"role": "assistant", "content": last, "label": True}], False, where, name
        )
        if not full.startswith(prompt):
            raise ShardpoolError(
                f"{where}: the chat template renders the prompt differently before the `{key}` answer, so the "
                f"answer cannot be cut after it (type: {name}); use a template that renders it the same way"
            )
        answers.append(full[len(prompt) :])
    return PreferenceTexts(prompt, answers[0], answers[1])


def _render(
    render: Render, messages: list[Message], add_generation_prompt: bool, where: str, name: str
) -> str:
    """``render`` applied, or one line naming the row when the template fails on it."""
    try:
        return render(messages, add_generation_prompt)
    except ShardpoolError:
        raise
    except Exception as error:  # jinja raises many types (TemplateError, TypeError, ...) from templates
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ShardpoolError(
            f"{where}: the chat template failed on this row ({reason[:200]}; type: {name}); fix the row or the template"
        ) from None


def _text(row: Mapping[str, Any], key: str, where: str, name: str) -> str:
    """``row[key]``, which must be a string."""
    value = row.get(key)
    if value is None:
        present = ", ".join(f"`{k}`" for k in list(row)[:6]) or "no fields"
        raise ShardpoolError(
            f"{where}: the row has no `{key}` (it has {present}); `type: {name}` rows need it"
        )
    if not isinstance(value, str):
        raise ShardpoolError(f"{where}: `{key}` must be a string, got {type(value).__name__} (type: {name})")
    return value


def _message_list(row: Mapping[str, Any], key: str, where: str, name: str) -> list[Any]:
    """``row[key]`` as a non-empty list of messages."""
    value = row.get(key)
    if value is None:
        raise ShardpoolError(
            f"{where}: the row has no `{key}`; `type: {name}` rows need it (a list of messages)"
        )
    if not isinstance(value, list) or not value:
        shown = "an empty list" if value == [] else type(value).__name__
        raise ShardpoolError(
            f"{where}: `{key}` must be a non-empty list of messages, got {shown} (type: {name})"
        )
    return value


def _turn_content(row: Mapping[str, Any], key: str, index: int, where: str, name: str) -> str:
    """The ``content`` of message ``index`` of ``row[key]``."""
    messages = _message_list(row, key, where, name)
    if index >= len(messages):
        raise ShardpoolError(
            f"{where}: `{key}` has {len(messages)} message(s), `type: {name}` reads message {index + 1}"
        )
    message = messages[index]
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        raise ShardpoolError(f"{where}: `{key}` message {index + 1} has no string `content` (type: {name})")
    return content


def _mapped(item: Any, where: str, fmt: PreferenceFormat, key: str) -> Message:
    """One source message as ``{"role", "content"}``: fields per the mappings, the role through ``roles``."""
    if not isinstance(item, dict):
        raise ShardpoolError(
            f"{where}: a message of `{key}` is a {type(item).__name__}, not an object (type: {fmt.type})"
        )
    for prop, source in (("role", fmt.role_field), ("content", fmt.content_field)):
        if not isinstance(item.get(source), str):
            raise ShardpoolError(
                f"{where}: a message of `{key}` has no string `{source}` (its {prop}; type: {fmt.type}); "
                f"give every message one, or set `message_property_mappings: {{{prop}: FIELD}}`"
            )
    role = item[fmt.role_field]
    if role not in fmt.roles:
        known = ", ".join(sorted(fmt.roles))
        target = role if role in _DEFAULT_ROLES else "user"
        raise ShardpoolError(
            f"{where}: unknown role {role!r} in `{key}` (known: {known}; type: {fmt.type}); map it in the "
            f"dataset's `roles`, e.g. `roles: {{{target}: [{role}]}}` (`roles` lists every role value the rows use)"
        )
    return {"role": fmt.roles[role], "content": item[fmt.content_field]}


def chat_template_renderer(tokenizer: Any, template: str) -> Render:
    """A :data:`Render` that applies the jinja ``template`` with ``tokenizer`` (as axolotl does, untokenized).

    ``template`` is the resolved text, e.g. from :func:`shardpool.data.chat.resolve_chat_template`.
    """

    def render(messages: list[Message], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    return render


def fits_sequence_len(texts: PreferenceTexts, tokenizer: Any, sequence_len: int) -> bool:
    """Whether axolotl keeps the row under its default ``excess_length_strategy: drop``.

    Prompt and each answer are counted as tokenized apart, without special tokens; both
    prompt + answer counts must be at most ``sequence_len``.
    """
    prompt, chosen, rejected = (
        len(ids)
        for ids in tokenizer([texts.prompt, texts.chosen, texts.rejected], add_special_tokens=False)[
            "input_ids"
        ]
    )
    return prompt + chosen <= sequence_len and prompt + rejected <= sequence_len


def dpo_pairs(
    rows: list[tuple[str, PreferenceTexts]], tokenizer: Any, *, max_length: int | None
) -> list[PreferencePair]:
    """Every row tokenized as TRL's DPOTrainer prepares a dataset of strings.

    Each answer gets the eos text appended unless it already ends with it; prompt, prompt + chosen
    and prompt + rejected are tokenized apart, with the tokenizer's special tokens; the answers
    start where the prompt's tokens stop being a prefix of both (tokens can merge across the
    boundary). Rows whose prompt alone fills ``max_length`` are left out, with a warning, since
    truncation would leave them no answer token.
    """
    eos = tokenizer.eos_token
    if not eos:
        raise ShardpoolError(
            "preference training needs a tokenizer with an eos token; set `eos_token` in its config"
        )
    chosen = [with_eos(t.chosen, eos) for _, t in rows]
    rejected = [with_eos(t.rejected, eos) for _, t in rows]
    prompts = [t.prompt for _, t in rows]
    prompt_ids = tokenizer(prompts)["input_ids"]
    chosen_ids = tokenizer([p + c for p, c in zip(prompts, chosen, strict=True)])["input_ids"]
    rejected_ids = tokenizer([p + r for p, r in zip(prompts, rejected, strict=True)])["input_ids"]
    pairs = []
    for (where, _), prompt, with_chosen, with_rejected in zip(
        rows, prompt_ids, chosen_ids, rejected_ids, strict=True
    ):
        cut = min(_common_prefix(prompt, with_chosen), _common_prefix(prompt, with_rejected))
        pairs.append(
            PreferencePair(list(prompt[:cut]), list(with_chosen[cut:]), list(with_rejected[cut:]), where)
        )
    if max_length is None:
        return pairs
    kept = [pair for pair in pairs if len(pair.prompt_ids) < max_length]
    if len(kept) < len(pairs):
        log.warning(
            "left out %d of %d preference rows whose prompt alone fills max_length %d (first: %s)",
            len(pairs) - len(kept),
            len(pairs),
            max_length,
            next(pair.where for pair in pairs if len(pair.prompt_ids) >= max_length),
        )
    return kept


def with_eos(answer: str, eos: str) -> str:
    """``answer`` ending with the eos text, which TRL's DPOTrainer appends when it is missing."""
    return answer if answer.endswith(eos) else answer + eos


def _common_prefix(ids: Sequence[Any], other: Sequence[Any]) -> int:
    """How many leading items (tokens, characters) ``ids`` and ``other`` share."""
    length = 0
    for token, other_token in zip(ids, other, strict=False):
        if token != other_token:
            break
        length += 1
    return length


def dpo_samples(pair: PreferencePair, *, max_length: int | None) -> tuple[Sample, Sample]:
    """The chosen and rejected training sequences of ``pair``, as TRL's DataCollatorForPreference makes them.

    Each is the prompt followed by the answer, cut to its first ``max_length`` tokens (DPOConfig's
    ``truncation_mode: keep_start``); only answer tokens are trained (labels -100 on the prompt).
    """
    return _sequence(pair.prompt_ids, pair.chosen_ids, pair.where, max_length), _sequence(
        pair.prompt_ids, pair.rejected_ids, pair.where, max_length
    )


def _sequence(prompt: list[int], answer: list[int], where: str, max_length: int | None) -> Sample:
    """``prompt + answer`` cut to ``max_length``, with the answer trained."""
    ids = (prompt + answer)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt) + answer)[:max_length]
    return Sample(ids, labels, [1] * len(ids), where)


def orpo_samples(
    texts: PreferenceTexts, tokenizer: Any, where: str, *, max_length: int
) -> tuple[Sample, Sample]:
    """The chosen and rejected training sequences of one row, as TRL's ORPO and CPO trainers make them.

    Unlike DPO: tokenized without special tokens, then bos put in front of the prompt and eos after
    each answer as token ids when missing; the answer starts after the prompt's tokens, or one
    token earlier when the last one merged with the answer; an answer that does not fit is cut to
    ``max_length`` minus the prompt, which is never cut. Only answer tokens are trained.
    """
    prompt_ids = tokenizer(texts.prompt, add_special_tokens=False)["input_ids"]
    chosen_prompt, chosen = _orpo_answer(prompt_ids, texts.prompt + texts.chosen, tokenizer, where)
    rejected_prompt, rejected = _orpo_answer(prompt_ids, texts.prompt + texts.rejected, tokenizer, where)
    differing = sum(a != b for a, b in zip(chosen_prompt, rejected_prompt, strict=False))
    if differing > 1 or abs(len(chosen_prompt) - len(rejected_prompt)) > 1:
        raise ShardpoolError(
            f"{where}: the prompt tokenizes differently before the chosen and the rejected answer; "
            "end the prompt with whitespace or a special token"
        )
    return (
        _orpo_sequence(chosen_prompt, chosen, tokenizer, where, max_length),
        _orpo_sequence(rejected_prompt, rejected, tokenizer, where, max_length),
    )


def _orpo_answer(
    prompt_ids: list[int], full_text: str, tokenizer: Any, where: str
) -> tuple[list[int], list[int]]:
    """The prompt and answer tokens of ``full_text``: split after the prompt's tokens, one earlier on a merge."""
    full = tokenizer(full_text, add_special_tokens=False)["input_ids"]
    if len(prompt_ids) > len(full):
        raise ShardpoolError(
            f"{where}: the prompt has more tokens than prompt and answer together; end the prompt on a word boundary"
        )
    start = len(prompt_ids)
    if prompt_ids != full[:start]:
        start -= 1
    return list(full[:start]), list(full[start:])


def _orpo_sequence(
    prompt: list[int], answer: list[int], tokenizer: Any, where: str, max_length: int
) -> Sample:
    """bos before ``prompt`` and eos after ``answer`` if missing, the answer cut to fit, the answer trained."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if eos is None:
        raise ShardpoolError(
            "preference training needs a tokenizer with an eos token; set `eos_token` in its config"
        )
    if bos is not None and (not prompt or prompt[0] != bos):
        prompt = [bos, *prompt]
    if not answer or answer[-1] != eos:
        answer = [*answer, eos]
    if len(prompt) + len(answer) > max_length:
        answer = answer[: max(0, max_length - len(prompt))]
    ids = prompt + answer
    return Sample(ids, [IGNORE_INDEX] * len(prompt) + answer, [1] * len(ids), where)
