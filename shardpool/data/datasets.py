"""Datasets: JSONL files in, fixed-length token rows out.

Three kinds of JSONL rows are understood (see docs/data.md):

* ``type: alpaca``: ``instruction``, optional ``input``, ``output``; only the response is trained.
* ``type: completion``: one text field (``text`` unless ``field:`` names another); every token trained.
* no ``type``: pre-tokenized ``input_ids`` with optional ``labels`` and ``attention_mask``, used as given.

Every row becomes ``sequence_len`` tokens: truncated, then right-padded with the pad token (padding
never counts in the loss). With ``sample_packing`` several rows share one sequence. ``val_set_size``
holds out a seeded sample as the eval split. The training rows come out in the order they are
consumed: shuffled with ``seed``, or in file order when ``shuffle_merged_datasets`` is false.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mesh.files import AtomicFile
from shardpool.config import Config, DatasetSpec
from shardpool.errors import ShardpoolError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "IGNORE_INDEX",
    "PreparedData",
    "TokenRows",
    "block_causal_mask",
    "format_alpaca_prompt",
    "load_prepared",
    "load_tokenizer",
    "prepare_data",
    "save_prepared",
    "step_batches",
]

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
_PROMPT_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"
_FORMAT_NAME = "shardpool-prepared-data"
_FORMAT_VERSION = "1"
_FIELDS = ("input_ids", "labels", "attention_mask", "position_ids")


# --------------------------------------------------------------------------------------------------
# Row containers
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenRows:
    """Fixed-length rows; every tensor is ``[num_rows, sequence_len]`` int64.

    ``labels`` is -100 wherever no loss is taken (prompt, padding, packed boundaries); the shift
    that makes position t predict token t+1 happens inside the loss, not here.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        for name in _FIELDS:
            tensor = getattr(self, name)
            if tensor.dim() != 2 or tensor.shape != shape or tensor.dtype != torch.int64:
                raise ValueError(
                    f"TokenRows.{name} must be int64 of shape {tuple(shape)}, got {tensor.dtype} {tuple(tensor.shape)}"
                )

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def sequence_len(self) -> int:
        """Tokens per row."""
        return int(self.input_ids.shape[1])

    def select(self, indices: Sequence[int]) -> TokenRows:
        """The rows at ``indices``, in that order (a micro-batch, or a split)."""
        index = torch.as_tensor(list(indices), dtype=torch.int64)
        return TokenRows(*(getattr(self, name).index_select(0, index) for name in _FIELDS))

    @classmethod
    def empty(cls, sequence_len: int) -> TokenRows:
        """Zero rows of ``sequence_len`` tokens (the eval split when ``val_set_size`` is 0)."""
        return cls(*(torch.zeros((0, sequence_len), dtype=torch.int64) for _ in _FIELDS))


@dataclass(frozen=True)
class PreparedData:
    """The tokenized train and eval splits of a run.

    ``train`` is in consumption order. ``dropped_rows`` counts rows with no trainable token left
    after truncation; ``truncated_rows`` counts rows cut to ``sequence_len``.
    """

    train: TokenRows
    eval: TokenRows
    packed: bool
    dropped_rows: int = 0
    truncated_rows: int = 0


@dataclass(frozen=True)
class _Sample:
    """One tokenized row before padding; ``where`` is ``file:line`` for messages."""

    input_ids: list[int]
    labels: list[int]
    attention_mask: list[int]
    where: str


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


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


def format_alpaca_prompt(instruction: str, input: str = "") -> str:
    """The alpaca prompt shardpool trains with; the response follows it directly.

    An empty ``input`` leaves out the ``### Input:`` section.
    """
    if input:
        return _PROMPT_WITH_INPUT.format(instruction=instruction, input=input)
    return _PROMPT_NO_INPUT.format(instruction=instruction)


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


# --------------------------------------------------------------------------------------------------
# Reading JSONL
# --------------------------------------------------------------------------------------------------


