"""The DPO loss (trainer/dpo.py) against numbers worked out by hand from the formula TRL's DPOTrainer uses for its
default "sigmoid" loss (no label smoothing): per pair, rewards r = beta (log pi - log ref) of the answers' summed
token log-probs, loss -log sigmoid(r_c - r_r), and the logged statistics as TRL's rewards/chosen, rewards/rejected,
rewards/margins and rewards/accuracies (r_c > r_r strictly: a tie, as at the first step, is not a win)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.dpo import DirectPreference, dpo_loss

BETA = 0.1
# Per pair: summed log-probs of the chosen and rejected answers under the policy and under the reference.
POLICY_CHOSEN, POLICY_REJECTED = [-5.0, -4.0, -10.0], [-9.0, -4.0, -3.0]
REFERENCE_CHOSEN, REFERENCE_REJECTED = [-6.0, -4.0, -7.0], [-8.0, -4.0, -5.0]
# By hand: r_c = 0.1 x (-5 + 6) = 0.1, r_r = 0.1 x (-9 + 8) = -0.1, margin 0.2; a tie at 0; r_c = -0.3, r_r = 0.2.
CHOSEN, REJECTED = [0.1, 0.0, -0.3], [-0.1, 0.0, 0.2]
MARGINS = [0.2, 0.0, -0.5]


def test_the_sigmoid_loss_rewards_and_gradient_match_the_formula_by_hand():
    policy_chosen = torch.tensor(POLICY_CHOSEN, dtype=torch.float64, requires_grad=True)
    policy_rejected = torch.tensor(POLICY_REJECTED, dtype=torch.float64, requires_grad=True)
    losses, chosen, rejected = dpo_loss(policy_chosen, policy_rejected, torch.tensor(REFERENCE_CHOSEN,
                                        dtype=torch.float64), torch.tensor(REFERENCE_REJECTED, dtype=torch.float64),
                                        BETA)
    # -log sigmoid(m) = log(1 + exp(-m))
    assert losses.tolist() == pytest.approx([math.log(1 + math.exp(-m)) for m in MARGINS], rel=1e-12)
    assert losses[1].item() == pytest.approx(math.log(2), rel=1e-12)
    assert chosen.tolist() == pytest.approx(CHOSEN, rel=1e-12, abs=1e-15)
    assert rejected.tolist() == pytest.approx(REJECTED, rel=1e-12, abs=1e-15)
    assert not chosen.requires_grad and not rejected.requires_grad  # reported, not trained on
    losses.sum().backward()
    # d/d pi_c of -log sigmoid(beta (pi_c - pi_r - ref_c + ref_r)) = -beta sigmoid(-m); the rejected: +beta sigmoid(-m)
    weights = [BETA / (1 + math.exp(m)) for m in MARGINS]
    assert policy_chosen.grad.tolist() == pytest.approx([-w for w in weights], rel=1e-12)
    assert policy_rejected.grad.tolist() == pytest.approx(weights, rel=1e-12)


def test_the_logged_statistics_are_trls_rewards_metrics():
    """Sums over the real pairs of [accuracy, margin, chosen reward, rejected reward]; a padding pair counts
    nowhere."""
    chosen = torch.tensor(CHOSEN + [5.0])
    rejected = torch.tensor(REJECTED + [-5.0])
    real = torch.tensor([True, True, True, False])
    sums = DirectPreference._stat_sums(chosen, rejected, real).tolist()
    assert sums == pytest.approx([1.0, sum(MARGINS), sum(CHOSEN), sum(REJECTED)], rel=1e-6, abs=1e-7)
