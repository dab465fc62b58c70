"""The checks of a trainer's flag values that their flag types cannot make alone: ranges, flags that only mean
something together, and each trainer's own (DPO, distillation's GKD, GRPO, PPO). Each refusal is one ValueError
line naming the flag, its value and what is allowed; the command line shows it as the parser's error.

The one rule for a flag the run will not use (DEPENDENT_FLAGS, apply_unused_flag_rule): a flag that only matters
when another flag switches its feature on, given at a value other than its trainer's default while that feature is
off, is refused when typed on the command line, and set back to its default with a note when a --config YAML (or a
sweep, which varies some flags and fixes the others) gave it."""

from __future__ import annotations

import copy
import math
import re
from typing import Any, Callable, NamedTuple

from dataset.copy_rows import SHORTEST_ROW
from dataset.shown_value import flag_refusal, shown_value
from model.config import MAX_SIZE, PRESETS, SWITCHED_FIELDS, SwitchedFields, field_default, preset_fields
from trainer.arg_fields import (COMPILE_MODES, COPY_FLAGS, DEFAULT_REWARD, DISTILL_DATA, DTYPES, MODEL_FIELDS,
                                POLICY_LORA_FLAGS, ROLLOUT_GROUPS, SAMPLED_TEMPERATURES, SFT_DATA, TrainArgs,
                                build_model_config, holds_out_validation, refuse_fixed_model_fields, rollout_tools,
                                task_default, task_flags)
from trainer.distillation_losses import DistillLoss
from trainer.dpo import (F_DIVERGENCE_READERS, LABEL_SMOOTHED, DPOLossType, FDivergence, check_label_smoothing,
                         check_option_values, check_options, parse_loss_types)
from trainer.inference_flags import OPENAI_TEMPERATURE_RANGE
from trainer.sampling_ranges import SMALLEST_DIVISOR
from trainer.optim import MuonAdjustLR, OptimizerName
from trainer.rewards import TOOL_REWARDS
from trainer.rl_losses import ImportanceSamplingLevel, KLEstimator, LossType, ScaleRewards, default_scale_rewards
from trainer.run_dir import TASKS
from trainer.schedule import LRSchedule
from trainer.threads import MAX_THREADS, parse_threads

A_YEAR_S = 365 * 24 * 3600  # the longest time a duration flag takes
WANDB_PROJECT_FORBIDDEN = frozenset("/\\#?%:")  # characters wandb refuses in a project name


def validate(args: TrainArgs) -> None:
    """Refuse `args` (a ValueError) where a value is out of its range or a flag goes without the one it needs; fill
    in what depends on other flags (GRPO's --scale_rewards, the rollouts' default --reward)."""
    _check_choices(args)
    _check_counts_and_durations(args)
    _check_optimizer_numbers(args)
    _check_copy_task(args)
    _check_sft_data(args)
    _check_bounded_values(args)
    _check_lora(args)
    _check_sizes_fit(args)
    refuse_fixed_model_fields(args)  # before the preset's config: a fine-tuning run never builds it
    if not model_checked_at_start(args):  # a resume's model is its checkpoint's, known once the run starts
        # the model fields' own checks: a value the config refuses is refused wherever from
        build_model_config(args, special_ids=False)
    refuse_typed_unused_flags(args)  # before the trainers' own checks, whose refusals meet only what the run uses
    task_checks = {"dpo": _validate_dpo, "distill": _validate_distill, "grpo": _validate_grpo, "ppo": _validate_ppo}
    if args.task in task_checks:
        task_checks[args.task](args)
    apply_unused_flag_rule(args)  # last: the values it sets back were checked as they came


def model_checked_at_start(args: TrainArgs) -> bool:
    """Whether the model flags' own checks wait for the run's start (check_model_flags_at_start): a pretraining
    --resume goes on with its checkpoint's model, whose shape the flags read alone do not know (a --num_attention_heads
    3 was refused as "it must divide hidden_size=320", --preset's width, for a checkpoint 96 wide); whether there is a
    checkpoint at all (`--resume auto` in an empty --out_dir starts afresh) every process agrees on only then."""
    return args.task == "pretrain" and bool(args.resume)


