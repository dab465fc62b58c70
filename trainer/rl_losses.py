"""The reinforcement-learning math of the policy-gradient trainers, as pure functions of tensors (no model, no
rollouts): group-relative advantages, the GRPO / Dr. GRPO / BNPO / DAPO / CISPO policy losses with a per-token or
per-sequence (GSPO) importance ratio, the k1 and k3 KL estimators to a reference model, and PPO's pieces: the
KL-penalised per-token rewards, the missing-eos penalty, GAE, whitening, the clipped policy and value losses and
their sum, and the critic's explained variance.

Conventions. A batch holds B completions of up to T tokens; `mask` (B, T) is 1 on a completion's tokens and 0 on
its padding, which trails, and on the tool results' tokens inside an episode that calls tools (--tools: context,
not actions; every function here leaves them out, and PPO's rewards and GAE step over them). `logp` (B, T) are the
log-probabilities of the sampled tokens under the policy being trained (with gradients), `old_logp` those under the
policy that sampled them (detached), `ref_logp` those under the frozen reference model. The importance ratio is
r = exp(logp - old_logp), 1 at the first update of a rollout. A loss is a 0-d tensor to minimize; each function
names the paper and equation it follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from dataset.shown_value import flag_refusal

ADVANTAGE_EPS = 1e-4  # added to a group's standard deviation: a group whose rewards are all equal gets advantages 0


class LossType(StrEnum):
    GRPO = "grpo"
    DR_GRPO = "dr_grpo"
    BNPO = "bnpo"
    DAPO = "dapo"
    CISPO = "cispo"


class ImportanceSamplingLevel(StrEnum):
    """Where GRPO's importance ratio is taken (TRL's importance_sampling_level): per token, or once per completion
    from the mean of its tokens' log-ratios (GSPO)."""

    TOKEN = "token"
    SEQUENCE = "sequence"


class KLEstimator(StrEnum):
    """The per-token estimate of KL(pi || pi_ref) that PPO pays in its rewards (TRL's PPOConfig kl_estimator)."""

    K1 = "k1"
    K3 = "k3"


class ScaleRewards(StrEnum):
    """What divides GRPO's centred rewards (TRL's scale_rewards): each group's std (group_advantages), the std of the
    rewards of the step's whole global batch, or nothing."""

    GROUP = "group"
    BATCH = "batch"
    NONE = "none"


def default_scale_rewards(loss_type: str) -> str:
    """--scale_rewards left unset: none for dr_grpo (Dr. GRPO drops the std), group for every other loss type."""
    return ScaleRewards.NONE.value if loss_type == LossType.DR_GRPO else ScaleRewards.GROUP.value


@dataclass(frozen=True)
class PolicyLoss:
    loss: torch.Tensor     # 0-d, to minimize (the KL term included)
    clip_fraction: float   # clipped / the completions' tokens (per-sequence ratios: / the completions)
    kl: float              # the mean k3 KL to the reference over the completions' tokens (0 without a reference)
    clipped: int           # the completions' tokens whose ratio was clipped (per-sequence ratios: the completions)
    clipped_low: int       # of those, the ones clipped below 1 - epsilon_low (TRL's clip_ratio/low)
    clipped_high: int      # and above 1 + epsilon_high (TRL's clip_ratio/high): clipped = clipped_low + clipped_high


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of `values` over the positions where `mask` is 1."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, section 4.1.2, outcome
    supervision):
    rewards (P, G), one row per prompt and its G completions, -> (r - mean of the row) / (std of the row + eps),
    the std with Bessel's correction as TRL and MiniMind compute it. scale=False leaves out the division (Dr. GRPO,
    Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783: the std weighs too easy and too hard
    questions up). A NaN reward (a completion no reward function scored) is left out of its row's mean and std and
    gets advantage 0, as TRL's GRPOTrainer does; so does every completion of a row with fewer than two rewards."""
    count, mean, std = scored_group_stats(rewards)
    centred = rewards - mean
    if scale:
        centred = centred / (std + eps)
    return torch.where(~rewards.isnan() & (count > 1), centred, torch.zeros_like(centred))


