"""What crosses the inference ring, as small integer headers: pure, torch-free.

Every hop starts with a header of :data:`HEADER_LEN` int64 values (:class:`Header`), so the
receiver knows what follows: the sampling settings of a new sequence (:data:`SAMPLING_LEN` float64
values), then its payload (token ids at stage 0, hidden states of ``length`` positions between
stages). The last stage answers the driver with a ``TOKEN`` header alone.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shardpool.errors import ShardpoolError

__all__ = ["HEADER_LEN", "SAMPLING_LEN", "Kind", "Header"]

HEADER_LEN = 6
SAMPLING_LEN = 4


class Kind(enum.IntEnum):
    """What a message asks of a stage (or tells the driver)."""

    READY = 1  # a stage is built; the last stage's READY tells the driver the ring is up
    PREFILL = 2  # a new sequence in ``slot``: its prompt, then sampling settings
    DECODE = 3  # the next token of ``slot`` (``token``, at ``position``)
    RELEASE = 4  # ``slot`` is done: drop its cache
    TOKEN = 5  # last stage → driver: ``slot`` sampled ``token``
    STOP = 6  # the engine is closing: pass it on and exit


@dataclass(frozen=True)
class Header:
    """One message's header: its kind, the sequence slot, how many positions follow and from where."""

    kind: Kind
    slot: int = 0
    length: int = 0
    position: int = 0
    token: int = 0

    def encode(self) -> list[int]:
        """The header as the :data:`HEADER_LEN` integers that go on the wire."""
        return [int(self.kind), self.slot, self.length, self.position, self.token, 0]

    @classmethod
    def decode(cls, values: list[int]) -> Header:
        """The header ``values`` stand for; one line when they are not a header this engine wrote."""
        if len(values) != HEADER_LEN:
            raise ShardpoolError(f"an inference header has {len(values)} values, expected {HEADER_LEN}")
        try:
            kind = Kind(values[0])
        except ValueError:
            raise ShardpoolError(f"unknown inference message kind {values[0]}") from None
        slot, length, position, token = values[1:5]
        if min(slot, length, position, token) < 0:
            raise ShardpoolError(f"a {kind.name} header holds a negative field: {values}")
        return cls(kind, slot, length, position, token)