def check_model_flags_at_start(args: TrainArgs, resumed: bool) -> str | None:
    """The model flags' checks a pretraining --resume left for its start (model_checked_at_start), once every
    process agrees whether it goes on from a checkpoint (trainer/core.py): `resumed`, the config of the checkpoint's
    fields and the flags (trainer/resume_checks.py, adopt_saved_architecture took them in, refusing an architecture
    flag of another value); else a fresh start, checked exactly as the same command without --resume: the config of
    --preset and the flags, then the unused-flag rule (a typed unused model flag refused, a --config YAML's set back:
    recorded in `args`). Returns the note line on the flags it set back (None: none)."""
    if not model_checked_at_start(args):
        return None
    if resumed:
        build_model_config(args)
        return None
    fresh = copy.copy(args)
    fresh.resume = None  # the model switches the command leaves unset are --preset's, not a checkpoint's
    build_model_config(fresh, special_ids=False)
    apply_unused_flag_rule(fresh)  # the other flags' were applied at parsing: only model fields are found now
    args.model, args.given, args.ignored = fresh.model, fresh.given, args.ignored + fresh.ignored
    return unused_flags_note(fresh)


class DependentFlag(NamedTuple):
    """Flags that only matter when another flag switches their feature on: `used_by` says what does (after "only",
    before "uses it"), `remedy` how a command line turns it on, `active` whether this run's flags do."""

    names: tuple[str, ...]
    used_by: str
    remedy: str
    active: Callable[[TrainArgs], bool]


def _dpo_types(args: TrainArgs) -> list[str]:
    return parse_loss_types(args.loss_type)  # its ValueError (an unknown type) is the one-line refusal


def _model_switch_on(args: TrainArgs, entry: SwitchedFields) -> bool:
    """Whether `entry`'s switch is on in the model `args` ask for: the preset under the model flags. A resume whose
    command leaves a switch unset takes it from its checkpoint (trainer/resume_checks.py, adopt_saved_architecture),
    so the field counts as used: the checkpoint's architecture check compares it (one that finds no checkpoint is
    judged again without --resume: check_model_flags_at_start)."""
    if args.resume and any(name not in args.model for name in entry.switches):
        return True
    return entry.active(preset_fields(args.preset, args.model))


def _model_dependency(entry: SwitchedFields) -> DependentFlag:
    """A SWITCHED_FIELDS entry as the rule's DependentFlag: its fields' flags, its switch named as flags."""
    used_by = re.sub(rf"\b({'|'.join(entry.switches)})\b", r"--\1", entry.used_by)
    return DependentFlag(entry.fields, used_by, f"give {used_by} with it", lambda args: _model_switch_on(args, entry))


# Every dependent flag, with what switches it on; a flag another trainer owns is skipped (task_flags). An entry
# whose check reads a flag an earlier entry may set back (--f_divergence_type) comes after it.
DEPENDENT_FLAGS: tuple[DependentFlag, ...] = (
    DependentFlag(("muon_lr", "muon_weight_decay", "muon_momentum", "muon_adjust_lr"), "--optimizer muon",
                  "give --optimizer muon with it", lambda args: args.optimizer == OptimizerName.MUON),
    DependentFlag(("wandb_project", "wandb_run_name", "wandb_group"), "--use_wandb", "give --use_wandb with it",
                  lambda args: args.use_wandb),
    DependentFlag(("decay_fraction",), "--lr_schedule wsd", "give --lr_schedule wsd with it",
                  lambda args: args.lr_schedule == LRSchedule.WSD),
    # trainer/run_length.py: a time budget plans the length itself, bounded by --epochs' steps
    DependentFlag(("max_steps",), "a run without --time_budget_s", "leave --time_budget_s out",
                  lambda args: not args.time_budget_s),
    DependentFlag(("epochs",), "--max_steps -1 or --time_budget_s", "give --max_steps -1 with it",
                  lambda args: args.max_steps == -1 or args.time_budget_s > 0),
    # unset --copy_rows (SFT's default) is resolved by the model's switches after parsing: maybe on
    DependentFlag(tuple(name for name in COPY_FLAGS if name != "copy_rows"), "--copy_rows N > 0",
                  "give --copy_rows N with it", lambda args: args.copy_rows != 0),
    DependentFlag(tuple(name for name in POLICY_LORA_FLAGS if name != "lora"), "--lora", "give --lora with it",
                  lambda args: args.task not in ROLLOUT_GROUPS or args.lora),
    DependentFlag(("sft_data",), "a run without --data_path (the file is the data)", "leave --data_path out",
                  lambda args: args.data_path is None),
    DependentFlag(("val_fraction",), "a --data_path without --val_data_path (its held-out split)",
                  "give --data_path without --val_data_path", holds_out_validation),
    DependentFlag(("jsd_beta",), "--distill_loss jsd", "give --distill_loss jsd with it",
                  lambda args: args.distill_loss == DistillLoss.JSD),
    DependentFlag(("max_new_tokens", "sampling_temperature"), "--lmbda > 0 or --seq_kd (sampled completions)",
                  "give --lmbda or --seq_kd with it", lambda args: args.lmbda > 0 or args.seq_kd),
    DependentFlag(("discopop_tau",), "--loss_type discopop", "give --loss_type discopop with it",
                  lambda args: DPOLossType.DISCOPOP in _dpo_types(args)),
    DependentFlag(("label_smoothing",), f"--loss_type {', '.join(LABEL_SMOOTHED)}",
                  "give one of those loss types with it",
                  lambda args: any(kind in LABEL_SMOOTHED for kind in _dpo_types(args))),
    DependentFlag(("rpo_alpha",), "a --loss_type other than sft alone", "list a preference loss type with it (sft "
                  "alone is the NLL it adds: weigh that with --loss_weights)",
                  lambda args: any(kind != DPOLossType.SFT for kind in _dpo_types(args))),
    DependentFlag(("ld_alpha",), "a --loss_type other than sft alone", "list a preference loss type with it",
                  lambda args: any(kind != DPOLossType.SFT for kind in _dpo_types(args))),
    DependentFlag(("f_divergence_type",), f"--loss_type {', '.join(F_DIVERGENCE_READERS)}",
                  "give one of those loss types with it",
                  lambda args: any(kind in F_DIVERGENCE_READERS for kind in _dpo_types(args))),
    DependentFlag(("f_alpha_divergence_coef",), "--f_divergence_type alpha_divergence",
                  "give --f_divergence_type alpha_divergence with it",
                  lambda args: args.f_divergence_type == FDivergence.ALPHA_DIVERGENCE),
    DependentFlag(("kl_estimator",), "--beta > 0 (the KL the rewards pay)", "give --beta > 0 with it",
                  lambda args: args.beta > 0),
    # Here only a rollout's later updates are off-policy (no TRL steps_per_generation): at one update the sequence
    # ratio is 1 and its gradient the per-token one's, plain GRPO
    DependentFlag(("importance_sampling_level",), "--num_iterations 2 or more (a rollout's later updates)",
                  "give --num_iterations 2 or more with it", lambda args: args.num_iterations > 1),
    DependentFlag(("max_tool_rounds",), "--tools (rollouts that call tools)", "give --tools with it",
                  lambda args: bool(args.tools)),
    # the model's own (model/config.py, SWITCHED_FIELDS): a fresh model's fields, pretraining's flags
    *(_model_dependency(entry) for entry in SWITCHED_FIELDS),
)


