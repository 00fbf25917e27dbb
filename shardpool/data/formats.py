"""The three row formats shardpool understands (see docs/data.md).

* ``type: alpaca``: ``instruction``, optional ``input``, ``output``; only the response is trained.
* ``type: completion``: one text field (``text`` unless ``field:`` names another); every token trained.
* no ``type``: pre-tokenized ``input_ids`` with optional ``labels`` and ``attention_mask``, used as given.

Every row is checked here, with a one-line error naming its ``file:line`` (or ``file row N``) and
the fix. Files are read in :mod:`shardpool.data.reading`; nothing is tokenized here (see
:mod:`shardpool.data.tokenizing`).
"""

from __future__ import annotations

from typing import Any

from shardpool.data.rows import IGNORE_INDEX, Sample
from shardpool.errors import ShardpoolError

__all__ = [
    "alpaca_texts",
    "completion_texts",
    "format_alpaca_prompt",
    "pretokenized_samples",
]

# axolotl's default alpaca prompter (AlpacaPrompter, prompt style "instruct", in
# src/axolotl/prompters.py): a preamble, a blank line, then the turn. The response follows directly.
_PREAMBLE_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
)
_PREAMBLE_NO_INPUT = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
_TURN_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
_TURN_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"


def format_alpaca_prompt(instruction: str, input: str = "") -> str:
    """The alpaca prompt shardpool trains with, exactly axolotl's ``type: alpaca`` prompt.

    The same rows must give the same training text as under axolotl, preamble included. An empty
    ``input`` uses the shorter preamble and leaves out the ``### Input:`` section.
    """
    if input:
        return _PREAMBLE_WITH_INPUT + _TURN_WITH_INPUT.format(instruction=instruction, input=input)
    return _PREAMBLE_NO_INPUT + _TURN_NO_INPUT.format(instruction=instruction)


def _text_field(row: dict[str, Any], key: str, where: str, *, required: bool, fix: str) -> str:
    """``row[key]`` as a string ('' when optional and absent or null)."""
    value = row.get(key)
    if value is None:
        if required:
            raise ShardpoolError(f"{where}: the row has no `{key}`; {fix}")
        return ""
    if not isinstance(value, str):
        raise ShardpoolError(
            f"{where}: `{key}` must be a string, got {type(value).__name__}; quote the value"
        )
    return value


def alpaca_texts(rows: list[tuple[str, dict[str, Any]]]) -> tuple[list[str], list[str]]:
    """The prompt (formatted with :func:`format_alpaca_prompt`) and the response of every alpaca row."""
    fix = "alpaca rows need `instruction` and `output` (and optional `input`)"
    prompts: list[str] = []
    responses: list[str] = []
    for where, row in rows:
        instruction = _text_field(row, "instruction", where, required=True, fix=fix)
        extra = _text_field(row, "input", where, required=False, fix=fix)
        responses.append(_text_field(row, "output", where, required=True, fix=fix))
        prompts.append(format_alpaca_prompt(instruction, extra))
    return prompts, responses


def completion_texts(rows: list[tuple[str, dict[str, Any]]], field: str) -> list[str]:
    """The ``field`` text of every completion row."""
    fix = f"completion rows need a string `{field}`" + (
        "" if field != "text" else " (or set `field:` on the dataset)"
    )
    return [_text_field(row, field, where, required=True, fix=fix) for where, row in rows]


def _int_list(value: Any, key: str, where: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    ):
        raise ShardpoolError(f"{where}: `{key}` must be a list of integers; write token ids as JSON integers")
    return value


def pretokenized_samples(rows: list[tuple[str, dict[str, Any]]], vocab_size: int) -> list[Sample]:
    """Rows used exactly as given; only their shapes and id ranges are checked."""
    samples = []
    for where, row in rows:
        if "input_ids" not in row:
            guess = "alpaca" if "instruction" in row else "completion" if "text" in row else None
            fix = (
                f"set `type: {guess}` on the dataset"
                if guess
                else "add `input_ids` or set the dataset's `type`"
            )
            raise ShardpoolError(
                f"{where}: a dataset without `type` holds pre-tokenized rows, but this row has no `input_ids`; {fix}"
            )
        ids = _int_list(row["input_ids"], "input_ids", where)
        if not ids:
            raise ShardpoolError(f"{where}: `input_ids` is empty; remove the row")
        bad = next((token for token in ids if not 0 <= token < vocab_size), None)
        if bad is not None:
            raise ShardpoolError(
                f"{where}: token id {bad} is outside the tokenizer's vocabulary (0..{vocab_size - 1}); tokenize with the base model's tokenizer"
            )
        labels = _optional_int_list(row, "labels", where, len(ids)) or list(ids)
        bad = next((label for label in labels if label != IGNORE_INDEX and not 0 <= label < vocab_size), None)
        if bad is not None:
            raise ShardpoolError(
                f"{where}: label {bad} is neither -100 nor a token id below {vocab_size}; fix the labels"
            )
        mask = _optional_int_list(row, "attention_mask", where, len(ids)) or [1] * len(ids)
        if any(bit not in (0, 1) for bit in mask):
            raise ShardpoolError(f"{where}: `attention_mask` must hold only 0 and 1; fix the mask")
        samples.append(Sample(list(ids), list(labels), list(mask), where))
    return samples


def _optional_int_list(row: dict[str, Any], key: str, where: str, length: int) -> list[int] | None:
    if row.get(key) is None:
        return None
    values = _int_list(row[key], key, where)
    if len(values) != length:
        raise ShardpoolError(
            f"{where}: `{key}` has {len(values)} entries but `input_ids` has {length}; give one per token"
        )
    return values
