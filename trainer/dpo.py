"""Direct Preference Optimization (Rafailov et al. 2023): the DPO loss, TRL's other preference losses, and their
objective for the training core.

For a prompt x with a chosen answer y_c and a rejected one y_r, the policy pi (being trained) and the frozen
reference model (the starting weights) give summed log-probabilities of each answer's tokens; the log-ratios are
l_c = log pi(y_c|x) - log ref(y_c|x) and l_r likewise, the implicit rewards r_c = beta l_c and r_r = beta l_r, the
margin h = r_c - r_r, and the default loss (--loss_type sigmoid) is

    -log sigmoid(h) = -log sigmoid(beta * ((pi_c - pi_r) - (ref_c - ref_r)))

averaged over pairs. The other loss types are TRL DPOTrainer's, by its names (per pair; sigma = sigmoid, eps =
--label_smoothing, which only the types in LABEL_SMOOTHED read):

    sigmoid       -(1 - eps) log sigma(h) - eps log sigma(-h)     conservative DPO (Mitchell 2023) for eps > 0
    hinge         max(0, 1 - h)                                    SLiC (Zhao et al. 2023, arXiv:2305.10425)
    ipo           (d - 1 / (2 beta))^2, d = l_c / n_c - l_r / n_r  IPO (Azar et al. 2023, eq. 17), per-token means
    robust        (-(1 - eps) log sigma(h) + eps log sigma(-h)) / (1 - 2 eps)   rDPO (Chowdhury et al. 2024);
                  eps <= ROBUST_MAX_EPS (0.4)
    exo_pair      sigma(h) (log sigma(h) - log(1 - eps)) + sigma(-h) (log sigma(-h) - log eps)   EXO (Ji et al.
                  2024, eq. 16; eps > 0)
    nca_pair      -log sigma(r_c) - log sigma(-r_c) / 2 - log sigma(-r_r) / 2   NCA (Chen et al. 2024)
    bco_pair      -log sigma(r_c - m) - log sigma(-(r_r - m)), m the running mean of the rewards (BCO, Jung et
                  al. 2024; BCORunningMean)
    sppo_hard     (l_c - 1 / (2 beta))^2 + (l_r + 1 / (2 beta))^2  SPPO (Wu et al. 2024) with hard probabilities
    aot           h' = beta (sort(pi_c - pi_r) - sort(ref_c - ref_r)) over the micro-batch's pairs, then sigmoid's
                  smoothed loss on h' (AOT, Melnyk et al. 2024)
    aot_unpaired  the same with h' = beta (sort(l_c) - sort(l_r)); aot_pair is its name in TRL before 2026-02
    apo_zero      1 - sigma(r_c) + sigma(r_r)                      APO (D'Oosterlinck et al. 2024, eq. 7)
    apo_down      sigma(r_c) + 1 - sigma(h)                        APO, eq. 8
    discopop      (1 - w) (-log sigma(h)) + w exp(-h), w = sigma(h / tau)   DiscoPOP (Lu et al. 2024, eq. 5;
                  tau = --discopop_tau)
    sigmoid_norm  -log sigma(beta d), d as ipo's
    sft           the chosen answers' token mean NLL, -sum pi_c / sum n_c over the optimizer step's pairs (TRL's
                  over its micro-batch's), each pair's share -pi_c P / N (P pairs and N chosen tokens in the step)

n_c and n_r are the answers' token counts. Several types, comma-separated (`sigmoid,sft`), are summed with
--loss_weights (1 each by default), TRL's combination (its MPO recipe). Four options of TRL's DPOConfig (as TRL
0.28, the last before its 2026-02 DPO rewrite, has them all) change any of them:

    --rpo_alpha a        RPO (Pang et al. 2024, v3): + a * sft's term, the chosen answers' token mean NLL
    --ld_alpha a         LD-DPO (Liu et al. 2024): each answer's log-probability, the policy's and the reference's,
                         is the sum over its first min(n_c, n_r) tokens + a * the sum over the rest (the longer
                         answer's verbose part); sft's and RPO's NLL stay the plain one
    --use_weighting      WPO (Zhou et al. 2024, eq. 2): each pair's loss times min(1, w_c w_r), w = exp(the mean over
                         the answer's tokens of log(p(token) / sum_v p_v^2)), from the policy without gradient
    --f_divergence_type  f-DPO (Wang et al. 2023): the margin of the types in F_DIVERGENCE_READERS takes
                         psi(l_c) - psi(l_r) for l_c - l_r, psi(l) = l (reverse_kl), l - softplus(l)
                         (js_divergence) or -exp(-alpha l) / alpha (alpha_divergence, alpha =
                         --f_alpha_divergence_coef); ipo's on the per-token log-ratios l / n

The per-pair loss is (sum of the types + RPO's term) x WPO's weight, TRL's order. The NLL is one number over the
step's chosen tokens, not each answer's own mean: pair i's share of it, -pi_c,i P / N, averages over the step's P
pairs to the token mean -sum pi_c / N, however the step is split into micro-batches and processes (the training
core's count_step gives each micro-batch N), and takes pair i's WPO weight with it.

The answer's tokens are its content and closing <|im_end|> (dataset/dpo_dataset.py, the SFT mask rule restricted to the
final answer). The reference's log-probabilities are computed once per batch without gradients, in the same autocast as
the policy's forward, so at the first step every log-ratio is 0 (sigmoid's loss is then log 2, whatever eps;
docs/post_training.md lists each type's).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

from model.model import shift_labels
from dataset.shown_value import flag_refusal
from trainer.evaluation import LoggedEval
from trainer.run_dir import DPO_VAL_METRICS
from trainer.step import StatWindow

NLL_STAT = "nll_loss"  # TRL's name for the chosen answers' NLL it logs with rpo_alpha or sft
# A micro-batch's key for its optimizer step's chosen-answer tokens, all processes (count_step): the NLL's divisor
STEP_CHOSEN_TOKENS = "step_chosen_tokens"
# what every pair adds beside its loss (and beside the NLL, where the loss reads it)
STAT_NAMES = tuple(name for name in DPO_VAL_METRICS.values() if name not in ("loss", NLL_STAT))
DEFAULT_DISCOPOP_TAU = 0.05  # TRL's discopop_tau, the DiscoPOP paper's
DEFAULT_F_ALPHA_DIVERGENCE_COEF = 1.0  # TRL's f_alpha_divergence_coef (up to 0.28; its rewrite changed the scale)


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label[t + 1] | tokens up to t) at each position t, in fp32, and exactly 0 where the target is not
    labelled (-100)."""
    targets = shift_labels(labels)
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100,
                          reduction="none")
    return -nll.view(targets.shape)


