"""The four options of TRL's DPOConfig built beside the loss types (trainer/dpo.py), each loss and gradient against a
formula written out here in fp64, for pairs whose answers differ in length: RPO's NLL term (rpo_alpha; the token
mean over the step's chosen tokens, split into micro-batches or processes or not), LD-DPO's
length-desensitized log-probabilities (ld_alpha), WPO's pair weights (use_weighting) and f-DPO's divergences
(f_divergence_type, f_alpha_divergence_coef); their one-line refusals; what a checkpoint recorded before them is
taken to have run with."""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.test_dpo_loss import _Tiny
from trainer.args import parse_args
from trainer.dpo import (DirectPreference, desensitized_log_probs, dpo_loss, f_divergence_difference,
                         token_log_probs, wpo_weights)

BETA = 0.1
# Per pair: summed log-probs of the chosen and rejected answers under the policy and the reference; log-ratios
# l_c = 1, 0, -3 and l_r = -1, 0, 2; answers of 2, 4, 1 (chosen) and 5, 4, 2 (rejected) tokens.
POLICY_CHOSEN, POLICY_REJECTED = [-5.0, -4.0, -10.0], [-9.0, -4.0, -3.0]
REFERENCE_CHOSEN, REFERENCE_REJECTED = [-6.0, -4.0, -7.0], [-8.0, -4.0, -5.0]
CHOSEN_TOKENS, REJECTED_TOKENS = [2.0, 4.0, 1.0], [5.0, 4.0, 2.0]
PAIRS = list(zip(POLICY_CHOSEN, POLICY_REJECTED, REFERENCE_CHOSEN, REFERENCE_REJECTED, CHOSEN_TOKENS,
                 REJECTED_TOKENS))


def _s(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _leaves() -> tuple[torch.Tensor, ...]:
    return (torch.tensor(POLICY_CHOSEN, dtype=torch.float64, requires_grad=True),
            torch.tensor(POLICY_REJECTED, dtype=torch.float64, requires_grad=True),
            torch.tensor(REFERENCE_CHOSEN, dtype=torch.float64), torch.tensor(REFERENCE_REJECTED, dtype=torch.float64))


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(CHOSEN_TOKENS, dtype=torch.float64), torch.tensor(REJECTED_TOKENS, dtype=torch.float64)


def _loss_and_grads(loss_type: str, **options) -> tuple[list[float], list[float], list[float]]:
    policy_chosen, policy_rejected, reference_chosen, reference_rejected = _leaves()
    label_smoothing = options.pop("label_smoothing", 0.0)
    losses, _, _ = dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, BETA, loss_type,
                            label_smoothing, *_tokens(), **options)
    losses.sum().backward()
    rejected_grad = policy_rejected.grad if policy_rejected.grad is not None else torch.zeros(3)
    return losses.tolist(), policy_chosen.grad.tolist(), rejected_grad.tolist()


# RPO: + alpha x the chosen answers' token mean NLL, -sum pi_c / sum n_c over the pairs (TRL's over its batch),
# pair i's share of it -pi_c,i P / N (P pairs, N chosen tokens).

@pytest.mark.parametrize("loss_type, alpha", [("sigmoid", 0.5), ("ipo", 1.0), ("sigmoid", 0.0)])
def test_rpo_adds_alpha_times_the_chosen_answers_token_mean_nll(loss_type, alpha):
    """With k = P / N = 3 / 7: sigmoid: -log s(h) - alpha k pi_c, d/d pi_c = -beta s(-h) - alpha k, d/d pi_r =
    beta s(-h); ipo: (d - 1 / (2 beta))^2 - alpha k pi_c, d = l_c / n_c - l_r / n_r. The mean over the pairs adds
    alpha x the token mean 19 / 7, not alpha x the mean of each answer's mean NLL (5/2 + 4/4 + 10/1) / 3 = 4.5."""
    share = len(PAIRS) / sum(CHOSEN_TOKENS)
    expected = []
    for pc, pr, refc, refr, nc, nr in PAIRS:
        lc, lr = pc - refc, pr - refr
        if loss_type == "sigmoid":
            h = BETA * (lc - lr)
            expected.append((math.log1p(math.exp(-h)) - alpha * share * pc, -BETA * _s(-h) - alpha * share,
                             BETA * _s(-h)))
        else:
            d = lc / nc - lr / nr - 1 / (2 * BETA)
            expected.append((d * d - alpha * share * pc, 2 * d / nc - alpha * share, -2 * d / nr))
    losses, chosen_grad, rejected_grad = _loss_and_grads(loss_type, rpo_alpha=alpha)
    assert losses == pytest.approx([e[0] for e in expected], rel=1e-12)
    assert chosen_grad == pytest.approx([e[1] for e in expected], rel=1e-12)
    assert rejected_grad == pytest.approx([e[2] for e in expected], rel=1e-12)
    plain = _loss_and_grads(loss_type)[0]
    assert sum(losses) / 3 - sum(plain) / 3 == pytest.approx(alpha * 19 / 7, rel=1e-12, abs=1e-15)


def test_rpo_is_sft_at_weight_alpha_and_none_is_the_plain_loss_exactly():
    """TRL 0.28 deprecated rpo_alpha as equal to listing sft at weight alpha; rpo_alpha None is no term at all."""
    rpo = dpo_loss(*_leaves(), BETA, "sigmoid", 0.0, *_tokens(), rpo_alpha=0.3)[0]
    listed = dpo_loss(*_leaves(), BETA, "sigmoid,sft", 0.0, *_tokens(), loss_weights=[1.0, 0.3])[0]
    torch.testing.assert_close(rpo, listed, rtol=1e-15, atol=0)
    assert torch.equal(dpo_loss(*_leaves(), BETA, "sigmoid", 0.0, *_tokens(), rpo_alpha=None)[0],
                       dpo_loss(*_leaves(), BETA)[0])


