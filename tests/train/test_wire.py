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


def test_sends_that_completed_are_let_go_at_the_next_send_and_the_rest_at_flush(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sends: list[_Send] = []

    def isend(tensor: torch.Tensor, *, dst: int, group: Any, tag: int) -> _Send:
        sends.append(_Send())
        return sends[-1]

    monkeypatch.setattr(process_group.dist, "isend", isend)
    link = Link(peer=1, group=None, staged=False, pinned=False)
    wire = Wire(torch.device("cpu"), torch.float32, torch.float32, previous=None, next=link)
    wire.send(torch.zeros(2), link, tag=1)
    wire.send(torch.ones(2), link, tag=1)
    assert [torch.equal(kept, torch.ones(2)) for _, kept in wire.pending] == [False, True]
    sends[0].done = True
    wire.send(torch.full((2,), 2.0), link, tag=1)
    # The first send's buffer is no longer held; the second is still on the wire, the third new.
    assert [work for work, _ in wire.pending] == sends[1:]
    assert wire.bytes_sent == 3 * 2 * 4
    wire.flush()
    assert wire.pending == [] and [send.waited for send in sends] == [False, True, True]
