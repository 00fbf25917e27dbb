"""The shapes a dataset takes on its way to the runtime: samples, fixed-length rows, both splits.

A :class:`Sample` is one tokenized row before padding. :class:`TokenRows` are rows cut and padded
to ``sequence_len``, as stages consume them. :class:`PreparedData` holds a run's train and eval
rows. ``labels`` is ``IGNORE_INDEX`` (-100) wherever no loss is taken.

torch is imported only where tensors are made, so reading and tokenizing a dataset into samples
(``shardpool validate``) never loads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["IGNORE_INDEX", "ROW_FIELDS", "PreparedData", "Sample", "TokenRows"]

IGNORE_INDEX = -100
ROW_FIELDS = ("input_ids", "labels", "attention_mask", "position_ids")


@dataclass(frozen=True)
class Sample:
    """One tokenized row before padding; ``where`` is ``file:line`` for messages."""

    input_ids: list[int]
    labels: list[int]
    attention_mask: list[int]
    where: str


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
        import torch

        shape = self.input_ids.shape
        for name in ROW_FIELDS:
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
        import torch

        index = torch.as_tensor(list(indices), dtype=torch.int64)
        return TokenRows(*(getattr(self, name).index_select(0, index) for name in ROW_FIELDS))

    @classmethod
    def empty(cls, sequence_len: int) -> TokenRows:
        """Zero rows of ``sequence_len`` tokens (the eval split when ``val_set_size`` is 0)."""
        import torch

        return cls(*(torch.zeros((0, sequence_len), dtype=torch.int64) for _ in ROW_FIELDS))


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
