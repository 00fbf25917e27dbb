"""The re-balance protocol: check steps, decisions on the store, the forced test hook, hand-over sets."""

from __future__ import annotations

import pytest

from shardpool.contract.names import ContractError
from shardpool.contract.rebalance import (
    FORCE_ENV,
    FORCE_SHARES_ENV,
    check_step,
    forced_reshard,
    forced_shares,
)
from shardpool.elastic.handover_plan import handovers, key_layer
from shardpool.elastic.messages import decode_decision, decode_shares, encode_decision, encode_shares

CURRENT = [(0, 2), (2, 4), (4, 6)]


def test_check_comes_after_the_warmup_steps_and_only_where_a_step_follows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(FORCE_ENV, raising=False)
    assert check_step("auto", first_step=0, total_steps=10, num_stages=3) == 3
    assert (
        check_step("auto", first_step=4, total_steps=10, num_stages=3) == 7
    )  # a resumed run measures itself afresh
    assert check_step("auto", first_step=0, total_steps=3, num_stages=3) is None  # nothing left to gain
    assert check_step("off", first_step=0, total_steps=10, num_stages=3) is None
    assert check_step("auto", first_step=0, total_steps=10, num_stages=1) is None  # nothing to move
    monkeypatch.setenv(FORCE_ENV, "5:0-1,1-6")
    assert check_step("auto", first_step=0, total_steps=10, num_stages=3) == 5
    assert check_step("off", first_step=0, total_steps=10, num_stages=3) is None
    assert check_step("auto", first_step=5, total_steps=10, num_stages=3) is None


def test_forced_reshard_reads_the_hook_and_refuses_nonsense(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FORCE_ENV, raising=False)
    assert forced_reshard() is None
    monkeypatch.setenv(FORCE_ENV, "3:0-1,1-3,3-6")
    assert forced_reshard() == (3, [(0, 1), (1, 3), (3, 6)])
    monkeypatch.setenv(FORCE_ENV, "three")
    with pytest.raises(ContractError, match=FORCE_ENV):
        forced_reshard()


def test_decisions_round_trip_and_keep_is_none() -> None:
    assert decode_decision(encode_decision(None), current=CURRENT) is None
    assert decode_decision(encode_decision(CURRENT), current=CURRENT) is None  # the same split: keep
    new = [(0, 1), (1, 3), (3, 6)]
    assert decode_decision(encode_decision(new), current=CURRENT) == new
    assert decode_decision(encode_decision(new).encode(), current=CURRENT) == new


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "not JSON"),
        ('{"stages": 3}', "neither keep nor layers"),
        ('{"layers": [[0, 3], [3, 6]]}', "2 stages"),
        ('{"layers": [[0, 2], [3, 4], [4, 6]]}', "contiguous"),
        ('{"layers": [[0, 2], [2, 2], [2, 6]]}', "contiguous"),
        ('{"layers": [[0, 2], [2, 4], [4, 7]]}', "end at 7"),
    ],
)
def test_malformed_decisions_are_refused(text: str, message: str) -> None:
    with pytest.raises(ContractError, match=message):
        decode_decision(text, current=CURRENT)


def test_handovers_name_each_moving_layer_once() -> None:
    assert handovers(CURRENT, CURRENT) == {}
    assert handovers(CURRENT, [(0, 1), (1, 3), (3, 6)]) == {(0, 1): [1], (1, 2): [3]}
    assert handovers(CURRENT, [(0, 4), (4, 5), (5, 6)]) == {(1, 0): [2, 3], (2, 1): [4]}
    # A layer may skip a stage: stage 0 hands layers 2..4 straight to stage 2.
    assert handovers([(0, 5), (5, 6), (6, 8)], [(0, 1), (1, 2), (2, 8)]) == {
        (0, 1): [1],
        (0, 2): [2, 3, 4],
        (1, 2): [5],
    }


def test_key_layer_finds_decoder_layers_only() -> None:
    assert key_layer("base_model.model.model.layers.12.self_attn.q_proj.lora_A.weight") == 12
    assert key_layer("base_model.model.lm_head.lora_B.weight") is None


def test_a_share_decision_keeps_the_replicas_and_the_step() -> None:
    assert decode_shares(encode_shares([12, 4]), current=[11, 5]) == [12, 4]
    assert decode_shares(encode_shares(None), current=[11, 5]) is None
    assert decode_shares(encode_shares([11, 5]), current=[11, 5]) is None  # nothing moves
    for shares, message in (([16], "each of 2 replicas"), ([10, 5], "step's 16"), ([16, 0], "at least 1")):
        with pytest.raises(ContractError, match=message):
            decode_shares(encode_shares(shares), current=[11, 5])
    with pytest.raises(ContractError, match="neither keep nor shares"):
        decode_shares('{"layers": [[0, 6]]}', current=[11, 5])


def test_the_forced_shares_hook_parses_or_says_the_format(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORCE_SHARES_ENV, "3:10,6")
    assert forced_shares() == (3, [10, 6])
    assert check_step("auto", first_step=0, total_steps=9, num_stages=1, data_parallel=True) == 3
    monkeypatch.setenv(FORCE_SHARES_ENV, "3:16")
    with pytest.raises(ContractError, match="expected STEP:SHARE,SHARE"):
        forced_shares()
    monkeypatch.delenv(FORCE_SHARES_ENV)
    assert check_step("auto", first_step=0, total_steps=9, num_stages=1) is None
    assert check_step("auto", first_step=0, total_steps=9, num_stages=1, data_parallel=True) == 3
