"""Chat datasets: conversations rendered through a chat template, trained on the chosen turns.

Each conversation is rendered to text with ``tokenizer.apply_chat_template`` and tokenized as a
whole, without added special tokens (the template writes them), exactly as
``apply_chat_template(tokenize=True)`` does. Which tokens are trained comes from the rendered
template itself, per turn, as in axolotl's ``chat_template`` strategy:

* the content of a turn is found by rendering the conversation once more with that turn's content
  replaced by a placeholder: the characters where the two renderings differ are the content, and
  every token that overlaps them is trained when the turn's role is in ``roles_to_train`` (or with
  ``train_on_inputs``). Role headers and other template text are never trained;
* the eos token that ends a turn (the first one at most 3 tokens after its content) is trained
  per ``train_on_eos``: ``turn`` after each trained turn, ``all`` after every turn, ``last``
  after the last trained turn only, ``none`` never;
* with ``eot_tokens`` (axolotl's key: the texts that end a turn, each a single token), the first
  of them at most 3 tokens after a turn's content is trained the same way per ``train_on_eot``
  (default: as ``train_on_eos``), and the eos still per ``train_on_eos``. Without it the eos is
  the only end of turn.

Templates: a name built in :mod:`shardpool.data.templates` (``chatml``, ``llama3``, ``qwen3``, ...),
``tokenizer_default`` (the base model's own, the default), ``tokenizer_default_fallback_<name>``
(the base model's own, else ``<name>``), ``jinja`` with ``chat_template_jinja``, or jinja text.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardpool.config import Config, DatasetSpec
from shardpool.config.schema import FALLBACK_PREFIX
from shardpool.data.conversations import ChatSettings, Message, chat_settings, conversation
from shardpool.data.rows import IGNORE_INDEX, Sample
from shardpool.data.templates import CHATML_TEMPLATE, named_template
from shardpool.errors import ShardpoolError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["CHATML_TEMPLATE", "chat_samples", "resolve_chat_template", "use_config_chat_template"]

log = logging.getLogger(__name__)

# How far after a turn's content its eos (or eot token) may come (template text such as a newline in between).
_EOS_WINDOW = 3
# Stands in for a turn's content; private-use characters, so no real text starts or ends like it.
_PLACEHOLDERS = ("\ue000\ue001\ue002", "\ue003\ue004\ue005")


def resolve_chat_template(choice: str | None, jinja: str | None, tokenizer: Any) -> str:
    """The jinja text of a ``chat_template`` / ``chat_template_jinja`` pair, as axolotl resolves it.

    No choice means ``jinja`` when ``chat_template_jinja`` is given, else ``tokenizer_default``.
    ``chat_template_jinja`` may name a file that holds the template. ``tokenizer_default_fallback_<name>``
    is the tokenizer's own template when it has one, else the built template ``<name>``.
    """
    if choice is None:
        choice = "jinja" if jinja else "tokenizer_default"
    if choice == "tokenizer_default":
        own = _tokenizer_template(tokenizer)
        if own is None:
            raise ShardpoolError(
                "the base model's tokenizer has no chat template (`chat_template: tokenizer_default`, the "
                "default for chat datasets); set `chat_template: chatml` (or another built name), or give "
                "one in `chat_template_jinja`"
            )
        return own
    if choice.startswith(FALLBACK_PREFIX):
        own = _tokenizer_template(tokenizer)
        if own is not None:
            return own
        name = choice.removeprefix(FALLBACK_PREFIX)
        log.warning("the base model's tokenizer has no chat template; using %s", name)
        return named_template(name).jinja
    if choice == "jinja":
        if not jinja:
            raise ShardpoolError("`chat_template: jinja` needs the template in `chat_template_jinja`")
        return _jinja_text(jinja)
    if "{{" in choice or "{%" in choice:
        return choice  # jinja text itself
    return named_template(choice).jinja


def _tokenizer_template(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    return template or None


def _jinja_text(jinja: str) -> str:
    """``jinja`` itself, or the text of the file it names (axolotl accepts both)."""
    if "{" not in jinja and "\n" not in jinja and len(jinja) < 4096:
        path = Path(jinja)
        if not path.is_file():
            raise ShardpoolError(
                f"`chat_template_jinja` {jinja!r} is neither jinja text nor an existing file; check the path"
            )
        return path.read_text(encoding="utf-8")
    return jinja


def use_config_chat_template(config: Config, tokenizer: PreTrainedTokenizerBase) -> None:
    """Give ``tokenizer`` the config's top-level chat template, if it sets one.

    The tokenizer saved beside the adapter then renders conversations for inference exactly as
    they were rendered for training (axolotl does the same).
    """
    if config.chat_template is not None or config.chat_template_jinja is not None:
        tokenizer.chat_template = resolve_chat_template(
            config.chat_template, config.chat_template_jinja, tokenizer
        )


@dataclass(frozen=True)
class _TurnEnd:
    """One kind of token that ends a turn (the eos, or the ``eot_tokens``) and when it is trained."""

    ids: frozenset[int]
    mode: str  # turn, all, last or none, as train_on_eos


@dataclass(frozen=True)
class _Turn:
    """Where one turn sits in the tokens: its content tokens ``[start, end)``."""

    start: int
    end: int


def chat_samples(
    rows: list[tuple[str, dict[str, Any]]],
    tokenizer: Any,
    spec: DatasetSpec,
    template: str,
    *,
    train_on_inputs: bool,
    label: str,
    eot_tokens: Sequence[str] | None = None,
) -> list[Sample]:
    """Every conversation row rendered with ``template``, tokenized and masked (see the module doc).

    ``label`` names the dataset in the warning given when the template never puts the
    tokenizer's eos token (or one of ``eot_tokens``) after a trained turn.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ShardpoolError(
            f"{label}: chat datasets need a fast tokenizer (tokenizer.json in the base_model directory)"
        )
    settings = chat_settings(spec)
    ends = _turn_ends(settings, eot_tokens, template, tokenizer, label)
    end_ids = frozenset().union(*(end.ids for end in ends))
    conversations = [(where, conversation(row, where, settings)) for where, row in rows]
    texts = [_render(messages, template, tokenizer, where) for where, messages in conversations]
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    samples: list[Sample] = []
    eos_trained = False
    for (where, messages), text, ids, offsets in zip(
        conversations, texts, encoded["input_ids"], encoded["offset_mapping"], strict=True
    ):
        labels = _labels(
            messages, text, list(ids), offsets, settings, train_on_inputs, template, tokenizer, where, ends
        )
        eos_trained |= any(label in end_ids for label in labels if label != IGNORE_INDEX)
        samples.append(Sample(list(ids), labels, [1] * len(ids), where))
    if any(end.mode != "none" for end in ends) and not eos_trained:
        log.warning(
            "%s: the chat template never puts the tokenizer's eos token %r after a trained turn, so "
            "no eos is trained and the model will not learn where its turns end; use a template that "
            "ends turns with `eos_token`, a base model whose eos is the template's end-of-turn token, "
            "or set `eot_tokens` to the template's end-of-turn token",
            label,
            tokenizer.eos_token,
        )
    return samples


