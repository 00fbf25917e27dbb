"""The pure parts of growing a job in place: which ranks keep their process, and what moves where."""

from __future__ import annotations

import pytest

from shardpool.contract.names import ContractError
from shardpool.elastic.handover_plan import (
    growth_moves,
    in_place_ranks,
    job_growth_moves,
    position_owners,
    state_position,
)
from shardpool.elastic.messages import decode_growth, encode_growth


def test_running_ranks_keep_their_members_and_order() -> None:
    assert in_place_ranks(["a", "b"], ["a", "c", "b"], old_replicas=1, new_replicas=1) == {0: 0, 1: 2}
    assert in_place_ranks(["a", "b"], ["c", "a", "b"], old_replicas=1, new_replicas=1) == {0: 1, 1: 2}
    assert in_place_ranks(["a", "a", "b"], ["a", "b", "a", "c"], old_replicas=1, new_replicas=1) == {
        0: 0,
        1: 2,
        2: 1,
    }


@pytest.mark.parametrize(
    ("old", "new", "replicas"),
    [
        (["a", "b"], ["a", "c"], (1, 1)),  # b loses its stage: not a growth
        (["a", "b"], ["a", "a", "b"], (1, 1)),  # a gains a second process
        (["a", "b"], ["a", "b"], (1, 1)),  # nothing joins
        (["a", "b"], ["a", "b", "c", "d"], (1, 2)),  # the replica count changes the batches
    ],
)
def test_what_cannot_grow_in_place(old: list[str], new: list[str], replicas: tuple[int, int]) -> None:
    assert in_place_ranks(old, new, old_replicas=replicas[0], new_replicas=replicas[1]) is None


def test_positions_of_state_names() -> None:
    assert state_position("lora.base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight", 6) == 3
    assert state_position("optim.base_model.model.model.layers.0.mlp.up_proj.lora_B.weight.exp_avg", 6) == 0
    assert state_position("lora.base_model.model.model.embed_tokens.lora_embedding_A", 6) == -1
    assert state_position("lora.base_model.model.lm_head.lora_A.weight", 6) == 6


def test_a_joiner_in_the_middle_takes_layers_from_both_sides() -> None:
    # 2 stages [0,3) [3,6) on ranks 0, 1 become [0,2) [2,4) [4,6), the joiner rank 1, old rank 1 -> 2
    moves = job_growth_moves([(0, 3), (3, 6)], [(0, 2), (2, 4), (4, 6)], replicas=1, renumber={0: 0, 1: 2})
    assert moves == {(0, 1): [2], (2, 1): [3]}


def test_a_joiner_first_takes_the_embedding() -> None:
    moves = job_growth_moves([(0, 3), (3, 6)], [(0, 2), (2, 4), (4, 6)], replicas=1, renumber={0: 1, 1: 2})
    assert moves == {(1, 0): [-1, 0, 1], (2, 1): [3]}


def test_replicas_hand_over_within_themselves() -> None:
    # 2 replicas of 1 stage (ranks 0, 1) grow to 2 replicas of 2 stages; joiners are ranks 1 and 3
    moves = job_growth_moves([(0, 4)], [(0, 2), (2, 4)], replicas=2, renumber={0: 0, 1: 2})
    assert moves == {(0, 1): [2, 3, 4], (2, 3): [2, 3, 4]}


def test_owners_and_moves_refuse_different_models() -> None:
    assert position_owners([(0, 2), (2, 3)], [5, 7]) == {-1: 5, 0: 5, 1: 5, 2: 7, 3: 7}
    with pytest.raises(ContractError, match="same layers"):
        growth_moves({0: 1}, {0: 1, 1: 1})


def test_the_decision_round_trips_and_bad_ones_are_refused() -> None:
    text = encode_growth({"stages": []}, {0: 0, 1: 2}, [(0, 3), (3, 6)])
    growth = decode_growth(text)
    assert (
        growth.job == {"stages": []}
        and growth.ranks == {0: 0, 1: 2}
        and growth.old_layers == [(0, 3), (3, 6)]
    )
    with pytest.raises(ContractError, match="not a job"):
        decode_growth("[]")
    with pytest.raises(ContractError, match="two running ranks one rank"):
        decode_growth(encode_growth({}, {0: 1, 1: 1}, [(0, 1)]))
