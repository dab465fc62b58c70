"""The RL math (trainer/rl_losses.py) against fp64 computations written out here token by token with the math
module: group advantages, the GRPO, Dr. GRPO and CISPO losses and their gradients on a hand-made batch (clipped and
unclipped tokens, a padded completion), with per-token and per-sequence (GSPO) ratios, the k3 KL, GAE, and PPO's
pieces: the KL-penalised per-token rewards (k1 and k3), the missing-eos penalty, whitening (with and without the
mean kept), the clipped policy and value losses, their sum and gradients, and the explained variance."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.rl_losses import (explained_fraction, gae, group_advantages, kl_estimate, kl_k3, kl_penalized_rewards,
                               missing_eos_penalized, policy_loss, ppo_loss, ppo_policy_loss, ppo_value_loss, whiten)

# Four completions of up to four tokens (two prompts, groups of two); the third has two tokens, then padding.
MASK = [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
OLD = [[-1.0, -2.0, -0.5, -1.5], [-0.7, -1.1, -2.2, 0.0], [-0.3, -0.9, 0.0, 0.0], [-1.2, -0.4, -0.8, -2.5]]
# Ratios exp(new - old) inside and outside [0.8, 1.2] in both directions.
SHIFT = [[0.0, 0.5, -0.5, 0.1], [0.15, -0.1, 0.3, 0.0], [-0.4, 0.05, 0.0, 0.0], [0.25, -0.3, 0.0, 0.12]]
NEW = [[o + s for o, s in zip(old, shift)] for old, shift in zip(OLD, SHIFT)]
REF = [[o - 0.2 * (i + 1) / (t + 1) for t, o in enumerate(old)] for i, old in enumerate(OLD)]
ADVANTAGES = [0.7, -0.7, 1.3, -0.4]
EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 0.05


def _tensors():
    new = torch.tensor(NEW, dtype=torch.float64, requires_grad=True)
    return (new, torch.tensor(OLD, dtype=torch.float64), torch.tensor(ADVANTAGES, dtype=torch.float64),
            torch.tensor(MASK, dtype=torch.float64), torch.tensor(REF, dtype=torch.float64))


def _token_terms(kind: str, i: int, t: int) -> tuple[float, float, bool]:
    """(loss term, its derivative in the new log-probability, clipped?) of token t of completion i, KL included."""
    new, old, ref, a = NEW[i][t], OLD[i][t], REF[i][t], ADVANTAGES[i]
    r = math.exp(new - old)
    kl = math.exp(ref - new) - (ref - new) - 1
    d_kl = -math.exp(ref - new) + 1
    if kind == "cispo":
        weight = min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH)  # a constant: no gradient through the weight
        term, d_term, clipped = -weight * a * new, -weight * a, not 1 - EPS_LOW <= r <= 1 + EPS_HIGH
    else:
        term = -min(r * a, min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH) * a)
        # The clipped term is the minimum only where r left the range in the direction A pushes it: a constant
        # there; elsewhere the term is -r a, whose derivative in the log-probability is -r a.
        clipped = (r < 1 - EPS_LOW and a < 0) or (r > 1 + EPS_HIGH and a > 0)
        d_term = 0.0 if clipped else -r * a
    return term + BETA * kl, d_term + BETA * d_kl, clipped


def _reference(kind: str, max_len: int = 6) -> tuple[float, list[list[float]], float, float]:
    """(loss, gradient in NEW, clip fraction, mean KL) with each loss type's normalisation."""
    lengths = [sum(row) for row in MASK]
    total_tokens = sum(lengths)
    loss, grad, clipped, kl = 0.0, [[0.0] * 4 for _ in MASK], 0, 0.0
    for i, row in enumerate(MASK):
        for t in range(lengths[i]):
            term, d_term, was_clipped = _token_terms(kind, i, t)
            weight = {"grpo": 1 / (lengths[i] * len(MASK)), "dr_grpo": 1 / (len(MASK) * max_len),
                      "bnpo": 1 / total_tokens, "dapo": 1 / total_tokens, "cispo": 1 / total_tokens}[kind]
            loss += weight * term
            grad[i][t] = weight * d_term
            clipped += was_clipped
            kl += (math.exp(REF[i][t] - NEW[i][t]) - (REF[i][t] - NEW[i][t]) - 1) / total_tokens
    return loss, grad, clipped / total_tokens, kl


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "bnpo", "dapo", "cispo"])
def test_policy_losses_and_gradients_match_fp64_by_hand(kind):
    new, old, advantages, mask, ref = _tensors()
    result = policy_loss(kind, new, old, advantages, mask, EPS_LOW, EPS_HIGH, beta=BETA, ref_logp=ref,
                         max_completion_length=6)
    result.loss.backward()
    loss, grad, clip_fraction, kl = _reference(kind)
    assert result.loss.item() == pytest.approx(loss, rel=1e-12)
    for row, expected in zip(new.grad.tolist(), grad):
        assert row == pytest.approx(expected, rel=1e-10, abs=1e-15)
    assert result.clip_fraction == pytest.approx(clip_fraction) and 0 < clip_fraction < 1
    assert result.kl == pytest.approx(kl, rel=1e-12)


