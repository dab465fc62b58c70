"""What differs between the kinds of run, built once at set-up: the model the optimizer trains (the base model, under
PEFT adapters, or beside PPO's critic) and the objective it minimizes (trainer/objectives.py's language modeling,
DPO's preference loss, distillation, GRPO's and PPO's policy losses). trainer/core.py calls these two in its set-up
order; everything else about a run is the same for every task."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator

from model.model import MiniNormForCausalLM
from trainer.arg_fields import (TrainArgs, flags_in_effect, requested_model_fields, scored_against_starting_weights,
                                rollout_tools, uses_lora)
from trainer.objectives import CopySettings, LanguageModeling, LanguageModelingWithCopies, Objective
from trainer.run_dir import ROLLOUT_TASKS, load_input_model

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def wrap_for_task(base: MiniNormForCausalLM, args: TrainArgs, sharded: bool,
                  starting_weights: Path | None) -> torch.nn.Module:
    """The model the optimizer trains: the base model itself, (LoRA, or GRPO/PPO with --lora) the base model
    frozen under PEFT adapters, or (PPO) the policy beside a critic started from the same weights
    (trainer/ppo.py)."""
    policy = base
    if uses_lora(args):
        if sharded:
            raise ValueError("LoRA runs on one process or under DDP; FSDP/DeepSpeed sharding is not supported "
                             "for it (the adapters are small: DDP is the setup to use)")
        from model.lora import LoraSettings, add_lora, parse_targets
        policy = add_lora(base, LoraSettings(rank=args.lora_rank, alpha=args.lora_alpha,
                                             dropout=args.lora_dropout, targets=parse_targets(args.lora_targets)))
    if args.task != "ppo":
        return policy
    if sharded:
        raise ValueError("PPO runs on one process or under DDP; FSDP/DeepSpeed sharding is not supported "
                         "for it (its policy and critic are exported apart)")
    from trainer.ppo import PolicyAndCritic, load_critic
    return PolicyAndCritic(policy, load_critic(starting_weights, **requested_model_fields(args)))


def build_objective(args: TrainArgs, tokenizer: PreTrainedTokenizerBase, base_model: MiniNormForCausalLM,
                    unwrapped: torch.nn.Module, accelerator: Accelerator, sharded: bool,
                    starting_weights: Path | None) -> Objective:
    """What the run minimizes: language modeling, (DPO) the preference loss against a frozen copy of the
    starting weights, (distillation) CE and KL to a frozen --teacher, or (GRPO, PPO) the policy loss of its
    rollouts, with a frozen copy of the starting weights as the KL's reference; a frozen model is kept whole on
    every process (it has no gradients or optimizer state). `unwrapped`: the trained model as wrap_for_task made
    it, after Accelerate's preparation (a LoRA rollout run's reference is its policy without the adapters)."""
    world = accelerator.num_processes
    if args.task == "distill":
        from trainer.distillation import CompletionSettings, Distillation, load_teacher
        from trainer.grpo import rollout_decode
        teacher = load_teacher(args.teacher, tokenizer, base_model.config.vocab_size, **requested_model_fields(args))
        completions = CompletionSettings(args.lmbda, args.seq_kd, args.max_new_tokens, args.sampling_temperature,
                                         rollout_decode(args.compile))
        return Distillation(teacher.to(accelerator.device), args.alpha, args.temperature, accelerator.autocast,
                            args.distill_loss, args.jsd_beta, completions, tokenizer, args.seed,
                            accelerator.process_index, world, sharded)
    if args.task in ROLLOUT_TASKS:
        return _rollout_objective(args, tokenizer, unwrapped, accelerator, sharded, starting_weights)
    moe = base_model.config.is_moe
    if args.task in ("pretrain", "sft") and args.copy_rows:
        settings = CopySettings(args.copy_rows, args.copy_weight, args.copy_steps, args.copy_weight_after,
                                args.copy_cue_pairs)
        vocab = range(max(tokenizer.all_special_ids) + 1, base_model.config.vocab_size)
        return LanguageModelingWithCopies(settings, vocab, args.seed, accelerator.process_index, world,
                                          args.accumulation_steps, moe)
    if args.task != "dpo":
        return LanguageModeling(moe=moe)
    from trainer.dpo import DirectPreference
    reference = load_input_model(starting_weights, "--from_weight", **requested_model_fields(args))
    return DirectPreference(reference.to(accelerator.device), args.beta, accelerator.autocast, args.loss_type,
                            args.label_smoothing, flags_in_effect(args.to_dict())["loss_weights"], args.discopop_tau,
                            rpo_alpha=args.rpo_alpha, ld_alpha=args.ld_alpha, use_weighting=args.use_weighting,
                            f_divergence_type=args.f_divergence_type,
                            f_alpha_divergence_coef=args.f_alpha_divergence_coef)


def _rollout_objective(args: TrainArgs, tokenizer: PreTrainedTokenizerBase, unwrapped: torch.nn.Module,
                       accelerator: Accelerator, sharded: bool, starting_weights: Path | None) -> Objective:
    """GRPO's or PPO's objective: the --reward functions, and a frozen copy of the starting weights as the KL's
    reference (none with --beta 0)."""
    from trainer.grpo import check_reward_names, rollout_decode
    from trainer.rewards import load_reward, with_logged_parts
    specs = args.reward or []
    in_effect = flags_in_effect(args.to_dict())  # the unset weights and clip range, as a resume compares them
    weights = in_effect["reward_weights"]
    rewards = [load_reward(spec, weight) for spec, weight in zip(specs, weights)]
    if args.reward_model:
        from trainer.reward_model import load_reward_model, reward_model_directory
        rewards.append(load_reward_model(reward_model_directory(args.reward_model), weights[-1], accelerator.device))
    rewards = with_logged_parts(rewards)  # a built-in's parts (tool_use's), logged at weight 0
    check_reward_names(rewards)
    reference = None
    if args.beta > 0 and uses_lora(args):  # the starting weights are the policy without its adapters
        from trainer.grpo import WithoutAdapters
        reference = WithoutAdapters(getattr(unwrapped, "policy", unwrapped))
    elif scored_against_starting_weights(args):
        reference = load_input_model(starting_weights, "--from_weight", **requested_model_fields(args))
        reference = reference.to(accelerator.device)
    common = (reference, args.seed, accelerator.process_index, accelerator.autocast, accelerator.num_processes)
    if args.task == "ppo":
        from trainer.ppo import PPOSettings, ProximalPolicy
        settings = PPOSettings(args.num_generations, args.max_completion_length, args.temperature, args.top_p,
                               args.beta, args.epsilon, args.cliprange_value, args.vf_coef, args.gamma,
                               args.lam, args.ppo_epochs, args.kl_estimator, args.whiten_rewards,
                               args.missing_eos_penalty, rollout_tools(args), args.max_tool_rounds,
                               args.open_thinking, rollout_decode(args.compile))
        return ProximalPolicy(rewards, tokenizer, settings, *common)
    from trainer.grpo import GroupRelativePolicy, RolloutSettings
    settings = RolloutSettings(args.loss_type, args.num_generations, args.max_completion_length, args.temperature,
                               args.top_p, args.beta, args.epsilon, in_effect["epsilon_high"], args.num_iterations,
                               args.scale_rewards, args.importance_sampling_level, rollout_tools(args),
                               args.max_tool_rounds, args.open_thinking, rollout_decode(args.compile))
    return GroupRelativePolicy(rewards, tokenizer, settings, *common, sharded=sharded)
