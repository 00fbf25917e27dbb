"""The messages that steer ranks: what a joining rank is told, values that break a message refused,
and values not sealed with the job's key refused (issue 39: the store trusted anyone)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest

from shardpool.contract.names import ContractError
from shardpool.elastic.messages import (
    ControlStore,
    GrowSchedule,
    await_key,
    beat_key,
    control_key,
    decision_key,
    decode_beat,
    decode_step,
    encode_beat,
    encode_ready,
    grow_key,
    peer_proof,
    ranks_ready,
    read_beat,
    ready_key,
    schedule_key,
    seal,
    step_key,
    unseal,
)
from shardpool.errors import ShardpoolError

KEY = control_key("a" * 64, addr="10.77.0.1", port=29500)


class _Store:
    """A rendezvous store on a dict: what any client of the real one can do (set anything)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.timeout = timedelta(seconds=1)

    def set(self, key: str, value: bytes) -> None:
        self.values[key] = bytes(value)

    def get(self, key: str) -> bytes:
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.timeout).total_seconds()
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise RuntimeError("Socket Timeout")
            time.sleep(0.01)

    def add(self, key: str, amount: int) -> int:
        self.values[key] = str(int(self.values.get(key, b"0")) + amount).encode()
        return int(self.values[key])


def test_a_sealed_value_opens_only_with_its_key_and_its_key_name() -> None:
    sealed = seal(KEY, grow_key(1), '{"job": {}}')
    assert unseal(KEY, grow_key(1), sealed) == b'{"job": {}}'
    with pytest.raises(ContractError, match=r"store value at 'shardpool/grow/2' fails its MAC"):
        unseal(KEY, grow_key(2), sealed)  # moved to another key (another generation)
    other_job = control_key("b" * 64, addr="10.77.0.1", port=29500)
    with pytest.raises(ContractError, match="fails its MAC"):
        unseal(other_job, grow_key(1), sealed)
    earlier_store = control_key("a" * 64, addr="10.77.0.1", port=29501)
    with pytest.raises(ContractError, match="fails its MAC"):
        unseal(earlier_store, grow_key(1), sealed)  # replayed from an earlier attempt's store


@pytest.mark.parametrize(
    ("garbled", "reason"),
    [
        (lambda sealed: sealed[:-1], "fails its MAC"),  # truncated value
        (lambda sealed: sealed[:20], "is not sealed"),  # truncated MAC
        (lambda sealed: sealed[:-1] + b"]", "fails its MAC"),  # one byte changed
        (lambda sealed: b'{"keep": true}', "is not sealed"),  # an outsider's plain value
        (lambda sealed: sealed[:4] + bytes(32) + b'{"keep": true}', "fails its MAC"),  # a forged MAC
    ],
)
def test_a_garbled_truncated_or_forged_value_is_refused_in_one_clear_line(
    garbled: Callable[[bytes], bytes], reason: str
) -> None:
    sealed = seal(KEY, decision_key(3), '{"layers": [[0, 3], [3, 6]]}')
    with pytest.raises(ContractError, match=reason) as refused:
        unseal(KEY, decision_key(3), garbled(sealed))
    assert "\n" not in str(refused.value) and "'shardpool/rebalance/3'" in str(refused.value)


def test_a_secret_too_short_to_be_one_is_refused() -> None:
    with pytest.raises(ShardpoolError, match="control secret is missing"):
        control_key("", addr="127.0.0.1", port=1)


def test_a_forged_value_reads_as_absent_and_is_logged_once(capsys: pytest.CaptureFixture[str]) -> None:
    inner = _Store()
    store = ControlStore(inner, KEY)
    inner.set(grow_key(1), b'{"job": {"stages": []}, "ranks": {}, "from": []}')
    assert store.check([grow_key(1)]), "the key is there"
    assert store.peek(grow_key(1)) is None and store.peek(grow_key(1)) is None
    assert capsys.readouterr().err == (
        "shardpool: refused a value in the rendezvous store: store value at 'shardpool/grow/1' is not "
        "sealed (48 bytes): forged or garbled\n"
    )
    store.set(grow_key(1), b"{}")
    assert store.peek(grow_key(1)) == b"{}"
    assert inner.values[grow_key(1)] != b"{}", "the stored value carries its seal"


def test_a_reader_waits_past_a_forged_value_for_the_honest_one() -> None:
    inner = _Store()
    store = ControlStore(inner, KEY)
    inner.set(step_key(1), b"99")  # the outsider writes first
    writer = ControlStore(inner, KEY)
    threading.Timer(0.3, lambda: writer.set(step_key(1), "12")).start()
    assert decode_step(await_key(store, step_key(1), timeout_s=5.0, what="step")) == 12
    inner.set(step_key(2), b"99")
    with pytest.raises(ShardpoolError, match=r"^no step within 0.5 s .*passes its MAC"):
        await_key(store, step_key(2), timeout_s=0.5, what="step")