def sequence_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per row, the sum of log p(label[t + 1] | tokens up to t) over the labelled targets (-100: not counted), in
    fp32: the log-probability of a row's labelled tokens given what precedes them."""
    return token_log_probs(logits, labels).sum(dim=-1)


def chosen_answer_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The number of labelled target tokens of a collated batch's chosen answers (its first half of rows; a padding
    pair, all -100, has none): the unit of the NLL that RPO and sft add."""
    return (shift_labels(labels[:labels.shape[0] // 2]) != -100).sum()


def chosen_nll_shares(policy_chosen: torch.Tensor, step_pairs: torch.Tensor | int,
                      step_chosen_tokens: torch.Tensor | int) -> torch.Tensor:
    """Each pair's share of the chosen answers' token mean NLL over a step of `step_pairs` pairs (P) holding
    `step_chosen_tokens` chosen tokens (N): -log pi(y_c|x) x P / N, so that the mean over the step's pairs is
    -sum log pi(y_c|x) / N, the NLL of all the step's chosen tokens (TRL's nll_loss, which takes a micro-batch's)."""
    pairs, tokens = (torch.as_tensor(count, dtype=policy_chosen.dtype, device=policy_chosen.device)
                     for count in (step_pairs, step_chosen_tokens))
    return -policy_chosen * (pairs / tokens.clamp(min=1))


def desensitized_log_probs(log_probs: torch.Tensor, labels: torch.Tensor, alpha: float) -> torch.Tensor:
    """LD-DPO's log-probability of each row's answer, from `log_probs` (token_log_probs of 2B rows: B chosen, then
    their B rejected): the sum over the answer's first l_p tokens, l_p = min(n_c, n_r) of its pair, + `alpha` x the
    sum over its later tokens (the verbose part only the longer answer has); alpha 1 is the plain sum."""
    answer = shift_labels(labels) != -100
    position = answer.cumsum(dim=-1)  # 1 at an answer's first token
    lengths = answer.sum(dim=-1)
    pairs = lengths.shape[0] // 2
    shared = torch.minimum(lengths[:pairs], lengths[pairs:]).repeat(2).unsqueeze(-1)
    verbose = answer & (position > shared)
    return (log_probs * ~verbose).sum(dim=-1) + alpha * (log_probs * verbose).sum(dim=-1)