class UnusedFlag(NamedTuple):
    name: str
    value: Any
    dependency: DependentFlag


def unused_flags(args: TrainArgs) -> list[UnusedFlag]:
    """The DEPENDENT_FLAGS flags of `args` at a value other than their trainer's default while their feature is off,
    in the table's order; each found counts as set back to its default for the entries after it."""
    found, trial = [], copy.copy(args)
    for dependency in DEPENDENT_FLAGS:
        names = [name for name in dependency.names if _off_default(trial, name)]
        if not names or dependency.active(trial):
            continue
        for name in names:
            found.append(UnusedFlag(name, flag_value(trial, name), dependency))
            _set_default(trial, name)
    return found


def flag_default(args: TrainArgs, name: str) -> Any:
    """Flag `name`'s default in the run `args` ask for: its trainer's (task_default), or for a model field the
    value its preset's config takes without it (model/config.py, field_default)."""
    if name in MODEL_FIELDS:
        return field_default(args.preset, args.model, name)
    return task_default(args.task, name)


def flag_value(args: TrainArgs, name: str) -> Any:
    """Flag `name`'s value in `args`: a model field's from the model flags (None: not given, its preset's)."""
    return args.model.get(name) if name in MODEL_FIELDS else getattr(args, name)


def _off_default(args: TrainArgs, name: str) -> bool:
    """Whether flag `name` is one of the run's trainer's and away from its default: a model field only where the run
    builds a fresh model (pretraining; fine-tuning takes its switches from --from_weight) and the flags give it."""
    if name in MODEL_FIELDS:
        return args.task == "pretrain" and name in args.model and args.model[name] != flag_default(args, name)
    return name in task_flags(args.task) and getattr(args, name) != task_default(args.task, name)


def _set_default(args: TrainArgs, name: str) -> None:
    """Flag `name` back at its default: a model field left to its preset (a new dict: a copy of `args` shares the
    old one)."""
    if name in MODEL_FIELDS:
        args.model = {field: value for field, value in args.model.items() if field != name}
    else:
        setattr(args, name, task_default(args.task, name))


