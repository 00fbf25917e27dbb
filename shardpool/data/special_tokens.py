"""axolotl's ``special_tokens``: re-point bos/eos/pad/unk at tokens the tokenizer already has.

axolotl users set ``special_tokens: {pad_token: "<|end_of_text|>"}`` to give a tokenizer a pad
token, or a different eos. shardpool applies such settings as long as every named token is
already in the vocabulary: a new token would grow the embedding and lm_head, which the frozen
NF4 base cannot train. Anything else is refused in one line that names the missing tokens.
"""

from __future__ import annotations

from typing import Any

from shardpool.errors import ShardpoolError

__all__ = ["apply_special_tokens"]


def _named_tokens(settings: dict[str, Any]) -> list[str]:
    named: list[str] = []
    for value in settings.values():
        named += value if isinstance(value, list) else [value]
    return named


def apply_special_tokens(tokenizer: Any, settings: dict[str, Any], *, source: str) -> None:
    """Set the tokenizer's special tokens from ``settings``, refusing any token outside its vocabulary."""
    if not settings:
        return
    vocabulary = tokenizer.get_vocab()
    missing = [token for token in _named_tokens(settings) if token not in vocabulary]
    if missing:
        raise ShardpoolError(
            f"special_tokens {missing} are not in the tokenizer of {source}: adding tokens would grow the "
            "vocabulary, which shardpool does not train; use tokens it has, or remove them"
        )
    size = len(tokenizer)
    tokenizer.add_special_tokens(settings)
    if len(tokenizer) != size:  # cannot happen for tokens already in the vocabulary; checked all the same
        raise ShardpoolError(f"special_tokens grew the tokenizer of {source}; remove them")