# f-DPO: psi(l_c) - psi(l_r) for l_c - l_r in the margin; psi' is what the gradient takes.

def _psi(kind: str, coef: float, x: float) -> tuple[float, float]:
    """(psi(x), psi'(x)) of f-DPO's divergence, written out: reverse KL x; JS log(u / (1 + u)) with u = e^x, i.e.
    x - log(1 + e^x), slope 1 / (1 + e^x); alpha-divergence -e^(-alpha x) / alpha, slope e^(-alpha x)."""
    if kind == "reverse_kl":
        return x, 1.0
    if kind == "js_divergence":
        return x - math.log1p(math.exp(x)), 1 / (1 + math.exp(x))
    return -math.exp(-coef * x) / coef, math.exp(-coef * x)


def _on_margin(loss_type: str, eps: float, h: float) -> tuple[float, float]:
    """(loss, d loss / d h) of the types that read the margin h."""
    if loss_type == "sigmoid":
        return math.log1p(math.exp(-h)), -_s(-h)
    if loss_type == "hinge":
        return max(0.0, 1 - h), -1.0 if 1 - h > 0 else 0.0
    if loss_type == "robust":
        loss = ((1 - eps) * math.log1p(math.exp(-h)) - eps * math.log1p(math.exp(h))) / (1 - 2 * eps)
        return loss, (-(1 - eps) * _s(-h) - eps * _s(h)) / (1 - 2 * eps)
    # exo_pair: s(h) (log s(h) - log(1 - eps)) + s(-h) (log s(-h) - log eps)
    loss = _s(h) * (math.log(_s(h)) - math.log(1 - eps)) + _s(-h) * (math.log(_s(-h)) - math.log(eps))
    return loss, _s(h) * _s(-h) * (h - math.log((1 - eps) / eps))


@pytest.mark.parametrize("kind, coef", [("js_divergence", 1.0), ("alpha_divergence", 1.0),
                                        ("alpha_divergence", 0.5), ("reverse_kl", 1.0)])
@pytest.mark.parametrize("loss_type, eps", [("sigmoid", 0.0), ("hinge", 0.0), ("robust", 0.1), ("exo_pair", 1e-3),
                                            ("ipo", 0.0)])
def test_f_divergences_shape_the_margin_of_the_types_that_read_it(kind, coef, loss_type, eps):
    """h = beta (psi(l_c) - psi(l_r)) for sigmoid, hinge, robust and exo_pair, d = psi(l_c / n_c) - psi(l_r / n_r)
    for ipo (TRL 0.28 applies it to the per-token log-ratios ipo takes); d h / d pi_c = beta psi'(l_c)."""
    expected = []
    for pc, pr, refc, refr, nc, nr in PAIRS:
        lc, lr = pc - refc, pr - refr
        if loss_type == "ipo":
            (psi_c, slope_c), (psi_r, slope_r) = _psi(kind, coef, lc / nc), _psi(kind, coef, lr / nr)
            d = psi_c - psi_r - 1 / (2 * BETA)
            expected.append((d * d, 2 * d * slope_c / nc, -2 * d * slope_r / nr))
        else:
            (psi_c, slope_c), (psi_r, slope_r) = _psi(kind, coef, lc), _psi(kind, coef, lr)
            loss, slope = _on_margin(loss_type, eps, BETA * (psi_c - psi_r))
            expected.append((loss, BETA * slope * slope_c, -BETA * slope * slope_r))
    losses, chosen_grad, rejected_grad = _loss_and_grads(loss_type, label_smoothing=eps, f_divergence_type=kind,
                                                         f_alpha_divergence_coef=coef)
    assert losses == pytest.approx([e[0] for e in expected], rel=1e-12)
    assert chosen_grad == pytest.approx([e[1] for e in expected], rel=1e-10, abs=1e-14)
    assert rejected_grad == pytest.approx([e[2] for e in expected], rel=1e-10, abs=1e-14)


def test_the_f_divergence_leaves_the_other_types_and_the_rewards_alone():
    """In `sigmoid,nca_pair` only sigmoid's margin takes the divergence; the logged rewards stay beta x l."""
    js = dict(f_divergence_type="js_divergence")
    both, chosen, _ = dpo_loss(*_leaves(), BETA, "sigmoid,nca_pair", **js)
    sigmoid = dpo_loss(*_leaves(), BETA, "sigmoid", **js)[0]
    torch.testing.assert_close(both - sigmoid, dpo_loss(*_leaves(), BETA, "nca_pair")[0], rtol=1e-12, atol=1e-15)
    assert chosen.tolist() == pytest.approx([0.1, 0.0, -0.3], rel=1e-12, abs=1e-15)


