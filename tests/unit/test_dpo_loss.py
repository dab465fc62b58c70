"""The DPO loss (trainer/dpo.py) against numbers worked out by hand from the formula TRL's DPOTrainer uses for its
default "sigmoid" loss: per pair, rewards r = beta (log pi - log ref) of the answers' summed token log-probs, loss
-log sigmoid(r_c - r_r); conservative DPO's label smoothing on it, TRL's "ipo" and "hinge" losses; and the logged
statistics as TRL's rewards/chosen, rewards/rejected, rewards/margins and rewards/accuracies (r_c > r_r strictly: a
tie, as at the first step, is not a win)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.dpo import DirectPreference, dpo_loss, sequence_log_probs

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


def _leaves() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.tensor(POLICY_CHOSEN, dtype=torch.float64, requires_grad=True),
            torch.tensor(POLICY_REJECTED, dtype=torch.float64, requires_grad=True),
            torch.tensor(REFERENCE_CHOSEN, dtype=torch.float64), torch.tensor(REFERENCE_REJECTED, dtype=torch.float64))


def test_label_smoothing_is_conservative_dpo_and_0_is_the_plain_loss_exactly():
    """eps = 0.1: per pair -(1 - eps) log sigmoid(m) - eps log sigmoid(-m) = (1 - eps) log(1 + e^-m) + eps log(1 +
    e^m) (Mitchell 2023; TRL's sigmoid loss with label_smoothing), whose derivative in m is -(1 - eps) sigmoid(-m) +
    eps sigmoid(m); eps = 0 gives the plain loss bit for bit."""
    eps = 0.1
    policy_chosen, policy_rejected, reference_chosen, reference_rejected = _leaves()
    losses, chosen, rejected = dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, BETA,
                                        "sigmoid", eps)
    assert losses.tolist() == pytest.approx([(1 - eps) * math.log(1 + math.exp(-m)) + eps * math.log(1 + math.exp(m))
                                             for m in MARGINS], rel=1e-12)
    assert losses[1].item() == pytest.approx(math.log(2), rel=1e-12)
    assert chosen.tolist() == pytest.approx(CHOSEN, rel=1e-12, abs=1e-15)
    losses.sum().backward()
    slopes = [-(1 - eps) / (1 + math.exp(m)) + eps / (1 + math.exp(-m)) for m in MARGINS]
    assert policy_chosen.grad.tolist() == pytest.approx([BETA * d for d in slopes], rel=1e-12)
    assert policy_rejected.grad.tolist() == pytest.approx([-BETA * d for d in slopes], rel=1e-12)
    plain = dpo_loss(*_leaves(), BETA)[0]
    assert torch.equal(dpo_loss(*_leaves(), BETA, "sigmoid", 0.0)[0], plain)


def test_the_hinge_loss_matches_by_hand():
    """max(0, 1 - m) per pair: 0.8, 1 (the tie), 1.5; its gradient -beta on pi_c and +beta on pi_r where 1 - m > 0."""
    policy_chosen, policy_rejected, reference_chosen, reference_rejected = _leaves()
    losses, chosen, rejected = dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, BETA,
                                        "hinge")
    assert losses.tolist() == pytest.approx([0.8, 1.0, 1.5], rel=1e-12)
    assert rejected.tolist() == pytest.approx(REJECTED, rel=1e-12, abs=1e-15)
    losses.sum().backward()
    assert policy_chosen.grad.tolist() == pytest.approx([-BETA] * 3, rel=1e-12)
    assert policy_rejected.grad.tolist() == pytest.approx([BETA] * 3, rel=1e-12)
    beyond = dpo_loss(torch.tensor([20.0]), torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([0.0]), BETA,
                      "hinge")[0]
    assert beyond.tolist() == [0.0]  # a margin of 2 > 1: nothing to gain


def test_the_ipo_loss_takes_the_per_token_log_ratios_by_hand():
    """Answers of 2, 4, 1 (chosen) and 5, 4, 2 (rejected) tokens: per-token log-ratios 1/2 - (-1)/5 = 0.7, 0, -3/1 -
    2/2 = -4; loss (d - 1 / (2 beta))^2 = (d - 5)^2 = 18.49, 25, 81; gradient 2 (d - 5) / n_c on pi_c, -2 (d - 5) /
    n_r on pi_r; the rewards stay beta x the summed log-ratios."""
    chosen_tokens, rejected_tokens = torch.tensor([2.0, 4.0, 1.0]), torch.tensor([5.0, 4.0, 2.0])
    policy_chosen, policy_rejected, reference_chosen, reference_rejected = _leaves()
    losses, chosen, rejected = dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, BETA,
                                        "ipo", 0.0, chosen_tokens.double(), rejected_tokens.double())
    assert losses.tolist() == pytest.approx([18.49, 25.0, 81.0], rel=1e-12)
    assert chosen.tolist() == pytest.approx(CHOSEN, rel=1e-12, abs=1e-15)
    losses.sum().backward()
    deltas = [0.7, 0.0, -4.0]
    assert policy_chosen.grad.tolist() == pytest.approx([2 * (d - 5) / n for d, n in zip(deltas, [2, 4, 1])],
                                                        rel=1e-12)
    assert policy_rejected.grad.tolist() == pytest.approx([-2 * (d - 5) / n for d, n in zip(deltas, [5, 4, 2])],
                                                          rel=1e-12)


@pytest.mark.parametrize("loss_type, smoothing, message", [
    ("kto", 0.0, "--loss_type='kto' is not allowed; choose one of sigmoid, ipo, hinge"),
    ("hinge", 0.1, "--label_smoothing=0.1 is not allowed; it smooths the sigmoid loss only"),
])
def test_bad_dpo_loss_arguments_are_refused(loss_type, smoothing, message):
    with pytest.raises(ValueError) as refused:
        dpo_loss(*_leaves(), BETA, loss_type, smoothing)
    assert str(refused.value) == message


class _Tiny(torch.nn.Module):
    """A causal LM of logits that are a fixed function of the token: enough to score answers."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.arange(7 * 7, dtype=torch.float64).view(7, 7).sin() * scale)

    def forward(self, input_ids, attention_mask=None):
        return type("Out", (), {"logits": self.table[input_ids]})()


@pytest.mark.parametrize("loss_type, smoothing", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0),
                                                  ("hinge", 0.0)])