def scored_group_stats(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of rewards (P, G), over its rewards that are not NaN (the completions some function scored): their
    count, mean and std with Bessel's correction, each (P, 1); the mean and std of a row with fewer than two are not
    numbers to use (NaN or inf)."""
    count = (~rewards.isnan()).sum(dim=1, keepdim=True)
    mean = rewards.nan_to_num(0.0).sum(dim=1, keepdim=True) / count
    variance = ((rewards - mean).nan_to_num(0.0) ** 2).sum(dim=1, keepdim=True) / (count - 1)
    return count, mean, variance.sqrt()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per token, the k3 estimator of KL(pi || pi_ref) from a token sampled from pi (Schulman 2020, "Approximating
    KL Divergence"; DeepSeekMath equation 4): exp(ref_logp - logp) - (ref_logp - logp) - 1, unbiased and >= 0."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = KLEstimator.K1) -> torch.Tensor:
    """Per token, an estimate of KL(pi || pi_ref) from a token sampled from pi (Schulman 2020, "Approximating KL
    Divergence"), as TRL's PPOTrainer writes them with log r = ref_logp - logp: k1 = -log r = logp - ref_logp
    (unbiased, any sign), k3 = (r - 1) - log r (kl_k3: unbiased, >= 0, lower variance)."""
    if estimator not in tuple(KLEstimator):
        raise ValueError(flag_refusal("kl_estimator", estimator, f"choose one of {', '.join(KLEstimator)}"))
    return logp - ref_logp if estimator == KLEstimator.K1 else kl_k3(logp, ref_logp)


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float,
                      epsilon_high: float) -> torch.Tensor:
    """Per token, minus PPO's clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
    arXiv:1707.06347, equation 7): -min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A). Separate low and
    high ranges as in DAPO (Yu et al. 2025, arXiv:2503.14476); equal ranges give PPO's."""
    return -torch.minimum(ratio * advantages, ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * advantages)


