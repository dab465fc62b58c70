"""Group-relative policy optimisation (GRPO and its Dr. GRPO, BNPO, DAPO and CISPO losses): the objective for the
training core.

Each optimizer step first samples its rollouts (`rollouts`, which trainer/core.py's train_step calls on the step's
micro-batches of prompts before the loss): G = --num_generations completions per prompt with model/generation.py's
GenerationEngine (batched, KV cache), the policy in eval mode (no dropout) and without gradients. Each completion's
sampling seed is derived from (--seed, optimizer step, the prompt's index in the step's global batch, the
completion's index in its group), so a resumed run samples the same rollouts as the uninterrupted one, and two
processes the same as one process over the same global batch. With --tools a completion is an episode that calls
tools (trainer/tool_rollouts.py: each round's seed derived the same way, the round added; the tool results' tokens
in the completion but out of its mask, so out of the loss, the KL and the entropy; the rewards also get each
episode's messages, and tool_calls and tool_errors are logged). The --reward functions score the completions
(trainer/rewards.py; a broken one stops the run with one line before anything of the step is applied), the rewards
become advantages within each prompt's group (trainer/rl_losses.py, group_advantages), divided as
--scale_rewards says by the group's std (the default; Dr. GRPO's default leaves it out) or the step's global
batch's, and the frozen reference's log-probs are computed once (only with --beta > 0). The logged rollout
statistics are computed over the step's whole global batch (all micro-batches, all processes). RolloutObjective
holds what PPO (trainer/ppo.py) shares: the sampling, the scoring, the step-wide sums, the reference's log-probs and
the greedy validation.

--num_iterations updates per rollout batch (TRL's name; the core's `updates_per_rollout`, one optimizer step of
the run). The first update's policy is the one that sampled the completions, so its old log-probs are its own,
detached: the importance ratio is exactly 1 and nothing is clipped. With more than one, the first update records
those log-probs in the rollout batch and the later ones take their ratio against them (fixed at sampling time),
so the clipping acts; the ratio is per token, or with --importance_sampling_level sequence one per completion
(GSPO's). The loss is rl_losses.policy_loss's; its unit (what it averages over, over the whole step) is the
completion for grpo and dr_grpo, the completion token for dapo and cispo, and the micro-batch for bnpo (TRL's bnpo
is each micro-batch's token mean, averaged over the micro-batches of every process: a step of other micro-batches
weighs its tokens otherwise).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from dataset.chat_format import IM_END
from dataset.shown_value import shown_value
from model.generation import (FINISH_ERROR, NON_FINITE_SCORES, GenerationEngine, GenerationSettings,
                              default_eos_token_ids)
from trainer.evaluation import LoggedEval
from trainer.export import whole_model_everywhere
from trainer.rewards import COMPLETION_MESSAGES, Reward, math_answer, score
from trainer.rl_losses import (ADVANTAGE_EPS, ImportanceSamplingLevel, LossType, ScaleRewards, default_scale_rewards,
                                group_advantages, policy_loss, scored_group_stats)
from trainer.run_dir import ROLLOUT_VAL_METRICS
from trainer.step import POLICY, SamplingDiverged, StatWindow
from trainer.tool_rollouts import sample_tool_episodes

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")

# The rollout's completions over the whole step (RolloutObjective.completion_shape), GRPO's and PPO's: the shortest and
# longest (tokens), the share the length limit cut, the mean, shortest and longest length of those that ended (NaN,
# null, when none did).
COMPLETION_SHAPE = ("completion_length_min", "completion_length_max", "truncated_fraction", "terminated_length",
                    "terminated_length_min", "terminated_length_max")
# How the log window takes them over its steps (trainer/step.py): a shortest the least of its steps', a longest the
# greatest, the ended completions' lengths over the steps where some ended (the cut share: the mean of the steps').
COMPLETION_SHAPE_WINDOWS = {"completion_length_min": StatWindow.MIN, "completion_length_max": StatWindow.MAX,
                            "terminated_length": StatWindow.DEFINED_MEAN, "terminated_length_min": StatWindow.MIN,
                            "terminated_length_max": StatWindow.MAX}
STAT_NAMES = ("reward", "reward_std", "kl", "clip_fraction", "completion_length", *COMPLETION_SHAPE,
              "zero_std_fraction", "entropy", "clip_fraction_low", "clip_fraction_high")  # then each reward's mean, std
# With --tools (GRPO's and PPO's), after the objective's STAT_NAMES: the mean number of tool calls run per rollout over
# the step, and of those that came back as an error (dataset/tools.py, is_tool_error: an unknown tool, bad arguments,
# no such article).
TOOL_STAT_NAMES = ("tool_calls", "tool_errors")
# A group's rewards count as all equal (its advantages are all 0: nothing to learn from it) when their std is at most
# this (TRL's torch.isclose(std, 0): the mean of equal rewards need not be exactly one of them in floating point).
ZERO_STD = 1e-8
# Rollout micro-batch keys: the completions of its whole step and their tokens, every micro-batch of every process
# (finish_rollouts); the logged clip fraction and KL count against them, whatever the loss's units.
STEP_COMPLETIONS = "step_completions"
STEP_COMPLETION_TOKENS = "step_completion_tokens"


def rollout_decode(compile_mode: str) -> str:
    """How rollouts decode (model/generation.py's DECODE_MODES) under the run's --compile: a compiled step over a
    static KV cache, 1.5-1.7x the speed of decoding through the model's forward (docs/benchmarks.md, rollout
    decoding). It compiles once per process (10-20 s cold), which a few steps of rollouts pay back, so auto compiles
    it whatever the run's length; --compile off compiles nothing: the same static step runs eagerly."""
    return "static" if compile_mode == "off" else "compiled"