def test_reverse_kl_given_or_left_out_is_the_plain_loss_bit_for_bit():
    """The default divergence takes no new arithmetic: on 500 random fp32 pairs, sigmoid's, hinge's, robust's,
    exo_pair's and ipo's losses and gradients with reverse_kl, given or left out, are those of the margin written out
    as before the option (beta l_c - beta l_r; ipo's l_c / n_c - l_r / n_r), to the bit; beta (l_c - l_r), the same
    number but for rounding, would not be."""
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(500, generator=generator) * 30 for _ in range(4)]
    tokens = [torch.randint(1, 40, (500,), generator=generator).float() for _ in range(2)]
    beta = 0.13
    for loss_type, eps in (("sigmoid", 0.0), ("hinge", 0.0), ("robust", 0.1), ("exo_pair", 1e-3), ("ipo", 0.0)):
        for options in ({}, {"f_divergence_type": "reverse_kl"}):
            policy = [value.clone().requires_grad_(True) for value in values[:2]]
            losses = dpo_loss(*policy, *values[2:], beta, loss_type, eps, *tokens, **options)[0]
            losses.sum().backward()
            leaves = [value.clone().requires_grad_(True) for value in values[:2]]
            chosen, rejected = leaves[0] - values[2], leaves[1] - values[3]
            h = beta * chosen - beta * rejected
            if loss_type == "sigmoid":
                expected = -torch.nn.functional.logsigmoid(h)
            elif loss_type == "hinge":
                expected = torch.relu(1 - h)
            elif loss_type == "robust":
                expected = (-(1 - eps) * torch.nn.functional.logsigmoid(h)
                            + eps * torch.nn.functional.logsigmoid(-h)) / (1 - 2 * eps)
            elif loss_type == "exo_pair":
                expected = (torch.sigmoid(h) * (torch.nn.functional.logsigmoid(h) - math.log1p(-eps))
                            + torch.sigmoid(-h) * (torch.nn.functional.logsigmoid(-h) - math.log(eps)))
            else:
                expected = (chosen / tokens[0] - rejected / tokens[1] - 1 / (2 * beta)) ** 2
            expected.sum().backward()
            assert torch.equal(losses, expected), (loss_type, options)
            assert torch.equal(policy[0].grad, leaves[0].grad) and torch.equal(policy[1].grad, leaves[1].grad)


def test_the_alpha_divergence_caps_its_exponent_as_trl_does():
    """exp(-alpha l) of a log-ratio of -1000 overflows fp32: the exponent is capped at floor(log(fp32 max), 4
    decimals) = 88.7228 (TRL's cap_exp), so the loss stays finite."""
    far = torch.tensor([-1000.0])
    difference = f_divergence_difference(far, torch.tensor([0.0]), "alpha_divergence", 1.0)
    assert difference.item() == pytest.approx(1 - math.exp(88.7228), rel=1e-5)  # fp32
    assert torch.isfinite(dpo_loss(far, torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([0.0]), BETA,
                                   f_divergence_type="alpha_divergence")[0]).all()


# LD-DPO: per pair, the first l_p = min(n_c, n_r) answer tokens count fully, the longer answer's later ones alpha.

def _ld_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Two pairs (rows: chosen 0, chosen 1, rejected 0, rejected 1) of 8 positions: answers of 3 and 5 tokens (pair
    0), 4 and 2 (pair 1), after prompts of different lengths; labels[t + 1] is the target at t."""
    labels = torch.full((4, 8), -100)
    for row, (start, length) in enumerate([(2, 3), (1, 4), (1, 5), (3, 2)]):
        labels[row, start + 1:start + 1 + length] = 7
    return labels, torch.linspace(-0.3, -2.9, 32, dtype=torch.float64).view(4, 8)


def test_ld_dpo_weighs_the_verbose_tokens_by_alpha():
    """Pair 0: l_p = 3, the rejected answer's tokens 4 and 5 are verbose; pair 1: l_p = 2, the chosen answer's 3 and
    4. The log-probability is the sum of the first l_p tokens' + alpha x the rest's; its gradient 1 and alpha."""
    labels, values = _ld_rows()
    values.requires_grad_(True)
    alpha = 0.25
    answer = (torch.roll(labels, -1, dims=1) != -100) & (torch.arange(8) < 7)
    log_probs = torch.where(answer, values, torch.zeros_like(values))
    result = desensitized_log_probs(log_probs, labels, alpha)
    expected, weights = [], torch.zeros(4, 8, dtype=torch.float64)
    for row, shared in enumerate([3, 2, 3, 2]):
        positions = answer[row].nonzero().flatten().tolist()
        weights[row, positions[:shared]] = 1.0
        weights[row, positions[shared:]] = alpha
        expected.append(sum(values[row, t].item() for t in positions[:shared])
                        + alpha * sum(values[row, t].item() for t in positions[shared:]))
    assert [len(answer[row].nonzero()) for row in range(4)] == [3, 4, 5, 2]
    assert result.tolist() == pytest.approx(expected, rel=1e-12)
    result.sum().backward()
    assert torch.equal(values.grad, weights)
    assert torch.equal(desensitized_log_probs(log_probs, labels, 1.0), log_probs.sum(dim=-1))


# Two pairs: the chosen answers have 2 and 3 labelled tokens, the rejected 4 and 1 (rows: chosen, then rejected).
INPUT_IDS = torch.tensor([[1, 2, 3, 4, 0, 0], [1, 5, 6, 2, 3, 0], [1, 2, 4, 4, 6, 5], [1, 5, 3, 2, 0, 0]])
LABELS = torch.tensor([[-100, -100, 3, 4, -100, -100], [-100, -100, 6, 2, 3, -100], [-100, -100, 4, 4, 6, 5],
                       [-100, -100, -100, 2, -100, -100]])


def _token_terms(table: torch.Tensor) -> list[list[tuple[float, float]]]:
    """Per row, per answer token in order: (log p(token), log sum_v p_v^2) from the logits `table[previous token]`,
    in fp64, written out from the softmax."""
    rows = []
    for ids, labels in zip(INPUT_IDS.tolist(), LABELS.tolist()):
        terms = []
        for t in range(1, len(ids)):
            if labels[t] != -100:
                logits = table[ids[t - 1]].tolist()
                top = max(logits)
                norm = sum(math.exp(z - top) for z in logits)
                probs = [math.exp(z - top) / norm for z in logits]
                terms.append((math.log(probs[labels[t]]), math.log(sum(p * p for p in probs))))
        rows.append(terms)
    return rows


def _by_hand_objective(policy: torch.Tensor, reference: torch.Tensor, ld_alpha: float | None,
                       weighted: bool) -> list[tuple[float, float]]:
    """Per pair, fp64, x WPO's min(1, exp(mean(log p - log sum p^2) of both answers)) (1 without it): (sigmoid's
    -log s(beta (l_c - l_r)) on LD-DPO's log-probabilities (both models'), the chosen answer's plain summed NLL). A
    step of P pairs and N chosen tokens minimizes the first's sum / P + RPO's alpha x the second's sum / N."""
    pi, ref = _token_terms(policy), _token_terms(reference)
    terms = []
    for pair in range(2):
        chosen, rejected = pair, pair + 2
        shared = min(len(pi[chosen]), len(pi[rejected]))

        def summed(terms: list[tuple[float, float]]) -> float:
            alpha = 1.0 if ld_alpha is None else ld_alpha
            return sum(lp for lp, _ in terms[:shared]) + alpha * sum(lp for lp, _ in terms[shared:])

        ratios = [summed(pi[row]) - summed(ref[row]) for row in (chosen, rejected)]
        loss = math.log1p(math.exp(-BETA * (ratios[0] - ratios[1])))
        nll = -sum(lp for lp, _ in pi[chosen])
        weight = 1.0
        if weighted:
            means = [sum(lp - sq for lp, sq in pi[row]) / len(pi[row]) for row in (chosen, rejected)]
            weight = min(1.0, math.exp(means[0] + means[1]))
        terms.append((weight * loss, weight * nll))
    return terms


