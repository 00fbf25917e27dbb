"""The pipeline's Inbox: each receive is posted before the stage computes the micro-batch ahead of it."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from shardpool.train.pipeline import Inbox


class _RecordingWire:
    """Stands in for Wire: records when receives are posted and waited for (pure ordering logic)."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def post_recv(self, shape: tuple[int, ...], link: Any, *, tag: int) -> Any:
        wire, index = self, len([entry for entry in self.log if entry.startswith("post")])
        self.log.append(f"post {index}")

        class _Posted:
            def wait(self) -> torch.Tensor:
                wire.log.append(f"wait {index}")
                return torch.full(shape, float(index))

        return _Posted()


def test_the_next_receive_is_posted_as_soon_as_the_current_one_is_taken() -> None:
    wire = _RecordingWire()
    inbox = Inbox(wire, link=None, tag=1, shapes=deque((index, (1, 2, 3)) for index in range(3)))  # type: ignore[arg-type]
    taken = []
    for index in range(3):
        taken.append(float(inbox.take(index)[0, 0, 0]))
        wire.log.append(f"compute {index}")
    assert taken == [0.0, 1.0, 2.0]
    assert wire.log == [
        "post 0", "wait 0", "post 1", "compute 0",
        "wait 1", "post 2", "compute 1",
        "wait 2", "compute 2",
    ]  # fmt: skip
