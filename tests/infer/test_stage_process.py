"""A stage's frames to the next stage: the header and a DECODE's hidden state in one message, read
back exactly (the hidden state bit for bit, since greedy tokens must equal peft's)."""

from __future__ import annotations

import pytest
import torch

from shardpool.errors import ShardpoolError
from shardpool.infer.messages import HEADER_LEN, Header, Kind
from shardpool.infer.stage_process import WIRE_DTYPE, frame_bytes, make_frame, read_frame

HIDDEN = 24


def test_a_decode_frame_carries_its_header_and_hidden_state_exactly() -> None:
    header = Header(Kind.DECODE, slot=3, length=1, position=1017, token=128_255, extra=0)
    hidden = torch.randn(1, 1, HIDDEN, generator=torch.Generator().manual_seed(0)) * 1e4
    hidden[0, 0, 0] = torch.finfo(WIRE_DTYPE).tiny  # the extremes survive too
    hidden[0, 0, 1] = -torch.finfo(WIRE_DTYPE).max

    frame = make_frame(header, HIDDEN, hidden)

    assert frame.dtype == torch.uint8
    assert frame.numel() == frame_bytes(HIDDEN) == HEADER_LEN * 8 + HIDDEN * 4
    read_header, read_hidden = read_frame(frame, HIDDEN)
    assert read_header == header
    assert read_hidden is not None and read_hidden.shape == (1, 1, HIDDEN)
    assert torch.equal(read_hidden.view(torch.int32), hidden.view(torch.int32))


@pytest.mark.parametrize("kind", [Kind.READY, Kind.PREFILL, Kind.RELEASE, Kind.STOP])
def test_other_frames_carry_their_header_alone(kind: Kind) -> None:
    header = Header(kind, slot=1, length=7, position=0, token=2, extra=64)

    read_header, read_hidden = read_frame(make_frame(header, HIDDEN), HIDDEN)

    assert (read_header, read_hidden) == (header, None)


def test_a_hidden_state_of_more_than_one_position_is_refused_in_one_line() -> None:
    header = Header(Kind.DECODE, slot=0, length=1, position=5, token=9)

    with pytest.raises(ShardpoolError, match=r"one position's hidden state \(24 values\), not 48$"):
        make_frame(header, HIDDEN, torch.zeros(1, 2, HIDDEN))