def _objective_grad(policy: _Tiny, reference: _Tiny, ld_alpha: float | None, weighted: bool,
                    rpo_alpha: float | None, weights_with_grad: bool = False) -> torch.Tensor:
    """The gradient of the loss by the policy's table: the formula above in fp64 torch ops, the mean over the two
    pairs of the weighted preference loss + alpha x the weighted chosen NLLs' sum over the chosen tokens (WPO's
    weights without gradient, or, `weights_with_grad`, with it: what the objective must not do)."""
    table = policy.table.detach().clone().requires_grad_(True)
    log_p = torch.log_softmax(table, dim=-1)
    ref_log_p = torch.log_softmax(reference.table.detach(), dim=-1)
    chosen_tokens = sum(int((LABELS[row] != -100).sum()) for row in (0, 1))
    total = 0
    for pair in range(2):
        rows = []
        for row in (pair, pair + 2):
            ids, labels = INPUT_IDS[row].tolist(), LABELS[row].tolist()
            rows.append([(ids[t - 1], labels[t]) for t in range(1, len(ids)) if labels[t] != -100])
        shared = min(len(rows[0]), len(rows[1]))
        alpha = 1.0 if ld_alpha is None else ld_alpha

        def summed(matrix: torch.Tensor, terms: list[tuple[int, int]]) -> torch.Tensor:
            return (sum(matrix[p, y] for p, y in terms[:shared])
                    + alpha * sum((matrix[p, y] for p, y in terms[shared:]), torch.tensor(0.0, dtype=torch.float64)))

        ratios = [summed(log_p, terms) - summed(ref_log_p, terms) for terms in rows]
        loss = -torch.nn.functional.logsigmoid(BETA * (ratios[0] - ratios[1])) / 2
        if rpo_alpha is not None:
            loss = loss + rpo_alpha * -sum(log_p[p, y] for p, y in rows[0]) / chosen_tokens
        if weighted:
            sharp = torch.logsumexp(2 * log_p, dim=-1)
            means = [sum(log_p[p, y] - sharp[p] for p, y in terms) / len(terms) for terms in rows]
            weight = torch.exp(means[0] + means[1]).clamp(max=1)
            loss = loss * (weight if weights_with_grad else weight.detach())
        total = total + loss
    total.backward()
    return table.grad


@pytest.mark.parametrize("ld_alpha, weighted, rpo_alpha", [(0.3, False, None), (None, True, None),
                                                           (0.5, True, 0.7), (None, False, 1.0), (0.0, False, None)])
def test_the_objective_with_ld_dpo_wpo_and_rpo_matches_fp64_by_hand(ld_alpha, weighted, rpo_alpha):
    """DirectPreference's loss (the mean over two pairs of 2/4 and 3/1 answer tokens) and its gradient by the
    policy's weights against the formulas written out in fp64 from the softmax; WPO's weight carries no gradient;
    the logged nll_loss is the chosen answers' mean token NLL summed over the pairs."""
    policy, reference = _Tiny(1.0), _Tiny(0.5)
    objective = DirectPreference(reference, BETA, torch.enable_grad, ld_alpha=ld_alpha, use_weighting=weighted,
                                 rpo_alpha=rpo_alpha)
    batch = {"input_ids": INPUT_IDS, "attention_mask": torch.ones_like(INPUT_IDS), "labels": LABELS}
    loss, stats = objective.loss(policy, batch, torch.tensor(2))
    terms = _by_hand_objective(policy.table.detach(), reference.table, ld_alpha, weighted)
    expected = sum(pair for pair, _ in terms) / 2 + (rpo_alpha or 0.0) * sum(nll for _, nll in terms) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-6)  # the token log-probs are fp32
    loss.backward()
    reference_grad = _objective_grad(policy, reference, ld_alpha, weighted, rpo_alpha)
    torch.testing.assert_close(policy.table.grad, reference_grad, rtol=1e-5, atol=1e-7)
    if weighted:  # a weight that kept its gradient would move the policy otherwise
        assert not torch.allclose(policy.table.grad, _objective_grad(policy, reference, ld_alpha, weighted,
                                                                     rpo_alpha, weights_with_grad=True),
                                  rtol=1e-3, atol=1e-6)
    pi = _token_terms(policy.table.detach())
    nll = -sum(lp for row in (0, 1) for lp, _ in pi[row]) / 5  # the 2 + 3 chosen tokens' mean
    assert objective.stat_names[-1:] == (("nll_loss",) if rpo_alpha is not None else ("rejected_reward",))
    if rpo_alpha is not None:  # the core divides the sum by the step's 2 pairs
        assert stats[-1].item() / 2 == pytest.approx(nll, rel=1e-6)
    assert len(stats) == len(objective.stat_names)