def test_at_the_rollouts_own_policy_grpo_is_minus_the_mean_advantage_and_cispo_its_log_prob_gradient():
    """With new == old (the first update of a rollout) every ratio is 1: GRPO's loss is -mean(A) and nothing is
    clipped, and CISPO's gradient is -A / (all tokens), REINFORCE's with the token mean."""
    _, old, advantages, mask, _ = _tensors()
    grpo = policy_loss("grpo", old.clone(), old, advantages, mask)
    assert grpo.loss.item() == pytest.approx(-sum(ADVANTAGES) / 4) and grpo.clip_fraction == 0.0
    logp = old.clone().requires_grad_(True)
    policy_loss("cispo", logp, old, advantages, mask).loss.backward()
    total = sum(map(sum, MASK))
    expected = [[-ADVANTAGES[i] / total * MASK[i][t] for t in range(4)] for i in range(4)]
    for row, want in zip(logp.grad.tolist(), expected):
        assert row == pytest.approx(want, rel=1e-12)


# Per-token shifts whose means per completion put GSPO's sequence ratio s = exp(mean shift) outside [0.9, 1.1] in the
# direction A pushes it (completions 1 and 4), inside (2), and outside against A (3: clipped for CISPO's weight only).
SEQUENCE_SHIFT = [[0.3, 0.1, 0.25, 0.15], [0.2, -0.25, -0.1, 0.0], [-0.1, -0.2, 0.0, 0.0], [-0.3, -0.1, -0.2, -0.2]]
SEQUENCE_EPS = 0.1