def reward_stat_name(reward: Reward) -> str:
    """The logged name of one reward function's mean (as TRL's rewards/<function>/mean): rewards/<function>; its
    std's (TRL's rewards/<function>/std) is this + "_std", as reward_std is reward's."""
    return f"rewards/{getattr(reward.function, '__name__', reward.name)}"


def check_reward_names(rewards: Sequence[Reward]) -> None:
    """A ValueError (one line naming the specs) when two of a run's rewards log as one mean (reward_stat_name: the
    function's name), which would stand for only the last one written."""
    names = [reward_stat_name(reward) for reward in rewards]
    repeated = next((name for name in names if names.count(name) > 1), None)
    if repeated is not None:
        specs = [reward.name for reward in rewards if reward_stat_name(reward) == repeated]
        raise ValueError(f"--reward {' and '.join(map(shown_value, specs))} log as one mean, {repeated}: give each "
                         f"reward function once, under a name of its own (--reward_weights weighs one)")


@dataclass(frozen=True)
class RolloutSettings:
    loss_type: str
    num_generations: int
    max_completion_length: int
    temperature: float
    top_p: float
    beta: float
    epsilon_low: float
    epsilon_high: float
    num_iterations: int = 1  # optimizer updates per rollout batch
    scale_rewards: str | None = None  # group, batch or none; None: default_scale_rewards(loss_type)
    importance_sampling_level: str = ImportanceSamplingLevel.TOKEN.value  # token, or sequence (GSPO)
    tools: tuple[str, ...] = ()  # --tools: the tools whose calls a rollout runs (trainer/tool_rollouts.py); (): none
    max_tool_rounds: int = 2  # --max_tool_rounds: rounds of calls per rollout
    open_thinking: bool = False  # the prompts' thinking block is open: so is each turn's after the tool results
    decode: str = rollout_decode("auto")  # how rollouts decode: rollout_decode(--compile)

    @property
    def reward_scaling(self) -> str:
        return self.scale_rewards if self.scale_rewards is not None else default_scale_rewards(self.loss_type)


def _scored_group_stds(rewards: torch.Tensor) -> torch.Tensor:
    """The std of each row's scored rewards (P, G) -> (groups with at least two of them,): what group_advantages
    divides by, for the logged share of groups whose rewards are all equal."""
    count, _, std = scored_group_stats(rewards)
    return std[count > 1]


def rollout_seed(seed: int, step: int, sample: int, generation: int, round_index: int = 0) -> int:
    """The sampling seed of one completion: a digest of where it is in the run -- the optimizer step, its prompt's
    index in the step's global batch, its index in the prompt's group and (--tools) the turn's round of tool calls
    (round 0's key is a plain completion's) --, the same on a resumed run and whatever the number of processes."""
    key = f"{seed}/{step}/{sample}/{generation}{f'/{round_index}' if round_index else ''}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:7], "big")


def global_sums(accelerator: Accelerator, *values: torch.Tensor | float) -> torch.Tensor:
    """The values (numbers or tensors, flattened and concatenated) summed over all processes, in fp64, on the CPU:
    one collective."""
    flat = torch.cat([torch.as_tensor(value, dtype=torch.float64).detach().reshape(-1).cpu() for value in values])
    return accelerator.reduce(flat.to(accelerator.device), reduction="sum").cpu()


def agreed_sampling(accelerator: Accelerator | None, world: int, sample: Callable[[], T],
                    validation: bool = False, sampler: str = POLICY) -> T:
    """`sample()` (a step's sampling on this process; `validation`: a validation's), or SamplingDiverged on every
    process when it raised that on any: under several processes one collective agrees on it, so that no process
    goes on alone into the next collective (the rollouts' global sums) while another ends the run. `sampler`: the
    model that samples (the policy, or distillation's teacher), which the error names on every process."""
    try:
        result, diverged = sample(), False
    except SamplingDiverged:
        result, diverged = None, True
    if world > 1 and accelerator is not None:  # (a unit test's stand-in processes have none)
        diverged = bool(global_sums(accelerator, float(diverged))[0] > 0)
    if diverged:
        raise SamplingDiverged(validation, sampler)
    return result


def first_sample(micro_batch: int, process: int, world: int, batch_size: int) -> int:
    """The index in the step's global batch of a micro-batch's first prompt: the data loader hands the step's
    micro-batch m of process p the (m x world + p)-th batch of the epoch's order (trainer/data.py)."""
    return (micro_batch * world + process) * batch_size


