"""What crosses the inference ring, as small integer headers: pure, torch-free.

Every message starts with a header of :data:`HEADER_LEN` int64 values (:class:`Header`), so the
receiver knows what follows: for a new sequence its sampling settings (:data:`SAMPLING_LEN`
float64 values) and its stop token ids, then the payload (token ids at stage 0, hidden states of
``length`` positions between stages). From one stage to the next, the header travels in a frame
with room for one position's hidden state, which a ``DECODE`` fills: a decode step is one message
per link. The last stage picks each token, tells the driver (a ``TOKEN`` header alone) and, unless
the sequence has ended, hands it straight to stage 0 as the next ``DECODE``: a token's round goes
through the stages only, never through the driver.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shardpool.errors import ShardpoolError

__all__ = ["HEADER_LEN", "HEADER_TAG", "SAMPLING_LEN", "Kind", "Header"]

HEADER_LEN = 6
SAMPLING_LEN = 4
#: The gloo tag headers (and frames) travel on; what follows a header goes on tag 0.
HEADER_TAG = 1


class Kind(enum.IntEnum):
    """What a message asks of a stage (or tells the driver)."""

    READY = 1  # a stage is built; the last stage's READY tells the driver the ring is up
    PREFILL = 2  # driver → stage 0 → …: a new sequence in ``slot``: sampling, stop ids, prompt
    DECODE = 3  # last stage → stage 0 → …: the next token of ``slot`` (``token``, at ``position``)
    RELEASE = 4  # ``slot`` is done: drop its cache (``extra`` 1: it was cancelled, say RELEASED)
    TOKEN = 5  # last stage → driver: ``slot`` sampled ``token`` (``extra`` 1: its last one)
    STOP = 6  # the engine is closing: pass it on and exit
    CANCEL = 7  # driver → stage 0: continue ``slot`` no further; its next DECODE becomes a RELEASE
    RELEASED = 8  # last stage → driver: a cancelled ``slot`` is free on every stage


@dataclass(frozen=True)
class Header:
    """One message's header: its kind, the sequence slot, how many positions follow and from where.

    ``token`` is the token of a DECODE or TOKEN, and a PREFILL's number of stop ids; ``extra`` is
    a PREFILL's ``max_new_tokens``, and the flag of a TOKEN (the last) or a RELEASE (cancelled).
    """

    kind: Kind
    slot: int = 0
    length: int = 0
    position: int = 0
    token: int = 0
    extra: int = 0

    def encode(self) -> list[int]:
        """The header as the :data:`HEADER_LEN` integers that go on the wire."""
        return [int(self.kind), self.slot, self.length, self.position, self.token, self.extra]

    @classmethod
    def decode(cls, values: list[int]) -> Header:
        """The header ``values`` stand for; one line when they are not a header this engine wrote."""
        if len(values) != HEADER_LEN:
            raise ShardpoolError(f"an inference header has {len(values)} values, expected {HEADER_LEN}")
        try:
            kind = Kind(values[0])
        except ValueError:
            raise ShardpoolError(f"unknown inference message kind {values[0]}") from None
        slot, length, position, token, extra = values[1:6]
        if min(slot, length, position, token, extra) < 0:
            raise ShardpoolError(f"a {kind.name} header holds a negative field: {values}")
        return cls(kind, slot, length, position, token, extra)