def test_the_objective_passes_its_loss_type_and_token_counts(loss_type, smoothing):
    """DirectPreference's loss on two pairs (answers of 2/3 and 1/2 labelled tokens, then rejected) is dpo_loss's on
    the rows' summed log-probs and labelled-token counts, summed over the pairs and divided by num_items."""
    input_ids = torch.tensor([[1, 2, 3, 4], [1, 5, 6, 0], [1, 2, 4, 4], [1, 5, 3, 2]])
    labels = torch.tensor([[-100, -100, 3, 4], [-100, -100, 6, -100], [-100, 2, 4, 4], [-100, -100, 3, 2]])
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    policy, reference = _Tiny(1.0), _Tiny(0.5)
    objective = DirectPreference(reference, BETA, torch.enable_grad, loss_type, smoothing)
    loss, _ = objective.loss(policy, batch, torch.tensor(2))
    with torch.no_grad():
        pi, ref = sequence_log_probs(policy.table[input_ids], labels), sequence_log_probs(reference.table[input_ids],
                                                                                              labels)
    tokens = torch.tensor([2.0, 1.0, 3.0, 2.0], dtype=torch.float64)
    expected = dpo_loss(pi[:2], pi[2:], ref[:2], ref[2:], BETA, loss_type, smoothing, tokens[:2], tokens[2:])[0]
    assert float(loss) == pytest.approx(float(expected.sum()) / 2, rel=1e-6)  # the log-probs are fp32
