"""The messages that steer ranks: what a joining rank is told, and values that break a message refused."""

from __future__ import annotations

import pytest

from shardpool.contract.names import ContractError
from shardpool.elastic.messages import GrowSchedule, await_key, decode_step, schedule_key, step_key


def test_a_grow_schedule_reads_back_as_it_was_written() -> None:
    schedule = GrowSchedule(
        scheduler_steps=12, rates=[1.5e-4, 3e-5], loss_scale=[65536.0, 3.0], eval_before=2.25
    )
    assert GrowSchedule.decode(schedule.encode()) == schedule
    plain = GrowSchedule(scheduler_steps=0, rates=[2e-4], loss_scale=None, eval_before=None)
    assert GrowSchedule.decode(plain.encode().encode()) == plain  # the store hands back bytes


@pytest.mark.parametrize(
    "text",
    ['{"rates": [1.0], "loss_scale": null, "eval_before": null}', "not json", '{"scheduler_steps": 1, "rates": [], '
     '"loss_scale": null, "eval_before": null}', '{"scheduler_steps": -1, "rates": [1.0], "loss_scale": null, '
     '"eval_before": null}'],
)  # fmt: skip
def test_a_grow_schedule_without_its_position_or_rates_is_refused(text: str) -> None:
    with pytest.raises(ContractError, match="grow schedule"):
        GrowSchedule.decode(text)


def test_the_step_a_job_grows_after_is_a_step_number() -> None:
    assert decode_step(b"12") == 12
    for text in (b"twelve", b"-3", b""):
        with pytest.raises(ContractError, match="grow step"):
            decode_step(text)


def test_a_message_that_never_comes_names_what_was_awaited_and_the_bound() -> None:
    class _SilentStore:
        def wait(self, keys: list[str], timeout: object) -> None:
            raise RuntimeError("Socket Timeout\nmore")

    with pytest.raises(
        Exception, match=r"^no schedule within 2 s \(is the launcher gone\?\): Socket Timeout$"
    ):
        await_key(_SilentStore(), schedule_key(1), timeout_s=2.0, what="schedule")
    assert (schedule_key(1), step_key(1)) == ("shardpool/grow/1/schedule", "shardpool/grow/1/step")