def refuse_typed_unused_flags(args: TrainArgs) -> None:
    """The rule's refusal: an unused flag typed on the command line (not in `args.untyped`, a --config YAML's or a
    sweep trial's) is a ValueError naming it, its value and what turns its feature on."""
    for unused in unused_flags(args):
        if unused.name not in args.untyped:
            dependency = unused.dependency
            raise _bad(unused.name, unused.value, f"only {dependency.used_by} uses it: {dependency.remedy}, or leave "
                                                  f"--{unused.name} out")


def apply_unused_flag_rule(args: TrainArgs) -> None:
    """The one rule for a flag the run will not use: a DEPENDENT_FLAGS flag at a value other than its trainer's
    default while its feature is off is refused where the command line typed it (refuse_typed_unused_flags), and set
    back to its default where nobody typed it (`args.untyped`: a --config YAML's, a sweep trial's), recorded in
    `args.ignored` (name, value as quoted, what turns it on) for the run's note (trainer/args.py, parse_args) and a
    sweep's check of its parameters (scripts/sweep_runner/config.py)."""
    refuse_typed_unused_flags(args)
    found = unused_flags(args)
    for unused in found:
        _set_default(args, unused.name)
    args.ignored = tuple((unused.name, shown_value(unused.value), unused.dependency.used_by) for unused in found)
    args.given = args.given - {unused.name for unused in found}


def unused_flags_note(args: TrainArgs) -> str | None:
    """The one note line on the flags apply_unused_flag_rule set back to their defaults; None when it set none."""
    if not args.ignored:
        return None
    flags = (f"--{name}={value} (only {used_by} uses it)" for name, value, used_by in args.ignored)
    return f"note: unused flags left at their defaults: {'; '.join(flags)}"


def _bad(name: str, value: Any, allowed: str) -> ValueError:
    """The one-line refusal of a flag's value."""
    return ValueError(flag_refusal(name, value, allowed))


def _check_choices(args: TrainArgs) -> None:
    """The flags that name one of a fixed set: task, dtype, compile mode, threads, optimizer, schedule, preset, and
    distillation's loss, PPO's KL estimator and GRPO's importance-sampling level."""
    if args.task not in TASKS:
        raise _bad("task", args.task, f"choose one of {', '.join(TASKS)}")
    if args.dtype not in DTYPES:
        raise _bad("dtype", args.dtype, f"choose one of {', '.join(DTYPES)}")
    if args.compile not in COMPILE_MODES:
        raise _bad("compile", args.compile, f"choose one of {', '.join(COMPILE_MODES)}")
    parse_threads(args.threads)
    for name, enum in (("optimizer", OptimizerName), ("muon_adjust_lr", MuonAdjustLR), ("lr_schedule", LRSchedule)):
        if getattr(args, name) not in tuple(enum):
            raise _bad(name, getattr(args, name), f"choose one of {', '.join(enum)}")
    if args.preset not in PRESETS:
        raise _bad("preset", args.preset, f"choose one of {', '.join(PRESETS)}")
    # one trainer's (task_flags), and read by the unused-flag rule's table before that trainer's own checks
    for name, enum in (("distill_loss", DistillLoss), ("kl_estimator", KLEstimator),
                       ("importance_sampling_level", ImportanceSamplingLevel)):
        if name in task_flags(args.task) and getattr(args, name) not in tuple(enum):
            raise _bad(name, getattr(args, name), f"choose one of {', '.join(enum)}")


def _check_counts_and_durations(args: TrainArgs) -> None:
    """Sizes, intervals and step counts (>= 1), the distributed timeouts (at most a year) and --num_proc."""
    for name in ("epochs", "batch_size", "accumulation_steps", "max_seq_len", "log_interval", "eval_interval",
                 "save_interval", "keep_checkpoints"):
        if getattr(args, name) < 1:
            raise _bad(name, getattr(args, name), "it must be >= 1")
    if args.task not in ROLLOUT_GROUPS:  # GRPO's and PPO's is a prompt's longest length, which their data bounds
        from dataset.building import MIN_SEQ_LEN  # the datasets' bound (their module is loaded for the run anyway)
        if args.max_seq_len < MIN_SEQ_LEN:  # was taken, and the dataset refused it once the run had started
            raise _bad("max_seq_len", args.max_seq_len, f"it must be >= {MIN_SEQ_LEN} (a sample's first token and "
                                                        f"the next one it learns to predict)")
    for name in ("dist_init_timeout", "dist_timeout"):  # a timedelta holds no more (an OverflowError at start)
        if not 1 <= getattr(args, name) <= A_YEAR_S:
            raise _bad(name, getattr(args, name), f"it must be a number of seconds in 1 .. {A_YEAR_S} (a year)")
    if args.max_steps != -1 and args.max_steps < 1:
        raise _bad("max_steps", args.max_steps, "it must be >= 1, or -1 (as many as --epochs give)")
    if args.num_proc is not None and args.num_proc < 1:
        raise _bad("num_proc", args.num_proc, "it must be >= 1")