def _sequence_reference(kind: str, max_len: int = 6) -> tuple[float, list[list[float]], float]:
    """(loss, gradient in the new log-probs, clip fraction) with GSPO's ratio, by hand: s_i = exp(mean_t (new - old))
    over completion i's tokens, so ds_i / dnew_t = s_i / |o_i|; each token's term is -min(s A, clip(s) A) (or CISPO's
    -sg(clip(s)) A new_t), plus beta x its own k3 KL; then each loss type's weights, as _reference's."""
    lengths = [sum(row) for row in MASK]
    total_tokens = sum(lengths)
    new = [[o + d for o, d in zip(old, shift)] for old, shift in zip(OLD, SEQUENCE_SHIFT)]
    loss, grad, clipped = 0.0, [[0.0] * 4 for _ in MASK], 0
    for i, n in enumerate(lengths):
        a = ADVANTAGES[i]
        s = math.exp(sum(new[i][t] - OLD[i][t] for t in range(n)) / n)
        bounded = min(max(s, 1 - SEQUENCE_EPS), 1 + SEQUENCE_EPS)
        weight = {"grpo": 1 / (n * len(MASK)), "dr_grpo": 1 / (len(MASK) * max_len), "bnpo": 1 / total_tokens,
                  "dapo": 1 / total_tokens, "cispo": 1 / total_tokens}[kind]
        if kind == "cispo":
            clipped += bounded != s
        else:
            was_clipped = (s < 1 - SEQUENCE_EPS and a < 0) or (s > 1 + SEQUENCE_EPS and a > 0)
            clipped += was_clipped
            d_surrogate_ds = 0.0 if was_clipped else -a  # the term -s A where unclipped, a constant where clipped
        for t in range(n):
            ref = REF[i][t]
            kl, d_kl = math.exp(ref - new[i][t]) - (ref - new[i][t]) - 1, 1 - math.exp(ref - new[i][t])
            if kind == "cispo":
                term, d_own = -bounded * a * new[i][t], -bounded * a
            else:
                term, d_own = -min(s * a, bounded * a), 0.0
            loss += weight * (term + BETA * kl)
            grad[i][t] += weight * (d_own + BETA * d_kl)
            if kind != "cispo":  # every token's term holds s, which each token's log-prob moves
                for u in range(n):
                    grad[i][u] += weight * d_surrogate_ds * s / n
    return loss, grad, clipped / len(MASK)


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "bnpo", "dapo", "cispo"])
def test_sequence_level_ratios_match_gspo_by_hand(kind):
    """TRL's importance_sampling_level="sequence": one ratio per completion from the mean of its tokens' log-ratios,
    clipped as one, its gradient reaching every token; the clip fraction counts completions, as TRL's."""
    _, old, advantages, mask, ref = _tensors()
    new = (old + torch.tensor(SEQUENCE_SHIFT, dtype=torch.float64)).requires_grad_(True)
    result = policy_loss(kind, new, old, advantages, mask, SEQUENCE_EPS, SEQUENCE_EPS, beta=BETA, ref_logp=ref,
                         max_completion_length=6, importance_sampling_level="sequence")
    result.loss.backward()
    loss, grad, clip_fraction = _sequence_reference(kind)
    assert result.loss.item() == pytest.approx(loss, rel=1e-12)
    for row, expected in zip(new.grad.tolist(), grad):
        assert row == pytest.approx(expected, rel=1e-10, abs=1e-15)
    assert result.clip_fraction == {"cispo": 0.75}.get(kind, 0.5) == clip_fraction
    assert result.clipped == clip_fraction * len(mask)  # completions, not tokens
    # Completions are independent: two micro-batches of two, each weighed by its share, give the whole batch's
    # (grpo: the mean over completions; dapo: the token mean).
    if kind in ("grpo", "dapo"):
        parts = []
        for rows in (slice(0, 2), slice(2, 4)):
            part = policy_loss(kind, new[rows], old[rows], advantages[rows], mask[rows], SEQUENCE_EPS, SEQUENCE_EPS,
                               beta=BETA, ref_logp=ref[rows], importance_sampling_level="sequence").loss
            parts.append(part * (2 / 4 if kind == "grpo" else mask[rows].sum() / mask.sum()))
        assert sum(parts).item() == pytest.approx(loss, rel=1e-12)
    # At the rollout's own policy (new == old) s is 1 and its gradient the per-token ratios': the level only acts
    # from the second update per rollout on.
    grads = []
    for level in ("token", "sequence"):
        logp = old.clone().requires_grad_(True)
        policy_loss(kind, logp, old, advantages, mask, SEQUENCE_EPS, SEQUENCE_EPS, beta=BETA, ref_logp=ref,
                    max_completion_length=6, importance_sampling_level=level).loss.backward()
        grads.append(logp.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-15)


def test_bad_policy_loss_arguments_are_refused():
    new, old, advantages, mask, _ = _tensors()
    with pytest.raises(ValueError, match="--loss_type='ppo' is not allowed; choose one of grpo, dr_grpo, bnpo, dapo, "
                                         "cispo"):
        policy_loss("ppo", new, old, advantages, mask)
    with pytest.raises(ValueError, match="beta > 0 needs ref_logp"):
        policy_loss("grpo", new, old, advantages, mask, beta=0.1)
    with pytest.raises(ValueError, match="dr_grpo needs max_completion_length"):
        policy_loss("dr_grpo", new, old, advantages, mask)
    with pytest.raises(ValueError, match="--importance_sampling_level='completion' is not allowed; choose one of "
                                         "token, sequence"):
        policy_loss("grpo", new, old, advantages, mask, importance_sampling_level="completion")


