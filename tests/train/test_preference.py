"""shardpool.train.preference: TRL's DPO and IPO losses and metrics from completion log-probabilities."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from shardpool.data.rows import TokenRows
from shardpool.model.lora import LoraSettings
from shardpool.model.stage import BaseSettings, StageSpec, build_stage
from shardpool.train.pipeline import StagePipe, _adapter_disabled
from shardpool.train.preference import (
    PairLogps,
    PreferenceObjective,
    completion_logps,
    completion_positions,
    micro_batch_losses,
    pair_losses,
)


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


def test_the_completion_positions_logits_alone_give_the_same_log_probabilities_and_gradient() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 7, requires_grad=True)
    # a row without completion, one whose completion ends the row, two with completions inside
    labels = torch.tensor(
        [
            [-100] * 6,
            [-100, -100, -100, 2, 5, 6],
            [-100, 1, 3, -100, -100, -100],
            [-100, -100, 4, 0, -100, -100],
        ]
    )
    keep = completion_positions(labels)
    assert keep.tolist()[1] == [False, False, True, True, True, False]
    full, full_tokens = completion_logps(logits, labels)
    kept, kept_tokens = completion_logps(logits[keep], labels, kept=True)
    assert kept.tolist() == pytest.approx(full.tolist(), rel=1e-6) and kept_tokens.tolist() == [0, 3, 2, 2]
    assert full_tokens.tolist() == kept_tokens.tolist()
    (full_grad,) = torch.autograd.grad(full.sum(), logits)
    (kept_grad,) = torch.autograd.grad(kept.sum(), logits)
    assert torch.allclose(kept_grad, full_grad, atol=1e-7)
    with pytest.raises(ValueError, match="kept logits"):
        completion_logps(logits[:, :2].reshape(-1, 7), labels, kept=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "objective",
    [PreferenceObjective("sigmoid", 0.1), PreferenceObjective("simpo", 2.0, cpo_alpha=0.5)],
    ids=["dpo", "simpo"],
)
def test_a_last_stage_computing_only_completion_logits_trains_as_with_every_logit(
    tiny_model: Path, objective: PreferenceObjective
) -> None:
    """The last stage's norm and lm_head on the completion positions alone: the same losses,
    metrics and LoRA gradients as from every position's logits."""
    lora = LoraSettings(
        r=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj", "down_proj"), init_from=None
    )
    stage = build_stage(tiny_model, StageSpec(1, 2, 3, 6, "cpu"), BaseSettings(), lora, seed=1)
    torch.manual_seed(1)
    hidden = torch.randn(4, 12, int(stage.hf_config.hidden_size))
    labels = torch.full((4, 12), -100)
    labels[:, 5:9] = torch.randint(0, int(stage.hf_config.vocab_size), (4, 4))
    labels[1, 9:] = 7
    rows = TokenRows(
        torch.zeros_like(labels), labels, torch.ones_like(labels), torch.arange(12).expand(4, 12).clone()
    )
    reference = PairLogps.split(torch.tensor([-30.0, -31.0, -29.0, -33.0]), torch.tensor([4, 7, 4, 4]))
    results = []
    for keep in (None, completion_positions(labels)):
        stage.zero_grad(set_to_none=True)
        logits = stage(hidden, attention_mask=rows.attention_mask, position_ids=rows.position_ids, keep=keep)
        losses, sums = micro_batch_losses(objective, logits, rows, reference, kept=keep is not None)
        losses.sum().backward()
        grads = [param.grad.clone() for param in stage.lora_parameters()]
        results.append((losses.detach(), sums, grads))
    (full_losses, full_sums, full_grads), (kept_losses, kept_sums, kept_grads) = results
    assert torch.allclose(kept_losses, full_losses, rtol=1e-5, atol=1e-6)
    assert torch.allclose(kept_sums, full_sums, rtol=1e-5, atol=1e-5)
    assert any(float(grad.abs().max()) > 0 for grad in full_grads)
    for kept_grad, full_grad in zip(kept_grads, full_grads, strict=True):
        assert torch.allclose(kept_grad, full_grad, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_the_folded_references_adapter_switch_is_pefts_disable_adapter(tiny_model: Path) -> None:
    """The stage's LoRA layers switched off one by one compute what peft's ``disable_adapter``
    computes (the base alone), and switched on again leave the adapter trainable as before."""
    lora = LoraSettings(r=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "down_proj"), init_from=None)
    stage = build_stage(tiny_model, StageSpec(0, 2, 0, 3, "cpu"), BaseSettings(), lora, seed=1)
    with torch.no_grad():
        for param in stage.lora_parameters():
            param.normal_(std=0.2)  # a moved adapter: on and off differ
    ids = torch.randint(0, int(stage.hf_config.vocab_size), (2, 10))
    positions = {"attention_mask": torch.ones_like(ids), "position_ids": torch.arange(10).expand(2, 10)}
    pipe = StagePipe(stage, stage.spec, wire=None, device=torch.device("cpu"), hidden_size=0, packed=False)  # type: ignore[arg-type]
    with torch.no_grad():
        policy = stage(ids, **positions)
        with stage.peft_model.disable_adapter():
            base = stage(ids, **positions)
        with _adapter_disabled(pipe._lora_layers()):
            switched = stage(ids, **positions)
        after = stage(ids, **positions)
    assert torch.equal(switched, base) and not torch.allclose(base, policy)
    assert torch.equal(after, policy)
    assert all(param.requires_grad for param in stage.lora_parameters())