def _check_optimizer_numbers(args: TrainArgs) -> None:
    """Clipping, warmup, learning rates and weight decays, with the measuring counts checked beside them
    (--peak_flops, --eval_batches, --diag_interval)."""
    if args.peak_flops is not None and not (args.peak_flops > 0 and math.isfinite(args.peak_flops)):
        raise _bad("peak_flops", args.peak_flops, "it must be a positive number")
    if not (args.grad_clip >= 0 and math.isfinite(args.grad_clip)):
        raise _bad("grad_clip", args.grad_clip, "it must be a number >= 0 (0: no clipping)")
    for name in ("warmup_steps", "eval_batches", "diag_interval"):
        if getattr(args, name) < 0:
            raise _bad(name, getattr(args, name), "it must be >= 0")
    for name in ("learning_rate", "muon_lr"):
        if not (getattr(args, name) > 0 and math.isfinite(getattr(args, name))):
            raise _bad(name, getattr(args, name), "it must be a positive number")
    for name in ("weight_decay", "muon_weight_decay"):
        if not (getattr(args, name) >= 0 and math.isfinite(getattr(args, name))):
            raise _bad(name, getattr(args, name), "it must be a number >= 0")
    # Decoupled decay scales each weight by 1 - lr x decay per step (the peak lr bounds the scheduled one): at
    # lr x decay >= 1 it zeroes or flips every decayed weight, and larger values blew them up into a non-finite model
    pairs = [("learning_rate", "weight_decay")] + [("muon_lr", "muon_weight_decay")] * (args.optimizer == "muon")
    for lr, decay in pairs:
        if getattr(args, lr) * getattr(args, decay) >= 1:
            # the flag typed is the one named (the other may be its default)
            named, other = (lr, decay) if lr in args.given and decay not in args.given else (decay, lr)
            raise _bad(named, getattr(args, named), f"with --{other}={getattr(args, other)!r} it must be below "
                                                    f"1 / {getattr(args, other)!r} (each step scales a weight by "
                                                    f"1 - {lr} x {decay})")


def _check_copy_task(args: TrainArgs) -> None:
    """The copy rows mixed into pretraining: their count, steps, cue pairs and loss weights."""
    if args.copy_rows is not None and not 0 <= args.copy_rows <= MAX_SIZE:  # more: torch.randint's TypeError
        raise _bad("copy_rows", args.copy_rows, f"it must be in 0 .. {MAX_SIZE} (0: no copy rows)")
    if args.copy_rows and args.max_seq_len < SHORTEST_ROW:  # a copy row is at most one training row long
        raise _bad("max_seq_len", args.max_seq_len, f"copy rows (--copy_rows {args.copy_rows}) need rows of at least "
                                                    f"{SHORTEST_ROW} tokens")
    if args.copy_steps < 0:
        raise _bad("copy_steps", args.copy_steps, "it must be >= 0")
    if args.copy_cue_pairs < 0:
        raise _bad("copy_cue_pairs", args.copy_cue_pairs, "it must be >= 0 (0: no cue pairs)")
    for name in ("copy_weight", "copy_weight_after"):
        if not (getattr(args, name) >= 0 and math.isfinite(getattr(args, name))):
            raise _bad(name, getattr(args, name), "it must be a number >= 0")


def _check_sft_data(args: TrainArgs) -> None:
    """--sft_data names an embedded set (used only without --data_path: DEPENDENT_FLAGS)."""
    if args.sft_data is not None and args.sft_data not in SFT_DATA:
        raise _bad("sft_data", args.sft_data, f"choose one of {', '.join(SFT_DATA)}")


def _check_bounded_values(args: TrainArgs) -> None:
    """The values with both ends bounded: Muon's momentum, the decay and minimum-LR fractions, the validation
    fraction, the time budget (at most a year) and wandb's project name (1 to 128 characters)."""
    if not 0 <= args.muon_momentum < 1:
        raise _bad("muon_momentum", args.muon_momentum, "it must be in [0, 1)")
    if not 0 < args.decay_fraction <= 1:
        raise _bad("decay_fraction", args.decay_fraction, "it must be in (0, 1]")
    if not 0 <= args.time_budget_s <= A_YEAR_S:  # a larger one overflowed the step count it asks for
        raise _bad("time_budget_s", args.time_budget_s, f"it must be a number of seconds in 0 .. {A_YEAR_S} (a year; "
                                                        f"0: no time budget)")
    if not args.wandb_project or WANDB_PROJECT_FORBIDDEN & set(args.wandb_project) or len(args.wandb_project) > 128:
        raise _bad("wandb_project", args.wandb_project, f"it must be 1 to 128 characters, none of "
                                                        f"{' '.join(sorted(WANDB_PROJECT_FORBIDDEN))}")
    if not 0 <= args.min_lr_ratio <= 1:
        raise _bad("min_lr_ratio", args.min_lr_ratio, "it must be in [0, 1]")
    if not 0 < args.val_fraction < 1:
        raise _bad("val_fraction", args.val_fraction, "it must be in (0, 1)")