def _clipped_sides(ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float,
                   either_way: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(clipped below, clipped above), disjoint: the ratio under 1 - epsilon_low where the advantage is negative and
    over 1 + epsilon_high where it is positive (the surrogate's clip, TRL's is_low_clipped / is_high_clipped);
    either_way: whatever the advantage (CISPO's clipped weight)."""
    low, high = ratio < 1 - epsilon_low, ratio > 1 + epsilon_high
    if either_way:
        return low, high
    return low & (advantages < 0), high & (advantages > 0)


def _checked_loss_type(loss_type: str, importance_sampling_level: str) -> LossType:
    """policy_loss's loss type, after a one-line refusal of a loss type or importance-sampling level it lacks."""
    if loss_type not in tuple(LossType):
        raise ValueError(flag_refusal("loss_type", loss_type, f"choose one of {', '.join(LossType)}"))
    if importance_sampling_level not in tuple(ImportanceSamplingLevel):
        raise ValueError(flag_refusal("importance_sampling_level", importance_sampling_level,
                                      f"choose one of {', '.join(ImportanceSamplingLevel)}"))
    return LossType(loss_type)


def _importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, sequence: bool) -> torch.Tensor:
    """Per token (B, T), the ratio exp(logp - old_logp), or with `sequence` GSPO's one ratio per completion (the
    exponential of the mean log-ratio over its tokens), on each of its tokens."""
    log_ratio = logp - old_logp
    if sequence:  # the mean log-ratio over each completion's tokens, one ratio per completion, broadcast
        log_ratio = ((log_ratio * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1))
        log_ratio = log_ratio.expand_as(logp)
    return torch.exp(log_ratio)


def _mean_over(loss_type: LossType, per_token: torch.Tensor, mask: torch.Tensor,
               max_completion_length: int | None) -> torch.Tensor:
    """The loss type's mean of the per-token terms (policy_loss's docstring says which)."""
    if loss_type == LossType.GRPO:
        return ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    if loss_type == LossType.DR_GRPO:
        if max_completion_length is None:
            raise ValueError("policy_loss: loss_type dr_grpo needs max_completion_length")
        return (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)
    return masked_mean(per_token, mask)


def _clip_counts(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, epsilon_low: float,
                 epsilon_high: float, either_way: bool, sequence: bool) -> tuple[float, int, int, int]:
    """(clip fraction, clipped, clipped low, clipped high) over the completions' tokens, or with `sequence` over the
    completions (PolicyLoss's fields)."""
    low, high = _clipped_sides(ratio, advantages, epsilon_low, epsilon_high, either_way=either_way)
    # per sequence, every token of a completion holds its one ratio: its first token's says whether it clipped
    low, high = (low[:, 0], high[:, 0]) if sequence else (low & mask.bool(), high & mask.bool())
    clipped = low | high
    clip_fraction = clipped.to(mask.dtype).mean() if sequence else masked_mean(clipped.to(mask.dtype), mask)
    return float(clip_fraction), int(clipped.sum()), int(low.sum()), int(high.sum())


def policy_loss(loss_type: str, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, epsilon_low: float = 0.2, epsilon_high: float = 0.2, beta: float = 0.0,
                ref_logp: torch.Tensor | None = None, max_completion_length: int | None = None,
                importance_sampling_level: str = ImportanceSamplingLevel.TOKEN) -> PolicyLoss:
    """The policy loss of one batch of B completions with one advantage each (B,), for `loss_type`:

    grpo     DeepSeekMath (Shao et al. 2024, arXiv:2402.03300) equation 3: per token the clipped surrogate plus
             beta x k3 KL; the mean over each completion's tokens (1/|o_i|), then the mean over the completions.
    dr_grpo  Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): the same per-token terms, summed over all tokens and
             divided by the constant B x max_completion_length, so a long completion's tokens weigh no less than
             a short one's (pair it with group_advantages(scale=False)).
    bnpo     TRL's "bnpo": the same per-token terms, their mean over the batch's tokens (1 / sum |o_i|). TRL takes it
             per micro-batch and averages the micro-batches; so does the GRPO objective (trainer/grpo.py).
    dapo     DAPO (Yu et al. 2025, arXiv:2503.14476) equation 8, TRL's default: the same per-token terms, their
             mean over all the tokens of the step's global batch; here the batch's token mean, which the GRPO
             objective weighs by the batch's tokens over the step's (trainer/grpo.py).
    cispo    CISPO (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585): per token -sg(r_hat) A log pi, where
             r_hat = clip(r, 1 - epsilon_low, 1 + epsilon_high) is detached (sg), so every token keeps a gradient
             (none is dropped by clipping) and the clip bounds its weight; plus beta x k3 KL; the token mean over
             the batch (1 / sum |o_i|). MiniMax-M1 sets no lower bound: pass epsilon_low=1 (or more).

    importance_sampling_level "token" takes the ratio per token, r_t = exp(logp_t - old_logp_t); "sequence" is GSPO's
    (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071, equation 7; TRL's
    importance_sampling_level="sequence"): one ratio per completion, s = exp(mean over its tokens of
    (logp_t - old_logp_t)), with gradients through every token's log-prob, the same for each of its tokens; the clip
    (and CISPO's weight) applies to s, and the loss type's mean is taken as above (GSPO's paper is "grpo"'s: per
    completion). The clip fraction is then the fraction of the B completions whose s was clipped (TRL's).
    """
    loss_type = _checked_loss_type(loss_type, importance_sampling_level)
    mask = mask.to(logp.dtype)
    sequence = importance_sampling_level == ImportanceSamplingLevel.SEQUENCE
    ratio = _importance_ratio(logp, old_logp, mask, sequence)
    advantages = advantages.to(logp.dtype).unsqueeze(1).expand_as(logp)
    if loss_type == LossType.CISPO:
        weight = ratio.clamp(1 - epsilon_low, 1 + epsilon_high).detach()
        per_token = -weight * advantages * logp
    else:
        per_token = clipped_surrogate(ratio, advantages, epsilon_low, epsilon_high)
    kl = kl_k3(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)
    if beta:
        if ref_logp is None:
            raise ValueError("policy_loss: beta > 0 needs ref_logp, the reference model's log-probabilities")
        per_token = per_token + beta * kl
    loss = _mean_over(loss_type, per_token, mask, max_completion_length)
    clip_fraction, clipped, clipped_low, clipped_high = _clip_counts(
        ratio, advantages, mask, epsilon_low, epsilon_high, loss_type == LossType.CISPO, sequence)
    return PolicyLoss(loss, clip_fraction, float(masked_mean(kl.detach(), mask)), clipped, clipped_low, clipped_high)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation", arXiv:1506.02438, equation 16), per token of B completions (B, T):
    delta_t = r_t + gamma V_{t+1} - V_t with V = 0 after a completion's last token (the episode ends there), and
    A_t = delta_t + gamma lam A_{t+1}. Returns (advantages, returns = advantages + values), 0 where `mask` is 0;
    both detached (they are targets).

    The recursion runs over the masked tokens only, in order: t + 1 is the next position where `mask` is 1, so a
    gap inside a row (a tool result's tokens, --tools: an observation of the environment, not an action) is skipped
    as one step of the episode, not taken as its end -- the action before it is followed by the action after it,
    whose value the critic gives from its reading of the whole episode so far, the tool result included. Without
    gaps (trailing padding only) this is the plain recursion."""
    rewards, values, mask = rewards.detach(), values.detach(), mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = (delta + gamma * lam * next_advantage) * mask[:, t]
        action = mask[:, t].bool()  # off an action, the next action's value and advantage carry over it
        next_value = torch.where(action, values[:, t], next_value)
        next_advantage = torch.where(action, advantages[:, t], next_advantage)
    return advantages, (advantages + values) * mask


def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    epsilon: float = 0.2) -> PolicyLoss:
    """PPO's clipped policy loss (Schulman et al. 2017, equation 7) with per-token advantages (B, T), e.g. from
    gae(): the token mean of -min(r A, clip(r, 1 - epsilon, 1 + epsilon) A) over the completions' tokens."""
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    loss = masked_mean(clipped_surrogate(ratio, advantages, epsilon, epsilon), mask)
    low, high = (side & mask.bool() for side in _clipped_sides(ratio, advantages, epsilon, epsilon))
    clipped = (low | high).to(mask.dtype)
    return PolicyLoss(loss, float(masked_mean(clipped, mask)), 0.0, int(clipped.sum()), int(low.sum()),
                      int(high.sum()))


def ppo_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                   clip: float = 0.2) -> torch.Tensor:
    """PPO's clipped value loss (as OpenAI baselines' ppo2 and TRL compute it): the token mean of
    0.5 max((V - R)^2, (V_clipped - R)^2), with V_clipped = old_V + clip(V - old_V, -clip, clip): a value
    prediction gains nothing from moving more than `clip` from the one the rollout saw."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * masked_mean(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), mask.to(values.dtype))


@torch.no_grad()
def value_clip_fraction(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                        clip: float = 0.2) -> float:
    """The fraction of the completions' tokens whose clipped value loss (ppo_value_loss) is strictly the larger of
    the two, so it is the one taken and the value's gradient is zero there (TRL's val/clipfrac_avg rule)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    taken = ((clipped - returns) ** 2 > (values - returns) ** 2).to(values.dtype)
    return float(masked_mean(taken, mask.to(values.dtype)))


