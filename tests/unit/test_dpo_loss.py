"""The DPO loss (trainer/dpo.py) against numbers worked out by hand from the formula TRL's DPOTrainer uses for its
default "sigmoid" loss: per pair, rewards r = beta (log pi - log ref) of the answers' summed token log-probs, loss
-log sigmoid(r_c - r_r); conservative DPO's label smoothing on it, TRL's "ipo" and "hinge" losses, and each of TRL's
other loss types and its weighted sums of several, each loss and its gradient in fp64 from the formula written out
here; bco_pair's running mean; and the logged statistics as TRL's rewards/chosen, rewards/rejected, rewards/margins
and rewards/accuracies (r_c > r_r strictly: a tie, as at the first step, is not a win)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.dpo import (DEFAULT_DISCOPOP_TAU, BCORunningMean, DirectPreference, dpo_loss, parse_loss_types,
                         sequence_log_probs)

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
    ("kto", 0.0, "--loss_type='kto' is not allowed; choose one or several (comma-separated) of sigmoid, ipo, hinge, "
                 "robust, exo_pair, nca_pair, bco_pair, sppo_hard, aot, aot_unpaired, aot_pair, apo_zero, apo_down, "
                 "discopop, sigmoid_norm, sft"),
    ("hinge", 0.1, "--label_smoothing=0.1 is not allowed; only --loss_type sigmoid, robust, exo_pair, aot, "
                   "aot_unpaired, aot_pair use it: leave it 0 with --loss_type hinge"),
    ("exo_pair", 0.0, "--label_smoothing=0.0 is not allowed; --loss_type exo_pair needs its epsilon > 0 (the EXO "
                      "paper recommends 1e-3)"),
])
def test_bad_dpo_loss_arguments_are_refused(loss_type, smoothing, message):
    with pytest.raises(ValueError) as refused:
        dpo_loss(*_leaves(), BETA, loss_type, smoothing)
    assert str(refused.value) == message


def test_more_bad_dpo_loss_arguments_and_the_forms_a_loss_type_takes():
    """The refusals the flags also make, made by dpo_loss itself: a weight per loss type, the answers' token counts
    for sft (as ipo's), the bad name of several shown alone; spaces around commas are dropped; --label_smoothing
    is taken when any of several types reads it (each was a surviving mutant)."""
    leaves = _leaves()
    with pytest.raises(ValueError, match=r"^--loss_weights=\[1\.0\] is not allowed; give one weight per --loss_type "
                                         r"\(2\)$"):
        dpo_loss(*leaves, BETA, "sigmoid,sft", loss_weights=[1.0])
    with pytest.raises(ValueError, match="^dpo_loss: loss_type sft needs the answers' token counts$"):
        dpo_loss(*leaves, BETA, "sft")
    with pytest.raises(ValueError, match="^--loss_type='kto' is not allowed; choose one or several"):
        parse_loss_types("sigmoid,kto")
    assert parse_loss_types("sigmoid , sft") == ("sigmoid", "sft")
    tokens = torch.tensor([2.0, 4.0, 1.0], dtype=torch.float64)
    both = dpo_loss(*leaves, BETA, "sigmoid,sft", 0.1, tokens, tokens)[0]
    alone = [dpo_loss(*leaves, BETA, kind, smoothing, tokens, tokens)[0] for kind, smoothing in (("sigmoid", 0.1),
                                                                                                 ("sft", 0.0))]
    torch.testing.assert_close(both, alone[0] + alone[1], rtol=1e-12, atol=0)
    assert DEFAULT_DISCOPOP_TAU == 0.05  # TRL's DPOConfig discopop_tau and the DiscoPOP paper's


class _Tiny(torch.nn.Module):
    """A causal LM of logits that are a fixed function of the token: enough to score answers."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.arange(7 * 7, dtype=torch.float64).view(7, 7).sin() * scale)

    def forward(self, input_ids, attention_mask=None):
        return type("Out", (), {"logits": self.table[input_ids]})()


def test_the_objectives_aot_sorts_only_the_real_pairs():
    """A target-free pair (a validation shard's padding) is left out of aot's sorting: the two real pairs' losses are
    dpo_loss's on those two alone (a mutant that sorted the padding in with them survived)."""
    input_ids = torch.tensor([[1, 2, 3, 4], [1, 5, 6, 0], [1, 3, 3, 3], [1, 2, 4, 4], [1, 5, 3, 2], [1, 3, 3, 3]])
    labels = torch.tensor([[-100, -100, 3, 4], [-100, -100, 6, -100], [-100] * 4, [-100, 2, 4, 4],
                           [-100, -100, 3, 2], [-100] * 4])
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    policy, reference = _Tiny(1.0), _Tiny(0.5)
    objective = DirectPreference(reference, BETA, torch.enable_grad, "aot")
    losses, _, _, real, _ = objective._pair_terms(policy, batch, 2, 3)
    assert real.tolist() == [True, True, False]
    with torch.no_grad():
        pi, ref = sequence_log_probs(policy.table[input_ids], labels), sequence_log_probs(reference.table[input_ids],
                                                                                              labels)
    expected = dpo_loss(pi[[0, 1]], pi[[3, 4]], ref[[0, 1]], ref[[3, 4]], BETA, "aot")[0]
    torch.testing.assert_close(losses[:2].detach(), expected, rtol=1e-6, atol=1e-7)


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


# TRL's other loss types, by hand. Per pair of the three above: log-ratios l_c = pi_c - ref_c = 1, 0, -3 and l_r =
# -1, 0, 2; rewards r = beta l; margin h = r_c - r_r; answers of 2, 4, 1 (chosen) and 5, 4, 2 (rejected) tokens.
CHOSEN_RATIOS, REJECTED_RATIOS = [1.0, 0.0, -3.0], [-1.0, 0.0, 2.0]
CHOSEN_TOKENS, REJECTED_TOKENS = [2.0, 4.0, 1.0], [5.0, 4.0, 2.0]


def _s(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _log_s(x: float) -> float:
    return -math.log1p(math.exp(-x))


def _by_hand(loss_type: str, eps: float, tau: float, mean: float, pc: float, pr: float, refc: float, refr: float,
             nc: float, nr: float) -> tuple[float, float, float]:
    """(loss, d loss / d pi_c, d loss / d pi_r) of one pair, from the formula written out and differentiated by
    hand (d h / d pi_c = beta = -d h / d pi_r; d r_c / d pi_c = beta; d l_c / d pi_c = 1)."""
    b = BETA
    lc, lr = pc - refc, pr - refr
    rc, rr = b * lc, b * lr
    h = rc - rr
    if loss_type == "sigmoid":  # -log s(h)
        return -_log_s(h), -b * _s(-h), b * _s(-h)
    if loss_type == "robust":  # (-(1 - eps) log s(h) + eps log s(-h)) / (1 - 2 eps)
        slope = (-(1 - eps) * _s(-h) - eps * _s(h)) / (1 - 2 * eps)
        return (-(1 - eps) * _log_s(h) + eps * _log_s(-h)) / (1 - 2 * eps), b * slope, -b * slope
    if loss_type == "exo_pair":  # s(h) (log s(h) - log(1 - eps)) + s(-h) (log s(-h) - log eps)
        loss = _s(h) * (_log_s(h) - math.log(1 - eps)) + _s(-h) * (_log_s(-h) - math.log(eps))
        slope = _s(h) * _s(-h) * (h - math.log((1 - eps) / eps))  # log s(h) - log s(-h) = h
        return loss, b * slope, -b * slope
    if loss_type == "nca_pair":  # -log s(r_c) - log s(-r_c) / 2 - log s(-r_r) / 2
        loss = -_log_s(rc) - 0.5 * _log_s(-rc) - 0.5 * _log_s(-rr)
        return loss, b * (-_s(-rc) + 0.5 * _s(rc)), b * 0.5 * _s(rr)
    if loss_type == "bco_pair":  # -log s(r_c - m) - log s(-(r_r - m))
        return -_log_s(rc - mean) - _log_s(-(rr - mean)), -b * _s(-(rc - mean)), b * _s(rr - mean)
    if loss_type == "sppo_hard":  # (l_c - 1 / (2 beta))^2 + (l_r + 1 / (2 beta))^2
        return (lc - 0.5 / b) ** 2 + (lr + 0.5 / b) ** 2, 2 * (lc - 0.5 / b), 2 * (lr + 0.5 / b)
    if loss_type == "apo_zero":  # 1 - s(r_c) + s(r_r)
        return 1 - _s(rc) + _s(rr), -b * _s(rc) * _s(-rc), b * _s(rr) * _s(-rr)
    if loss_type == "apo_down":  # s(r_c) + 1 - s(h)
        return (_s(rc) + 1 - _s(h), b * (_s(rc) * _s(-rc) - _s(h) * _s(-h)), b * _s(h) * _s(-h))
    if loss_type == "discopop":  # -log s(h) (1 - w) + exp(-h) w, w = s(h / tau)
        w, dw = _s(h / tau), _s(h / tau) * _s(-h / tau) / tau
        loss = -_log_s(h) * (1 - w) + math.exp(-h) * w
        slope = -_s(-h) * (1 - w) + _log_s(h) * dw - math.exp(-h) * w + math.exp(-h) * dw
        return loss, b * slope, -b * slope
    if loss_type == "sigmoid_norm":  # -log s(beta d), d = l_c / n_c - l_r / n_r
        d = lc / nc - lr / nr
        return -_log_s(b * d), -b * _s(-b * d) / nc, b * _s(-b * d) / nr
    if loss_type == "sft":  # the pair's share of the chosen answers' token mean NLL: -pi_c x 3 pairs / their tokens
        share = len(CHOSEN_TOKENS) / sum(CHOSEN_TOKENS)
        return -pc * share, -share, 0.0
    raise AssertionError(loss_type)


def _check_against_hand(loss_type: str, eps: float = 0.0, tau: float = 0.05, mean: float = 0.0,
                        weights: list[float] | None = None) -> None:
    policy_chosen, policy_rejected, reference_chosen, reference_rejected = _leaves()
    losses, chosen, rejected = dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, BETA,
                                        loss_type, eps, torch.tensor(CHOSEN_TOKENS, dtype=torch.float64),
                                        torch.tensor(REJECTED_TOKENS, dtype=torch.float64), loss_weights=weights,
                                        discopop_tau=tau, bco_mean=mean)
    types = loss_type.split(",")
    weights = weights or [1.0] * len(types)
    expected = [[sum(w * _by_hand(kind, eps, tau, mean, *pair)[part] for kind, w in zip(types, weights))
                 for pair in zip(POLICY_CHOSEN, POLICY_REJECTED, REFERENCE_CHOSEN, REFERENCE_REJECTED, CHOSEN_TOKENS,
                                 REJECTED_TOKENS)] for part in range(3)]
    assert losses.tolist() == pytest.approx(expected[0], rel=1e-12, abs=1e-14)
    assert chosen.tolist() == pytest.approx(CHOSEN, rel=1e-12, abs=1e-15)  # the logged rewards, whatever the loss
    assert rejected.tolist() == pytest.approx(REJECTED, rel=1e-12, abs=1e-15)
    losses.sum().backward()
    assert policy_chosen.grad.tolist() == pytest.approx(expected[1], rel=1e-10, abs=1e-14)
    rejected_grad = policy_rejected.grad if policy_rejected.grad is not None else torch.zeros(3)  # sft: unused
    assert rejected_grad.tolist() == pytest.approx(expected[2], rel=1e-10, abs=1e-14)


@pytest.mark.parametrize("loss_type, eps, tau, mean", [
    ("robust", 0.1, 0.05, 0.0), ("robust", 0.0, 0.05, 0.0),
    ("exo_pair", 0.1, 0.05, 0.0), ("exo_pair", 1e-3, 0.05, 0.0),
    ("nca_pair", 0.0, 0.05, 0.0),
    ("bco_pair", 0.0, 0.05, 0.0), ("bco_pair", 0.0, 0.05, 0.07),
    ("sppo_hard", 0.0, 0.05, 0.0),
    ("apo_zero", 0.0, 0.05, 0.0), ("apo_down", 0.0, 0.05, 0.0),
    ("discopop", 0.0, 0.05, 0.0), ("discopop", 0.0, 0.5, 0.0),
    ("sigmoid_norm", 0.0, 0.05, 0.0),
    ("sft", 0.0, 0.05, 0.0),
])
def test_each_of_trls_other_loss_types_and_its_gradient_match_the_formula_by_hand(loss_type, eps, tau, mean):
    _check_against_hand(loss_type, eps, tau, mean)


def test_robust_dpo_is_dpo_minus_its_noise_correction_and_takes_eps_up_to_its_bound():
    """rDPO's loss is -log s(h) - eps / (1 - 2 eps) h: the correction's slope grows without bound as eps nears 0.5,
    where [0, 0.5) let --label_smoothing 0.4999999 train to a loss of about -82,000 (2.5e6 times the margin). eps is
    taken up to ROBUST_MAX_EPS (0.4, the slope 2) and refused past it in one line naming the range, by the flags'
    check and by dpo_loss alike; the other loss types keep [0, 0.5)."""
    for eps in (0.1, 0.4):
        losses = dpo_loss(*_leaves(), BETA, "robust", eps)[0]
        assert losses.tolist() == pytest.approx([math.log(1 + math.exp(-m)) - eps / (1 - 2 * eps) * m
                                                 for m in MARGINS], rel=1e-9)
    for eps in (0.4000001, 0.45, 0.4999999):
        with pytest.raises(ValueError) as refused:
            dpo_loss(*_leaves(), BETA, "sigmoid,robust", eps)
        assert str(refused.value) == (f"--label_smoothing={eps} is not allowed; --loss_type robust takes it in "
                                      f"[0, 0.4]: its loss is DPO's minus eps / (1 - 2 eps) x the margin, which "
                                      f"grows without bound as eps nears 0.5")
    assert dpo_loss(*_leaves(), BETA, "sigmoid", 0.45)[0].isfinite().all()


def test_robust_dpo_at_eps_0_is_the_sigmoid_loss():
    """rDPO's (-(1 - eps) log s(h) + eps log s(-h)) / (1 - 2 eps) is -log s(h) at eps = 0: log(1 + e^-h)."""
    losses = dpo_loss(*_leaves(), BETA, "robust")[0]
    assert losses.tolist() == pytest.approx([math.log(1 + math.exp(-m)) for m in MARGINS], rel=1e-12)


@pytest.mark.parametrize("loss_type, weights", [("sigmoid,sft", [0.8, 0.2]), ("nca_pair,apo_zero,bco_pair", None),
                                                ("apo_down", [3.0])])
def test_several_loss_types_are_summed_with_their_weights(loss_type, weights):
    """TRL's combination: sum_k w_k loss_k per pair (1 each without weights)."""
    _check_against_hand(loss_type, weights=weights)


def _aot_by_hand(first: list[float], second: list[float], eps: float) -> tuple[list[float], list[float]]:
    """AOT's loss in sorted order: delta_k = sorted(first)_k - sorted(second)_k, loss_k = -(1 - eps) log s(beta
    delta_k) - eps log s(-beta delta_k); and d loss / d first_i: beta x the slope at the position first_i sorts to."""
    order = sorted(range(len(first)), key=lambda i: first[i])
    deltas = [a - b for a, b in zip(sorted(first), sorted(second))]
    losses = [-(1 - eps) * _log_s(BETA * d) - eps * _log_s(-BETA * d) for d in deltas]
    grads = [0.0] * len(first)
    for position, index in enumerate(order):
        d = BETA * deltas[position]
        grads[index] = BETA * (-(1 - eps) * _s(-d) + eps * _s(d))
    return losses, grads


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_aot_sorts_the_policys_and_the_references_margins_apart(eps):
    """aot: x = pi_c - pi_r = 1, 3, -2 and y = ref_c - ref_r = 2, -1, 0 sorted apart: -2, 1, 3 against -1, 0, 2,
    deltas -1, 1, 1 (paired they would be -1, 4, -2); a padding pair is left out of the sorting."""
    policy_chosen = torch.tensor([1.0, 3.0, -2.0, 50.0], dtype=torch.float64, requires_grad=True)
    policy_rejected = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    reference_chosen = torch.tensor([2.0, -1.0, 0.0, -50.0], dtype=torch.float64)
    real = torch.tensor([True, True, True, False])
    losses, _, _ = dpo_loss(policy_chosen, policy_rejected, reference_chosen, torch.zeros(4, dtype=torch.float64),
                            BETA, "aot", eps, real=real)
    expected, grads = _aot_by_hand([1.0, 3.0, -2.0], [2.0, -1.0, 0.0], eps)
    assert losses[:3].tolist() == pytest.approx(expected, rel=1e-12)
    (losses * real).sum().backward()
    assert policy_chosen.grad.tolist() == pytest.approx(grads + [0.0], rel=1e-12)
    assert policy_rejected.grad.tolist() == pytest.approx([-g for g in grads] + [0.0], rel=1e-12)


@pytest.mark.parametrize("loss_type", ["aot_unpaired", "aot_pair"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_aot_unpaired_sorts_the_chosen_and_rejected_log_ratios_apart(loss_type, eps):
    """aot_unpaired (TRL's aot_pair before 2026-02): l_c = 1, 0, -3 and l_r = -1, 0, 2 sorted apart: -3, 0, 1
    against -1, 0, 2, deltas -2, 0, -1 (paired: 2, 0, -5)."""
    policy_chosen, policy_rejected, reference_chosen, reference_rejected = _leaves()
    losses, _, _ = dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, BETA, loss_type,
                            eps)
    expected, chosen_grads = _aot_by_hand(CHOSEN_RATIOS, REJECTED_RATIOS, eps)
    assert losses.tolist() == pytest.approx(expected, rel=1e-12)
    losses.sum().backward()
    assert policy_chosen.grad.tolist() == pytest.approx(chosen_grads, rel=1e-12)
    # d/d l_r: minus the slope at the position l_r sorts to (l_r's order is 0, 1, 2 already: positions = pairs)
    deltas = [BETA * (c - r) for c, r in zip(sorted(CHOSEN_RATIOS), sorted(REJECTED_RATIOS))]
    assert policy_rejected.grad.tolist() == pytest.approx([-BETA * (-(1 - eps) * _s(-d) + eps * _s(d))
                                                           for d in deltas], rel=1e-12)


def test_bco_pairs_running_mean_folds_each_step_in_by_its_pairs():
    """m = the mean of every reward so far: steps of 4 pairs with mean rewards (r_c, r_r) = (0.3, -0.1), then 2
    pairs of (0.5, 0.1): m = 0.1, then (8 x 0.1 + 4 x 0.3) / 12 = 1/6; a step of no pairs changes nothing."""
    running = BCORunningMean()
    running.add_step(0.3, -0.1, 4)
    assert running.mean == pytest.approx(0.1, rel=1e-12) and running.pairs == 4
    running.add_step(0.5, 0.1, 2)
    assert running.mean == pytest.approx(1 / 6, rel=1e-12) and running.pairs == 6
    running.add_step(9.0, 9.0, 0)
    assert running.mean == pytest.approx(1 / 6, rel=1e-12) and running.pairs == 6
    empty = BCORunningMean()  # a step of no pairs first (it divided by the 0 pairs so far)
    empty.add_step(9.0, 9.0, 0)
    assert (empty.mean, empty.pairs) == (0.0, 0)


def test_the_bco_objective_keeps_its_mean_as_state_and_uses_it_in_the_loss():
    """end_step folds a step's logged reward means in; state() and load_state() carry the mean across a resume; the
    loss takes it as m; other loss types keep no state, and a checkpoint without the mean leaves it at 0."""
    reference = _Tiny(0.5)
    objective = DirectPreference(reference, BETA, torch.enable_grad, "bco_pair")
    assert objective.state() == {"bco_mean": 0.0, "bco_pairs": 0}
    objective.end_step({"chosen_reward": 0.3, "rejected_reward": -0.1, "reward_margin": 0.4,
                        "reward_accuracy": 1.0}, 4)
    assert objective.state() == pytest.approx({"bco_mean": 0.1, "bco_pairs": 4})
    resumed = DirectPreference(reference, BETA, torch.enable_grad, "bco_pair")
    resumed.load_state(objective.state())
    assert resumed.state() == objective.state()
    input_ids = torch.tensor([[1, 2, 3, 4], [1, 2, 4, 4]])
    labels = torch.tensor([[-100, -100, 3, 4], [-100, 2, 4, 4]])
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    loss, _ = resumed.loss(_Tiny(1.0), batch, torch.tensor(1))
    with torch.no_grad():
        pi = sequence_log_probs(_Tiny(1.0).table[input_ids], labels).double()
        ref = sequence_log_probs(reference.table[input_ids], labels).double()
    rc, rr = BETA * float(pi[0] - ref[0]), BETA * float(pi[1] - ref[1])
    assert float(loss) == pytest.approx(-_log_s(rc - 0.1) - _log_s(-(rr - 0.1)), rel=1e-6)
    fresh = DirectPreference(reference, BETA, torch.enable_grad, "bco_pair")
    fresh.load_state({})
    assert fresh.state() == {"bco_mean": 0.0, "bco_pairs": 0}
    fresh.load_state({"bco_mean": 0.25})  # a mean without its count of pairs is still the mean
    assert fresh.state() == {"bco_mean": 0.25, "bco_pairs": 0}
    assert DirectPreference(reference, BETA, torch.enable_grad, "sigmoid").state() == {}
