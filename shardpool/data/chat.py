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
  after the last trained turn only, ``none`` never.

Templates: a name built in :mod:`shardpool.data.templates` (``chatml``, ``llama3``, ``qwen3``, ...),
``tokenizer_default`` (the base model's own, the default), ``tokenizer_default_fallback_<name>``
(the base model's own, else ``<name>``), ``jinja`` with ``chat_template_jinja``, or jinja text.
"""

from __future__ import annotations

import logging
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

# How far after a turn's content its eos may come (template text such as a newline in between).
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
class _Turn:
    """Where one turn sits in the tokens: its content tokens ``[start, end)`` and its eos (or -1)."""

    start: int
    end: int
    eos: int


def chat_samples(
    rows: list[tuple[str, dict[str, Any]]],
    tokenizer: Any,
    spec: DatasetSpec,
    template: str,
    *,
    train_on_inputs: bool,
    label: str,
) -> list[Sample]:
    """Every conversation row rendered with ``template``, tokenized and masked (see the module doc).

    ``label`` names the dataset in the warning given when the template never puts the
    tokenizer's eos token after a trained turn.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ShardpoolError(
            f"{label}: chat datasets need a fast tokenizer (tokenizer.json in the base_model directory)"
        )
    settings = chat_settings(spec)
    conversations = [(where, conversation(row, where, settings)) for where, row in rows]
    texts = [_render(messages, template, tokenizer, where) for where, messages in conversations]
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    samples: list[Sample] = []
    eos_trained = False
    for (where, messages), text, ids, offsets in zip(
        conversations, texts, encoded["input_ids"], encoded["offset_mapping"], strict=True
    ):
        labels = _labels(
            messages, text, list(ids), offsets, settings, train_on_inputs, template, tokenizer, where
        )
        eos_trained |= any(label == tokenizer.eos_token_id for label in labels if label != IGNORE_INDEX)
        samples.append(Sample(list(ids), labels, [1] * len(ids), where))
    if settings.train_on_eos != "none" and not eos_trained:
        log.warning(
            "%s: the chat template never puts the tokenizer's eos token %r after a trained turn, so "
            "no eos is trained and the model will not learn where its turns end; use a template that "
            "ends turns with `eos_token`, or a base model whose eos is the template's end-of-turn token",
            label,
            tokenizer.eos_token,
        )
    return samples


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
) -> list[int]:
    """The labels of one rendered conversation: trained turns' content and eos, -100 elsewhere."""
    labels = [IGNORE_INDEX] * len(ids)
    mode = settings.train_on_eos
    last_eos = -1
    for index, message in enumerate(messages):
        trained = train_on_inputs or message["role"] in settings.roles_to_train
        if not trained and mode != "all":
            continue
        span = _content_span(messages, index, text, template, tokenizer, where)
        turn = _turn_tokens(span, ids, offsets, tokenizer.eos_token_id)
        if trained:
            labels[turn.start : turn.end] = ids[turn.start : turn.end]
        if turn.eos >= 0 and (mode == "all" or (mode == "turn" and trained)):
            labels[turn.eos] = ids[turn.eos]
        if trained and turn.eos >= 0:
            last_eos = turn.eos
    if mode == "last" and last_eos >= 0:
        labels[last_eos] = ids[last_eos]
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


def _turn_tokens(span: tuple[int, int], ids: list[int], offsets: list[tuple[int, int]], eos_id: int) -> _Turn:
    """The tokens that overlap ``span`` and the eos that follows them within a few tokens."""
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
    window = range(end, min(end + _EOS_WINDOW + 1, len(ids)))
    eos = next((position for position in window if ids[position] == eos_id), -1)
    return _Turn(start, end, eos)