def _pair_batch(pairs: list[int]) -> dict[str, torch.Tensor]:
    """A micro-batch of the given pairs of INPUT_IDS / LABELS: their chosen rows, then their rejected rows."""
    rows = pairs + [pair + 2 for pair in pairs]
    return {"input_ids": INPUT_IDS[rows], "attention_mask": torch.ones_like(INPUT_IDS[rows]), "labels": LABELS[rows]}


@pytest.mark.parametrize("loss_type, options", [("sigmoid", {"rpo_alpha": 0.7}),
                                                ("sigmoid,sft", {"loss_weights": [1.0, 0.4]}),
                                                ("sigmoid", {"rpo_alpha": 0.7, "use_weighting": True})])
@pytest.mark.parametrize("split", ["micro-batches", "processes"])
def test_the_nll_is_the_steps_token_mean_however_the_step_is_split(loss_type, options, split):
    """A step of the two pairs (chosen answers of 2 and 3 tokens) split into two micro-batches of one pair, or over
    two processes of one pair each (threads whose all-reduce sums): after count_step, the micro-batches' losses,
    gradients and NLL statistics sum to the whole step's as one micro-batch, which is the fp64 formula: the pairs'
    mean preference loss + c x the chosen NLLs' sum over the step's 5 chosen tokens (c: alpha, or sft's weight; each
    pair's terms x its WPO weight). Each micro-batch's own token mean averaged, (S_0 / 2 + S_1 / 3) / 2, would fail."""
    from tests.threaded_processes import OneProcess, ThreadedProcesses

    def step(batches: list[dict[str, torch.Tensor]], accelerator) -> tuple[float, torch.Tensor, float]:
        policy = _Tiny(1.0)
        objective = DirectPreference(_Tiny(0.5), BETA, torch.enable_grad, loss_type, **options)
        objective.count_step(batches, accelerator)
        loss, nll = 0.0, 0.0
        for batch in batches:
            micro_loss, stats = objective.loss(policy, batch, torch.tensor(2))  # the step's 2 pairs
            micro_loss.backward()
            loss, nll = loss + micro_loss.item(), nll + stats[-1].item()
        return loss, policy.table.grad, nll / 2

    whole_loss, whole_grad, whole_nll = step([_pair_batch([0, 1])], OneProcess())
    if split == "micro-batches":
        loss, grad, nll = step([_pair_batch([0]), _pair_batch([1])], OneProcess())
    else:
        parts = ThreadedProcesses(2).run(lambda rank, accelerator: step([_pair_batch([rank])], accelerator))
        loss, grad, nll = (sum(part[index] for part in parts) for index in range(3))
    assert loss == pytest.approx(whole_loss, rel=1e-6)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-5, atol=1e-7)
    assert nll == pytest.approx(whole_nll, rel=1e-6)
    terms = _by_hand_objective(_Tiny(1.0).table.detach(), _Tiny(0.5).table, None, options.get("use_weighting", False))
    weight = options.get("rpo_alpha", 0.4)
    assert whole_loss == pytest.approx(sum(pair for pair, _ in terms) / 2 + weight * sum(s for _, s in terms) / 5,
                                       rel=1e-6)
    pi = _token_terms(_Tiny(1.0).table.detach())
    assert whole_nll == pytest.approx(-sum(lp for row in (0, 1) for lp, _ in pi[row]) / 5, rel=1e-6)


def test_wpo_weights_are_trls_by_hand_clamped_at_1_and_carry_no_gradient():
    """w = exp(mean over the answer's tokens of log p - log sum_v p_v^2) per answer, the pair's min(1, w_c w_r): the
    sine table's weights are below 1; a table that favours every answer's next token (logit 1 there, 0 elsewhere)
    has w_c w_r about 2.1 and 2.2, clamped to 1."""
    favouring = torch.zeros(7, 7, dtype=torch.float64)
    for ids, labels in zip(INPUT_IDS.tolist(), LABELS.tolist()):
        for t in range(1, len(ids)):
            if labels[t] != -100:
                favouring[ids[t - 1], labels[t]] = 1.0
    for table, clamped in ((torch.arange(49, dtype=torch.float64).view(7, 7).sin(), False), (favouring, True)):
        table.requires_grad_(True)
        logits = table[INPUT_IDS]
        weights = wpo_weights(logits, LABELS, token_log_probs(logits, LABELS))
        assert not weights.requires_grad
        terms = _token_terms(table.detach())
        raw = [math.exp(sum(lp - sq for lp, sq in terms[pair]) / len(terms[pair])
                        + sum(lp - sq for lp, sq in terms[pair + 2]) / len(terms[pair + 2])) for pair in range(2)]
        assert all(w > 1 for w in raw) if clamped else all(w < 1 for w in raw)
        assert weights.tolist() == pytest.approx([min(1.0, w) for w in raw], rel=1e-5)