@torch.no_grad()
def wpo_weights(logits: torch.Tensor, labels: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """WPO's weight of each pair (Zhou et al. 2024, eq. 2, with TRL 0.28's clamp), without gradient: per answer,
    w = exp(mean over its tokens of log p(token) - log sum_v p_v^2), each token's probability taken relative to the
    policy's own sharpness there; the pair's weight is min(1, w_c w_r). `logits` and `labels` are the 2B rows' (B
    chosen, then their B rejected), `log_probs` their token_log_probs. Every answer token's log p counts, as in TRL's
    2026-02 rewrite (0.28's sat one position off its mask and left out the last one's)."""
    answer = shift_labels(labels) != -100
    sharpness = torch.logsumexp(2 * F.log_softmax(logits.float(), dim=-1), dim=-1)  # log sum_v p_v^2
    means = ((log_probs - sharpness) * answer).sum(dim=-1) / answer.sum(dim=-1).clamp(min=1)
    pairs = means.shape[0] // 2
    return torch.exp(means[:pairs] + means[pairs:]).clamp(max=1)


class DPOLossType(StrEnum):
    SIGMOID = "sigmoid"
    IPO = "ipo"
    HINGE = "hinge"
    ROBUST = "robust"
    EXO_PAIR = "exo_pair"
    NCA_PAIR = "nca_pair"
    BCO_PAIR = "bco_pair"
    SPPO_HARD = "sppo_hard"
    AOT = "aot"
    AOT_UNPAIRED = "aot_unpaired"
    AOT_PAIR = "aot_pair"
    APO_ZERO = "apo_zero"
    APO_DOWN = "apo_down"
    DISCOPOP = "discopop"
    SIGMOID_NORM = "sigmoid_norm"
    SFT = "sft"


# The loss types --label_smoothing applies to (TRL's, and sigmoid's conservative DPO); the others refuse it.
LABEL_SMOOTHED = (DPOLossType.SIGMOID, DPOLossType.ROBUST, DPOLossType.EXO_PAIR, DPOLossType.AOT,
                  DPOLossType.AOT_UNPAIRED, DPOLossType.AOT_PAIR)
# robust's loss is DPO's minus eps / (1 - 2 eps) x the margin h (log s(-h) = log s(h) - h): an unbiased estimate of
# the clean loss under flips at rate eps, whose correction grows without bound as eps nears 0.5, where the labels say
# nothing (--label_smoothing 0.4999999: a loss of -82,500 at h = 0.033, where DPO's is 0.68). At ROBUST_MAX_EPS the
# correction's slope is 2 and the loss's scale 1 / (1 - 2 eps) = 5 times DPO's, the factor rDPO's error bounds grow by
# (Chowdhury et al. 2024).
ROBUST_MAX_EPS = 0.4
# The loss types whose per-pair loss needs the answers' token counts.
PER_TOKEN = (DPOLossType.IPO, DPOLossType.SIGMOID_NORM, DPOLossType.SFT)


class FDivergence(StrEnum):
    REVERSE_KL = "reverse_kl"
    JS_DIVERGENCE = "js_divergence"
    ALPHA_DIVERGENCE = "alpha_divergence"


# The loss types --f_divergence_type shapes: those TRL (up to 0.28) computes from its f-divergence `logits`; the
# others use the plain log-ratios there, and refuse another divergence when none of these is listed.
F_DIVERGENCE_READERS = (DPOLossType.SIGMOID, DPOLossType.HINGE, DPOLossType.IPO, DPOLossType.ROBUST,
                        DPOLossType.EXO_PAIR)
# The loss types --use_weighting refuses (as TRL does): they sort the pairs' log-ratios apart, so a pair's weight
# would meet another pair's loss.
SORTED = (DPOLossType.AOT, DPOLossType.AOT_UNPAIRED, DPOLossType.AOT_PAIR)
WEIGHTABLE = tuple(kind for kind in DPOLossType if kind not in SORTED)  # the types --use_weighting is allowed with


def parse_loss_types(text: str) -> tuple[DPOLossType, ...]:
    """The loss types of a --loss_type value: one name or several, comma-separated (`sigmoid,sft`)."""
    names = [name.strip() for name in str(text).split(",")]
    for name in names:
        if name not in tuple(DPOLossType):
            shown = text if len(names) == 1 else name
            raise _bad_option("loss_type", shown, f"choose one or several (comma-separated) of "
                                                  f"{', '.join(DPOLossType)}")
    return tuple(DPOLossType(name) for name in names)


def check_label_smoothing(loss_types: Sequence[str], label_smoothing: float) -> None:
    """Refuse, in one line, a --label_smoothing none of `loss_types` reads, robust's past ROBUST_MAX_EPS, and exo_pair
    without one (its log eps)."""
    if label_smoothing and not any(kind in LABEL_SMOOTHED for kind in loss_types):
        raise _bad_option("label_smoothing", label_smoothing, f"only --loss_type {', '.join(LABEL_SMOOTHED)} use it: "
                                                              f"leave it 0 with --loss_type {','.join(loss_types)}")
    if DPOLossType.ROBUST in loss_types and not label_smoothing <= ROBUST_MAX_EPS:
        raise _bad_option("label_smoothing", label_smoothing, f"--loss_type robust takes it in [0, {ROBUST_MAX_EPS}]: "
                                                              f"its loss is DPO's minus eps / (1 - 2 eps) x the "
                                                              f"margin, which grows without bound as eps nears 0.5")
    if DPOLossType.EXO_PAIR in loss_types and not label_smoothing:
        raise _bad_option("label_smoothing", label_smoothing, "--loss_type exo_pair needs its epsilon > 0 (the EXO "
                                                              "paper recommends 1e-3)")


def _bad_option(name: str, value: Any, allowed: str) -> ValueError:
    """The one-line refusal of an option's value (dataset/shown_value.py's flag_refusal: a long value cut)."""
    return ValueError(flag_refusal(name, value, allowed))


def check_option_values(rpo_alpha: float | None = None, ld_alpha: float | None = None,
                        f_divergence_type: str = FDivergence.REVERSE_KL,
                        f_alpha_divergence_coef: float = DEFAULT_F_ALPHA_DIVERGENCE_COEF) -> None:
    """Refuse, in one line, a value of RPO's, LD-DPO's or f-DPO's option out of its range or choices, whatever the
    loss types (the flags' checks run it on a value the run will not use too: a bad value is bad wherever from)."""
    if rpo_alpha is not None and not (math.isfinite(rpo_alpha) and rpo_alpha >= 0):
        raise _bad_option("rpo_alpha", rpo_alpha, "it must be a number >= 0 (RPO's weight of the chosen answer's "
                                                  "NLL; the paper's 1.0)")
    if ld_alpha is not None and not 0 <= ld_alpha <= 1:
        raise _bad_option("ld_alpha", ld_alpha, "it must be in [0, 1] (1: the plain log-probabilities, 0: the "
                                                "longer answer's verbose tokens dropped)")
    if f_divergence_type not in tuple(FDivergence):
        raise _bad_option("f_divergence_type", f_divergence_type, f"choose one of {', '.join(FDivergence)}")
    if not (math.isfinite(f_alpha_divergence_coef) and f_alpha_divergence_coef > 0):
        raise _bad_option("f_alpha_divergence_coef", f_alpha_divergence_coef, "it must be a positive number")


def check_options(loss_types: Sequence[str], rpo_alpha: float | None = None, ld_alpha: float | None = None,
                  use_weighting: bool = False, f_divergence_type: str = FDivergence.REVERSE_KL,
                  f_alpha_divergence_coef: float = DEFAULT_F_ALPHA_DIVERGENCE_COEF) -> None:
    """Refuse, in one line, a value of RPO's, LD-DPO's, WPO's or f-DPO's option out of its range
    (check_option_values), or one that `loss_types` would not read: --rpo_alpha and --ld_alpha with sft alone (it is
    the NLL RPO adds, and reads the plain log-probabilities), --use_weighting with a type that sorts pairs, another
    --f_divergence_type without one of F_DIVERGENCE_READERS, --f_alpha_divergence_coef without alpha_divergence.
    Each refusal names what is allowed. The trainers' flags meet the unused ones first (trainer/arg_checks.py,
    DEPENDENT_FLAGS); this guards the objective and the loss built without them."""
    check_option_values(rpo_alpha, ld_alpha, f_divergence_type, f_alpha_divergence_coef)
    given = ",".join(loss_types)
    only_sft = all(kind == DPOLossType.SFT for kind in loss_types)
    if rpo_alpha is not None and only_sft:
        raise _bad_option("rpo_alpha", rpo_alpha, "it adds the chosen answers' NLL to a preference loss, and "
                                                  "--loss_type sft is that NLL alone: weigh it with --loss_weights "
                                                  "instead (leave --rpo_alpha unset with sft alone, or list another "
                                                  "type with it)")
    if ld_alpha is not None and only_sft:
        raise _bad_option("ld_alpha", ld_alpha, "it reweighs the log-ratios of the preference losses, and --loss_type "
                                                "sft reads the plain NLL: give a preference loss type with it, or "
                                                "leave --ld_alpha unset")
    if use_weighting:
        for kind in loss_types:
            if kind in SORTED:
                raise _bad_option("use_weighting", use_weighting, f"--loss_type {kind} sorts the pairs' log-ratios "
                                                                  f"apart, so a pair's WPO weight would meet another "
                                                                  f"pair's loss: it is allowed with --loss_type "
                                                                  f"{', '.join(WEIGHTABLE)} (leave it off with "
                                                                  f"--loss_type {given})")
    if f_divergence_type != FDivergence.REVERSE_KL and not any(kind in F_DIVERGENCE_READERS for kind in loss_types):
        raise _bad_option("f_divergence_type", f_divergence_type, f"only --loss_type "
                                                                  f"{', '.join(F_DIVERGENCE_READERS)} read it: leave "
                                                                  f"it reverse_kl with --loss_type {given}")
    if (f_alpha_divergence_coef != DEFAULT_F_ALPHA_DIVERGENCE_COEF
            and f_divergence_type != FDivergence.ALPHA_DIVERGENCE):
        raise _bad_option("f_alpha_divergence_coef", f_alpha_divergence_coef,
                          f"it shapes --f_divergence_type alpha_divergence only: give that with it, or leave it out "
                          f"({DEFAULT_F_ALPHA_DIVERGENCE_COEF})")


def _exp_capped(exponent: torch.Tensor) -> torch.Tensor:
    """exp with the exponent capped just below log(the dtype's largest number), TRL's cap_exp: a finite result."""
    cap = math.floor(math.log(torch.finfo(exponent.dtype).max) * 1e4) / 1e4
    return torch.exp(exponent.clamp(max=cap))


def f_divergence_difference(chosen: torch.Tensor, rejected: torch.Tensor, kind: str,
                            alpha: float = DEFAULT_F_ALPHA_DIVERGENCE_COEF) -> torch.Tensor:
    """psi(chosen) - psi(rejected) of two log-ratios under f-DPO's divergence `kind` (TRL's `logits` before beta):
    psi(l) = l for reverse_kl (DPO's chosen - rejected), l - softplus(l) = log(u / (1 + u)) for js_divergence (u =
    e^l; the constant log 2 cancels), and -u^-alpha / alpha for alpha_divergence."""
    if kind == FDivergence.JS_DIVERGENCE:
        return chosen - rejected - (F.softplus(chosen) - F.softplus(rejected))
    if kind == FDivergence.ALPHA_DIVERGENCE:
        return (_exp_capped(-alpha * rejected) - _exp_capped(-alpha * chosen)) / alpha
    return chosen - rejected


def _log_sigmoid_smoothed(logits: torch.Tensor, eps: float) -> torch.Tensor:
    """-(1 - eps) log sigmoid(x) - eps log sigmoid(-x): eps 0 is -log sigmoid(x) bit for bit."""
    losses = -F.logsigmoid(logits)
    return (1 - eps) * losses - eps * F.logsigmoid(-logits) if eps else losses


def _sorted_difference(first: torch.Tensor, second: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """sort(first) - sort(second) over the real pairs (AOT's quantile matching), in their places; 0 elsewhere."""
    if real is None:
        return torch.sort(first).values - torch.sort(second).values
    out = torch.zeros_like(first)
    out[real] = torch.sort(first[real]).values - torch.sort(second[real]).values
    return out


@dataclass(frozen=True)
class _LossInputs:
    """What the loss types read, per pair, from the summed log-probabilities: the inputs (aot sorts them), the
    log-ratios l_c and l_r, the rewards beta x l, DPO's margin h, the per-token log-ratio difference d (ipo's and
    sigmoid_norm's; None without token counts), f-DPO's margin and d (DPO's own tensors under reverse_kl), and each
    pair's share of the chosen answers' NLL (None where no type reads it)."""
    policy_chosen: torch.Tensor
    policy_rejected: torch.Tensor
    reference_chosen: torch.Tensor
    reference_rejected: torch.Tensor
    real: torch.Tensor | None
    chosen_ratio: torch.Tensor
    rejected_ratio: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    margins: torch.Tensor
    per_token: torch.Tensor | None
    f_margins: torch.Tensor
    f_per_token: torch.Tensor | None
    chosen_nll: torch.Tensor | None


def _loss_weights(loss_types: Sequence[str], loss_weights: Sequence[float] | None) -> list[float]:
    """One weight per loss type (1 each when None); refuses, in one line, a count that does not match."""
    weights = [1.0] * len(loss_types) if loss_weights is None else list(loss_weights)
    if len(weights) != len(loss_types):
        raise _bad_option("loss_weights", weights, f"give one weight per --loss_type ({len(loss_types)})")
    return weights


def _loss_inputs(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
                 reference_rejected: torch.Tensor, beta: float, chosen_tokens: torch.Tensor | None,
                 rejected_tokens: torch.Tensor | None, real: torch.Tensor | None, needs_nll: bool,
                 chosen_nll: torch.Tensor | None, f_divergence_type: str,
                 f_alpha_divergence_coef: float) -> _LossInputs:
    """dpo_loss's per-pair terms (_LossInputs); the NLL shares over these pairs, the real ones, when a type or RPO
    needs them and none were given."""
    chosen_ratio, rejected_ratio = policy_chosen - reference_chosen, policy_rejected - reference_rejected
    chosen_rewards, rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
    margins = chosen_rewards - rejected_rewards
    per_token = chosen_per_token = rejected_per_token = None
    if chosen_tokens is not None and rejected_tokens is not None:  # ipo's and sigmoid_norm's d
        chosen_per_token, rejected_per_token = (chosen_ratio / chosen_tokens.clamp(min=1),
                                                rejected_ratio / rejected_tokens.clamp(min=1))
        per_token = chosen_per_token - rejected_per_token
    if needs_nll and chosen_nll is None:  # these pairs are the step
        counted = chosen_tokens if real is None else chosen_tokens * real
        chosen_nll = chosen_nll_shares(policy_chosen, len(policy_chosen) if real is None else real.sum(),
                                       counted.sum())
    f_margins, f_per_token = margins, per_token  # reverse_kl: DPO's own margins, the very tensors
    if f_divergence_type != FDivergence.REVERSE_KL:  # f-DPO's, for the F_DIVERGENCE_READERS
        f_margins = beta * f_divergence_difference(chosen_ratio, rejected_ratio, f_divergence_type,
                                                   f_alpha_divergence_coef)
        if per_token is not None:
            f_per_token = f_divergence_difference(chosen_per_token, rejected_per_token, f_divergence_type,
                                                  f_alpha_divergence_coef)
    return _LossInputs(policy_chosen, policy_rejected, reference_chosen, reference_rejected, real, chosen_ratio,
                      rejected_ratio, chosen_rewards, rejected_rewards, margins, per_token, f_margins, f_per_token,
                      chosen_nll)


def _type_losses(kind: DPOLossType, t: _LossInputs, beta: float, eps: float, bco_mean: float,
                 discopop_tau: float) -> torch.Tensor:
    """The per-pair losses of one loss type (the module's docstring has the formulas); eps is --label_smoothing."""
    if kind == DPOLossType.SIGMOID:
        return _log_sigmoid_smoothed(t.f_margins, eps)
    if kind == DPOLossType.HINGE:
        return torch.relu(1 - t.f_margins)
    if kind == DPOLossType.IPO:
        return (t.f_per_token - 1 / (2 * beta)) ** 2
    if kind == DPOLossType.ROBUST:
        return (-(1 - eps) * F.logsigmoid(t.f_margins) + eps * F.logsigmoid(-t.f_margins)) / (1 - 2 * eps)
    if kind == DPOLossType.EXO_PAIR:
        return (torch.sigmoid(t.f_margins) * (F.logsigmoid(t.f_margins) - math.log1p(-eps))
                + torch.sigmoid(-t.f_margins) * (F.logsigmoid(-t.f_margins) - math.log(eps)))
    if kind == DPOLossType.NCA_PAIR:
        return (-F.logsigmoid(t.chosen_rewards) - 0.5 * F.logsigmoid(-t.chosen_rewards)
                - 0.5 * F.logsigmoid(-t.rejected_rewards))
    if kind == DPOLossType.BCO_PAIR:
        return -F.logsigmoid(t.chosen_rewards - bco_mean) - F.logsigmoid(-(t.rejected_rewards - bco_mean))
    if kind == DPOLossType.SPPO_HARD:
        return (t.chosen_ratio - 0.5 / beta) ** 2 + (t.rejected_ratio + 0.5 / beta) ** 2
    if kind == DPOLossType.AOT:
        shifted = _sorted_difference(t.policy_chosen - t.policy_rejected, t.reference_chosen - t.reference_rejected,
                                     t.real)
        return _log_sigmoid_smoothed(beta * shifted, eps)
    if kind in (DPOLossType.AOT_UNPAIRED, DPOLossType.AOT_PAIR):
        return _log_sigmoid_smoothed(beta * _sorted_difference(t.chosen_ratio, t.rejected_ratio, t.real), eps)
    if kind == DPOLossType.APO_ZERO:
        return 1 - torch.sigmoid(t.chosen_rewards) + torch.sigmoid(t.rejected_rewards)
    if kind == DPOLossType.APO_DOWN:
        return torch.sigmoid(t.chosen_rewards) + 1 - torch.sigmoid(t.margins)
    if kind == DPOLossType.DISCOPOP:
        mix = torch.sigmoid(t.margins / discopop_tau)
        return -F.logsigmoid(t.margins) * (1 - mix) + torch.exp(-t.margins) * mix
    if kind == DPOLossType.SIGMOID_NORM:
        return -F.logsigmoid(beta * t.per_token)
    return t.chosen_nll  # sft


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float, loss_type: str = DPOLossType.SIGMOID,
             label_smoothing: float = 0.0, chosen_tokens: torch.Tensor | None = None,
             rejected_tokens: torch.Tensor | None = None, *, loss_weights: Sequence[float] | None = None,
             discopop_tau: float = DEFAULT_DISCOPOP_TAU, bco_mean: float = 0.0,
             real: torch.Tensor | None = None, rpo_alpha: float | None = None,
             f_divergence_type: str = FDivergence.REVERSE_KL,
             f_alpha_divergence_coef: float = DEFAULT_F_ALPHA_DIVERGENCE_COEF,
             chosen_nll: torch.Tensor | None = None,
             pair_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses of `loss_type`, chosen rewards, rejected rewards) from per-pair summed log-probabilities
    (the module's docstring has the formulas). `loss_type` is one type or several, comma-separated, summed with
    `loss_weights` (1 each when None); ipo, sigmoid_norm and sft also need each answer's token count, bco_pair the
    running mean of the rewards, aot and aot_unpaired which pairs are `real` (the others are left out of their
    sorting; None: all). `rpo_alpha` adds RPO's alpha x `chosen_nll`, each pair's share of the chosen answers' token
    mean NLL (chosen_nll_shares; sft's term too; None: over these pairs, the real ones, as TRL's over its batch,
    from policy_chosen, which LD-DPO's reweighted log-probabilities are not: then give it); the margin of the
    F_DIVERGENCE_READERS is f-DPO's under `f_divergence_type`; `pair_weights` (WPO's, without gradient) multiply
    each pair's loss. The rewards, beta x the summed log-ratio whatever the loss, are detached (they are reported,
    not trained on)."""
    loss_types = parse_loss_types(loss_type)
    weights = _loss_weights(loss_types, loss_weights)
    check_label_smoothing(loss_types, label_smoothing)
    check_options(loss_types, rpo_alpha, None, pair_weights is not None, f_divergence_type, f_alpha_divergence_coef)
    needs_nll = rpo_alpha is not None or DPOLossType.SFT in loss_types
    if (any(kind in PER_TOKEN for kind in loss_types) or (needs_nll and chosen_nll is None)) and (
            chosen_tokens is None or rejected_tokens is None):
        raise ValueError(f"dpo_loss: loss_type {loss_type} needs the answers' token counts")
    terms = _loss_inputs(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta, chosen_tokens,
                         rejected_tokens, real, needs_nll, chosen_nll, f_divergence_type, f_alpha_divergence_coef)
    total = torch.zeros_like(terms.margins)
    for kind, weight in zip(loss_types, weights):
        losses = _type_losses(kind, terms, beta, label_smoothing, bco_mean, discopop_tau)
        # one type at weight 1 (the usual run) is its loss exactly, bit for bit
        total = losses if len(loss_types) == 1 and weight == 1 else total + weight * losses
    if rpo_alpha is not None:
        total = total + rpo_alpha * terms.chosen_nll
    if pair_weights is not None:
        total = total * pair_weights
    return total, terms.chosen_rewards.detach(), terms.rejected_rewards.detach()


@dataclass
class BCORunningMean:
    """bco_pair's m: the mean of every reward (r_c and r_r of each pair) of the optimizer steps done, as TRL's
    RunningMoments keeps it. It is folded in once per step from the step's global reward means (all processes and
    micro-batches), so it is the same whatever the number of processes; a checkpoint saves it (`state`)."""

    mean: float = 0.0
    pairs: int = 0

    def add_step(self, chosen_mean: float, rejected_mean: float, pairs: int) -> None:
        """Fold in a step of `pairs` pairs whose mean chosen and rejected rewards these are."""
        if pairs <= 0:
            return
        total = self.pairs + pairs
        self.mean += ((chosen_mean + rejected_mean) / 2 - self.mean) * pairs / total
        self.pairs = total


def real_pairs(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Which pairs of a collated batch (2B rows: B chosen, then B rejected) carry a target: validation shards are
    padded with target-free samples, which must count nowhere."""
    pairs = batch["input_ids"].shape[0] // 2
    return (batch["labels"][:pairs] != -100).any(dim=-1)


