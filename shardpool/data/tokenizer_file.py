"""The base model's tokenizer read from its ``tokenizer.json`` with the ``tokenizers`` library alone.

``shardpool validate`` tokenizes a run's datasets to count tokens without loading torch, and
``transformers.AutoTokenizer`` imports torch. :class:`TokenizerFile` is the small part of a
fast Hugging Face tokenizer that :mod:`shardpool.data.tokenizing` and :mod:`shardpool.data.show`
use (calling it on texts, the special token ids, ``len``, ``decode``, ``apply_chat_template``,
``add_special_tokens``), built from the same files: the ids are the ones training uses, which a
test holds to ``AutoTokenizer``'s. Training itself keeps loading
``AutoTokenizer`` (:func:`shardpool.data.tokenizing.load_tokenizer`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from shardpool.errors import ShardpoolError

__all__ = ["TokenizerFile", "load_tokenizer_file"]

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TokenizerFile:
    """A fast tokenizer from ``tokenizer.json`` and the special tokens of ``tokenizer_config.json``."""

    is_fast = True

    def __init__(self, backend: Any, special_tokens: dict[str, str], chat_template: str | None) -> None:
        self._backend = backend
        self.special_tokens_map = dict(special_tokens)
        self.chat_template = chat_template
        for name in _SPECIAL_TOKENS:
            setattr(self, name, special_tokens.get(name))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        """Id of the beginning-of-sequence token, or None."""
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        """Id of the end-of-sequence token, or None."""
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        """Id of the padding token, or None."""
        return self._id(self.pad_token)

    def get_vocab(self) -> dict[str, int]:
        """Every token (added ones included) and its id."""
        return dict(self._backend.get_vocab(with_added_tokens=True))

    def add_special_tokens(self, settings: dict[str, Any]) -> int:
        """Make the named tokens special (``bos_token``, ..., ``additional_special_tokens``), as HF does.

        Returns how many tokens were new to the vocabulary.
        """
        size = len(self)
        for name, value in settings.items():
            tokens = value if isinstance(value, list) else [value]
            self._backend.add_special_tokens(tokens)
            if name in _SPECIAL_TOKENS:
                setattr(self, name, value)
                self.special_tokens_map[name] = value
        return len(self) - size

    def __len__(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def __call__(
        self,
        text: str | list[str],
        *,
        add_special_tokens: bool = True,
        return_offsets_mapping: bool = False,
        **_: Any,
    ) -> dict[str, Any]:
        """``input_ids`` (and ``offset_mapping``) of one text or a list of them, as a HF tokenizer returns."""
        texts = [text] if isinstance(text, str) else list(text)
        encodings = self._backend.encode_batch(texts, add_special_tokens=add_special_tokens) if texts else []
        result: dict[str, Any] = {"input_ids": [list(encoding.ids) for encoding in encodings]}
        if return_offsets_mapping:
            result["offset_mapping"] = [list(encoding.offsets) for encoding in encodings]
        if isinstance(text, str):
            result = {key: value[0] for key, value in result.items()}
        return result

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``, special tokens written out unless ``skip_special_tokens``."""
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        *,
        chat_template: str | None = None,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> Any:
        """One conversation rendered with ``chat_template`` (default: the tokenizer's), as transformers does."""
        from transformers.utils.chat_template_utils import render_jinja_template  # no torch

        template = chat_template or self.chat_template
        if template is None:
            raise ShardpoolError("the tokenizer has no chat template; set `chat_template` in the config")
        messages = [
            {key: value for key, value in message.items() if value is not None} for message in conversation
        ]
        rendered, _ = render_jinja_template(
            conversations=[messages],
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            **{
                **{key: value for key, value in self.special_tokens_map.items() if value is not None},
                **kwargs,
            },
        )
        text = rendered[0]
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text


def load_tokenizer_file(model_dir: str | os.PathLike[str]) -> TokenizerFile:
    """The tokenizer of ``model_dir`` (``tokenizer.json`` and its config), padding with eos where it has no pad.

    Refused in one line where ``tokenizer.json`` is missing or broken, or there is no eos token,
    as :func:`shardpool.data.tokenizing.load_tokenizer` refuses them.
    """
    from tokenizers import Tokenizer

    path = Path(model_dir)
    tokenizer_json = path / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ShardpoolError(
            f"{path} has no tokenizer.json; the base_model directory needs tokenizer.json and tokenizer_config.json"
        )
    try:
        backend = Tokenizer.from_file(str(tokenizer_json))
    except Exception as error:  # tokenizers raises a bare Exception for a malformed file
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ShardpoolError(
            f"cannot read {tokenizer_json} ({reason[:200]}); re-save the tokenizer"
        ) from None
    settings = {
        **_json_object(path / "special_tokens_map.json"),
        **_json_object(path / "tokenizer_config.json"),
    }
    special = {name: token for name in _SPECIAL_TOKENS if (token := _token_text(settings.get(name)))}
    if special.get("eos_token") is None or backend.token_to_id(special["eos_token"]) is None:
        raise ShardpoolError(
            f"the tokenizer in {str(path)!r} has no eos token; set `eos_token` in its tokenizer_config.json"
        )
    if special.get("pad_token") is None or backend.token_to_id(special["pad_token"]) is None:
        special["pad_token"] = special["eos_token"]
    return TokenizerFile(backend, special, _chat_template(path, settings))


def _chat_template(path: Path, settings: dict[str, Any]) -> str | None:
    """The tokenizer's own chat template: ``chat_template.jinja``, else the config's ``chat_template``."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = settings.get("chat_template")
    return template if isinstance(template, str) else None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _json_object(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ShardpoolError(f"{file} is not valid JSON; fix or re-save it") from None
    return data if isinstance(data, dict) else {}