def completion_text(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    """What the reward functions read of a completion: its token ids decoded with every control token kept as its
    text (<think>, </think>, <tool_call>, ... -- our tokenizer marks them special, so skip_special_tokens would
    drop them; Qwen3's keeps them, and TRL's and MiniMind's format rewards read them), except the end-of-turn token
    that ends it (<|im_end|>, or the end-of-text / padding token), which is not text. A tag that the model wrote in
    ordinary tokens reads the same as the control token: a reward sees text."""
    ends = {tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
    ids = list(ids)
    while ids and ids[-1] in ends:
        ids.pop()
    return tokenizer.decode(ids, skip_special_tokens=False)


def completion_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, starts: torch.Tensor, length: int,
                         temperature: float = 1.0) -> torch.Tensor:
    """(N, length) log-probabilities, in fp32 (fp64 stays fp64), of the tokens input_ids[i, starts[i] + t] given
    what precedes them under softmax(logits / temperature), from a causal LM's logits (N, T, V); positions past a
    row's end are clamped (mask them). The RL objectives pass the rollouts' sampling temperature: the log-probs
    are the distribution's that sampled the tokens (TRL's GRPOTrainer and PPOTrainer divide the logits by it)."""
    return completion_log_probs_and_entropy(logits, input_ids, starts, length, temperature, entropy=False)[0]


def completion_log_probs_and_entropy(logits: torch.Tensor, input_ids: torch.Tensor, starts: torch.Tensor,
                                     length: int, temperature: float = 1.0,
                                     entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """completion_log_probs's log-probabilities and, from the same log-softmax over the vocabulary (no second
    forward, no second log-softmax), the entropy in nats of each of those positions' distributions, (N, length),
    detached (it is logged, not trained: no graph is kept for it) and computed one completion at a time, so its
    extra memory is one completion's (length, V) probabilities; None with entropy=False."""
    positions = (starts.unsqueeze(1) + torch.arange(length, device=starts.device)).clamp(max=input_ids.shape[1] - 1)
    selected = logits.gather(1, (positions - 1).unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    selected = selected.to(torch.promote_types(selected.dtype, torch.float32))
    if temperature != 1.0:  # the default spares a copy of the (N, length, V) logits at every update
        selected = selected / temperature
    log_p = torch.log_softmax(selected, dim=-1)
    log_probs = log_p.gather(-1, input_ids.gather(1, positions).unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return log_probs, None
    with torch.no_grad():  # -sum p log p, one completion at a time in one reused buffer
        log_p = log_p.detach()
        entropies = log_p.new_empty(log_p.shape[:2])
        terms = torch.empty_like(log_p[0])
        for row, log_p_row in enumerate(log_p):
            torch.exp(log_p_row, out=terms)
            terms.mul_(log_p_row).nan_to_num_(0.0)  # a -inf log-prob (p = 0) adds 0, not 0 x -inf = NaN
            torch.sum(terms, dim=-1, out=entropies[row])
        entropies.neg_()
    return log_probs, entropies


def sample_completions(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[Sequence[int]],
                       settings: Sequence[GenerationSettings], decode: str) -> list[list[int]]:
    """The completions' token ids (the end-of-turn token included when sampled), one request per prompt/settings
    pair, all in one batch of the engine; the model in eval mode. The prefills run eagerly (their shapes change with
    every prompt, which would recompile a compiled model), the decode steps as `decode` says (rollout_decode)."""
    if hasattr(model, "peft_config"):  # PEFT's adapters live inside the base model's layers: it samples with them
        model = model.get_base_model()
    engine = GenerationEngine(model, tokenizer, max_batch=len(prompt_ids), decode=decode)
    was_training = model.training
    model.eval()
    try:
        with torch.compiler.set_stance("force_eager"):
            generations = [engine.submit(ids, setting) for ids, setting in zip(prompt_ids, settings)]
            while not all(generation.done for generation in generations):
                engine.step()
    finally:
        model.train(was_training)
    failed = next((g for g in generations if g.finish_reason == FINISH_ERROR), None)
    if failed is not None and failed.error == NON_FINITE_SCORES:  # the settings are checked: the logits diverged
        raise SamplingDiverged() from failed.failure
    if failed is not None:
        # from what failed: an allocation failure is the run's one out-of-memory line (trainer/memory.py)
        raise RuntimeError(f"rollout: sampling a completion failed: {failed.error}") from failed.failure
    return [generation.token_ids for generation in generations]


class WithoutAdapters:
    """The frozen reference of a policy trained as LoRA adapters (--lora): the same PEFT model with its adapters
    disabled, i.e. the starting weights, at no memory cost. Called as a causal LM; always in eval mode."""

    def __init__(self, peft_model: torch.nn.Module) -> None:
        self.peft_model = peft_model

    def eval(self) -> WithoutAdapters:
        return self

    def requires_grad_(self, requires_grad: bool = False) -> WithoutAdapters:
        return self  # the base weights are frozen already; the adapters are the policy's to train

    def __call__(self, **inputs: Any) -> Any:
        was_training = self.peft_model.training
        self.peft_model.eval()
        try:
            with self.peft_model.disable_adapter():
                return self.peft_model(**inputs)
        finally:
            self.peft_model.train(was_training)


def _padded(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[index, :len(row)] = 1
    return ids, mask


@dataclass(frozen=True)
class SampledCompletions:
    """What a rollout sampled, one entry per completion: its token ids after the prompt, True where the policy
    sampled the token (False on a tool result's context, --tools), whether it ended with an end-of-turn token,
    the tool calls run and those that failed, and (--tools; else None) the episode as messages, which the rewards
    get as completion_messages."""

    token_ids: list[list[int]]
    action_masks: list[list[bool]]
    ended: list[bool]
    tool_calls: list[int]
    tool_errors: list[int]
    messages: list[list[dict]] | None = None

    def reward_columns(self, columns: dict[str, list]) -> dict[str, list]:
        """The data's columns for the reward functions, with the episodes' messages where there are some."""
        return columns if self.messages is None else {**columns, COMPLETION_MESSAGES: self.messages}


@dataclass
class GRPOEval(LoggedEval):
    metrics = ROLLOUT_VAL_METRICS

    loss: float               # minus the mean reward: lower is better, as for every other validation loss
    reward: float             # the mean weighted reward of one greedy completion per validation prompt
    completion_length: float  # their mean length in tokens
    prompts: int
    accuracy: float = float("nan")  # the fraction whose greedy completion has math_answer 1 (NaN: no "answer")

    def describe(self) -> str:
        accuracy = "" if math.isnan(self.accuracy) else f"accuracy {self.accuracy:.2%}, "
        return (f"val reward {self.reward:.4f} (greedy, {self.prompts} prompts), {accuracy}completion length "
                f"{self.completion_length:.1f} tokens")


class SamplingSettings(Protocol):
    """What a rollout samples (RolloutSettings, trainer/ppo.py's PPOSettings)."""

    num_generations: int
    max_completion_length: int
    temperature: float
    top_p: float
    tools: tuple[str, ...]  # --tools: the tools whose calls a rollout runs; (): none
    max_tool_rounds: int
    open_thinking: bool
    decode: str  # how rollouts decode (rollout_decode)


class RolloutObjective:
    """What the policy-gradient objectives share (GRPO here, PPO in trainer/ppo.py): sampling and scoring the
    rollouts, the frozen reference's log-probs and the greedy validation. `reference`: the frozen starting model
    on the training device (None when beta is 0); `autocast`: the mixed-precision context of its forward;
    `process_index` of `world` processes: where this process's prompts sit in each step's global batch; `sharded`:
    the policy's weights are (FSDP2), so it samples through a whole copy of them (whole_model_everywhere)."""

    def __init__(self, rewards: Sequence[Reward], tokenizer: PreTrainedTokenizerBase, settings: SamplingSettings,
                 reference: torch.nn.Module | None, seed: int, process_index: int,
                 autocast: Callable[[], AbstractContextManager], world: int = 1, sharded: bool = False) -> None:
        self.sharded = sharded
        self.rewards, self.tokenizer, self.settings = list(rewards), tokenizer, settings
        self.reference = reference.eval().requires_grad_(False) if reference is not None else None
        self.seed, self.process_index, self.world, self.autocast = seed, process_index, world, autocast
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.reward_names = tuple(reward_stat_name(reward) for reward in self.rewards)
        self.reward_std_names = tuple(f"{name}_std" for name in self.reward_names)
        # a function's mean and std are undefined (NaN) on a step where it scored no completion (the std: fewer than
        # two): the log window takes them over the steps where they are defined
        self.stat_windows: dict[str, StatWindow] = {
            **COMPLETION_SHAPE_WINDOWS,
            **{name: StatWindow.DEFINED_MEAN for name in self.reward_names + self.reward_std_names}}
        self.tool_stat_names = TOOL_STAT_NAMES if settings.tools else ()  # logged after the objective's STAT_NAMES

    @staticmethod
    def policy_of(model: torch.nn.Module) -> torch.nn.Module:
        """The language model that samples, within what the optimizer trains (here: the model itself)."""
        return model

    def sampling_policy(self, model: torch.nn.Module) -> torch.nn.Module:
        """What samples: the policy, or (collective) a whole copy of it where its weights are sharded."""
        policy = self.policy_of(model)
        return whole_model_everywhere(policy) if self.sharded else policy

    def rollouts(self, model: torch.nn.Module, batches: Sequence[dict[str, Any]], step: int,
                 accelerator: Accelerator) -> list[dict[str, Any]]:
        """Collective (every process, once per optimizer step): each micro-batch of prompts sampled and scored
        (`rollout`), then what spans the step's whole global batch -- every micro-batch of every process -- computed
        over it (`finish_rollouts`: the logged statistics, PPO's whitening), so that the step does not depend on how
        its prompts are split between processes and micro-batches."""
        sampler = self.sampling_policy(model)  # once per step: under sharding a gather of the whole weights
        sampled = agreed_sampling(accelerator, self.world, lambda: [
            self.rollout(model, batch, step, index, sampler) for index, batch in enumerate(batches)])
        self.finish_rollouts(sampled, accelerator)
        return sampled

    def reward_sums(self, batches: Sequence[dict[str, Any]]) -> torch.Tensor:
        """This process's fp64 sums over its micro-batches of the step: [completions, weighted rewards, completion
        tokens, then each function's values over the completions it scored, then the number it scored, then the
        completions the length limit cut (no end-of-turn token) and the tokens of those that ended, then how many
        completions have each length 0 .. --max_completion_length, then how many of those that ended] (summed over
        the processes, the two histograms give the step's shortest and longest completion and ended completion:
        completion_shape). `_sum_parts` names the parts."""
        scores = torch.cat([batch["scores"] for batch in batches]).double()
        values = torch.cat([batch["reward_values"] for batch in batches], dim=1)
        lengths = torch.cat([batch["completion_mask"].sum(dim=1).cpu() for batch in batches])
        tokens = int(lengths.sum())
        ended = torch.cat([batch["ended"] for batch in batches])
        limit = self.settings.max_completion_length
        histogram = torch.bincount(lengths.clamp(max=limit), minlength=limit + 1).double()
        ended_histogram = torch.bincount(lengths[ended].clamp(max=limit), minlength=limit + 1).double()
        cut_and_ended = torch.tensor([int((~ended).sum()), int(lengths[ended].sum())], dtype=torch.float64)
        scored_values = values.nan_to_num(0.0)
        return torch.cat([torch.tensor([len(scores), float(scores.sum()), tokens], dtype=torch.float64),
                          scored_values.sum(dim=1), (~values.isnan()).sum(dim=1).double(), cut_and_ended,
                          histogram, ended_histogram])

    @staticmethod
    def tool_count_sums(batches: Sequence[dict[str, Any]]) -> torch.Tensor:
        """This process's fp64 [tool calls run, of them errors] over its micro-batches of the step (0 without
        --tools), to be summed over the processes with the step's other sums."""
        return torch.cat([batch["tool_counts"] for batch in batches], dim=1).sum(dim=1)

    @staticmethod
    def set_tool_stats(batches: Sequence[dict[str, Any]], calls_and_errors: torch.Tensor, completions: float) -> None:
        """Sets each batch's "tool_stats" (TOOL_STAT_NAMES), from tool_count_sums summed over all processes and the
        step's number of completions: the mean calls run per rollout, and of those that failed."""
        calls, errors = calls_and_errors.tolist()
        for batch in batches:
            batch["tool_stats"] = torch.tensor([calls / completions, errors / completions],
                                               device=batch["completion_mask"].device)

    def logged_tool_stats(self, batch: dict[str, Any], like: torch.Tensor) -> torch.Tensor:
        """The micro-batch's tool statistics as the loss logs them after its STAT_NAMES' (none without --tools)."""
        return batch["tool_stats"].to(like.dtype) if self.tool_stat_names else like.new_zeros(0)

    def _sum_parts(self, sums: torch.Tensor) -> dict[str, torch.Tensor]:
        """reward_sums's vector (summed over the processes) cut into its named parts: the one owner of its order."""
        functions, bins = len(self.rewards), self.settings.max_completion_length + 1
        sizes = {"counts": 3, "function_sums": functions, "function_scored": functions, "cut_and_ended_tokens": 2,
                 "lengths": bins, "ended_lengths": bins}
        return dict(zip(sizes, torch.split(sums, list(sizes.values()))))

    def completion_shape(self, sums: torch.Tensor) -> list[float]:
        """From reward_sums summed over all processes, COMPLETION_SHAPE: the step's shortest and longest completion
        (tokens), the share of its completions the length limit cut, and the mean, shortest and longest length of
        those that ended (each NaN when none did; TRL's 0) -- TRL's completions/min_length, max_length,
        clipped_ratio, mean_terminated_length, min_terminated_length and max_terminated_length."""
        parts = self._sum_parts(sums)
        held = parts["lengths"].nonzero().flatten()
        held_ended = parts["ended_lengths"].nonzero().flatten()
        cut, ended_tokens = parts["cut_and_ended_tokens"].tolist()
        completions = float(sums[0])
        ended = completions - cut
        if not ended:
            return [float(held.min()), float(held.max()), cut / completions] + [float("nan")] * 3
        return [float(held.min()), float(held.max()), cut / completions, ended_tokens / ended,
                float(held_ended.min()), float(held_ended.max())]

    def reward_means(self, sums: torch.Tensor) -> tuple[float, float]:
        """From reward_sums summed over all processes: (the mean weighted reward, the mean completion length)."""
        return float(sums[1] / sums[0]), float(sums[2] / sums[0])

    def function_means(self, sums: torch.Tensor) -> torch.Tensor:
        """From reward_sums summed over all processes: each reward function's mean over the step's completions it
        scored, fp64 (NaN if none)."""
        parts = self._sum_parts(sums)
        return parts["function_sums"] / parts["function_scored"]

    @staticmethod
    def function_deviations(batches: Sequence[dict[str, Any]], means: torch.Tensor) -> torch.Tensor:
        """This process's fp64 sums over its micro-batches, per reward function, of (value - the function's step
        mean)^2 over the completions it scored: the second pass of the functions' stds, all-reduced after the first
        has given the means. One pass (sum x^2 - n mean^2) cancels catastrophically where the values sit far from 0
        with a small spread (a reward model's 1e8 +- 0.01: both terms near 1e17, their fp64 rounding larger than
        the spread); deviations from the step's mean keep it, and the mean's own rounding enters only squared."""
        values = torch.cat([batch["reward_values"] for batch in batches], dim=1)
        deviations = values - means.unsqueeze(1)
        return torch.where(values.isnan(), 0.0, deviations * deviations).sum(dim=1)

    def set_function_stats(self, sums: torch.Tensor, deviations: torch.Tensor,
                           batches: Sequence[dict[str, Any]]) -> None:
        """Sets each batch's "reward_function_stats", from reward_sums and function_deviations each summed over all
        processes: each function's mean over the completions it scored (NaN if none), then its std over them, with
        Bessel's correction (TRL's nanstd; NaN if fewer than two)."""
        scored = self._sum_parts(sums)["function_scored"]
        stds = torch.where(scored > 1, (deviations / (scored - 1)).sqrt(), float("nan"))
        for batch in batches:
            batch["reward_function_stats"] = torch.cat([self.function_means(sums), stds]).float().to(
                batch["completion_mask"].device)

    def sample_rollouts(self, policy: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                        settings: Sequence[GenerationSettings],
                        round_seed: Callable[[int, int], int | None] | None = None) -> SampledCompletions:
        """The completions of `prompt_ids`, one per settings: plain ones (sample_completions), or with --tools
        (`tools` in the settings) episodes whose turns' tool calls are run (trainer/tool_rollouts.py;
        `round_seed(completion, round)` the seed of each turn, None: the settings' own)."""
        stops = default_eos_token_ids(policy, self.tokenizer)  # where the engine stopped a completion
        tools = self.settings.tools
        if not tools:
            completions = sample_completions(policy, self.tokenizer, prompt_ids, settings, self.settings.decode)
            none = [0] * len(completions)
            return SampledCompletions(completions, [[True] * len(ids) for ids in completions],
                                      [bool(ids) and ids[-1] in stops for ids in completions], none, none)
        own_seed = round_seed or (lambda index, round_index: settings[index].seed)
        episodes = sample_tool_episodes(partial(sample_completions, policy, self.tokenizer,
                                                decode=self.settings.decode), self.tokenizer,
                                        prompt_ids, settings, own_seed, tools, self.settings.max_tool_rounds,
                                        self.settings.max_completion_length, stops, self.settings.open_thinking)
        return SampledCompletions([e.token_ids for e in episodes], [e.action_mask for e in episodes],
                                  [e.ended for e in episodes], [e.calls for e in episodes],
                                  [e.errors for e in episodes], [e.messages for e in episodes])

    def sample(self, model: torch.nn.Module, batch: dict[str, Any], step: int, micro_batch: int,
               sampler: torch.nn.Module | None = None) -> dict[str, Any]:
        """The micro-batch of P prompts -> P x G scored completions: the tensors every loss reads (input_ids,
        attention_mask, starts, completion_mask), the weighted rewards ("scores", P x G, fp64 on the CPU: a reward
        model's 1e8 +- 0.01 keeps its spread, which fp32, 8 between neighbours there, would round away), each
        function's values with None as NaN ("reward_values", functions x completions, fp64) and whether each
        completion ended with its end-of-turn token rather than at the length limit ("ended", bool on the CPU)."""
        s, group = self.settings, self.settings.num_generations
        prompt_ids = [ids for ids in batch["prompt_ids"] for _ in range(group)]
        first = first_sample(micro_batch, self.process_index, self.world, len(batch["prompt_ids"]))
        settings = [GenerationSettings(max_new_tokens=s.max_completion_length, temperature=s.temperature,
                                       top_p=s.top_p, seed=rollout_seed(self.seed, step, first + index // group,
                                                                        index % group))
                    for index in range(len(prompt_ids))]
        # `sampler`: what samples (sampling_policy's, taken once per step by rollouts); None: take it here
        policy = self.sampling_policy(model) if sampler is None else sampler
        sampled = self.sample_rollouts(
            policy, prompt_ids, settings,
            lambda index, round_index: rollout_seed(self.seed, step, first + index // group, index % group,
                                                    round_index))
        completions = sampled.token_ids
        texts = [completion_text(self.tokenizer, ids) for ids in completions]  # a tool episode's whole text
        columns = {name: [value for value in values for _ in range(group)]
                   for name, values in batch["columns"].items()}
        prompts = [prompt for prompt in batch["prompts"] for _ in range(group)]
        totals, per_function = score(self.rewards, prompts, texts, sampled.reward_columns(columns))
        device = next(model.parameters()).device
        input_ids, attention_mask = _padded([p + c for p, c in zip(prompt_ids, completions)], self.pad_id)
        width = max(len(c) for c in completions)
        # the sampled tokens only: a tool result's tokens are context, out of the loss, the KL and the entropy
        completion_mask = torch.tensor([mask + [False] * (width - len(mask)) for mask in sampled.action_masks],
                                       dtype=torch.bool).view(len(completions), width)
        out = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device),
               "starts": torch.tensor([len(p) for p in prompt_ids], device=device),
               "completion_mask": completion_mask.to(device),
               "scores": torch.tensor(totals, dtype=torch.float64),
               "reward_values": torch.tensor(per_function, dtype=torch.float64).view(len(per_function), len(texts)),
               "ended": torch.tensor(sampled.ended, dtype=torch.bool),
               "tool_counts": torch.tensor([sampled.tool_calls, sampled.tool_errors], dtype=torch.float64)}
        return out

    def reference_log_probs(self, batch: dict[str, Any]) -> torch.Tensor:
        """The frozen reference's log-probs (fp32) of the batch's completion tokens, at the sampling temperature
        (the KL compares the policy's and the reference's distributions at it, as TRL's trainers do)."""
        with torch.no_grad(), self.autocast():
            logits = self.reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            return completion_log_probs(logits, batch["input_ids"], batch["starts"],
                                        batch["completion_mask"].shape[1], self.settings.temperature).float()

    # ----------------------------------------------------------------- validation
    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator,
                 token_bytes: torch.Tensor | None = None, max_batches: int = 0) -> GRPOEval:
        """One greedy completion per validation prompt, scored by the run's rewards; where the data has an "answer"
        field, also the accuracy: the fraction of prompts whose completion math_answer scores 1."""
        policy = self.sampling_policy(model)
        totals = agreed_sampling(accelerator, self.world, lambda: self._validation_totals(policy, loader, max_batches),
                                 validation=True)
        totals = accelerator.reduce(totals.to(accelerator.device), reduction="sum")
        prompts = int(totals[2])
        reward = float(totals[0] / prompts) if prompts else float("nan")
        length = float(totals[1] / prompts) if prompts else float("nan")
        accuracy = float(totals[3] / totals[4]) if totals[4] else float("nan")
        return GRPOEval(-reward, reward, length, prompts, accuracy)

    def _validation_totals(self, policy: torch.nn.Module, loader: DataLoader, max_batches: int) -> torch.Tensor:
        """This process's validation sums (evaluate): the rewards, the completions' lengths, the prompts, the
        correct answers and the prompts with an "answer" field."""
        totals = torch.zeros(5, dtype=torch.float64)
        greedy = GenerationSettings(max_new_tokens=self.settings.max_completion_length, temperature=0.0)
        for index, batch in enumerate(loader):
            if max_batches and index >= max_batches:
                break
            keep = [i for i, padding in enumerate(batch.get("padding") or [False] * len(batch["prompts"]))
                    if not padding]  # a validation shard's padding copies are not counted
            if not keep:
                continue
            prompts = [batch["prompts"][i] for i in keep]
            columns = {name: [values[i] for i in keep] for name, values in batch["columns"].items()}
            sampled = self.sample_rollouts(policy, [batch["prompt_ids"][i] for i in keep], [greedy] * len(keep))
            completions = sampled.token_ids
            texts = [completion_text(self.tokenizer, ids) for ids in completions]
            rewards, _ = score(self.rewards, prompts, texts, sampled.reward_columns(columns))
            answers = columns.get("answer")
            correct = sum(math_answer(prompts, texts, answers)) if answers is not None else 0.0
            totals += torch.tensor([sum(rewards), sum(map(sum, sampled.action_masks)), len(texts), correct,
                                    len(texts) if answers is not None else 0], dtype=torch.float64)
        return totals


class GroupRelativePolicy(RolloutObjective):
    """The GRPO objective (RolloutObjective has the arguments)."""

    progress_labels = {"reward": "reward", "kl": "kl", "completion_length": "len"}

    def __init__(self, rewards: Sequence[Reward], tokenizer: PreTrainedTokenizerBase, settings: RolloutSettings,
                 reference: torch.nn.Module | None, seed: int, process_index: int,
                 autocast: Callable[[], AbstractContextManager], world: int = 1, sharded: bool = False) -> None:
        super().__init__(rewards, tokenizer, settings, reference, seed, process_index, autocast, world, sharded)
        self.stat_names = STAT_NAMES + self.tool_stat_names + self.reward_names + self.reward_std_names
        # no completion scored: no reward; fewer than two: no std
        self.stat_windows.update(reward=StatWindow.DEFINED_MEAN, reward_std=StatWindow.DEFINED_MEAN)
        self.updates_per_rollout = settings.num_iterations

    # ----------------------------------------------------------------- rollouts
    def rollout(self, model: torch.nn.Module, batch: dict[str, Any], step: int, micro_batch: int,
                sampler: torch.nn.Module | None = None) -> dict[str, Any]:
        """The micro-batch of P prompts -> P x G scored completions, as the tensors the loss reads (`sampler`:
        sample's)."""
        out = self.sample(model, batch, step, micro_batch, sampler)
        unscored = out["reward_values"].isnan().all(dim=0)  # no function scored it: not a reward of 0 it earned
        rewards = out["scores"].masked_fill(unscored, float("nan")).view(-1, self.settings.num_generations)
        # batch: centred here, divided by the global batch's std in finish_rollouts
        advantages = group_advantages(rewards, scale=self.settings.reward_scaling == ScaleRewards.GROUP).flatten()
        device = out["input_ids"].device
        out["advantages"] = advantages.to(device, torch.float32)  # centred in fp64, the loss's in fp32
        if self.reference is not None:
            out["ref_logp"] = self.reference_log_probs(out)
        return out

    def finish_rollouts(self, batches: Sequence[dict[str, Any]], accelerator: Accelerator) -> None:
        """Collective (two all-reduces of fp64 sums: the step's, then the deviations from its means, so that every
        std is a two-pass one): the logged rollout statistics over the step's global batch -- the mean reward over the
        completions some reward function scored (as TRL's nanmean: one no function scored earned no reward of 0; NaN,
        written as null, when none is scored), the mean completion length over all its completions, the std of the
        scored completions' rewards over the whole batch (Bessel's, TRL's reward_std; NaN with fewer than two),
        the shortest and longest completion, the share of the completions the length limit cut, the share of
        the groups whose scored rewards are all equal (std <= ZERO_STD: TRL's frac_reward_zero_std, over all the
        groups; one with fewer than two scored is not counted), the ended completions' mean, shortest and longest
        length (completion_shape) --, the same in every micro-batch ("rollout_stats", and each reward function's
        mean and std over the completions it scored, "reward_function_stats"; the loss weighs them by its units,
        which sum to the step's), as are the numbers of the step's completions
        (STEP_COMPLETIONS) and of their tokens (STEP_COMPLETION_TOKENS), which the logged clip fractions, KL and
        entropy count against; with --scale_rewards batch, the advantages divided by the std of the global batch's
        scored rewards + 1e-4 (TRL's)."""
        scored = torch.cat([~batch["reward_values"].isnan().all(dim=0) for batch in batches])
        scores = torch.cat([batch["scores"] for batch in batches]).double()
        groups = _scored_group_stds(scores.masked_fill(~scored, float("nan")).view(-1, self.settings.num_generations))
        rollout = self.reward_sums(batches)
        sums = global_sums(accelerator, rollout, scores[scored].sum(), scored.sum(), (groups <= ZERO_STD).sum(),
                           self.tool_count_sums(batches))
        _, length = self.reward_means(sums[:len(rollout)])
        shape = self.completion_shape(sums[:len(rollout)])
        scored_sum, scored_count, zero_std = sums[len(rollout):len(rollout) + 3].tolist()
        self.set_tool_stats(batches, sums[len(rollout) + 3:], float(sums[0]))
        reward = scored_sum / scored_count if scored_count else float("nan")
        zero_std_fraction = zero_std / (float(sums[0]) / self.settings.num_generations)
        # the second pass over the step's means: the stds from deviations, not from the sums of squares
        means = self.function_means(sums[:len(rollout)])
        deviations = global_sums(accelerator, self.function_deviations(batches, means),
                                 ((scores[scored] - reward) ** 2).sum())
        self.set_function_stats(sums[:len(rollout)], deviations[:len(self.rewards)], batches)
        # the scored rewards' std over the step's batch, Bessel's: TRL's reward_std, and its batch scaling's divisor
        squares = float(deviations[len(self.rewards)])
        reward_std = math.sqrt(squares / (scored_count - 1)) if scored_count > 1 else float("nan")
        if self.settings.reward_scaling == ScaleRewards.BATCH:
            std = reward_std if scored_count > 1 else 0.0
            for batch in batches:
                batch["advantages"] = batch["advantages"] / (std + ADVANTAGE_EPS)
        for batch in batches:
            batch["rollout_stats"] = torch.tensor(
                [reward, reward_std, length, *shape, zero_std_fraction],
                device=batch["completion_mask"].device)
            batch[STEP_COMPLETIONS] = int(sums[0])
            batch[STEP_COMPLETION_TOKENS] = int(sums[2])

    # ----------------------------------------------------------------- the loss
    def count_items(self, batch: dict[str, Any]) -> torch.Tensor:
        mask = batch["completion_mask"]
        if self.settings.loss_type in (LossType.CISPO, LossType.DAPO):
            return mask.sum()
        if self.settings.loss_type == LossType.BNPO:
            return torch.tensor(1, device=mask.device)
        return torch.tensor(mask.shape[0], device=mask.device)

    def loss(self, model: torch.nn.Module, batch: dict[str, Any],
             num_items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, mask = self.settings, batch["completion_mask"]
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logp, entropy = completion_log_probs_and_entropy(logits, batch["input_ids"], batch["starts"], mask.shape[1],
                                                         s.temperature)
        old_logp = batch.get("old_logp")
        if old_logp is None:  # the rollout's first update: the policy that sampled it
            old_logp = logp.detach()
            if self.updates_per_rollout > 1:
                batch["old_logp"] = old_logp
        result = policy_loss(s.loss_type, logp, old_logp, batch["advantages"], mask, s.epsilon_low,
                             s.epsilon_high, s.beta, batch.get("ref_logp"), s.max_completion_length,
                             s.importance_sampling_level)
        local = self.count_items(batch).to(result.loss.dtype)
        reward, reward_std, length, *shape, zero_std = batch["rollout_stats"].tolist()
        stats = torch.tensor([reward, reward_std, 0.0, 0.0, length, *shape, zero_std, 0.0, 0.0, 0.0],
                             device=mask.device)
        stats = torch.cat([stats, self.logged_tool_stats(batch, stats),
                           batch.get("reward_function_stats", stats.new_zeros(2 * len(self.rewards)))]) * local
        # The shares of the step's completion tokens clipped (per-sequence ratios: of its completions), and the mean
        # KL and entropy over the step's completion tokens, whatever the loss's unit (a completion for grpo and
        # dr_grpo, a token for dapo and cispo, the micro-batch for bnpo): this micro-batch's counts and sums over the
        # step's, in the units the summed statistics are divided by (num_items), not its own means weighed by its
        # units. The rollout's statistics, the step's already, stay as they are.
        sequence = s.importance_sampling_level == ImportanceSamplingLevel.SEQUENCE
        step_tokens = max(batch[STEP_COMPLETION_TOKENS], 1)
        clip_base = batch[STEP_COMPLETIONS] if sequence else step_tokens
        for name, count in (("clip_fraction", result.clipped), ("clip_fraction_low", result.clipped_low),
                            ("clip_fraction_high", result.clipped_high)):
            stats[STAT_NAMES.index(name)] = count * num_items / clip_base
        stats[STAT_NAMES.index("kl")] = result.kl * mask.sum() * num_items / step_tokens  # kl: its tokens' mean
        stats[STAT_NAMES.index("entropy")] = (entropy * mask).sum() * num_items / step_tokens
        return result.loss * local / num_items, stats