def test_orpo_reads_every_position() -> None:
    orpo = PreferenceObjective("orpo", 0.1)
    assert not orpo.reads_completions_only and PreferenceObjective("simpo", 2.0).reads_completions_only
    rows = TokenRows(*(torch.zeros(2, 3, dtype=torch.int64) for _ in range(4)))
    with pytest.raises(ValueError, match="every position"):
        micro_batch_losses(orpo, torch.zeros(0, 5), rows, None, kept=True)


def test_a_micro_batch_splits_into_chosen_then_rejected_rows() -> None:
    pairs = PairLogps.split(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([5, 6, 7, 8]))
    assert pairs.chosen.tolist() == [1.0, 2.0] and pairs.rejected.tolist() == [3.0, 4.0]
    assert pairs.chosen_tokens.tolist() == [5, 6] and pairs.rejected_tokens.tolist() == [7, 8]
    with pytest.raises(ValueError, match="even number of rows"):
        PairLogps.split(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 1, 1]))


def _trl_self(**settings: object) -> object:
    """Stand-in for a TRL trainer's ``self`` in its loss methods: the settings and a CPU device."""
    from types import SimpleNamespace

    return SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu")), **settings)


def test_label_smoothing_weighs_the_flipped_pair_as_trls_sigmoid_loss() -> None:
    """Conservative DPO, ``-logsigmoid(beta d) (1 - ls) - logsigmoid(-beta d) ls``, as earlier TRL
    releases computed the sigmoid loss (TRL 1.16 reads label_smoothing only in robust and exo_pair)."""
    policy = _pairs([-10.0, -5.0, -7.0], [-12.0, -4.0, -7.5])
    reference = _pairs([-11.0, -5.0, -6.0], [-11.0, -5.0, -8.0])
    losses, _ = pair_losses(PreferenceObjective("sigmoid", 0.3, label_smoothing=0.2), policy, reference)
    delta = torch.tensor([2.0, -1.0, -1.5])
    logsigmoid = torch.nn.functional.logsigmoid
    assert losses.tolist() == pytest.approx(
        (-logsigmoid(0.3 * delta) * 0.8 - logsigmoid(-0.3 * delta) * 0.2).tolist()
    )
    unsmoothed, _ = pair_losses(PreferenceObjective("sigmoid", 0.3), policy, reference)
    assert unsmoothed.tolist() == pytest.approx((-logsigmoid(0.3 * delta)).tolist())


def test_orpo_is_trls_odds_ratio_loss_plus_the_chosen_nll() -> None:
    """Against TRL's own ``ORPOTrainer.odds_ratio_loss`` on mean log-probabilities."""
    orpo = pytest.importorskip("trl.experimental.orpo")
    policy = _pairs([-6.0, -2.0, -9.0], [-8.0, -1.0, -9.5], tokens=(4, 2))
    nll = torch.tensor(1.25)
    losses, sums = pair_losses(PreferenceObjective("orpo", 0.2), policy, None, nll)
    chosen, rejected = policy.chosen / 4, policy.rejected / 2
    trl_losses, chosen_rewards, rejected_rewards, ratio, log_odds = orpo.ORPOTrainer.odds_ratio_loss(
        _trl_self(beta=0.2), chosen, rejected
    )
    # TRL's loss is nll - mean(beta * logsigmoid(log_odds)); shardpool's is the same per pair
    assert float(losses.mean()) == pytest.approx(float(nll - trl_losses.mean()), rel=1e-6)
    names = PreferenceObjective("orpo", 0.2).metrics
    logged = dict(zip(names, (sums / 3).tolist(), strict=True))
    assert logged["rewards/chosen"] == pytest.approx(float(chosen_rewards.mean()))
    assert logged["rewards/rejected"] == pytest.approx(float(rejected_rewards.mean()))
    assert logged["logps/chosen"] == pytest.approx(float(chosen.mean()))
    assert logged["nll_loss"] == pytest.approx(1.25)
    assert logged["log_odds_ratio"] == pytest.approx(float(ratio))
    assert logged["log_odds_chosen"] == pytest.approx(float(log_odds))


def test_simpo_is_trls_cpo_loss_with_a_margin_plus_alpha_times_the_nll() -> None:
    """Against TRL's own ``CPOTrainer.cpo_loss`` with ``loss_type: simpo``."""
    cpo = pytest.importorskip("trl.experimental.cpo")
    policy = _pairs([-6.0, -2.0], [-8.0, -1.0], tokens=(3, 5))
    nll = torch.tensor(0.75)
    objective = PreferenceObjective("simpo", 2.0, simpo_gamma=0.4, cpo_alpha=0.5)
    losses, sums = pair_losses(objective, policy, None, nll)
    chosen, rejected = policy.chosen / 3, policy.rejected / 5
    trl_self = _trl_self(beta=2.0, simpo_gamma=0.4, label_smoothing=0.0, loss_type="simpo", alpha=0.0)
    trl_losses, _, _ = cpo.CPOTrainer.cpo_loss(trl_self, chosen, rejected)
    assert float(losses.mean()) == pytest.approx(float(trl_losses.mean() + 0.5 * nll), rel=1e-6)
    assert objective.metrics[-1] == "nll_loss" and float(sums[-1]) / 2 == pytest.approx(0.75)
    assert not objective.needs_reference and PreferenceObjective("ipo", 0.1).needs_reference
