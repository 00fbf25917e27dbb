"""shardpool.train.preference: TRL's DPO and IPO losses and metrics from completion log-probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from shardpool.train.preference import PairLogps, PreferenceObjective, completion_logps, pair_losses


def _pairs(chosen: list[float], rejected: list[float], tokens: tuple[int, int] = (1, 1)) -> PairLogps:
    count = len(chosen)
    return PairLogps(
        torch.tensor(chosen),
        torch.tensor(rejected),
        torch.full((count,), tokens[0]),
        torch.full((count,), tokens[1]),
    )


def test_sigmoid_is_minus_logsigmoid_of_beta_times_the_log_ratio_margin() -> None:
    policy = _pairs([-10.0, -5.0], [-12.0, -4.0])
    reference = _pairs([-11.0, -5.0], [-11.0, -5.0])
    losses, sums = pair_losses(PreferenceObjective("sigmoid", 0.1), policy, reference)
    # pair 0: (1) - (-1) = 2; pair 1: 0 - 1 = -1
    assert losses.tolist() == pytest.approx([math.log1p(math.exp(-0.2)), math.log1p(math.exp(0.1))])
    chosen_rewards, rejected_rewards = [0.1, 0.0], [-0.1, 0.1]
    assert sums.tolist() == pytest.approx(
        [sum(chosen_rewards), sum(rejected_rewards), 1.0, 0.2 + (-0.1), -15.0, -16.0]
    )


def test_ipo_squares_the_per_token_margin_minus_one_over_two_beta() -> None:
    policy = _pairs([-10.0], [-12.0], tokens=(4, 2))
    reference = _pairs([-11.0], [-11.0], tokens=(4, 2))
    losses, _ = pair_losses(PreferenceObjective("ipo", 0.1), policy, reference)
    assert losses.tolist() == pytest.approx([(1 / 4 - (-1 / 2) - 5.0) ** 2])


def test_the_gradient_flows_through_the_policy_only() -> None:
    chosen = torch.tensor([-3.0], requires_grad=True)
    policy = PairLogps(chosen, torch.tensor([-4.0]), torch.tensor([2]), torch.tensor([2]))
    losses, sums = pair_losses(PreferenceObjective("sigmoid", 0.5), policy, _pairs([-3.0], [-4.0]))
    losses.sum().backward()
    assert chosen.grad is not None and float(chosen.grad) == pytest.approx(-0.5 * 0.5)
    assert not sums.requires_grad


def test_completion_logps_sum_only_the_labelled_next_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5)
    labels = torch.tensor([[-100, 3, 1, -100], [-100, -100, 2, 4]])
    logps, tokens = completion_logps(logits, labels)
    log_probs = torch.log_softmax(logits, dim=-1)
    expected = [
        float(log_probs[0, 0, 3] + log_probs[0, 1, 1]),
        float(log_probs[1, 1, 2] + log_probs[1, 2, 4]),
    ]
    assert logps.tolist() == pytest.approx(expected, rel=1e-6)
    assert tokens.tolist() == [2, 2]


def test_a_micro_batch_splits_into_chosen_then_rejected_rows() -> None:
    pairs = PairLogps.split(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([5, 6, 7, 8]))
    assert pairs.chosen.tolist() == [1.0, 2.0] and pairs.rejected.tolist() == [3.0, 4.0]
    assert pairs.chosen_tokens.tolist() == [5, 6] and pairs.rejected_tokens.tolist() == [7, 8]
    with pytest.raises(ValueError, match="even number of rows"):
        PairLogps.split(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 1, 1]))