def _check_lora(args: TrainArgs) -> None:
    """The adapter flags' ranges, wherever the trainer has them (without --lora in GRPO or PPO they are unused:
    DEPENDENT_FLAGS; a bad value is refused all the same)."""
    if "lora_rank" in task_flags(args.task):
        from model.lora import parse_targets
        if args.lora_rank < 1:
            raise _bad("lora_rank", args.lora_rank, "it must be >= 1")
        if not (args.lora_alpha > 0 and math.isfinite(args.lora_alpha)):
            raise _bad("lora_alpha", args.lora_alpha, "it must be a positive number")
        if not 0 <= args.lora_dropout < 1:
            raise _bad("lora_dropout", args.lora_dropout, "it must be in [0, 1)")
        parse_targets(args.lora_targets)


# The counts that size a run's work, each refused past model/config.py's MAX_SIZE: 10**30 was taken, and a run of
# --max_steps 10**30 or a rollout of --num_generations 10**30 never finished (the group was being listed). The
# lengths have their own bounds, the model's (--max_seq_len, --max_completion_length: its positions; --lora_rank:
# its layers' sides), and a generation stops where the context is full (--max_new_tokens). Task -> its own flags.
SIZE_FLAGS = ("epochs", "batch_size", "accumulation_steps", "max_steps")
TASK_SIZE_FLAGS: dict[str, tuple[str, ...]] = {
    "grpo": ("num_generations", "num_iterations"),
    "ppo": ("num_generations", "ppo_epochs"),
    "distill": ("max_new_tokens",),
}


def forward_past_max_size(rows: str, long: str, tokens: int) -> str:
    """Why one micro-batch of `rows` (the flags that make them) of up to `long` tokens each, `tokens` in all, is
    refused: more than MAX_SIZE, one dimension of its flattened logits. The trainer's words (_check_sizes_fit), and a
    benchmark's that builds trainers from its own flags (eval/benchmarks/bench_train.py)."""
    return (f"one micro-batch would hold {rows} of up to {long} tokens, {tokens} in all, more than the {MAX_SIZE} "
            f"(MAX_SIZE, model/config.py) one forward holds")


def _check_sizes_fit(args: TrainArgs) -> None:
    """Each count of SIZE_FLAGS at most MAX_SIZE (--num_proc at most MAX_THREADS), and the tokens of one
    micro-batch's forward (its rows x their longest length: a rollout's prompts x --num_generations completions of
    up to --max_seq_len + --max_completion_length tokens) at most MAX_SIZE too, one dimension of its flattened
    logits."""
    for name in SIZE_FLAGS + TASK_SIZE_FLAGS.get(args.task, ()):
        if getattr(args, name) > MAX_SIZE:
            raise _bad(name, getattr(args, name), f"it must be at most {MAX_SIZE} (MAX_SIZE, model/config.py: "
                                                  f"past it no run ends, no batch or group fits)")
    if args.num_proc is not None and args.num_proc > MAX_THREADS:  # datasets starts one per record up to it
        raise _bad("num_proc", args.num_proc, f"it must be at most {MAX_THREADS} (more than any machine's cores; "
                                              f"datasets starts that many processes, up to one per record)")
    if args.task in ROLLOUT_GROUPS:
        factors = ("batch_size", "num_generations")
        length = args.max_seq_len + args.max_completion_length
        rows = f"--batch_size {args.batch_size} prompts x --num_generations {args.num_generations} completions"
        long = f"--max_seq_len + --max_completion_length = {length}"
        blame = ("num_generations", "batch_size", "max_completion_length", "max_seq_len")
    else:
        factors, length = ("batch_size",), args.max_seq_len
        rows, long = f"--batch_size {args.batch_size} rows", f"--max_seq_len {length}"
        blame = ("batch_size", "max_seq_len")
    tokens = math.prod(getattr(args, name) for name in factors) * length
    if length <= MAX_SIZE < tokens:  # a longer length is refused by the model's positions, which it cannot exceed
        named = next((name for name in blame if name in args.given), blame[0])  # the flag typed, not a default
        raise _bad(named, getattr(args, named), forward_past_max_size(rows, long, tokens))