def test_a_prefixed_store_seals_under_the_full_key_name() -> None:
    inner = _Store()
    group = ControlStore(inner, KEY).prefixed("shardpool/group/1/")
    group.set("0//cpu//0/0", b"address")
    assert unseal(KEY, "shardpool/group/1/0//cpu//0/0", inner.values["shardpool/group/1/0//cpu//0/0"])
    assert group.peek("0//cpu//0/0") == b"address"
    assert b"address" not in inner.values["shardpool/group/1/0//cpu//0/0"], "an outsider cannot read it"


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
    class _SilentStore(_Store):
        def wait(self, keys: list[str], timeout: object = None) -> None:
            raise RuntimeError("Socket Timeout\nmore")

    with pytest.raises(
        Exception,
        match=r"^no schedule within 2 s \(is the launcher gone\?\): no value at 'shardpool/grow/1/schedule' "
        r"within 2 s: Socket Timeout$",
    ):
        await_key(ControlStore(_SilentStore(), KEY), schedule_key(1), timeout_s=2.0, what="schedule")
    assert (schedule_key(1), step_key(1)) == ("shardpool/grow/1/schedule", "shardpool/grow/1/step")


# ----- beats and readiness are sealed values, not counters (issue 39) ---------------------------
def test_a_beat_is_a_sealed_number_and_an_unsealed_or_garbled_one_reads_as_no_beat(
    capsys: pytest.CaptureFixture[str],
) -> None:
    inner = _Store()
    store = ControlStore(inner, KEY)
    assert read_beat(store, 1) == 0, "no beat yet"
    store.set(beat_key(1), encode_beat(7))
    assert read_beat(store, 1) == 7 and decode_beat(b"7") == 7
    inner.add(beat_key(2), 1000)  # what an outsider's add did to a counter: now it is refused
    assert read_beat(store, 2) == 0
    inner.set(beat_key(1), b"9999")
    assert read_beat(store, 1) == 0
    assert "store value at 'shardpool/beat/1' is not sealed" in capsys.readouterr().err
    store.set(beat_key(1, 2), "not a number")  # sealed, but no beat: only a broken rank writes it
    assert read_beat(store, 1, 2) == 0
    with pytest.raises(ContractError, match="is not a beat number"):
        decode_beat(b"0")
    moved = seal(KEY, beat_key(0), encode_beat(50))  # rank 0's sealed beat copied to rank 1's key
    inner.set(beat_key(1), moved)
    assert read_beat(store, 1) == 0


def test_a_joining_rank_is_ready_only_when_its_own_sealed_key_says_so() -> None:
    inner = _Store()
    store = ControlStore(inner, KEY)
    assert ranks_ready(store, 1, [2, 3]) == []
    inner.add("shardpool/grow/1/ready", 2)  # the old shared counter, forged: counts for nothing
    inner.set(ready_key(1, 2), b'{"ready": 2}')  # unsealed
    assert ranks_ready(store, 1, [2, 3]) == []
    store.set(ready_key(1, 2), encode_ready(2))
    assert ranks_ready(store, 1, [2, 3]) == [2]
    inner.set(ready_key(1, 3), inner.values[ready_key(1, 2)])  # rank 2's sealed value moved to rank 3
    store.set(ready_key(2, 3), encode_ready(3))  # another generation's
    assert ranks_ready(store, 1, [2, 3]) == [2]
    store.set(ready_key(1, 3), encode_ready(2))  # sealed, but for another rank
    assert ranks_ready(store, 1, [2, 3]) == [2]
    store.set(ready_key(1, 3), encode_ready(3))
    assert ranks_ready(store, 1, [2, 3]) == [2, 3]


def test_a_peer_proof_answers_one_challenge_in_one_direction_under_the_runs_key() -> None:
    peers = ControlStore(_Store(), KEY).peer_key(1)
    nonce = peers.challenge()
    assert len(nonce) == 32 and peers.challenge() != nonce
    proof = peers.answer("world", prover=2, verifier=0, nonce=nonce)
    peers.check("world", prover=2, verifier=0, nonce=nonce, proof=proof)
    line = r"^rank 2 of group world \(generation 1\) did not prove the run's key: a process outside the run took its place$"
    stranger = ControlStore(_Store(), control_key("b" * 64, addr="10.77.0.1", port=29500)).peer_key(1)
    others = [
        stranger.answer("world", prover=2, verifier=0, nonce=nonce),  # another key
        peers.answer("world", prover=0, verifier=2, nonce=nonce),  # the challenger's own answer reflected
        peers.answer("world", prover=2, verifier=0, nonce=peers.challenge()),  # an answer to another nonce
        peers.answer("gloo[0, 2]", prover=2, verifier=0, nonce=nonce),  # another group's
        ControlStore(_Store(), KEY).peer_key(0).answer("world", prover=2, verifier=0, nonce=nonce),
        bytes(32),
    ]
    for forged in others:
        with pytest.raises(ShardpoolError, match=line):
            peers.check("world", prover=2, verifier=0, nonce=nonce, proof=forged)
    assert peer_proof(KEY, group="g", prover=0, verifier=1, nonce=nonce) != seal(KEY, "g", nonce)