WHITEN_EPS = 1e-8  # added to the variance before its square root (TRL's masked_whiten, MiniMind's PPO)


@dataclass(frozen=True)
class PPOLoss:
    loss: torch.Tensor     # 0-d, to minimize: the policy loss + vf_coef x the value loss
    policy_loss: float
    value_loss: float
    clip_fraction: float   # the fraction of the completions' tokens whose ratio was clipped
    value_clip_fraction: float  # the fraction whose clipped value loss was the larger (TRL's val/clipfrac)
    approx_kl: float        # the token mean of (logp - old_logp)^2 / 2 (TRL's policy/approxkl)
    ratio: float            # the token mean of the ratio exp(logp - old_logp) (TRL's val/ratio)


def kl_penalized_rewards(scores: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                         beta: float, kl_estimator: str = KLEstimator.K1) -> torch.Tensor:
    """Per-token rewards (B, T) for PPO on language (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
    Preferences", arXiv:1909.08593, section 2.2; Ouyang et al. 2022, InstructGPT, equation 2; TRL's PPOTrainer):
    each token pays -beta x kl_estimate(logp, ref_logp, kl_estimator), by default k1 = logp - ref_logp, the
    estimate of the KL to the reference from the sampled token (its sum over a completion estimates the
    completion's KL without bias; TRL's kl_estimator="k3" pays kl_k3 instead), and the completion's score (B,)
    comes at its last token (the last where `mask` is 1: a tool result's tokens inside a row are out of the mask,
    --tools, and pay nothing); 0 where `mask` is 0. The log-probs are the rollout's (detached): the KL is a reward,
    not a loss term."""
    mask = mask.to(logp.dtype)
    rewards = -beta * kl_estimate(logp.detach(), ref_logp.detach(), kl_estimator) * mask
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask.bool(), positions, 0).amax(dim=1)  # an empty row: position 0, as before
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += scores.to(rewards.dtype)
    return rewards