@dataclass(frozen=True)
class DPOEval(LoggedEval):
    metrics = DPO_VAL_METRICS

    loss: float              # mean DPO loss over the pairs
    reward_accuracy: float   # fraction of pairs whose chosen reward exceeds the rejected one
    reward_margin: float     # mean r_c - r_r
    chosen_reward: float     # mean r_c
    rejected_reward: float   # mean r_r
    pairs: int
    nll_loss: float | None = None  # the chosen answers' token mean NLL, where the loss reads it (TRL's eval_nll_loss)

    def describe(self) -> str:
        nll = f", chosen NLL {self.nll_loss:.4f}" if self.nll_loss is not None else ""
        return (f"val DPO loss {self.loss:.4f}, reward accuracy {self.reward_accuracy:.1%}, margin "
                f"{self.reward_margin:.3f} (chosen {self.chosen_reward:.3f}, rejected {self.rejected_reward:.3f})"
                f"{nll}")


class DirectPreference:
    """The DPO objective: its unit is the preference pair. `reference` is the frozen starting model on the
    training device; `autocast` is the mixed-precision context the policy's forward runs in."""

    progress_labels = {"reward_accuracy": "acc", "reward_margin": "margin"}
    stat_windows: dict[str, StatWindow] = {}  # every statistic a mean over the log window

    def __init__(self, reference: torch.nn.Module, beta: float,
                 autocast: Callable[[], AbstractContextManager], loss_type: str = DPOLossType.SIGMOID,
                 label_smoothing: float = 0.0, loss_weights: Sequence[float] | None = None,
                 discopop_tau: float = DEFAULT_DISCOPOP_TAU, *, rpo_alpha: float | None = None,
                 ld_alpha: float | None = None, use_weighting: bool = False,
                 f_divergence_type: str = FDivergence.REVERSE_KL,
                 f_alpha_divergence_coef: float = DEFAULT_F_ALPHA_DIVERGENCE_COEF) -> None:
        self.reference, self.beta, self.autocast = reference.eval().requires_grad_(False), beta, autocast
        self.loss_type, self.label_smoothing = loss_type, label_smoothing
        self.loss_weights, self.discopop_tau = loss_weights, discopop_tau
        loss_types = parse_loss_types(loss_type)
        check_options(loss_types, rpo_alpha, ld_alpha, use_weighting, f_divergence_type, f_alpha_divergence_coef)
        self.rpo_alpha, self.ld_alpha, self.use_weighting = rpo_alpha, ld_alpha, use_weighting
        self.f_divergence_type, self.f_alpha_divergence_coef = f_divergence_type, f_alpha_divergence_coef
        # the chosen answers' NLL, logged where the loss reads it (TRL's nll_loss: RPO's term, or sft's)
        self.logs_nll = rpo_alpha is not None or DPOLossType.SFT in loss_types
        self.stat_names = STAT_NAMES + ((NLL_STAT,) if self.logs_nll else ())
        # bco_pair's running mean of the rewards: trainer state, saved with a checkpoint (state, load_state)
        self.bco = BCORunningMean() if DPOLossType.BCO_PAIR in loss_types else None

    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return real_pairs(batch).sum()

    def count_step(self, batches: Sequence[dict[str, Any]], accelerator: Accelerator) -> None:
        """Collective where the loss reads the NLL (the training core calls it before a step's micro-batches): the
        step's chosen-answer tokens over all its micro-batches and processes, given to each micro-batch
        (STEP_CHOSEN_TOKENS), the NLL's divisor. Nothing otherwise."""
        if not self.logs_nll:
            return
        tokens = sum(chosen_answer_tokens(batch["labels"]) for batch in batches)
        tokens = accelerator.reduce(torch.as_tensor(tokens, device=accelerator.device), reduction="sum")
        for batch in batches:
            batch[STEP_CHOSEN_TOKENS] = tokens

    def _pair_terms(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], step_pairs: torch.Tensor | int,
                    step_chosen_tokens: torch.Tensor | int | None):
        """(per-pair losses, chosen rewards, rejected rewards, which pairs are real, each pair's share of the
        chosen answers' token mean NLL over a step of `step_pairs` pairs and `step_chosen_tokens` chosen tokens
        where the loss reads it, else None)."""
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask")}
        labels = batch["labels"]
        logits = model(**inputs).logits
        per_token = token_log_probs(logits, labels)
        plain = per_token.sum(dim=-1)
        with torch.no_grad(), self.autocast():
            reference_per_token = token_log_probs(self.reference(**inputs).logits, labels)
        if self.ld_alpha is None:
            policy, reference = plain, reference_per_token.sum(dim=-1)
        else:  # LD-DPO: both models' log-probabilities, so that equal models still give log-ratios 0
            policy = desensitized_log_probs(per_token, labels, self.ld_alpha)
            reference = desensitized_log_probs(reference_per_token, labels, self.ld_alpha)
        pairs = policy.shape[0] // 2
        tokens = (shift_labels(labels) != -100).sum(dim=-1).to(policy.dtype)
        real = real_pairs(batch)
        chosen_nll = chosen_nll_shares(plain[:pairs], step_pairs, step_chosen_tokens) if self.logs_nll else None
        weights = wpo_weights(logits, labels, per_token) if self.use_weighting else None
        losses, chosen, rejected = dpo_loss(policy[:pairs], policy[pairs:], reference[:pairs], reference[pairs:],
                                            self.beta, self.loss_type, self.label_smoothing, tokens[:pairs],
                                            tokens[pairs:], loss_weights=self.loss_weights,
                                            discopop_tau=self.discopop_tau,
                                            bco_mean=self.bco.mean if self.bco is not None else 0.0, real=real,
                                            rpo_alpha=self.rpo_alpha, f_divergence_type=self.f_divergence_type,
                                            f_alpha_divergence_coef=self.f_alpha_divergence_coef,
                                            chosen_nll=chosen_nll, pair_weights=weights)
        return losses, chosen, rejected, real, chosen_nll

    def end_step(self, stats: dict[str, float], pairs: int) -> None:
        """After each optimizer step, with its statistics (means over its `pairs` pairs, all processes): bco_pair
        folds the step's rewards into its running mean, which the next step's loss uses."""
        if self.bco is not None:
            self.bco.add_step(stats["chosen_reward"], stats["rejected_reward"], pairs)

    def state(self) -> dict[str, Any]:
        """What a checkpoint saves of the objective beyond the weights: bco_pair's running mean ({} otherwise)."""
        return {} if self.bco is None else {"bco_mean": self.bco.mean, "bco_pairs": self.bco.pairs}

    def load_state(self, state: dict[str, Any]) -> None:
        """A checkpoint's `state` back; one saved before bco_pair's mean existed (or by another loss type) leaves
        the mean at its start, 0 over no pairs."""
        if self.bco is not None and "bco_mean" in state:
            self.bco = BCORunningMean(float(state["bco_mean"]), int(state.get("bco_pairs", 0)))

    @staticmethod
    def _stat_sums(chosen: torch.Tensor, rejected: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        real = real.float()
        return torch.stack([((chosen > rejected).float() * real).sum(), ((chosen - rejected) * real).sum(),
                            (chosen * real).sum(), (rejected * real).sum()])

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
             num_items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # a micro-batch the training core did not count (count_step) is its step; without an NLL nothing is counted
        step_tokens = batch.get(STEP_CHOSEN_TOKENS)
        if step_tokens is None and self.logs_nll:
            step_tokens = chosen_answer_tokens(batch["labels"])
        losses, chosen, rejected, real, chosen_nll = self._pair_terms(model, batch, num_items, step_tokens)
        stats = self._stat_sums(chosen, rejected, real)
        if chosen_nll is not None:
            stats = torch.cat([stats, (chosen_nll.detach() * real).sum().unsqueeze(0)])
        return (losses * real).sum() / num_items, stats

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator,
                 token_bytes: torch.Tensor | None = None, max_batches: int = 0) -> DPOEval:
        was_training = model.training
        model.eval()
        # the validation set is one step: where the loss reads the NLL, its token mean over all the chosen tokens
        counts = torch.zeros(2, dtype=torch.long, device=accelerator.device)  # real pairs, chosen tokens
        if self.logs_nll:
            for index, batch in enumerate(loader):
                if max_batches and index >= max_batches:
                    break
                counts += torch.stack([real_pairs(batch).sum(), chosen_answer_tokens(batch["labels"])]).to(counts)
            counts = accelerator.reduce(counts, reduction="sum")
        # loss, pairs, the pair statistics, and the chosen answers' NLL where the loss reads it
        stats_end = 2 + len(STAT_NAMES)
        totals = torch.zeros(stats_end + int(self.logs_nll), dtype=torch.float64, device=accelerator.device)
        for index, batch in enumerate(loader):
            if max_batches and index >= max_batches:
                break
            batch = {key: value.to(accelerator.device) for key, value in batch.items()}
            losses, chosen, rejected, real, chosen_nll = self._pair_terms(model, batch, counts[0], counts[1])
            totals[0] += (losses * real).sum().double()
            totals[1] += real.sum()
            totals[2:stats_end] += self._stat_sums(chosen, rejected, real).double()
            if chosen_nll is not None:
                totals[stats_end] += (chosen_nll * real).sum().double()
        totals = accelerator.reduce(totals, reduction="sum")
        model.train(was_training)
        pairs = int(totals[1])
        means = (totals / max(pairs, 1)).tolist() if pairs else [float("nan")] * len(totals)
        return DPOEval(means[0], *means[2:stats_end], pairs=pairs, nll_loss=means[stats_end] if self.logs_nll else None)