def test_group_advantages_match_fp64_by_hand():
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, -1.0, 2.0, 0.25]]
    scaled = group_advantages(torch.tensor(rewards, dtype=torch.float64))
    centred = group_advantages(torch.tensor(rewards, dtype=torch.float64), scale=False)
    for row, got_scaled, got_centred in zip(rewards, scaled.tolist(), centred.tolist()):
        mean = sum(row) / len(row)
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / (len(row) - 1))  # Bessel's correction
        assert got_scaled == pytest.approx([(r - mean) / (std + 1e-4) for r in row], rel=1e-12, abs=1e-15)
        assert got_centred == pytest.approx([r - mean for r in row], rel=1e-12, abs=1e-15)
    assert scaled[1].tolist() == [0.0] * 4  # equal rewards: no signal


def test_a_reward_no_function_gave_is_out_of_its_groups_baseline_and_its_advantage_is_0():
    """NaN marks a completion that no reward function scored (each returned None). As TRL's GRPOTrainer: it is
    left out of its group's mean and std (a 0 in its place would bias the baseline and hand it an advantage it did
    not earn) and its advantage is 0; so is every advantage of a group with fewer than two scored completions
    (Bessel's std of one value is undefined). Numbers by hand: the scored 1, 3, 2 have mean 2 and std 1."""
    nan = float("nan")
    rewards = torch.tensor([[1.0, nan, 3.0, 2.0], [nan] * 4, [5.0, nan, nan, nan], [4.0, 4.0, nan, 0.0]],
                           dtype=torch.float64)
    scaled, centred = group_advantages(rewards).tolist(), group_advantages(rewards, scale=False).tolist()
    assert scaled[0] == pytest.approx([-1 / 1.0001, 0.0, 1 / 1.0001, 0.0], rel=1e-12)
    assert centred[0] == pytest.approx([-1.0, 0.0, 1.0, 0.0], rel=1e-12)
    assert scaled[1] == centred[1] == [0.0] * 4
    assert scaled[2] == centred[2] == [0.0] * 4
    # 4, 4, 0: mean 8/3, Bessel's variance ((4/3)^2 * 2 + (8/3)^2) / 2 = 16/3
    std = math.sqrt(16 / 3)
    assert scaled[3] == pytest.approx([(4 / 3) / (std + 1e-4)] * 2 + [0.0, -(8 / 3) / (std + 1e-4)], rel=1e-12)
    assert centred[3] == pytest.approx([4 / 3, 4 / 3, 0.0, -8 / 3], rel=1e-12)


def test_k3_kl_matches_by_hand_and_is_zero_at_the_reference():
    logp = torch.tensor([-1.0, -0.2, -3.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -0.2, -0.1], dtype=torch.float64)
    expected = [math.exp(r - p) - (r - p) - 1 for p, r in zip(logp.tolist(), ref.tolist())]
    assert kl_k3(logp, ref).tolist() == pytest.approx(expected, rel=1e-12)
    assert kl_k3(logp, ref)[1].item() == 0.0 and (kl_k3(logp, ref) >= 0).all()


def test_gae_matches_the_recursion_by_hand():
    gamma, lam = 0.9, 0.8
    rewards = [[0.0, 0.0, 0.0, 1.0], [0.1, -0.2, 0.5, 0.0]]
    values = [[0.2, 0.4, 0.1, 0.6], [0.3, -0.1, 0.2, 9.0]]  # the padding's value (9.0) must not leak in
    mask = [[1, 1, 1, 1], [1, 1, 1, 0]]
    advantages, returns = gae(torch.tensor(rewards, dtype=torch.float64), torch.tensor(values, dtype=torch.float64),
                              torch.tensor(mask, dtype=torch.float64), gamma, lam)
    for i in range(2):
        length = sum(mask[i])
        expected = [0.0] * 4
        for t in range(length):  # the definition: A_t = sum_l (gamma lam)^l delta_{t+l}
            for k in range(t, length):
                next_value = values[i][k + 1] if k + 1 < length else 0.0
                delta = rewards[i][k] + gamma * next_value - values[i][k]
                expected[t] += (gamma * lam) ** (k - t) * delta
        assert advantages[i].tolist() == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert returns[i].tolist() == pytest.approx([expected[t] + values[i][t] if t < length else 0.0
                                                     for t in range(4)], rel=1e-12, abs=1e-15)