def _validate_distill(args: TrainArgs) -> None:
    """Distillation: the loss's mix and temperature, the data, then GKD's flags."""
    if not 0 <= args.alpha <= 1:
        raise _bad("alpha", args.alpha, "it must be in [0, 1]")
    if not (args.temperature > 0 and math.isfinite(args.temperature)):
        raise _bad("temperature", args.temperature, "it must be a positive number")
    if args.distill_data not in DISTILL_DATA:
        raise _bad("distill_data", args.distill_data, f"choose one of {', '.join(DISTILL_DATA)}")
    _validate_gkd(args)


def _validate_gkd(args: TrainArgs) -> None:
    """Distillation's GKD flags: the soft divergence and the sampled completions."""
    if not 0 <= args.jsd_beta <= 1:
        raise _bad("jsd_beta", args.jsd_beta, "it must be in [0, 1]")
    if not 0 <= args.lmbda <= 1:
        raise _bad("lmbda", args.lmbda, "it must be in [0, 1]")
    if args.max_new_tokens < 1:
        raise _bad("max_new_tokens", args.max_new_tokens, "it must be >= 1")
    _check_sampling_temperature("sampling_temperature", args.sampling_temperature)
    if args.seq_kd and args.lmbda == 1:  # step_source: the student's draw always wins, the teacher never samples
        raise _bad("seq_kd", args.seq_kd, "with --lmbda 1 every step trains on the student's completions, never on "
                                         "the teacher's: leave one of them out")
    if (args.lmbda > 0 or args.seq_kd) and args.distill_data != "sft":
        flag = "lmbda" if args.lmbda > 0 else "seq_kd"
        raise _bad(flag, getattr(args, flag), "a sampled completion answers a conversation's prompt, which "
                                             "pretraining text has none of: use --distill_data sft")


def _validate_dpo(args: TrainArgs) -> None:
    if not (args.beta > 0 and math.isfinite(args.beta)):
        raise _bad("beta", args.beta, "it must be a positive number")
    loss_types = parse_loss_types(args.loss_type)  # its ValueError is the one-line refusal
    if args.loss_weights is not None:
        if len(args.loss_weights) != len(loss_types):
            raise _bad("loss_weights", args.loss_weights, f"give one weight per --loss_type ({len(loss_types)})")
        # a negative weight maximises its loss (the preference turned round, no bound below); all 0: no gradient
        if not all(math.isfinite(weight) and weight >= 0 for weight in args.loss_weights):
            raise _bad("loss_weights", args.loss_weights, "every weight must be a finite number >= 0")
        if not any(weight > 0 for weight in args.loss_weights):
            raise _bad("loss_weights", args.loss_weights, "at least one weight must be > 0 (all 0: the loss is 0 and "
                                                          "nothing trains)")
    if not 0 <= args.label_smoothing < 0.5:
        raise _bad("label_smoothing", args.label_smoothing, "it must be in [0, 0.5)")
    if not (args.discopop_tau > 0 and math.isfinite(args.discopop_tau)):
        raise _bad("discopop_tau", args.discopop_tau, "it must be a positive number")
    check_option_values(args.rpo_alpha, args.ld_alpha, args.f_divergence_type, args.f_alpha_divergence_coef)
    # the loss types' own refusals meet what the run will use: an unused flag a YAML gave is set back afterwards
    unused = {flag.name for flag in unused_flags(args)}

    def used(name: str) -> Any:
        return task_default(args.task, name) if name in unused else getattr(args, name)

    check_label_smoothing(loss_types, used("label_smoothing"))
    check_options(loss_types, used("rpo_alpha"), used("ld_alpha"), args.use_weighting, used("f_divergence_type"),
                  used("f_alpha_divergence_coef"))


def _validate_grpo(args: TrainArgs) -> None:
    if args.loss_type not in tuple(LossType):
        raise _bad("loss_type", args.loss_type, f"choose one of {', '.join(LossType)}")
    if args.scale_rewards is None:  # resolved here, so the run records (and a resume compares) what it uses
        args.scale_rewards = default_scale_rewards(args.loss_type)
    if args.scale_rewards not in tuple(ScaleRewards):
        raise _bad("scale_rewards", args.scale_rewards, f"choose one of {', '.join(ScaleRewards)}")
    if args.num_generations < 2:
        raise _bad("num_generations", args.num_generations, "it must be >= 2 (advantages compare a prompt's "
                                                           "completions with each other)")
    if args.num_iterations < 1:
        raise _bad("num_iterations", args.num_iterations, "it must be >= 1")
    if args.epsilon_high is not None and not (args.epsilon_high > 0 and math.isfinite(args.epsilon_high)):
        raise _bad("epsilon_high", args.epsilon_high, "it must be a positive number")
    _validate_rollouts(args)