def test_wpo_weighs_each_pairs_loss_in_dpo_loss():
    """dpo_loss(pair_weights=w): w x the loss, and w x its gradient (w is a constant there)."""
    weights = torch.tensor([0.5, 0.25, 1.0], dtype=torch.float64)
    plain, plain_chosen, plain_rejected = _loss_and_grads("sigmoid")
    losses, chosen_grad, rejected_grad = _loss_and_grads("sigmoid", pair_weights=weights)
    assert losses == pytest.approx([w * x for w, x in zip(weights.tolist(), plain)], rel=1e-12)
    assert chosen_grad == pytest.approx([w * x for w, x in zip(weights.tolist(), plain_chosen)], rel=1e-12)
    assert rejected_grad == pytest.approx([w * x for w, x in zip(weights.tolist(), plain_rejected)], rel=1e-12)


# Refusals: one line, naming the flag, its value, why, and the values allowed (WPO's: the loss types it takes).

@pytest.mark.parametrize("flags, message", [
    (["--rpo_alpha", "-1"], "--rpo_alpha=-1.0 is not allowed; it must be a number >= 0 (RPO's weight of the chosen "
                            "answer's NLL; the paper's 1.0)"),
    (["--rpo_alpha", "nan"], "--rpo_alpha=nan is not allowed; it must be a number >= 0"),
    (["--rpo_alpha", "inf"], "--rpo_alpha=inf is not allowed; it must be a number >= 0"),
    (["--loss_type", "sft", "--rpo_alpha", "1"], "--rpo_alpha=1.0 is not allowed; only a --loss_type other than sft "
                                                 "alone uses it: list a preference loss type with it (sft alone is "
                                                 "the NLL it adds: weigh that with --loss_weights), or leave "
                                                 "--rpo_alpha out"),
    (["--ld_alpha", "1.5"], "--ld_alpha=1.5 is not allowed; it must be in [0, 1] (1: the plain log-probabilities, "
                            "0: the longer answer's verbose tokens dropped)"),
    (["--ld_alpha", "-0.1"], "--ld_alpha=-0.1 is not allowed; it must be in [0, 1]"),
    (["--loss_type", "sft", "--ld_alpha", "0.5"], "--ld_alpha=0.5 is not allowed; only a --loss_type other than sft "
                                                  "alone uses it: list a preference loss type with it, or leave "
                                                  "--ld_alpha out"),
    (["--loss_type", "aot", "--use_weighting"], "--use_weighting=True is not allowed; --loss_type aot sorts the "
                                                "pairs' log-ratios apart, so a pair's WPO weight would meet another "
                                                "pair's loss: it is allowed with --loss_type sigmoid, ipo, hinge, "
                                                "robust, exo_pair, nca_pair, bco_pair, sppo_hard, apo_zero, apo_down, "
                                                "discopop, sigmoid_norm, sft (leave it off with --loss_type aot)"),
    (["--loss_type", "sigmoid,aot_unpaired", "--use_weighting", "true"], "--use_weighting=True is not allowed; "
                                                                         "--loss_type aot_unpaired sorts the pairs' "
                                                                         "log-ratios apart, so a pair's WPO weight "
                                                                         "would meet another pair's loss: it is "
                                                                         "allowed with --loss_type sigmoid, ipo, "
                                                                         "hinge, robust, exo_pair, nca_pair, "
                                                                         "bco_pair, sppo_hard, apo_zero, apo_down, "
                                                                         "discopop, sigmoid_norm, sft (leave it off "
                                                                         "with --loss_type sigmoid,aot_unpaired)"),
    (["--f_divergence_type", "forward_kl"], "--f_divergence_type='forward_kl' is not allowed; choose one of "
                                            "reverse_kl, js_divergence, alpha_divergence"),
    (["--loss_type", "nca_pair,apo_zero", "--f_divergence_type", "js_divergence"],
     "--f_divergence_type='js_divergence' is not allowed; only --loss_type sigmoid, hinge, ipo, robust, exo_pair "
     "uses it: give one of those loss types with it, or leave --f_divergence_type out"),
    (["--f_divergence_type", "alpha_divergence", "--f_alpha_divergence_coef", "0"],
     "--f_alpha_divergence_coef=0.0 is not allowed; it must be a positive number"),
    (["--f_divergence_type", "alpha_divergence", "--f_alpha_divergence_coef", "inf"],
     "--f_alpha_divergence_coef=inf is not allowed; it must be a positive number"),
    (["--f_divergence_type", "js_divergence", "--f_alpha_divergence_coef", "0.5"],
     "--f_alpha_divergence_coef=0.5 is not allowed; only --f_divergence_type alpha_divergence uses it: give "
     "--f_divergence_type alpha_divergence with it, or leave --f_alpha_divergence_coef out"),
])
def test_bad_option_values_are_one_line_refusals(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args("dpo", flags)
    line = capsys.readouterr().err.splitlines()[0]
    assert line.startswith(f"error: {message}"), line


@pytest.mark.parametrize("flags", [["--loss_type", "sigmoid,sft", "--rpo_alpha", "1"],
                                   ["--loss_type", "apo_zero", "--ld_alpha", "0"],
                                   ["--loss_type", "nca_pair,hinge", "--f_divergence_type", "js_divergence"],
                                   ["--loss_type", "ipo", "--use_weighting", "--f_divergence_type",
                                    "alpha_divergence", "--f_alpha_divergence_coef", "0.5"]])
def test_the_options_are_taken_where_a_listed_type_reads_them(flags):
    args = parse_args("dpo", flags)
    assert args.loss_type == flags[1]


def test_the_objective_refuses_what_the_flags_refuse():
    """DirectPreference (built without the flags' checks) refuses the same values."""
    with pytest.raises(ValueError, match=r"^--use_weighting=True is not allowed; --loss_type aot sorts"):
        DirectPreference(_Tiny(0.5), BETA, torch.enable_grad, "aot", use_weighting=True)
    with pytest.raises(ValueError, match=r"^--ld_alpha=2\.0 is not allowed; it must be in \[0, 1\]"):
        DirectPreference(_Tiny(0.5), BETA, torch.enable_grad, ld_alpha=2.0)


def test_dpo_loss_refuses_what_the_flags_refuse():
    """dpo_loss, called without the flags' checks, refuses a divergence it does not know (it would otherwise take
    DPO's margin), one no listed type reads, and WPO's weights with a type that sorts the pairs."""
    with pytest.raises(ValueError, match=r"^--f_divergence_type='forward_kl' is not allowed; choose one of"):
        dpo_loss(*_leaves(), BETA, f_divergence_type="forward_kl")
    with pytest.raises(ValueError, match=r"^--f_divergence_type='js_divergence' is not allowed; only --loss_type"):
        dpo_loss(*_leaves(), BETA, "nca_pair", f_divergence_type="js_divergence")
    with pytest.raises(ValueError, match=r"^--use_weighting=True is not allowed; --loss_type aot sorts"):
        dpo_loss(*_leaves(), BETA, "aot", pair_weights=torch.ones(3, dtype=torch.float64))


def test_the_loss_refusals_quote_a_long_value_cut_on_one_line():
    """--loss_type and --loss_weights quote a refused value as every flag refusal does (dataset/shown_value.py's
    flag_refusal: the repr cut at MAX_SHOWN characters): a 5,000-character name made a 5,000-character line."""
    from dataset.shown_value import MAX_SHOWN
    from trainer.dpo import parse_loss_types

    with pytest.raises(ValueError) as refused:
        parse_loss_types("n" * 5000)
    assert str(refused.value).startswith("--loss_type='" + "n" * (MAX_SHOWN - 4) + "... is not allowed; choose one")
    assert len(str(refused.value)) < 400
    weights = [0.5] * 1000
    with pytest.raises(ValueError) as refused:
        dpo_loss(*_leaves(), BETA, "sigmoid,sft", loss_weights=weights)
    assert str(refused.value) == (f"--loss_weights={repr(weights)[:MAX_SHOWN - 3]}... is not allowed; give one weight "
                                  f"per --loss_type (2)")


def test_nll_loss_is_logged_with_sft_and_counts_the_real_pairs_only():
    """`sigmoid,sft` logs nll_loss as RPO does; a padding pair (no target, as validation shards are padded) adds
    nothing to it nor to the loss: with pair 1 blanked, the sums are pair 0's, by hand from the softmax."""
    labels = LABELS.clone()
    labels[[1, 3]] = -100
    objective = DirectPreference(_Tiny(0.5), BETA, torch.enable_grad, "sigmoid,sft")
    batch = {"input_ids": INPUT_IDS, "attention_mask": torch.ones_like(INPUT_IDS), "labels": labels}
    loss, stats = objective.loss(_Tiny(1.0), batch, torch.tensor(1))
    assert objective.stat_names[-1] == "nll_loss" and len(stats) == len(objective.stat_names)
    pi, ref = _token_terms(_Tiny(1.0).table.detach()), _token_terms(_Tiny(0.5).table.detach())
    nll = -sum(lp for lp, _ in pi[0]) / len(pi[0])
    ratios = [sum(lp for lp, _ in pi[row]) - sum(lp for lp, _ in ref[row]) for row in (0, 2)]
    assert stats[-1].item() == pytest.approx(nll, rel=1e-6)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-BETA * (ratios[0] - ratios[1]))) + nll, rel=1e-6)