def test_ppo_policy_and_value_losses_match_fp64_by_hand():
    epsilon = 0.2
    new, old, _, mask, _ = _tensors()
    token_advantages = [[0.5, -1.0, 0.3, 2.0], [-0.2, 0.9, -1.4, 0.0], [1.1, -0.6, 0.0, 0.0], [-0.3, 0.4, 0.7, -0.9]]
    result = ppo_policy_loss(new, old, torch.tensor(token_advantages, dtype=torch.float64), mask, epsilon)
    result.loss.backward()
    total = sum(map(sum, MASK))
    loss, clipped = 0.0, 0
    for i, row in enumerate(MASK):
        for t in range(sum(row)):
            r, a = math.exp(NEW[i][t] - OLD[i][t]), token_advantages[i][t]
            loss -= min(r * a, min(max(r, 1 - epsilon), 1 + epsilon) * a) / total
            was_clipped = (r > 1 + epsilon and a > 0) or (r < 1 - epsilon and a < 0)
            clipped += was_clipped
            assert new.grad[i, t].item() == pytest.approx(0.0 if was_clipped else -r * a / total, rel=1e-10,
                                                          abs=1e-15)
    assert result.loss.item() == pytest.approx(loss, rel=1e-12)
    assert result.clip_fraction == pytest.approx(clipped / total)

    values = torch.tensor([[0.5, 0.1, -0.3], [1.0, 0.2, 0.0]], dtype=torch.float64, requires_grad=True)
    old_values = [[0.2, 0.15, 0.0], [0.5, 0.3, 0.0]]
    returns = [[0.9, 0.0, -0.2], [0.4, 0.25, 0.0]]
    value_mask = [[1, 1, 1], [1, 1, 0]]
    got = ppo_value_loss(values, torch.tensor(old_values, dtype=torch.float64),
                         torch.tensor(returns, dtype=torch.float64), torch.tensor(value_mask, dtype=torch.float64),
                         clip=0.2)
    expected = 0.0
    for i in range(2):
        for t in range(3):
            if value_mask[i][t]:
                v, o, ret = values[i, t].item(), old_values[i][t], returns[i][t]
                v_clipped = o + min(max(v - o, -0.2), 0.2)
                expected += 0.5 * max((v - ret) ** 2, (v_clipped - ret) ** 2) / 5
    assert got.item() == pytest.approx(expected, rel=1e-12)


