"""Padding samples into fixed-length rows, packing several into one row, and the packed rows' mask.

With ``sample_packing`` consecutive samples share a row: positions restart at 0 per sample, the
first label of each is -100 (no sample learns to predict across a boundary), and
:func:`block_causal_mask` keeps attention inside each sample.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from shardpool.data.rows import IGNORE_INDEX, Sample, TokenRows

__all__ = ["block_causal_mask", "to_rows"]


def to_rows(samples: list[Sample], sequence_len: int, pad_id: int, *, packed: bool) -> TokenRows:
    """Samples as rows of ``sequence_len`` tokens: one sample per row, or packed greedily."""
    if not samples:
        return TokenRows.empty(sequence_len)
    groups = _pack(samples, sequence_len) if packed else ([sample] for sample in samples)
    columns = list(zip(*(_row(group, sequence_len, pad_id, packed=packed) for group in groups), strict=True))
    return TokenRows(*(torch.tensor(column, dtype=torch.int64) for column in columns))


def _pack(samples: list[Sample], sequence_len: int) -> Iterator[list[Sample]]:
    """Group consecutive samples greedily into bins of at most ``sequence_len`` tokens."""
    group: list[Sample] = []
    used = 0
    for sample in samples:
        if group and used + len(sample.input_ids) > sequence_len:
            yield group
            group, used = [], 0
        group.append(sample)
        used += len(sample.input_ids)
    if group:
        yield group


def _row(group: list[Sample], sequence_len: int, pad_id: int, *, packed: bool) -> tuple[list[int], ...]:
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