# A checkpoint recorded before the options ran without them.

def test_a_dpo_run_recorded_before_the_options_implies_their_values():
    """resume_checks._FLAGS_BEFORE writes them out: no RPO term, no LD-DPO, no WPO, DPO's reverse KL with TRL's
    alpha 1.0 unread; resuming as it ran notes nothing, another divergence, WPO, RPO or LD-DPO notes the change."""
    from trainer.resume_checks import _with_implied_flags, changed_flags

    old = {"task": "dpo", "beta": 0.15, "loss_type": "sigmoid"}
    implied = _with_implied_flags(old)
    assert {name: implied[name] for name in ("rpo_alpha", "ld_alpha", "use_weighting", "f_divergence_type",
                                             "f_alpha_divergence_coef")} == {
        "rpo_alpha": None, "ld_alpha": None, "use_weighting": False, "f_divergence_type": "reverse_kl",
        "f_alpha_divergence_coef": 1.0}
    assert changed_flags({"config": old}, parse_args("dpo", []).to_dict()) == ""
    assert changed_flags({"config": old}, parse_args("dpo", ["--use_weighting", "--f_divergence_type",
                                                             "alpha_divergence", "--f_alpha_divergence_coef", "0.5"]
                                                     ).to_dict()) == (
        "--use_weighting was False there and is True now, --f_divergence_type was reverse_kl there and is "
        "alpha_divergence now, --f_alpha_divergence_coef was 1.0 there and is 0.5 now")
    assert changed_flags({"config": old}, parse_args("dpo", ["--rpo_alpha", "1", "--ld_alpha", "0.5"]).to_dict()) == (
        "--rpo_alpha was unset there and is 1.0 now, --ld_alpha was unset there and is 0.5 now")