def test_kl_penalized_rewards_pay_the_kl_per_token_and_the_score_at_the_last_token():
    beta, scores = 0.1, [2.0, -1.0]
    logp = [[-1.0, -0.5, -2.0], [-0.2, -3.0, -9.0]]
    ref = [[-1.5, -0.5, -1.0], [-0.4, -2.0, -1.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    got = kl_penalized_rewards(torch.tensor(scores, dtype=torch.float64), torch.tensor(logp, dtype=torch.float64),
                               torch.tensor(ref, dtype=torch.float64), torch.tensor(mask), beta)
    expected = [[-beta * (logp[i][t] - ref[i][t]) if mask[i][t] else 0.0 for t in range(3)] for i in range(2)]
    expected[0][2] += 2.0  # the first completion's last token
    expected[1][1] -= 1.0  # the second's: its padding gets nothing
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_kl_estimate_is_k1_unless_told_k3():
    """Without an estimator kl_estimate is k1, logp - ref_logp (a mutant defaulting to k3 survived: every caller
    names one); "k3" is (r - 1) - log r with log r = ref - logp, by hand."""
    logp = torch.tensor([-1.0, -0.5, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -0.5, -1.0], dtype=torch.float64)
    torch.testing.assert_close(kl_estimate(logp, ref), logp - ref, rtol=0, atol=0)
    k3 = [math.exp(r - p) - 1 - (r - p) for p, r in zip(logp.tolist(), ref.tolist())]
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor(k3, dtype=torch.float64), rtol=1e-12,
                               atol=1e-15)


def test_kl_penalized_rewards_with_the_k3_estimator_pay_trls_k3_per_token():
    """TRL's kl_estimator="k3": with log r = ref - logp, each token pays -beta ((r - 1) - log r), >= 0 per token."""
    beta, scores = 0.1, [2.0, -1.0]
    logp = [[-1.0, -0.5, -2.0], [-0.2, -3.0, -9.0]]
    ref = [[-1.5, -0.5, -1.0], [-0.4, -2.0, -1.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    got = kl_penalized_rewards(torch.tensor(scores, dtype=torch.float64), torch.tensor(logp, dtype=torch.float64),
                               torch.tensor(ref, dtype=torch.float64), torch.tensor(mask), beta, "k3")
    expected = [[-beta * (math.exp(ref[i][t] - logp[i][t]) - 1 - (ref[i][t] - logp[i][t])) if mask[i][t] else 0.0
                 for t in range(3)] for i in range(2)]
    expected[0][2] += 2.0
    expected[1][1] -= 1.0
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="--kl_estimator='k2' is not allowed; choose one of k1, k3"):
        kl_penalized_rewards(torch.tensor(scores), torch.tensor(logp), torch.tensor(ref), torch.tensor(mask), beta,
                             "k2")


def test_a_long_estimator_or_loss_type_is_refused_in_one_short_line():
    """The refusals quote a refused name as every flag refusal does (dataset/shown_value.py's flag_refusal: the repr cut
    at MAX_SHOWN characters), not whole."""
    from dataset.shown_value import MAX_SHOWN

    cut = "'" + "k" * (MAX_SHOWN - 4) + "..."
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError) as refused:
        kl_estimate(logp, logp, "k" * 5000)
    assert str(refused.value) == f"--kl_estimator={cut} is not allowed; choose one of k1, k3"
    with pytest.raises(ValueError) as refused:
        policy_loss("k" * 5000, logp, logp, torch.zeros(2), torch.ones(2, 3))
    assert str(refused.value).startswith(f"--loss_type={cut} is not allowed; choose one of ")
    with pytest.raises(ValueError) as refused:
        policy_loss("grpo", logp, logp, torch.zeros(2), torch.ones(2, 3), importance_sampling_level="k" * 5000)
    assert str(refused.value).startswith(f"--importance_sampling_level={cut} is not allowed; choose one of ")


def test_the_missing_eos_penalty_is_taken_off_the_cut_completions_scores_only():
    scores = torch.tensor([2.0, -1.0, 0.5, 0.0])
    ended = torch.tensor([True, False, False, True])
    assert missing_eos_penalized(scores, ended, 1.5).tolist() == [2.0, -2.5, -1.0, 0.0]


def test_whitening_with_the_mean_kept_matches_trls_shift_mean_false_by_hand():
    """TRL's masked_whiten(shift_mean=False), its whiten_rewards: (x - mean) / sqrt(var + 1e-8) + mean on the masked
    tokens, 0 on padding."""
    values = [[0.5, -1.0, 2.0, 7.0], [0.25, 3.0, 9.0, 9.0]]
    mask = [[1, 1, 1, 0], [1, 1, 0, 0]]
    kept = [v for row, m in zip(values, mask) for v, keep in zip(row, m) if keep]
    mean = sum(kept) / len(kept)
    variance = sum((v - mean) ** 2 for v in kept) / (len(kept) - 1)
    got = whiten(torch.tensor(values, dtype=torch.float64), torch.tensor(mask), (mean, variance), shift_mean=False)
    expected = [[(v - mean) / math.sqrt(variance + 1e-8) + mean if keep else 0.0 for v, keep in zip(row, m)]
                for row, m in zip(values, mask)]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_whitening_over_the_masked_tokens_matches_fp64_by_hand():
    values = [[0.5, -1.0, 2.0, 7.0], [0.25, 3.0, 9.0, 9.0]]
    mask = [[1, 1, 1, 0], [1, 1, 0, 0]]
    kept = [v for row, m in zip(values, mask) for v, keep in zip(row, m) if keep]
    mean = sum(kept) / len(kept)
    variance = sum((v - mean) ** 2 for v in kept) / (len(kept) - 1)  # Bessel's correction, as TRL
    got = whiten(torch.tensor(values, dtype=torch.float64), torch.tensor(mask), (mean, variance))
    expected = [[(v - mean) / math.sqrt(variance + 1e-8) if keep else 0.0 for v, keep in zip(row, m)]
                for row, m in zip(values, mask)]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_explained_fraction():
    assert explained_fraction(0.25, 1.0) == 0.75
    assert explained_fraction(0.0, 2.0) == 1.0
    assert explained_fraction(3.0, 1.0) == -2.0
    assert math.isnan(explained_fraction(0.5, 0.0))


def test_the_ppo_loss_and_its_gradients_match_fp64_by_hand():
    """policy + vf_coef x value on a hand-made batch with clipped ratios and clipped values, a padded token."""
    epsilon, clip_value, vf_coef = 0.2, 0.2, 0.3
    logp = [[-1.0, -0.3, -2.0], [-0.5, -1.5, 0.0]]
    old_logp = [[-1.1, -0.7, -1.6], [-0.5, -1.2, 0.0]]
    advantages = [[1.0, 0.5, -0.8], [-1.2, 0.3, 0.0]]
    values = [[0.5, 0.45, -0.3], [1.0, 0.2, 0.0]]
    old_values = [[0.2, 0.4, 0.0], [0.5, 0.3, 0.0]]
    returns = [[0.9, 0.0, -0.2], [0.4, 0.25, 0.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    logp_t = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    values_t = torch.tensor(values, dtype=torch.float64, requires_grad=True)
    result = ppo_loss(logp_t, torch.tensor(old_logp, dtype=torch.float64), values_t,
                      torch.tensor(old_values, dtype=torch.float64), torch.tensor(advantages, dtype=torch.float64),
                      torch.tensor(returns, dtype=torch.float64), torch.tensor(mask), epsilon, clip_value, vf_coef)
    result.loss.backward()
    n = sum(map(sum, mask))
    policy = value = 0.0
    clipped = 0
    for i in range(2):
        for t in range(3):
            if not mask[i][t]:
                assert logp_t.grad[i, t].item() == 0.0 and values_t.grad[i, t].item() == 0.0
                continue
            r, a = math.exp(logp[i][t] - old_logp[i][t]), advantages[i][t]
            policy -= min(r * a, min(max(r, 1 - epsilon), 1 + epsilon) * a) / n
            ratio_clipped = (r > 1 + epsilon and a > 0) or (r < 1 - epsilon and a < 0)
            clipped += ratio_clipped
            assert logp_t.grad[i, t].item() == pytest.approx(0.0 if ratio_clipped else -r * a / n, abs=1e-15)
            v, o, ret = values[i][t], old_values[i][t], returns[i][t]
            v_clipped = o + min(max(v - o, -clip_value), clip_value)
            unclipped_loss, clipped_loss = (v - ret) ** 2, (v_clipped - ret) ** 2
            value += 0.5 * max(unclipped_loss, clipped_loss) / n
            # d/dv: (v - R) / n where the unclipped error is the larger; 0 where the clipped one is and v is clipped
            if unclipped_loss >= clipped_loss:
                d_value = (v - ret) / n
            else:
                d_value = (v_clipped - ret) / n if abs(v - o) < clip_value else 0.0
            assert values_t.grad[i, t].item() == pytest.approx(vf_coef * d_value, rel=1e-12, abs=1e-15)
    assert 0 < clipped < n  # the batch has clipped and unclipped ratios
    assert result.policy_loss == pytest.approx(policy, rel=1e-12)
    assert result.value_loss == pytest.approx(value, rel=1e-12)
    assert result.loss.item() == pytest.approx(policy + vf_coef * value, rel=1e-12)
    assert result.clip_fraction == pytest.approx(clipped / n)


def test_the_ppo_loss_logs_trls_value_clip_fraction_approx_kl_and_ratio_by_hand():
    """TRL's PPOTrainer, written out token by token over the completion tokens (the padded one left out): val/clipfrac
    counts where (clamp(v, v_old - c, v_old + c) - R)^2 > (v - R)^2, policy/approxkl is (logp - old_logp)^2 / 2 and
    val/ratio exp(logp - old_logp), each a token mean here; with --cliprange_value c = 0.1, which takes the
    clipped loss at other tokens than the default 0.2 would."""
    logp = [[-1.0, -0.3, -2.0], [-0.5, -1.5, 0.0]]
    old_logp = [[-1.1, -0.7, -1.6], [-0.5, -1.2, 3.0]]
    values = [[0.5, 0.45, -0.3], [1.0, 0.2, 5.0]]
    old_values = [[0.2, 0.4, 0.0], [0.5, 0.3, 0.0]]
    returns = [[0.9, 0.0, -0.2], [0.4, 0.25, 0.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    tokens = [(i, t) for i in range(2) for t in range(3) if mask[i][t]]

    def taken(clip: float) -> list[bool]:
        return [(min(max(values[i][t], old_values[i][t] - clip), old_values[i][t] + clip) - returns[i][t]) ** 2
                > (values[i][t] - returns[i][t]) ** 2 for i, t in tokens]

    assert taken(0.1) != taken(0.2) and 0 < sum(taken(0.1)) < len(tokens)
    as_tensor = [torch.tensor(rows, dtype=torch.float64) for rows in (logp, old_logp, values, old_values)]
    result = ppo_loss(*as_tensor, torch.zeros(2, 3, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64),
                      torch.tensor(mask), 0.2, 0.1, 0.5)
    log_ratios = [logp[i][t] - old_logp[i][t] for i, t in tokens]
    assert result.value_clip_fraction == pytest.approx(sum(taken(0.1)) / len(tokens), rel=1e-12)
    assert result.approx_kl == pytest.approx(sum(0.5 * x ** 2 for x in log_ratios) / len(tokens), rel=1e-12)
    assert result.ratio == pytest.approx(sum(math.exp(x) for x in log_ratios) / len(tokens), rel=1e-12)


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "bnpo", "dapo", "cispo", "ppo"])
def test_clip_fraction_counts_the_clipped_tokens_by_trls_rule(kind):
    """The logged clip fraction, token by token. GRPO and PPO (TRL's GRPOTrainer: is_low_clipped = r < 1 - eps_low
    and A < 0, is_high_clipped = r > 1 + eps_high and A > 0): a token with A = 0 is never clipped, and a ratio
    between 1 + eps_low and 1 + eps_high (DAPO's clip-higher band) is not clipped on the high side. CISPO clips the
    weight of every token whose ratio leaves [1 - eps_low, 1 + eps_high], whatever its advantage. The clipped
    tokens below and above the range are counted apart too."""
    ratios, signs = [0.7, 0.9, 1.1, 1.25, 1.4], [-1.0, 0.0, 1.0]
    pairs = [(r, a) for r in ratios for a in signs]
    old = torch.full((len(pairs), 2), -1.0, dtype=torch.float64)
    new = old + torch.tensor([[math.log(r), 0.0] for r, _ in pairs], dtype=torch.float64)
    mask = torch.tensor([[1, 0]] * len(pairs), dtype=torch.float64)  # the second token is padding
    advantages = torch.tensor([a for _, a in pairs], dtype=torch.float64)
    # the padding token's ratio would clip, but it is no token of a completion
    new[:, 1] = old[:, 1] + torch.tensor([math.log(0.5) if a < 0 else math.log(2.0) for _, a in pairs])
    if kind == "ppo":
        low = high = EPS_LOW
        result = ppo_policy_loss(new, old, advantages[:, None].expand(-1, 2), mask, EPS_LOW)
    else:
        low, high = EPS_LOW, EPS_HIGH
        result = policy_loss(kind, new, old, advantages, mask, EPS_LOW, EPS_HIGH, max_completion_length=2)
    got = result.clip_fraction
    if kind == "cispo":
        below = [r < 1 - low for r, _ in pairs]
        above = [r > 1 + high for r, _ in pairs]
    else:
        below = [r < 1 - low and a < 0 for r, a in pairs]
        above = [r > 1 + high and a > 0 for r, a in pairs]
    clipped = [b or a for b, a in zip(below, above)]
    assert got == pytest.approx(sum(clipped) / len(pairs), rel=1e-12) and result.clipped == sum(clipped)
    # TRL's clip_ratio/low_mean and high_mean (cispo: either way), the padding token's clip in neither
    assert (result.clipped_low, result.clipped_high) == (sum(below), sum(above))