def whiten(values: torch.Tensor, mask: torch.Tensor, moments: tuple[float, float], eps: float = WHITEN_EPS,
           shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) where `mask` is 1, 0 on padding (TRL's masked_whiten), with the given `moments`
    (mean, variance with Bessel's correction): PPO takes them over all the tokens of the step's global batch
    (trainer/ppo.py finish_rollouts), of which `values` may be one micro-batch. shift_mean=False adds the mean back,
    (x - mean) / sqrt(var + eps) + mean: the spread scaled to 1, the mean kept (TRL's whiten_rewards)."""
    mean, variance = (torch.tensor(moment, dtype=values.dtype, device=values.device) for moment in moments)
    whitened = (values - mean) * torch.rsqrt(variance + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(values.dtype)


def missing_eos_penalized(scores: torch.Tensor, ended: torch.Tensor, penalty: float) -> torch.Tensor:
    """The completions' scores (B,) less `penalty` for each that did not end with its end-of-turn token (`ended`
    False: the length limit cut it), as TRL's PPOTrainer applies its missing_eos_penalty before the rewards."""
    return scores - penalty * (~ended.bool()).to(scores)


def explained_fraction(residual_variance: float, return_variance: float) -> float:
    """1 - Var(returns - values) / Var(returns), from the two variances: 1 for a critic that predicts the returns,
    0 for one no better than their mean, below 0 for worse; NaN when the returns do not vary."""
    return 1 - residual_variance / return_variance if return_variance > 0 else float("nan")


def ppo_loss(logp: torch.Tensor, old_logp: torch.Tensor, values: torch.Tensor, old_values: torch.Tensor,
             advantages: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, epsilon: float,
             cliprange_value: float, vf_coef: float) -> PPOLoss:
    """PPO's loss (Schulman et al. 2017, equation 9, without the entropy bonus, as TRL's PPOTrainer): the clipped
    policy loss plus vf_coef x the clipped value loss, both token means over the completions (ppo_policy_loss,
    ppo_value_loss); old_logp and old_values are the rollout's, advantages and returns from gae()."""
    policy = ppo_policy_loss(logp, old_logp, advantages, mask, epsilon)
    value = ppo_value_loss(values, old_values, returns, mask, cliprange_value)
    with torch.no_grad():  # what the log reads of the update (TRL's approxkl and ratio, here exact token means)
        log_ratio, token_mask = (logp - old_logp).detach(), mask.to(logp.dtype)
        approx_kl = float(masked_mean(0.5 * log_ratio ** 2, token_mask))
        ratio = float(masked_mean(torch.exp(log_ratio), token_mask))
    return PPOLoss(policy.loss + vf_coef * value, float(policy.loss.detach()), float(value.detach()),
                   policy.clip_fraction,
                   value_clip_fraction(values.detach(), old_values, returns, mask, cliprange_value), approx_kl, ratio)
