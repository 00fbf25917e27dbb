"""The pipeline's bookkeeping: each receive is posted before the stage computes the micro-batch ahead of
it (Inbox), and a stage lets its gradient sends go as the schedule proves them received."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from shardpool.data.rows import TokenRows
from shardpool.train.pipeline import BACKWARD_TAG, Inbox, StagePipe


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


class _Spec:
    """Stage 1 of 3: it receives activations and gradients and sends both ways."""

    index, num_stages, is_first, is_last = 1, 3, False, False


class _PipeWire(_RecordingWire):
    """Stands in for Wire under a middle stage: records sends and what is let go."""

    previous, next = "previous", "next"

    def send(self, tensor: torch.Tensor, link: Any, *, tag: int) -> None:
        self.log.append(f"send {link} {tag}")

    def delivered(self, link: Any, tag: int, *, through: int) -> None:
        self.log.append(f"delivered {link} {tag} through {through}")


class _Stage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, hidden: torch.Tensor, **_: Any) -> torch.Tensor:
        return hidden * self.scale


def test_a_stage_lets_its_gradient_sends_go_as_the_activations_after_them_arrive() -> None:
    wire = _PipeWire()
    pipe = StagePipe(_Stage(), _Spec(), wire, torch.device("cpu"), hidden_size=4, packed=True)  # type: ignore[arg-type]
    ids = torch.zeros((1, 2), dtype=torch.int64)
    rows = [TokenRows(input_ids=ids, labels=ids, attention_mask=ids + 1, position_ids=ids) for _ in range(6)]
    pipe.run_schedule("1f1b", rows, step_label_tokens=6)
    let_go = [entry for entry in wire.log if entry.startswith("delivered previous")]
    # Stage 0 of 3 runs B0 before F4 and B1 before F5 (LINK_SLACK_FORWARDS included): activation 4
    # proves this stage's first gradient received, activation 5 its second.
    assert let_go == [
        f"delivered previous {BACKWARD_TAG} through 0",
        f"delivered previous {BACKWARD_TAG} through 1",
    ]
    for entry in let_go:  # as the activation is taken (its wait, the next receive posted), before its forward
        at = wire.log.index(entry)
        before = [done for done in wire.log[:at] if not done.startswith("post")][-1]
        assert before.startswith("wait") and wire.log[at + 1] == "send next 1", wire.log
    assert [entry for entry in wire.log if entry.startswith("send previous")] == [
        f"send previous {BACKWARD_TAG}"
    ] * 6