def _turn_ends(
    settings: ChatSettings, eot_tokens: Sequence[str] | None, template: str, tokenizer: Any, label: str
) -> list[_TurnEnd]:
    """The tokens that end a turn: the eos per ``train_on_eos``, and ``eot_tokens`` per ``train_on_eot``.

    As in axolotl, an end-of-turn text the template never writes is left out with a warning, one
    that is not a single token is refused, and the eos listed in ``eot_tokens`` must be trained
    the same way under both keys.
    """
    eos = _TurnEnd(frozenset({tokenizer.eos_token_id}), settings.train_on_eos)
    if not eot_tokens:
        return [eos]
    ids: set[int] = set()
    for token in eot_tokens:
        if token not in template:
            log.warning("%s: the chat template never writes eot token %r; it is left out", label, token)
            continue
        encoded = tokenizer(token, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise ShardpoolError(
                f"`eot_tokens` entry {token!r} is {len(encoded)} tokens for this tokenizer, not one; "
                "list only the base model's own special tokens"
            )
        ids.add(encoded[0])
    if tokenizer.eos_token_id in ids and settings.train_on_eot != settings.train_on_eos:
        raise ShardpoolError(
            f"{label}: the eos token {tokenizer.eos_token!r} is in `eot_tokens`, so `train_on_eot: "
            f"{settings.train_on_eot}` and `train_on_eos: {settings.train_on_eos}` disagree about it; "
            "make them equal or leave the eos out of `eot_tokens`"
        )
    return [_TurnEnd(frozenset(ids), settings.train_on_eot), eos]


def _render(messages: list[Message], template: str, tokenizer: Any, where: str) -> str:
    """The conversation as text, or one line naming the row when the template fails on it."""
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    except Exception as error:  # jinja raises many types (TemplateError, TypeError, ...) from templates
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ShardpoolError(
            f"{where}: the chat template failed on this row ({reason[:200]}); fix the row or the template"
        ) from None


def _labels(
    messages: list[Message],
    text: str,
    ids: list[int],
    offsets: list[tuple[int, int]],
    settings: ChatSettings,
    train_on_inputs: bool,
    template: str,
    tokenizer: Any,
    where: str,
    ends: list[_TurnEnd],
) -> list[int]:
    """The labels of one rendered conversation: trained turns' content and turn ends, -100 elsewhere."""
    labels = [IGNORE_INDEX] * len(ids)
    last = [-1] * len(ends)
    for index, message in enumerate(messages):
        trained = train_on_inputs or message["role"] in settings.roles_to_train
        if not trained and all(end.mode != "all" for end in ends):
            continue
        span = _content_span(messages, index, text, template, tokenizer, where)
        turn = _turn_tokens(span, ids, offsets)
        if trained:
            labels[turn.start : turn.end] = ids[turn.start : turn.end]
        for kind, end in enumerate(ends):
            position = _end_after(turn, ids, end.ids)
            if position >= 0 and (end.mode == "all" or (end.mode == "turn" and trained)):
                labels[position] = ids[position]
            if trained and position >= 0:
                last[kind] = position
    for kind, end in enumerate(ends):
        if end.mode == "last" and last[kind] >= 0:
            labels[last[kind]] = ids[last[kind]]
    return labels


def _content_span(
    messages: list[Message], index: int, text: str, template: str, tokenizer: Any, where: str
) -> tuple[int, int]:
    """The characters of ``text`` that hold message ``index``'s content, ``[start, end)``.

    The conversation is rendered again with that content replaced by a placeholder; the content is
    what lies between the longest common prefix and the longest common suffix of the two texts.
    """
    content = messages[index]["content"]
    placeholder = next(p for p in _PLACEHOLDERS if p[0] not in content and p[-1] not in content)
    swapped = [*messages[:index], {**messages[index], "content": placeholder}, *messages[index + 1 :]]
    other = _render(swapped, template, tokenizer, where)
    limit = min(len(text), len(other))
    start = 0
    while start < limit and text[start] == other[start]:
        start += 1
    tail = 0
    while tail < limit - start and text[-1 - tail] == other[-1 - tail]:
        tail += 1
    return start, len(text) - tail


def _turn_tokens(span: tuple[int, int], ids: list[int], offsets: list[tuple[int, int]]) -> _Turn:
    """The tokens that overlap ``span``."""
    begin, finish = span
    overlapping = [
        position
        for position, (first, last) in enumerate(offsets)
        if first < finish and last > begin and last > first
    ]
    if overlapping:
        start, end = overlapping[0], overlapping[-1] + 1
    else:  # empty content: the turn is where its text would be
        start = end = next((p for p, (first, _) in enumerate(offsets) if first >= finish), len(ids))
    return _Turn(start, end)


def _end_after(turn: _Turn, ids: list[int], end_ids: frozenset[int]) -> int:
    """The first of ``end_ids`` within a few tokens after ``turn``'s content, or -1."""
    window = range(turn.end, min(turn.end + _EOS_WINDOW + 1, len(ids)))
    return next((position for position in window if ids[position] in end_ids), -1)
