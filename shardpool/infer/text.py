"""From text to prompt ids and from generated ids back to text, for ``shardpool generate`` and ``serve``.

Prompts: a plain prompt is tokenized as the tokenizer does by default (with its bos), as vLLM's
``/v1/completions`` does; a chat is rendered by the tokenizer's chat template with the assistant's
turn opened, then tokenized without adding special tokens again (the template writes its own),
which gives the ids ``apply_chat_template(tokenize=True)`` gives.

Completions: :class:`TextStream` turns ids into text as they come. It decodes a short window of
ids (Text Generation Inference's ``decode_token``: the new text is what the last ids add to the
decoding of the few before them, so a SentencePiece word keeps its leading space), skips special
tokens, holds back a trailing ``"\\ufffd"`` (a character whose bytes have not all arrived), and
cuts the text before the first stop string, holding back any end of the text that could still
become one. Nothing here prints or knows about HTTP.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from shardpool.errors import ShardpoolError

__all__ = ["MAX_STOP_STRINGS", "TextStream", "chat_prompt_ids", "prompt_ids", "stop_ids", "stop_strings"]

#: How many stop strings one request may give (OpenAI's limit).
MAX_STOP_STRINGS = 4
#: Prompt ids decoded in front of the first generated ids, so the first word is spaced as in context.
_CONTEXT_IDS = 5
_REPLACEMENT = "\ufffd"


def prompt_ids(tokenizer: Any, prompt: str, *, chat: bool = False) -> list[int]:
    """The ids of ``prompt``: as ``tokenizer(prompt)`` gives them, or with ``chat`` as the one user
    message of a chat (see :func:`chat_prompt_ids`)."""
    if chat:
        return chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt)["input_ids"])


def chat_prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """The ids of ``messages`` rendered by the tokenizer's chat template, the assistant's turn
    opened (``add_generation_prompt``): the template's own special tokens, none added twice."""
    if not getattr(tokenizer, "chat_template", None):
        raise ShardpoolError(
            "the model's tokenizer has no chat template; send a plain prompt (/v1/completions, or "
            "generate without --chat), or set one (`chat_template` in the config, or in tokenizer_config.json)"
        )
    try:
        text = tokenizer.apply_chat_template(
            [dict(message) for message in messages], add_generation_prompt=True, tokenize=False
        )
    except Exception as error:  # jinja raises many types (TemplateError, TypeError, ...) from templates
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ShardpoolError(f"the chat template failed on these messages: {reason[:200]}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_ids(tokenizer: Any, model_dir: str | Path | None = None) -> frozenset[int]:
    """The token ids that end a completion: the tokenizer's eos, and the ``eos_token_id`` (one or a
    list) of the model's ``generation_config.json`` when ``model_dir`` has one (chat models end a
    turn with a token of their own there, e.g. Llama 3's ``<|eot_id|>``)."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    if model_dir is not None:
        ids.update(_generation_eos_ids(Path(model_dir) / "generation_config.json"))
    return frozenset(ids)


def stop_strings(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """A request's ``stop`` (none, one string, or a list of up to four) as a tuple; one line when
    it is anything else. Empty strings are dropped (they would stop before the first token)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(item, str) for item in items):
        raise ShardpoolError("`stop` must be a string or a list of strings")
    if len(items) > MAX_STOP_STRINGS:
        raise ShardpoolError(f"`stop` has {len(items)} strings; give at most {MAX_STOP_STRINGS}")
    return tuple(item for item in items if item)


class TextStream:
    """The text of a completion, pushed one token id at a time.

    :meth:`push` returns the text that is now certain (possibly ""); :meth:`finish` returns what
    was held back once no token will follow. Their concatenation is :attr:`text`. Once a stop
    string appears, :attr:`stopped` is True, the text ends just before it and further ids are
    ignored: the caller cancels the generation.

    ``context`` is the prompt's ids: its last few are decoded with the first generated ones, so the
    completion starts with the space or letter it has after that prompt.
    """

    def __init__(self, tokenizer: Any, *, stop: Iterable[str] = (), context: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._stops = tuple(item for item in stop if item)
        self._ids = list(context[-_CONTEXT_IDS:])
        self._prefix = 0  # the window decoded for context starts here ...
        self._read = len(self._ids)  # ... and the ids from here on are not yet text
        self._released: list[str] = []
        self._held = ""  # decoded, but the start of a stop string as far as we know
        self.stopped = False

    @property
    def text(self) -> str:
        """The completion so far: the text released, and the text held back as a possible stop
        string's start (not a half character; :meth:`finish` adds that once the completion ends)."""
        return "".join(self._released) + ("" if self.stopped else self._held)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it makes certain."""
        if self.stopped:
            return ""
        self._ids.append(int(token_id))
        return self._release(self._decode(final=False))

    def finish(self) -> str:
        """No more ids come: return what was held back (a half character decodes as ``"\\ufffd"``)."""
        if self.stopped:
            return ""
        piece = self._release(self._decode(final=True))
        rest, self._held = self._held, ""
        self._released.append(rest)
        return piece + rest

    def _decode(self, *, final: bool) -> str:
        """The text the ids after the read offset add, or "" while it ends in half a character."""
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        after = decode(self._ids[self._prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or (after.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def _release(self, piece: str) -> str:
        """Pass ``piece`` through the stop strings: return what is certain, keep what may start one."""
        if not piece:
            return ""
        text = self._held + piece
        cut = min((index for index in (text.find(s) for s in self._stops) if index >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            self._released.append(text[:cut])
            return text[:cut]
        keep = _stop_prefix_length(text, self._stops)
        out, self._held = text[: len(text) - keep], text[len(text) - keep :]
        self._released.append(out)
        return out


def _stop_prefix_length(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins some stop string (0 when none does)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(text), len(stop) - 1), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def _generation_eos_ids(path: Path) -> set[int]:
    import json

    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    value = loaded.get("eos_token_id") if isinstance(loaded, dict) else None
    values = value if isinstance(value, list) else [value]
    return {int(item) for item in values if isinstance(item, int) and not isinstance(item, bool)}
