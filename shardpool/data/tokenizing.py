"""Tokenizing each dataset into samples, with the mask that decides which tokens are trained.

An alpaca row trains only its response and eos (the prompt, and bos if the tokenizer adds one,
get label -100), or every token with ``train_on_inputs: true``; a completion row trains every
token; a conversation (``chat_template``, ``sharegpt``) trains the turns :mod:`shardpool.data.chat`
picks; pre-tokenized rows keep their own labels.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mesh.files import atomic_write
from shardpool.config import DatasetSpec
from shardpool.data.chat import chat_samples, resolve_chat_template
from shardpool.data.formats import alpaca_texts, completion_texts, pretokenized_samples
from shardpool.data.reading import read_rows
from shardpool.data.rows import IGNORE_INDEX, Sample
from shardpool.errors import ShardpoolError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["dataset_chat_template", "dataset_samples", "load_tokenizer"]


def load_tokenizer(model_dir: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved with the base model, offline, making sure it can pad.

    A tokenizer without a pad token pads with eos: padding is masked out of the loss, so which
    id fills it does not matter, and the eos at the end of each row is still trained.
    """
    from transformers import AutoTokenizer

    path = Path(model_dir)
    if not path.is_dir():
        raise ShardpoolError(
            f"base_model directory {str(path)!r} does not exist; check the path (relative to the current directory)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as error:  # transformers raises many types for a broken or missing tokenizer
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ShardpoolError(
            f"cannot load a tokenizer from {str(path)!r} ({reason[:200]}); the base_model directory needs tokenizer.json and tokenizer_config.json"
        ) from None
    if tokenizer.eos_token_id is None:
        raise ShardpoolError(
            f"the tokenizer in {str(path)!r} has no eos token; set `eos_token` in its tokenizer_config.json"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def dataset_samples(
    spec: DatasetSpec,
    index: int,
    tokenizer: Any,
    *,
    train_on_inputs: bool = False,
    chat_template: str | None = None,
    chat_template_jinja: str | None = None,
    eot_tokens: list[str] | None = None,
) -> list[Sample]:
    """Every row of the dataset ``datasets[index]``, read, checked and tokenized by its ``type``.

    ``train_on_inputs`` (axolotl's key) trains alpaca rows on their prompt tokens too, and every
    turn of a conversation. ``chat_template`` / ``chat_template_jinja`` are the config's top-level
    template for chat datasets; a dataset's own ``chat_template`` (or ``chat_template_jinja``) wins.
    ``eot_tokens`` are the config's texts that end a chat turn (the eos alone when None).
    """
    rows = read_rows(spec, index)
    if spec.is_chat:
        template = dataset_chat_template(spec, tokenizer, chat_template, chat_template_jinja)
        return chat_samples(
            rows,
            tokenizer,
            spec,
            template,
            train_on_inputs=train_on_inputs,
            label=f"datasets[{index}]",
            eot_tokens=eot_tokens,
        )
    if spec.type == "alpaca":
        return _alpaca_samples(rows, tokenizer, train_on_inputs=train_on_inputs)
    if spec.type == "completion":
        return _completion_samples(rows, tokenizer, spec.field or "text")
    return pretokenized_samples(rows, len(tokenizer))


def dataset_chat_template(
    spec: DatasetSpec, tokenizer: Any, chat_template: str | None, chat_template_jinja: str | None
) -> str:
    """The jinja text a chat dataset is rendered with: its own template if it sets one, else the config's."""
    if spec.chat_template or spec.chat_template_jinja:
        chat_template, chat_template_jinja = spec.chat_template, spec.chat_template_jinja
    return resolve_chat_template(chat_template, chat_template_jinja, tokenizer)


def _adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer itself puts bos in front of a text (Llama yes, GPT-2 and Qwen no)."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == bos


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without any special tokens."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _alpaca_samples(
    rows: list[tuple[str, dict[str, Any]]], tokenizer: Any, *, train_on_inputs: bool
) -> list[Sample]:
    """Prompt tokens (and bos) get label -100, unless ``train_on_inputs``; the response and eos are trained."""
    prompts, responses = alpaca_texts(rows)
    head = [tokenizer.bos_token_id] if _adds_bos(tokenizer) else []
    eos = tokenizer.eos_token_id
    samples = []
    # Prompt and response are encoded separately, so the mask boundary is exactly where the response starts.
    for (where, _), prompt_ids, response_ids in zip(
        rows, _encode(tokenizer, prompts), _encode(tokenizer, responses), strict=True
    ):
        prompt = head + prompt_ids
        answer = response_ids + [eos]
        ids = prompt + answer
        labels = (list(prompt) if train_on_inputs else [IGNORE_INDEX] * len(prompt)) + answer
        samples.append(Sample(ids, labels, [1] * len(ids), where))
    return samples


def _completion_samples(rows: list[tuple[str, dict[str, Any]]], tokenizer: Any, field: str) -> list[Sample]:
    """Text plus eos, every token trained."""
    texts = completion_texts(rows, field)
    head = [tokenizer.bos_token_id] if _adds_bos(tokenizer) else []
    eos = tokenizer.eos_token_id
    samples = []
    for (where, _), text_ids in zip(rows, _encode(tokenizer, texts), strict=True):
        ids = head + text_ids + [eos]
        samples.append(Sample(ids, list(ids), [1] * len(ids), where))
    return samples


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, directory: Path, *, scratch_parent: Path) -> None:
    """Save the tokenizer the data was tokenized with into ``directory``, each file atomically.

    ``save_pretrained`` writes in place, so it writes into a scratch directory under
    ``scratch_parent`` first, and each file is then published with one rename.
    """
    with tempfile.TemporaryDirectory(dir=scratch_parent, prefix="tokenizer-") as scratch:
        tokenizer.save_pretrained(scratch)
        for saved in sorted(Path(scratch).iterdir()):
            if saved.is_file():
                atomic_write(directory / saved.name, saved.read_bytes())