def _read_jsonl(spec: DatasetSpec, index: int) -> list[tuple[str, dict[str, Any]]]:
    """The rows of one dataset as ``(file:line, object)``; blank lines are skipped."""
    path = Path(spec.path)
    if not path.is_file():
        raise ShardpoolError(
            f"dataset file {spec.path!r} (datasets[{index}].path) does not exist; check the path (relative to the current directory)"
        )
    rows: list[tuple[str, dict[str, Any]]] = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{spec.path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ShardpoolError(
                    f"{where}: invalid JSON ({error.msg} at column {error.colno}); fix the line"
                ) from None
            if not isinstance(row, dict):
                raise ShardpoolError(
                    f"{where}: expected a JSON object per line, got {type(row).__name__}; wrap the row in {{...}}"
                )
            rows.append((where, row))
    if not rows:
        raise ShardpoolError(
            f"dataset file {spec.path!r} has no rows; add JSON lines or remove it from `datasets`"
        )
    return rows


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


# --------------------------------------------------------------------------------------------------
# Tokenizing each kind
# --------------------------------------------------------------------------------------------------


def _alpaca_samples(rows: list[tuple[str, dict[str, Any]]], tokenizer: Any) -> list[_Sample]:
    """Prompt tokens (and bos) get label -100; the response and eos are trained."""
    fix = "alpaca rows need `instruction` and `output` (and optional `input`)"
    prompts: list[str] = []
    responses: list[str] = []
    for where, row in rows:
        instruction = _text_field(row, "instruction", where, required=True, fix=fix)
        extra = _text_field(row, "input", where, required=False, fix=fix)
        responses.append(_text_field(row, "output", where, required=True, fix=fix))
        prompts.append(format_alpaca_prompt(instruction, extra))
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
        labels = [IGNORE_INDEX] * len(prompt) + answer
        samples.append(_Sample(ids, labels, [1] * len(ids), where))
    return samples


def _completion_samples(rows: list[tuple[str, dict[str, Any]]], tokenizer: Any, field: str) -> list[_Sample]:
    """Text plus eos, every token trained."""
    fix = f"completion rows need a string `{field}`" + (
        "" if field != "text" else " (or set `field:` on the dataset)"
    )
    texts = [_text_field(row, field, where, required=True, fix=fix) for where, row in rows]
    head = [tokenizer.bos_token_id] if _adds_bos(tokenizer) else []
    eos = tokenizer.eos_token_id
    samples = []
    for (where, _), text_ids in zip(rows, _encode(tokenizer, texts), strict=True):
        ids = head + text_ids + [eos]
        samples.append(_Sample(ids, list(ids), [1] * len(ids), where))
    return samples


def _int_list(value: Any, key: str, where: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    ):
        raise ShardpoolError(f"{where}: `{key}` must be a list of integers; write token ids as JSON integers")
    return value


def _pretokenized_samples(rows: list[tuple[str, dict[str, Any]]], vocab_size: int) -> list[_Sample]:
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
        samples.append(_Sample(list(ids), list(labels), list(mask), where))
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


def _dataset_samples(spec: DatasetSpec, index: int, tokenizer: Any) -> list[_Sample]:
    rows = _read_jsonl(spec, index)
    if spec.type == "alpaca":
        return _alpaca_samples(rows, tokenizer)
    if spec.type == "completion":
        return _completion_samples(rows, tokenizer, spec.field or "text")
    return _pretokenized_samples(rows, len(tokenizer))


# --------------------------------------------------------------------------------------------------
# Truncation, split, order, packing
# --------------------------------------------------------------------------------------------------


def _has_target(labels: list[int]) -> bool:
    """True if the loss sees a label: position 0 is never predicted (nothing comes before it)."""
    return any(label != IGNORE_INDEX for label in labels[1:])


def _truncate(samples: list[_Sample], sequence_len: int) -> tuple[list[_Sample], int, int]:
    """Cut samples to ``sequence_len``; drop those with no trainable label left. Returns kept, dropped, truncated."""
    kept: list[_Sample] = []
    truncated = 0
    first_dropped = ""
    for sample in samples:
        if len(sample.input_ids) > sequence_len:
            truncated += 1
            sample = _Sample(
                sample.input_ids[:sequence_len],
                sample.labels[:sequence_len],
                sample.attention_mask[:sequence_len],
                sample.where,
            )
        if _has_target(sample.labels):
            kept.append(sample)
        elif not first_dropped:
            first_dropped = sample.where
    dropped = len(samples) - len(kept)
    if not kept:
        raise ShardpoolError(
            f"no row has a trainable token within sequence_len {sequence_len} (first: {first_dropped}); raise `sequence_len` or shorten the prompts"
        )
    if dropped:
        log.warning(
            "dropped %d of %d rows with no trainable token within sequence_len %d (first: %s)",
            dropped,
            len(samples),
            sequence_len,
            first_dropped,
        )
    return kept, dropped, truncated


def _val_count(num_rows: int, val_set_size: float) -> int:
    """Rows to hold out: a fraction rounded half up (at least 1 when positive), or a count."""
    if val_set_size <= 0:
        return 0
    if val_set_size < 1:
        return max(1, math.floor(num_rows * val_set_size + 0.5))
    return int(val_set_size)


def _split(samples: list[_Sample], val_set_size: float, seed: int) -> tuple[list[_Sample], list[_Sample]]:
    """A seeded sample of rows becomes eval; both splits keep file order."""
    count = _val_count(len(samples), val_set_size)
    if count >= len(samples):
        raise ShardpoolError(
            f"val_set_size {val_set_size:g} holds out {count} of {len(samples)} rows and leaves none to train on; lower `val_set_size`"
        )
    held = set(random.Random(f"shardpool-val:{seed}").sample(range(len(samples)), count))
    train = [sample for index, sample in enumerate(samples) if index not in held]
    evals = [sample for index, sample in enumerate(samples) if index in held]
    return train, evals


def _pack(samples: list[_Sample], sequence_len: int) -> Iterator[list[_Sample]]:
    """Group consecutive samples greedily into bins of at most ``sequence_len`` tokens."""
    group: list[_Sample] = []
    used = 0
    for sample in samples:
        if group and used + len(sample.input_ids) > sequence_len:
            yield group
            group, used = [], 0
        group.append(sample)
        used += len(sample.input_ids)
    if group:
        yield group


def _row(group: list[_Sample], sequence_len: int, pad_id: int, *, packed: bool) -> tuple[list[int], ...]:
    """Concatenate a group into one padded row: ids, labels, mask, positions.

    In a packed row the first label of every sample is -100, so no sample is trained to predict
    across a boundary, and positions restart at 0 per sample. Padding continues the positions of
    the row's last sample.
    """
    ids: list[int] = []
    labels: list[int] = []
    mask: list[int] = []
    positions: list[int] = []
    for sample in group:
        sample_labels = list(sample.labels)
        if packed:
            sample_labels[0] = IGNORE_INDEX
        ids += sample.input_ids
        labels += sample_labels
        mask += sample.attention_mask
        positions += range(len(sample.input_ids))
    padding = sequence_len - len(ids)
    last_start = positions[-1] + 1
    ids += [pad_id] * padding
    labels += [IGNORE_INDEX] * padding
    mask += [0] * padding
    positions += range(last_start, last_start + padding)
    return ids, labels, mask, positions


def _to_rows(samples: list[_Sample], sequence_len: int, pad_id: int, *, packed: bool) -> TokenRows:
    if not samples:
        return TokenRows.empty(sequence_len)
    groups = _pack(samples, sequence_len) if packed else ([sample] for sample in samples)
    columns = list(zip(*(_row(group, sequence_len, pad_id, packed=packed) for group in groups), strict=True))
    return TokenRows(*(torch.tensor(column, dtype=torch.int64) for column in columns))


def prepare_data(config: Config, tokenizer: PreTrainedTokenizerBase) -> PreparedData:
    """Tokenize every dataset of ``config`` and cut the train and eval rows the runtime consumes.

    Order of operations: read and tokenize each file (datasets merged in config order), truncate
    to ``sequence_len`` and drop rows with nothing left to train, hold out the eval split, shuffle
    the training rows with ``seed`` (unless ``shuffle_merged_datasets: false``), then pack (if
    ``sample_packing``) and pad.
    """
    samples: list[_Sample] = []
    for index, spec in enumerate(config.datasets):
        samples += _dataset_samples(spec, index, tokenizer)
    samples, dropped, truncated = _truncate(samples, config.sequence_len)
    train, evals = _split(samples, config.val_set_size, config.seed)
    if config.shuffle_merged_datasets:
        random.Random(config.seed).shuffle(train)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    packed = config.sample_packing
    return PreparedData(
        train=_to_rows(train, config.sequence_len, pad_id, packed=packed),
        eval=_to_rows(evals, config.sequence_len, pad_id, packed=packed),
        packed=packed,
        dropped_rows=dropped,
        truncated_rows=truncated,
    )


def block_causal_mask(position_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A ``[batch, 1, L, L]`` boolean mask (True = may attend) for packed rows.

    A query attends to earlier keys of its own sample only: samples start where position_ids
    drops to 0, and keys with attention_mask 0 are hidden. For unpacked rows this is the plain
    causal mask with padding hidden.
    """
    starts = (position_ids == 0).to(torch.int64)
    segment = torch.cumsum(starts, dim=1)
    length = position_ids.shape[1]
    causal = torch.ones((length, length), dtype=torch.bool, device=position_ids.device).tril()
    same = segment[:, :, None] == segment[:, None, :]
    keys = attention_mask.bool()[:, None, :]
    return (same & causal & keys)[:, None, :, :]


# --------------------------------------------------------------------------------------------------
# Save / load
# --------------------------------------------------------------------------------------------------


def save_prepared(data: PreparedData, path: str | os.PathLike[str]) -> None:
    """Write both splits to one safetensors file, atomically (temporary file, then rename).

    Stage processes load the same file instead of tokenizing again; the header carries ``packed``
    and the counters, so the file alone restores :class:`PreparedData`.
    """
    from safetensors.torch import save_file

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"{split}.{name}": getattr(rows, name).contiguous()
        for split, rows in (("train", data.train), ("eval", data.eval))
        for name in _FIELDS
    }
    metadata = {
        "format": _FORMAT_NAME,
        "version": _FORMAT_VERSION,
        "packed": "true" if data.packed else "false",
        "dropped_rows": str(data.dropped_rows),
        "truncated_rows": str(data.truncated_rows),
        "sequence_len": str(data.train.sequence_len),
    }
    with AtomicFile(target) as file:
        save_file(tensors, file.temp_path, metadata=metadata)
        file.commit()


def load_prepared(path: str | os.PathLike[str]) -> PreparedData:
    """Read a file written by :func:`save_prepared`."""
    from safetensors import safe_open

    source = Path(path)
    if not source.is_file():
        raise ShardpoolError(f"prepared data file {str(source)!r} does not exist; prepare the data again")
    try:
        with safe_open(str(source), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception:
        raise ShardpoolError(
            f"{str(source)!r} is not a readable safetensors file; delete it and prepare the data again"
        ) from None
    if metadata.get("format") != _FORMAT_NAME or metadata.get("version") != _FORMAT_VERSION:
        raise ShardpoolError(
            f"{str(source)!r} is not shardpool prepared data (version {_FORMAT_VERSION}); delete it and prepare again"
        )
    try:
        train, evals = (
            TokenRows(*(tensors[f"{split}.{name}"] for name in _FIELDS)) for split in ("train", "eval")
        )
    except (KeyError, ValueError):
        raise ShardpoolError(
            f"{str(source)!r} is incomplete or malformed; delete it and prepare the data again"
        ) from None
    return PreparedData(
        train=train,
        eval=evals,
        packed=metadata.get("packed") == "true",
        dropped_rows=int(metadata.get("dropped_rows", "0")),
        truncated_rows=int(metadata.get("truncated_rows", "0")),
    )


# --------------------------------------------------------------------------------------------------
# Step schedule
# --------------------------------------------------------------------------------------------------


def step_batches(
    num_rows: int,
    *,
    micro_batch_size: int,
    micro_batches_per_step: int,
    num_epochs: float,
    max_steps: int | None,
    shuffle_each_epoch: bool,
    seed: int,
) -> list[list[list[int]]]:
    """Plan every optimizer step: steps -> micro-batches -> row indices.

    The epochs form one stream of row indices: epoch 0 in row order (the rows are already in
    consumption order), each later epoch ``e`` reshuffled with ``random.Random(seed + e)`` when
    ``shuffle_each_epoch``, else in row order again. Rows left over at an epoch's end are carried
    into the next epoch's first step; only the rows after the last whole step are dropped. A
    fractional ``num_epochs`` takes ``floor(num_rows * num_epochs)`` rows of that stream, and
    ``max_steps`` caps the step count (with ``num_epochs`` infinite it alone sets it).
    """
    if micro_batch_size < 1 or micro_batches_per_step < 1:
        raise ValueError("micro_batch_size and micro_batches_per_step must be at least 1")
    per_step = micro_batch_size * micro_batches_per_step
    if num_rows < per_step:
        raise ShardpoolError(
            f"dataset has {num_rows} training rows but one step needs {per_step} "
            f"({micro_batch_size} × {micro_batches_per_step} micro-batches); lower micro_batch_size or gradient_accumulation_steps"
        )
    steps = _step_count(num_rows, per_step, num_epochs, max_steps)
    stream = _index_stream(num_rows, steps * per_step, shuffle_each_epoch, seed)
    return [
        [
            stream[start + micro * micro_batch_size : start + (micro + 1) * micro_batch_size]
            for micro in range(micro_batches_per_step)
        ]
        for start in range(0, steps * per_step, per_step)
    ]


def _step_count(num_rows: int, per_step: int, num_epochs: float, max_steps: int | None) -> int:
    if not math.isfinite(num_epochs):
        if max_steps is None:
            raise ShardpoolError("`num_epochs` is not finite and `max_steps` is unset; set one of them")
        return max_steps
    if num_epochs <= 0:
        raise ShardpoolError(f"`num_epochs` must be positive, got {num_epochs:g}; raise it")
    covered = math.floor(num_rows * num_epochs + 1e-9)  # 100 × 0.29 is 28.999…, meant as 29
    steps = covered // per_step
    if steps == 0:
        raise ShardpoolError(
            f"num_epochs {num_epochs:g} covers {covered} rows but one step needs {per_step}; raise `num_epochs`"
        )
    return steps if max_steps is None else min(steps, max_steps)


def _index_stream(num_rows: int, length: int, shuffle_each_epoch: bool, seed: int) -> list[int]:
    stream: list[int] = []
    epoch = 0
    while len(stream) < length:
        order = list(range(num_rows))
        if epoch > 0 and shuffle_each_epoch:
            random.Random(seed + epoch).shuffle(order)
        stream += order
        epoch += 1
    return stream[:length]
