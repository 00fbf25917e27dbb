"""Wire.send's bookkeeping of sends in flight (pure logic: torch.distributed's isend is replaced)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardpool.train import process_group
from shardpool.train.process_group import Link, Wire


class _Send:
    """A send's work handle whose completion the test decides (NCCL's reports it by itself)."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        self.waited = True
        return True


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> list[_Send]:
    """Every send the wire starts, in order (torch.distributed's isend replaced)."""
    started: list[_Send] = []

    def isend(tensor: torch.Tensor, *, dst: int, group: Any, tag: int) -> _Send:
        started.append(_Send())
        return started[-1]

    monkeypatch.setattr(process_group.dist, "isend", isend)
    return started


def test_sends_that_completed_are_let_go_at_the_next_send_and_the_rest_at_flush(sends: list[_Send]) -> None:
    link = Link(peer=1, send_group=None, recv_group=None, staged=False, pinned=False)
    wire = Wire(torch.device("cpu"), torch.float32, torch.float32, previous=None, next=link)
    wire.send(torch.zeros(2), link, tag=1)
    wire.send(torch.ones(2), link, tag=1)
    assert [torch.equal(sent.payload, torch.ones(2)) for sent in wire.pending] == [False, True]
    sends[0].done = True
    wire.send(torch.full((2,), 2.0), link, tag=1)
    # The first send's buffer is no longer held; the second is still on the wire, the third new.
    assert [sent.work for sent in wire.pending] == sends[1:]
    assert wire.bytes_sent == 3 * 2 * 4
    wire.flush()
    assert wire.pending == [] and [send.waited for send in sends] == [False, True, True]


def test_a_delivered_send_is_let_go_by_its_place_on_its_channel_whatever_was_let_go_before(
    sends: list[_Send],
) -> None:
    """gloo: a send is complete only once waited for, so the pipeline says when the neighbour has it."""
    after = Link(peer=2, send_group=None, recv_group=None, staged=False, pinned=False)
    before = Link(0, None, None, False, False)
    wire = Wire(torch.device("cpu"), torch.float32, torch.float32, previous=before, next=after)
    for index in range(3):
        wire.send(torch.full((2,), float(index)), after, tag=1)  # activations 0, 1, 2
    wire.send(torch.zeros(2), before, tag=2)  # a gradient, another channel
    sends[0].done = True  # completed by itself (NCCL) and let go at the next send
    wire.send(torch.full((2,), 3.0), after, tag=1)
    assert [sent.seq for sent in wire.pending if sent.peer == 2] == [1, 2, 3]
    wire.delivered(after, 1, through=1)  # the gradient of micro-batch 1 came back
    assert [(sent.peer, sent.seq) for sent in wire.pending] == [(2, 2), (0, 0), (2, 3)]
    assert sends[1].waited and not sends[2].waited
    wire.flush()
    wire.send(torch.zeros(2), after, tag=1)
    assert [sent.seq for sent in wire.pending] == [0], "a step's sends count from 0 again"
