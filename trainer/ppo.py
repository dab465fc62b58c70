"""Proximal policy optimisation with a learned critic (PPO, Schulman et al. 2017, arXiv:1707.06347), as MiniMind's
train_ppo.py and TRL's PPOTrainer run it on a language model: the objective for the training core.

What the optimizer trains is a `PolicyAndCritic`: the policy (the language model, which the run exports) and a
separate critic, a copy of the starting model's trunk under a scalar value head (zero at the start, so every value
starts at 0) -- not a value head on the policy's own trunk: the value regression's gradients would then pull on
the representation the policy samples from, and the exported policy would carry a head no tool reads. MiniMind
and TRL keep the critic separate too. One optimizer, gradient clip and schedule cover both (as TRL's
policy-and-value wrapper); --vf_coef weighs the critic's loss. Checkpoints hold both, so a resumed run continues
the critic (and its optimizer state) where it stopped.

Each optimizer step samples its rollouts as GRPO does (trainer/grpo.py, RolloutObjective: --num_generations
completions per prompt, seeded by the step, scored by the --reward functions), then computes without gradients
the rollout's log-probs under the policy and values under the critic (old_logp, old_values: fixed for the step)
and the frozen reference's log-probs. A completion the length limit cut (no end-of-turn token) has
--missing_eos_penalty taken off its score (TRL's). The KL penalty is folded into the rewards (TRL's convention;
rl_losses.kl_penalized_rewards: -beta x the --kl_estimator KL per token, k1 or k3, the score at the last token);
with --whiten_rewards those rewards are whitened with their mean kept (TRL's whiten_rewards); GAE with --gamma and
--lam gives the advantages and returns; the advantages are whitened. Both whitenings take the mean and variance of
the completion tokens of the step's whole global batch, every micro-batch of every process (TRL and MiniMind
whiten each process's rollout batch, so their two processes do not take one process's step). Then --ppo_epochs
optimizer updates on that batch (the core's `updates_per_rollout`; each over the whole batch, TRL's
num_mini_batches = 1), each minimizing rl_losses.ppo_loss. The loss's unit is the completion token.

With --tools a completion is an episode that calls tools, sampled by the shared code (RolloutObjective's
sample_rollouts, trainer/tool_rollouts.py), and the tool results' tokens are context: out of the completion mask,
so they pay no KL and carry no reward, policy loss, value loss or entropy, and are not counted in the whitenings'
moments or the lengths. GAE runs over the sampled (action) tokens in their order, a tool result skipped as an
observation of the environment (rl_losses.gae): the action before it is followed by the first action after it,
whose value is the critic's at the position before that token, i.e. its reading of the whole episode so far,
the tool result included; gamma and lambda discount per action token. The score sits on the episode's last
sampled token. tool_calls and tool_errors are logged as GRPO's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch
from accelerate import Accelerator
from torch import nn

from model.model import MiniNormForCausalLM, MiniNormModel
from trainer.grpo import (COMPLETION_SHAPE, RolloutObjective, completion_log_probs, completion_log_probs_and_entropy,
                          global_sums, rollout_decode)
from trainer.rewards import Reward
from trainer.run_dir import load_input_model
from trainer.step import StatWindow
from trainer.rl_losses import (KLEstimator, explained_fraction, gae, kl_estimate, kl_penalized_rewards,
                               missing_eos_penalized, ppo_loss, whiten)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

STAT_NAMES = ("reward", "reward_std", "kl", "clip_fraction", "policy_loss", "value_loss", "explained_variance",
              "completion_length", *COMPLETION_SHAPE, "entropy", "approx_kl", "value_clip_fraction",
              "ratio")  # then (--tools) grpo.py's TOOL_STAT_NAMES, then each reward's mean, then its std


@dataclass(frozen=True)
class PPOSettings:
    num_generations: int
    max_completion_length: int
    temperature: float
    top_p: float
    beta: float             # the KL penalty's weight in the rewards
    epsilon: float          # the policy ratio's clip range
    cliprange_value: float  # how far a value may move from the rollout's before its loss is clipped
    vf_coef: float          # the value loss's weight
    gamma: float            # GAE's discount
    lam: float              # GAE's lambda
    ppo_epochs: int         # optimizer updates per rollout batch
    kl_estimator: str = KLEstimator.K1.value  # the per-token KL paid in the rewards: k1 or k3
    whiten_rewards: bool = False  # whiten the per-token rewards (their mean kept) over the step before GAE
    missing_eos_penalty: float = 0.0  # subtracted from the score of a completion the length limit cut
    tools: tuple[str, ...] = ()  # --tools: the tools whose calls a rollout runs (trainer/tool_rollouts.py); (): none
    max_tool_rounds: int = 2  # --max_tool_rounds: rounds of calls per rollout
    open_thinking: bool = False  # the prompts' thinking block is open: so is each turn's after the tool results
    decode: str = rollout_decode("auto")  # how rollouts decode: rollout_decode(--compile)


class CriticModel(nn.Module):
    """A scalar value per position: the decoder trunk, then a linear head (zero-initialised)."""

    def __init__(self, trunk: MiniNormModel) -> None:
        super().__init__()
        self.model = trunk
        self.value_head = nn.Linear(trunk.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden, _, _ = self.model(input_ids, attention_mask)
        return self.value_head(hidden).squeeze(-1)


def load_critic(source: Path, **overrides: Any) -> CriticModel:
    """The critic of a PPO run: the trunk of the model in `source` (the policy's starting weights), a new head."""
    return CriticModel(load_input_model(source, "--from_weight", **overrides).model)


class PolicyValues(NamedTuple):
    logits: torch.Tensor  # (B, T, V), the policy's
    values: torch.Tensor  # (B, T), the critic's


class PolicyAndCritic(nn.Module):
    """What a PPO run's optimizer trains: one forward gives the policy's logits and the critic's values."""

    def __init__(self, policy: MiniNormForCausalLM, critic: CriticModel) -> None:
        super().__init__()
        self.policy, self.critic = policy, critic

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> PolicyValues:
        return PolicyValues(self.policy(input_ids=input_ids, attention_mask=attention_mask).logits,
                            self.critic(input_ids, attention_mask))


def completion_values(values: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """(N, length) fp32 values of the states before each completion token: the critic's value at the position that
    predicts the token (one position back), as completion_log_probs reads the logits; clamped past a row's end."""
    positions = (starts.unsqueeze(1) + torch.arange(length, device=starts.device)).clamp(max=values.shape[1] - 1)
    return values.gather(1, positions - 1).float()


def _advantages(batch: dict[str, Any]) -> torch.Tensor:
    return batch["advantages"]


def _returns(batch: dict[str, Any]) -> torch.Tensor:
    return batch["returns"]


def _residuals(batch: dict[str, Any]) -> torch.Tensor:
    return batch["returns"] - batch["old_values"]


def _rewards(batch: dict[str, Any]) -> torch.Tensor:
    return batch["rewards"]


def _kl(batch: dict[str, Any]) -> torch.Tensor:
    return batch["kl"]


class CompletionTokens:
    """A process's rollout micro-batches as their completion tokens: fp64 sums over those tokens, on the CPU."""

    def __init__(self, batches: Sequence[dict[str, Any]]) -> None:
        self.batches = batches
        self.masks = [batch["completion_mask"].cpu().double() for batch in batches]

    def count(self) -> torch.Tensor:
        return sum(mask.sum() for mask in self.masks)

    def sum(self, values: Callable[[dict[str, Any]], torch.Tensor], centre: float = 0.0,
            power: int = 1) -> torch.Tensor:
        """The sum over the process's completion tokens of (values - centre) ** power."""
        return sum(((((values(batch).cpu().double() - centre) * mask) ** power).sum()
                    for batch, mask in zip(self.batches, self.masks)), torch.zeros((), dtype=torch.float64))


class ProximalPolicy(RolloutObjective):
    """The PPO objective; `model` is the run's PolicyAndCritic (RolloutObjective has the other arguments)."""

    progress_labels = {"reward": "reward", "kl": "kl", "value_loss": "vf", "completion_length": "len"}

    def __init__(self, rewards: Sequence[Reward], tokenizer: PreTrainedTokenizerBase, settings: PPOSettings,
                 reference: torch.nn.Module | None, seed: int, process_index: int,
                 autocast: Callable[[], AbstractContextManager], world: int = 1) -> None:
        super().__init__(rewards, tokenizer, settings, reference, seed, process_index, autocast, world)
        self.stat_names = STAT_NAMES + self.tool_stat_names + self.reward_names + self.reward_std_names
        self.stat_windows["explained_variance"] = StatWindow.DEFINED_MEAN  # NaN on a step whose returns are equal
        self.updates_per_rollout = settings.ppo_epochs

    @staticmethod
    def policy_of(model: torch.nn.Module) -> torch.nn.Module:
        return model.policy

    # ----------------------------------------------------------------- rollouts
    def rollout(self, model: PolicyAndCritic, batch: dict[str, Any], step: int, micro_batch: int,
                sampler: torch.nn.Module | None = None) -> dict[str, Any]:
        """The micro-batch of P prompts -> P x G scored completions (less --missing_eos_penalty where cut) with
        their old log-probs and values, the KL-folded rewards, GAE advantages (whitened by finish_rollouts) and
        returns -- with --whiten_rewards finish_rollouts computes those two from the whitened rewards --, and the
        --kl_estimator KL to the reference per token (`sampler`: sample's)."""
        out = self.sample(model, batch, step, micro_batch, sampler)
        s, mask = self.settings, out["completion_mask"]
        width = mask.shape[1]
        was_training = model.training
        model.eval()  # the policy as it sampled: no dropout
        try:
            with torch.no_grad(), self.autocast():
                logits = model.policy(input_ids=out["input_ids"], attention_mask=out["attention_mask"]).logits
                old_logp = completion_log_probs(logits, out["input_ids"], out["starts"], width, s.temperature).float()
                values = model.critic(out["input_ids"], out["attention_mask"])
                old_values = completion_values(values, out["starts"], width) * mask
        finally:
            model.train(was_training)
        ref_logp = self.reference_log_probs(out) if self.reference is not None else old_logp
        if s.missing_eos_penalty:  # logged in the reward too, as TRL's scores are
            out["scores"] = missing_eos_penalized(out["scores"], out["ended"], s.missing_eos_penalty)
        rewards = kl_penalized_rewards(out["scores"].to(old_logp.device), old_logp, ref_logp, mask, s.beta,
                                       s.kl_estimator)
        out.update(old_logp=old_logp, old_values=old_values, rewards=rewards,
                   kl=kl_estimate(old_logp, ref_logp, s.kl_estimator) * mask)
        if not s.whiten_rewards:  # else after their whitening over the step (finish_rollouts)
            out["advantages"], out["returns"] = gae(rewards, old_values, mask, s.gamma, s.lam)
        return out

    def finish_rollouts(self, batches: Sequence[dict[str, Any]], accelerator: Accelerator) -> None:
        """Collective: over the step's global batch -- every micro-batch of every process, fp64 sums, two
        collectives, two more with --whiten_rewards --, with --whiten_rewards the rewards whitened with the mean
        and variance of all its tokens' and the mean kept, then GAE on them; the advantages whitened with the mean
        and variance of all its tokens' (TRL whitens each process's rollout batch); and the logged statistics, the
        same in every micro-batch ("rollout_stats"): the reward's mean and std over its completions, the mean KL
        and the critic's explained variance over its tokens, the mean completion length and the others of
        completion_shape (shortest, longest, the share cut, the mean, shortest and longest length of those that
        ended), each reward function's mean and std ("reward_function_stats", set_function_stats) and with --tools
        the calls per rollout and the failed ones ("tool_stats", set_tool_stats). So one
        process of 4 prompts, two of 2 and one of 2 micro-batches of 2 take the same step."""
        tokens = CompletionTokens(batches)
        if self.settings.whiten_rewards:
            self.whiten_rewards_then_gae(batches, tokens, accelerator)
        moments, stats = self.advantage_moments_and_stats(batches, tokens, accelerator)
        for batch in batches:
            mask = batch["completion_mask"]
            batch["advantages"] = whiten(batch["advantages"], mask, moments)
            batch["rollout_stats"] = torch.tensor(stats, device=mask.device)

    def whiten_rewards_then_gae(self, batches: Sequence[dict[str, Any]], tokens: CompletionTokens,
                                accelerator: Accelerator) -> None:
        """--whiten_rewards (two collectives): each micro-batch's rewards whitened with the mean and Bessel's
        variance of the global batch's completion tokens, their mean kept (TRL's masked_whiten(shift_mean=False)),
        then its advantages and returns by GAE on them."""
        s = self.settings
        counted = global_sums(accelerator, tokens.count(), tokens.sum(_rewards))
        count = max(float(counted[0]), 1.0)
        mean = float(counted[1]) / count
        variance = float(global_sums(accelerator, tokens.sum(_rewards, mean, 2))[0]) / max(count - 1, 1.0)
        for batch in batches:  # Bessel's variance, as the advantages'
            mask = batch["completion_mask"]
            batch["rewards"] = whiten(batch["rewards"], mask, (mean, variance), shift_mean=False)
            batch["advantages"], batch["returns"] = gae(batch["rewards"], batch["old_values"], mask, s.gamma, s.lam)

    def advantage_moments_and_stats(self, batches: Sequence[dict[str, Any]], tokens: CompletionTokens,
                                    accelerator: Accelerator) -> tuple[tuple[float, float], list[float]]:
        """Two collectives over the global batch: the sums (each reward function's, the tokens', and over the tokens
        the advantages', returns', residuals' and KL's), then the squared deviations from their means (each reward
        function's too: set_function_stats). Returns the advantages' (mean, Bessel's variance), for whiten, and the
        rollout_stats row (finish_rollouts)."""
        reward_sums = self.reward_sums(batches)
        first = global_sums(accelerator, reward_sums, tokens.count(), tokens.sum(_advantages), tokens.sum(_returns),
                            tokens.sum(_residuals), tokens.sum(_kl), self.tool_count_sums(batches))
        reward, length = self.reward_means(first[:len(reward_sums)])
        shape = self.completion_shape(first[:len(reward_sums)])
        completions, count = float(first[0]), float(first[len(reward_sums)])
        token_sums, tool_sums = first[len(reward_sums) + 1:len(reward_sums) + 5], first[len(reward_sums) + 5:]
        advantage, returned, residual, kl = (token_sums / max(count, 1.0)).tolist()
        self.set_tool_stats(batches, tool_sums, completions)
        scores = torch.cat([batch["scores"] for batch in batches]).double()
        second = global_sums(accelerator, tokens.sum(_advantages, advantage, 2), tokens.sum(_returns, returned, 2),
                             tokens.sum(_residuals, residual, 2), ((scores - reward) ** 2).sum(),
                             self.function_deviations(batches, self.function_means(first[:len(reward_sums)])))
        self.set_function_stats(first[:len(reward_sums)], second[4:], batches)
        squares_advantage, squares_returns, squares_residual, squares_reward = second[:4].tolist()
        moments = (advantage, squares_advantage / max(count - 1, 1.0))  # Bessel's correction, as whiten's own
        explained = explained_fraction(squares_residual / max(count, 1.0), squares_returns / max(count, 1.0))
        reward_std = math.sqrt(squares_reward / completions)
        return moments, [reward, reward_std, kl, explained, length, *shape]

    # ----------------------------------------------------------------- the loss
    def count_items(self, batch: dict[str, Any]) -> torch.Tensor:
        return batch["completion_mask"].sum()

    def loss(self, model: torch.nn.Module, batch: dict[str, Any],
             num_items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, mask = self.settings, batch["completion_mask"]
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logp, entropy = completion_log_probs_and_entropy(out.logits, batch["input_ids"], batch["starts"],
                                                         mask.shape[1], s.temperature)
        values = completion_values(out.values, batch["starts"], mask.shape[1])
        result = ppo_loss(logp, batch["old_logp"], values, batch["old_values"], batch["advantages"],
                          batch["returns"], mask, s.epsilon, s.cliprange_value, s.vf_coef)
        local = self.count_items(batch).to(result.loss.dtype)
        reward, reward_std, kl, explained, length, *shape = batch["rollout_stats"].tolist()
        entropy = float((entropy * mask).sum() / local.clamp(min=1))
        stats = torch.tensor([reward, reward_std, kl, result.clip_fraction, result.policy_loss, result.value_loss,
                              explained, length, *shape, entropy, result.approx_kl,
                              result.value_clip_fraction, result.ratio], device=mask.device)
        stats = torch.cat([stats, self.logged_tool_stats(batch, stats), batch["reward_function_stats"]])
        # Weighed by this micro-batch's completion tokens, which the core sums over the step's micro-batches and
        # processes and divides by the step's (num_items): the clip fractions, the losses, the entropy, the
        # approximate KL and the ratio, token means here, become the step's exact token means; the rollout's
        # statistics, the step's already, stay as they are.
        return result.loss * local / num_items, stats * local