MAX_TOOL_ROUNDS = 16  # --max_tool_rounds' bound: each round is a batch of generations


def _validate_tools(args: TrainArgs) -> None:
    """The rollouts' --tools (built-in names, each once) and --max_tool_rounds, GRPO's and PPO's."""
    from dataset.tools import TOOLS
    if args.tools is not None:
        names = rollout_tools(args)
        unknown = next((name for name in names if name not in TOOLS), None)
        if not names or unknown is not None or len(set(names)) != len(names):
            raise _bad("tools", args.tools, f"give built-in tools, comma-separated, each once: {', '.join(TOOLS)}")
    if not 1 <= args.max_tool_rounds <= MAX_TOOL_ROUNDS:
        raise _bad("max_tool_rounds", args.max_tool_rounds, f"it must be in 1..{MAX_TOOL_ROUNDS}")


def _validate_ppo(args: TrainArgs) -> None:
    if args.num_generations < 1:
        raise _bad("num_generations", args.num_generations, "it must be >= 1")
    if args.ppo_epochs < 1:
        raise _bad("ppo_epochs", args.ppo_epochs, "it must be >= 1")
    for name in ("gamma", "lam"):
        if not 0 <= getattr(args, name) <= 1:
            raise _bad(name, getattr(args, name), "it must be in [0, 1]")
    for name in ("vf_coef", "cliprange_value"):
        if not (getattr(args, name) > 0 and math.isfinite(getattr(args, name))):
            raise _bad(name, getattr(args, name), "it must be a positive number")
    if not (args.missing_eos_penalty >= 0 and math.isfinite(args.missing_eos_penalty)):
        raise _bad("missing_eos_penalty", args.missing_eos_penalty, "it must be a number >= 0 (0: no penalty)")
    _validate_rollouts(args)


def _check_sampling_temperature(name: str, value: float) -> None:
    """A trainer's sampling temperature (GRPO's and PPO's rollouts, distillation's sampled completions): in the range
    chat's --temperature and the server's requests take, OpenAI's (trainer/inference_flags.py), less its 0 (greedy),
    as the rollouts are sampled: past it every token is all but equally likely (1e308 divided the logits to zeros),
    below SMALLEST_DIVISOR the logits overflow."""
    if not SMALLEST_DIVISOR <= value <= OPENAI_TEMPERATURE_RANGE[1]:  # NaN fails too
        raise _bad(name, value, f"it must be in {SAMPLED_TEMPERATURES} (OpenAI's range, chat's and the server's, "
                                f"less its 0: the completions are sampled)")


def _validate_rollouts(args: TrainArgs) -> None:
    """What GRPO and PPO share: the sampling, the KL weight, the clip range, the tools and the rewards."""
    if args.max_completion_length < 1:
        raise _bad("max_completion_length", args.max_completion_length, "it must be >= 1")
    _check_sampling_temperature("temperature", args.temperature)
    if not 0 < args.top_p <= 1:
        raise _bad("top_p", args.top_p, "it must be in (0, 1]")
    if not (args.beta >= 0 and math.isfinite(args.beta)):
        raise _bad("beta", args.beta, "it must be a number >= 0 (0: no reference model)")
    if not (args.epsilon > 0 and math.isfinite(args.epsilon)):
        raise _bad("epsilon", args.epsilon, "it must be a positive number")
    _validate_tools(args)
    if not args.reward and not args.reward_model:
        args.reward = [DEFAULT_REWARD]
    tool_reward = next((spec for spec in args.reward or [] if spec in TOOL_REWARDS), None)
    if tool_reward is not None and not args.tools:
        raise _bad("reward", tool_reward, "it reads the rollouts' tool calls: give --tools with it")
    if args.reward_weights is not None:
        count = len(args.reward or []) + bool(args.reward_model)
        if len(args.reward_weights) != count:
            model = " and one for --reward_model" if args.reward_model else ""
            raise _bad("reward_weights", args.reward_weights, f"give one weight per --reward{model} ({count})")
        if not all(math.isfinite(weight) for weight in args.reward_weights):
            raise _bad("reward_weights", args.reward_weights, "every weight must be a finite number")
        if not any(args.reward_weights):  # a negative weight is a penalty; all 0 leave no reward to learn from
            raise _bad("reward_weights", args.reward_weights, "at least one weight must be non-zero (all 0: every "
                                                              "score is 0 and the policy learns from none)")