@pytest.mark.parametrize("rpo_alpha", [0.7, None])
def test_validation_logs_nll_loss_where_the_loss_reads_it(rpo_alpha):
    """DirectPreference.evaluate over two batches (the second with pair 1 blanked, as validation shards are padded),
    one step of 3 real pairs and 2 + 3 + 2 = 7 chosen tokens: with --rpo_alpha its val_nll_loss (TRL's
    eval_nll_loss) is the token mean NLL over those 7 tokens, its val_loss the pairs' mean sigmoid loss + alpha x
    it, by hand from the softmax (the mean of each pair's own mean NLL differs: answers of 2 and 3 tokens), and
    run_summary.json's final_val holds nll_loss; without it neither the log nor final_val has an NLL."""
    from accelerate import Accelerator

    objective = DirectPreference(_Tiny(0.5), BETA, torch.enable_grad, rpo_alpha=rpo_alpha)
    blanked = LABELS.clone()
    blanked[[1, 3]] = -100
    loader = [{"input_ids": INPUT_IDS, "attention_mask": torch.ones_like(INPUT_IDS), "labels": labels}
              for labels in (LABELS, blanked)]
    result = objective.evaluate(_Tiny(1.0), loader, Accelerator(cpu=True))
    (pair_0, nll_0), (pair_1, nll_1) = _by_hand_objective(_Tiny(1.0).table.detach(), _Tiny(0.5).table, None, False)
    pi = _token_terms(_Tiny(1.0).table.detach())
    assert (len(pi[0]), len(pi[1])) == (2, 3)
    token_mean = (2 * nll_0 + nll_1) / 7
    assert abs(token_mean - (2 * nll_0 / 2 + nll_1 / 3) / 3) > 1e-3  # the per-pair mean is another number
    logged = result.logged()
    assert result.pairs == 3
    assert logged["val_loss"] == pytest.approx((2 * pair_0 + pair_1) / 3 + (rpo_alpha or 0.0) * token_mean, rel=1e-6)
    if rpo_alpha is None:
        assert "val_nll_loss" not in logged and "nll_loss" not in result.as_dict()
    else:
        assert logged["val_nll_loss"] == pytest.approx(token_mean, rel=1e-6)
        assert result.as_dict()["nll_loss"] == logged["val_nll_loss"]
        assert "chosen NLL" in result.describe()


def test_dpo_loss_takes_the_nll_over_its_real_pairs_alone():
    """dpo_loss given no chosen_nll takes its pairs as the step, and a pair that is not `real` counts in neither P nor
    N: the real pairs 0 and 1 beside pair 2 marked not real lose what the two alone lose, -log s(h) + alpha x pi_c's
    share -pi_c x 2 / (2 + 4) (not x 3 / 7, the three pairs' counts)."""
    alpha, real = 0.5, torch.tensor([True, True, False])
    losses, _, _ = dpo_loss(*_leaves(), BETA, "sigmoid", 0.0, *_tokens(), real=real, rpo_alpha=alpha)
    alone, _, _ = dpo_loss(*(leaf[:2] for leaf in _leaves()), BETA, "sigmoid", 0.0,
                           *(tokens[:2] for tokens in _tokens()), rpo_alpha=alpha)
    expected = [math.log1p(math.exp(-BETA * ((pc - refc) - (pr - refr)))) - alpha * pc * 2 / 6
                for pc, pr, refc, refr, _, _ in PAIRS[:2]]
    assert losses[:2].tolist() == pytest.approx(expected, rel=1e-12)
    assert alone.tolist() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("split", ["max_batches", "processes"])
def test_validation_is_one_step_over_the_batches_it_reads_on_every_process(split):
    """--rpo_alpha's validation NLL is the token mean over the chosen tokens of the batches evaluate reads, on all
    processes: with max_batches 1 of the two batches, the first's 2 pairs and 2 + 3 chosen tokens (not its pairs
    against all 7 tokens); over two processes (threads whose all-reduce sums) holding one batch each, the same 3
    real pairs and 7 tokens as one process holding both, in each process (not each its own pairs and tokens)."""
    from tests.threaded_processes import ThreadedProcesses

    blanked = LABELS.clone()
    blanked[[1, 3]] = -100
    batches = [{"input_ids": INPUT_IDS, "attention_mask": torch.ones_like(INPUT_IDS), "labels": labels}
               for labels in (LABELS, blanked)]

    def evaluate(loader, accelerator, max_batches: int = 0):
        objective = DirectPreference(_Tiny(0.5), BETA, torch.enable_grad, rpo_alpha=0.7)
        return objective.evaluate(_Tiny(1.0), loader, accelerator, max_batches=max_batches)

    (pair_0, nll_0), (pair_1, nll_1) = _by_hand_objective(_Tiny(1.0).table.detach(), _Tiny(0.5).table, None, False)
    if split == "max_batches":
        from tests.threaded_processes import OneProcess

        results = [evaluate(batches, OneProcess(), max_batches=1)]
        pairs, loss, nll = 2, (pair_0 + pair_1) / 2, (nll_0 + nll_1) / 5
    else:
        results = ThreadedProcesses(2).run(lambda rank, accelerator: evaluate([batches[rank]], accelerator))
        pairs, loss, nll = 3, (2 * pair_0 + pair_1) / 3, (2 * nll_0 + nll_1) / 7
    for result in results:
        assert result.pairs == pairs
        assert result.nll_loss == pytest.approx(nll, rel=1e-6)
        assert result.loss == pytest.approx(loss + 0.7 * nll, rel=1e-6)
