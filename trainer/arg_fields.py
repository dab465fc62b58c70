"""The trainers' flags: TrainArgs, one dataclass field per flag with its default, --help section and help text
(`_flag`), and the tables that say which trainer has which flag, each task's defaults and which model config fields
are flags; plus what a run's TrainArgs answers (its task's defaults, LoRA or not, the model config it asks for).

Flag names follow MiniMind's where MiniMind has them. The MiniNormConfig fields in MODEL_FIELDS are flags too
(`--hidden_size`, `--norm_type`, ...); left unset, they come from `--preset` (or from `--from_weight`). The command
line that fills a TrainArgs is trainer/args.py's (parse_args), from trainer/arg_parser.py's parser, a --config YAML
(trainer/arg_yaml.py) and the checks of trainer/arg_checks.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

from model.config import (PLACEMENT_ALIASES, PRESETS, MiniNormConfig, NormImpl, NormPlacement, NormType,
                          QKNormScope, field_default, placement_choices)
from trainer.distillation_losses import DistillLoss
from trainer.dpo import (DEFAULT_DISCOPOP_TAU, DEFAULT_F_ALPHA_DIVERGENCE_COEF, F_DIVERGENCE_READERS, LABEL_SMOOTHED,
                         ROBUST_MAX_EPS, SORTED, DPOLossType, FDivergence, parse_loss_types)
from trainer.inference_flags import OPENAI_TEMPERATURE_RANGE
from trainer.sampling_ranges import SMALLEST_DIVISOR
from trainer.machine import COMPILE_AUTO_MIN_BUDGET_S, COMPILE_AUTO_MIN_STEPS
from trainer.optim import MuonAdjustLR, OptimizerName
from trainer.rewards import BUILTIN, reward_file_spec
from trainer.rl_losses import ImportanceSamplingLevel, KLEstimator, LossType, ScaleRewards
from trainer.run_dir import DEFAULT_OUT_DIRS, DEFAULT_TEACHER, ROLLOUT_TASKS, recorded_input_path, resolve_path
from trainer.schedule import LRSchedule
from trainer.threads import THREADS_AUTO, THREADS_HELP

DTYPES = ("auto", "bfloat16", "float16", "float32")
COMPILE_MODES = ("auto", "on", "off")
DISTILL_DATA = ("sft", "pretrain")  # the tasks whose data a distillation run reads
SFT_DATA = ("tools", "chat")  # the embedded SFT sets (dataset/corpus.py): with the tool-use dialogues, and without
DEFAULT_SFT_DATA = SFT_DATA[0]  # --sft_data unset (flags_in_effect)
DEFAULT_REWARD = "math_answer"      # GRPO's and PPO's reward without --reward (trainer/rewards.py)
ROLLOUT_GROUPS = {task: task for task in ROLLOUT_TASKS}  # the --help section of a flag GRPO and PPO share
LORA_GROUPS = {"lora": "lora", **ROLLOUT_GROUPS}  # the adapter flags: LoRA's section, or GRPO's/PPO's (--lora)

# A trainer's sampling temperature: OpenAI's range, which chat's --temperature and the server's requests take, less
# its 0 (greedy): the completions are sampled (trainer/arg_checks.py checks it)
SAMPLED_TEMPERATURES = f"{SMALLEST_DIVISOR:g} .. {OPENAI_TEMPERATURE_RANGE[1]:g}"


class ModelFlag(NamedTuple):
    """A MiniNormConfig field exposed as a flag: its type, its allowed values (switches only) and its --help text."""

    kind: type
    choices: tuple[str, ...] | None
    help: str


# Model config fields exposed as flags. Their defaults come from the preset (or the starting model), so --help
# shows none; the group title says so.
MODEL_FIELDS: dict[str, ModelFlag] = {
    "vocab_size": ModelFlag(int, None, "vocabulary size (pretraining: the tokenizer's, unless given)"),
    "hidden_size": ModelFlag(int, None, "width of the residual stream"),
    "num_hidden_layers": ModelFlag(int, None, "number of decoder blocks"),
    "num_attention_heads": ModelFlag(int, None, "query heads per attention layer (must divide hidden_size unless "
                                                "head_dim is set)"),
    "num_key_value_heads": ModelFlag(int, None, "key/value heads, shared by groups of query heads (must divide "
                                                "num_attention_heads)"),
    "head_dim": ModelFlag(int, None, "width of each attention head, a positive even integer (unset: hidden_size / "
                                     "num_attention_heads; set: the attention is heads x head_dim wide, as Qwen3's "
                                     "heads of 128)"),
    "intermediate_size": ModelFlag(int, None, "width of the SwiGLU MLP (unset: derived from hidden_size)"),
    "max_position_embeddings": ModelFlag(int, None, "longest sequence the model takes (RoPE positions), at least 2"),
    "rope_theta": ModelFlag(float, None, "RoPE base frequency (> 0, at most the largest fp32, 3.4e38: RoPE computes "
                                         "its frequencies in fp32)"),
    "tie_word_embeddings": ModelFlag(bool, None, "share one matrix between the token embedding and the LM head"),
    "dropout": ModelFlag(float, None, "dropout probability, in [0, 1)"),
    "initializer_range": ModelFlag(float, None, "standard deviation of the initial weights"),
    "norm_type": ModelFlag(str, tuple(NormType), "which norm; prmsnorm estimates the RMS from the first prms_p of "
                                                 "each row, dyt is Dynamic Tanh (docs/architecture.md)"),
    "norm_placement": ModelFlag(str, (*NormPlacement, *PLACEMENT_ALIASES),
                                f"where the norms sit in a block: {placement_choices()} (docs/architecture.md, "
                                f"Placements)"),
    "prms_p": ModelFlag(float, None, "prmsnorm: the fraction of each row its RMS is estimated from, in (0, 1]"),
    "norm_eps": ModelFlag(float, None, "epsilon added to the mean square inside the norms' square root, in (0, 1]"),
    "norm_impl": ModelFlag(str, tuple(NormImpl), "what computes the norms (docs/architecture.md, Implementations)"),
    "qk_norm": ModelFlag(bool, None, "also normalize the queries and keys"),
    "qk_norm_scope": ModelFlag(str, tuple(QKNormScope), "qk_norm: one norm per head (head) or one over all heads "
                                                        "together (full, OLMo-2)"),
    "norm_affine": ModelFlag(bool, None, "the norms' gain (and bias); false: parameter-free norms (DyT keeps alpha)"),
    "dyt_alpha_init": ModelFlag(float, None, "dyt: the initial value of alpha in w * tanh(alpha * x) + b (> 0)"),
    "mix_ln_ratio": ModelFlag(float, None, "mix: the fraction of blocks, from the first, that are post-LN, in [0, 1]"),
    "norm_depth_scaling": ModelFlag(bool, None, "multiply each block norm's output by 1/sqrt(l), l the block's "
                                                "1-based index (LayerNorm Scaling)"),
    "init_depth_scaling": ModelFlag(bool, None, "initialise the attention output and MLP down projections with std "
                                                "/ sqrt(2 x layers) (deepnorm: its beta gain instead)"),
    "smeared_keys": ModelFlag(bool, None, "mix each attention key with the previous position's by a learned weight "
                                          "per KV head (Olsson et al. 2022; docs/architecture.md, Smeared keys): "
                                          "copying from the context forms early; not exportable to LLaMA/Qwen3"),
    "num_experts": ModelFlag(int, None, "experts per block's sparse MLP (0: the dense SwiGLU MLP; "
                                        "docs/architecture.md, Mixture of experts)"),
    "num_experts_per_tok": ModelFlag(int, None, "MoE: experts each token is routed to (top-k), in [1, num_experts]"),
    "moe_intermediate_size": ModelFlag(int, None, "MoE: each expert's SwiGLU width (unset: intermediate_size)"),
    "norm_topk_prob": ModelFlag(bool, None, "MoE: renormalise the top-k routing probabilities to sum to 1"),
    "router_aux_loss_coef": ModelFlag(float, None, "MoE: weight of the load-balancing loss added to the loss (>= 0)"),
    "router_z_loss_coef": ModelFlag(float, None, "MoE: weight of the router z-loss added to the loss (>= 0)"),
}
# Per-task defaults where they differ from TrainArgs', sized so each default run but SFT's takes under 10 minutes
# on 2 CPU cores (see README); SFT's makes the chat model that uses its tools, about an hour.
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    # The recipe found by scripts/sweep_configs/recipe_cpu.yaml and checked at equal time (docs/recipe.md): Muon on
    # the 2-layer, 320-wide shape, small batches, a short warmup.
    "pretrain": {"max_steps": 400, "warmup_steps": 10, "optimizer": "muon", "learning_rate": 0.01, "muon_lr": 0.0375,
                 "batch_size": 8, "preset": "cpu-wide"},
    # The chat model that uses its tools (docs/tools.md): the tool dialogues (--sft_data tools) are longer than 256
    # tokens, copying from the context forms only with smeared keys and copy rows (after ~600 steps here, from the
    # plain pretrained model; the README's route starts from a pretraining that copies, and unset --copy_rows then
    # adds none), and choosing what to copy takes the rest of the 2,400 steps.
    "sft": {"max_steps": 2400, "learning_rate": 2e-3, "warmup_steps": 20, "max_seq_len": 384, "copy_rows": None,
            "copy_steps": 1200},
    "lora": {"max_steps": 120, "learning_rate": 2e-3, "warmup_steps": 10, "weight_decay": 0.0},
    "dpo": {"max_steps": 60, "batch_size": 8, "learning_rate": 5e-5, "warmup_steps": 10, "weight_decay": 0.0,
            "loss_type": DPOLossType.SIGMOID.value},
    "distill": {"max_steps": 150, "learning_rate": 5e-4, "warmup_steps": 20},
    # Not tuned yet: batch_size counts prompts (x --num_generations completions); MiniMind's beta.
    "grpo": {"max_steps": 50, "batch_size": 4, "learning_rate": 1e-5, "warmup_steps": 5, "weight_decay": 0.0,
             "temperature": 1.0, "beta": 0.02, "eval_batches": 25},
    # Not tuned yet: one completion per prompt (MiniMind's), TRL's KL weight.
    "ppo": {"max_steps": 50, "batch_size": 8, "learning_rate": 1e-5, "warmup_steps": 5, "weight_decay": 0.0,
            "temperature": 1.0, "beta": 0.05, "eval_batches": 25, "num_generations": 1},
}
# --lora on an RL trainer: the policy trained as LoRA adapters (with train_lora.py's adapter flags).
POLICY_LORA_FLAGS = ("lora", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "merge")
# The copy rows' flags (trainer/objectives.py): pretraining teaches copying with them, SFT may (a model given smeared
# keys at SFT learns to copy there).
COPY_FLAGS = ("copy_rows", "copy_weight", "copy_steps", "copy_weight_after", "copy_cue_pairs")
# Distillation's GKD flags (trainer/distillation.py): the soft divergence and the sampled completions.
GKD_FLAGS = ("distill_loss", "jsd_beta", "lmbda", "seq_kd", "max_new_tokens", "sampling_temperature")
# The flags that multiply a term of the loss (or the rewards it is made of): one set far from its default can make
# the loss non-finite, so a diverged run names those set away from their defaults (loss_multipliers_set). The
# distillation's --temperature T weighs its soft term by T^2; the rollouts' --temperature only samples.
LOSS_MULTIPLIER_FLAGS = ("beta", "loss_weights", "rpo_alpha", "alpha", "copy_weight", "copy_weight_after",
                         "reward_weights", "vf_coef", "router_aux_loss_coef", "router_z_loss_coef")
LOSS_MULTIPLIER_TASK_FLAGS: dict[str, tuple[str, ...]] = {"distill": ("temperature",)}
# A fresh model's shape is pretraining's to choose; a fine-tuning run starts from a model and takes its shape.
FINE_TUNING_FLAGS = ("from_weight",)
# Flags that only one kind of run has (its --help and --config YAML show them; the others' do not).
TASK_FLAGS: dict[str, tuple[str, ...]] = {
    "lora": ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "merge") + FINE_TUNING_FLAGS,
    "dpo": ("beta", "loss_type", "loss_weights", "label_smoothing", "discopop_tau", "rpo_alpha", "ld_alpha",
            "use_weighting", "f_divergence_type", "f_alpha_divergence_coef") + FINE_TUNING_FLAGS,
    "pretrain": ("control_tokens_in_text", "preset") + COPY_FLAGS,
    "sft": ("sft_data",) + COPY_FLAGS + FINE_TUNING_FLAGS,
    "distill": ("teacher", "alpha", "temperature", "distill_data", "control_tokens_in_text") + GKD_FLAGS
               + FINE_TUNING_FLAGS,
    "grpo": ("beta", "temperature", "reward", "reward_model", "reward_weights", "num_generations",
             "max_completion_length", "top_p", "open_thinking", "loss_type", "scale_rewards", "epsilon",
             "epsilon_high", "num_iterations", "importance_sampling_level", "tools", "max_tool_rounds")
            + POLICY_LORA_FLAGS + FINE_TUNING_FLAGS,
    "ppo": ("beta", "temperature", "reward", "reward_model", "reward_weights", "num_generations",
            "max_completion_length", "top_p", "open_thinking", "epsilon", "cliprange_value", "vf_coef", "gamma",
            "lam", "ppo_epochs", "kl_estimator", "whiten_rewards", "missing_eos_penalty", "tools", "max_tool_rounds")
           + POLICY_LORA_FLAGS + FINE_TUNING_FLAGS,
}
# The flags that name a file or folder a run reads (trainer/run_dir.py's resolve_input_path finds each: from the
# current directory, else from the repo root), besides --reward's path/to/file.py:function specs and --config (which
# no run records). A run records them as recorded_input_paths says.
INPUT_PATH_FLAGS = ("data_path", "val_data_path", "tokenizer_path", "resume", "from_weight", "teacher",
                    "reward_model")
# Model fields a fine-tuning task sets unless its command line does: SFT gives the model smeared keys, so that copy
# rows teach it to copy (docs/tools.md; `--smeared_keys false` keeps a plain model plain, and exportable).
TASK_MODEL_DEFAULTS: dict[str, dict[str, Any]] = {"sft": {"smeared_keys": True}}
# What a fine-tuning run may change on a pretrained model without changing its weights' meaning.
RUNTIME_MODEL_FIELDS = ("norm_impl", "dropout")
# Switches a fine-tuning task may turn on in a model that lacks them (off -> on only): they add weights, so only a
# task that trains every weight may (LoRA would leave a new smear frozen at half and half).
ADDABLE_MODEL_FIELDS: dict[str, tuple[str, ...]] = {"sft": ("smeared_keys",)}


def settable_model_fields(task: str) -> tuple[str, ...]:
    """The model fields a fine-tuning run of `task` may set on its starting model (pretraining sets them all)."""
    return (*RUNTIME_MODEL_FIELDS, *ADDABLE_MODEL_FIELDS.get(task, ()))

# The --help sections, in the order --help lists them: key (a flag's "group") -> (title, description). The model
# config fields (MODEL_FIELDS) are the MODEL_CONFIG_GROUP section, whose title depends on the task.
MODEL_CONFIG_GROUP = "model config"
FLAG_GROUPS: dict[str, tuple[str, str | None]] = {
    "lora": ("LoRA", "adapters of rank r, scaled by alpha / r, on the named projections"),
    "dpo": ("DPO", None),
    "pretrain": ("copy rows", "a curriculum for in-context copying, best with --smeared_keys true: beside each "
                          "micro-batch, rows that repeat a span, supervised on the repeat (docs/tools.md, Copy rows)"),
    "sft": ("SFT data and copy rows", "copy rows as pretraining's (its copy rows section), beside each "
                                      "SFT micro-batch; with --smeared_keys true it teaches a model to copy "
                                      "(docs/tools.md)"),
    "distill": ("distillation", "loss = alpha x CE + (1 - alpha) x T^2 x D(teacher^T, student^T) on the supervised "
                                "tokens, D Hinton's KL(teacher^T || student^T) or GKD's generalized JSD; with "
                                "--lmbda / --seq_kd, on completions the student / teacher samples "
                                "(trainer/distillation.py)"),
    "grpo": ("GRPO", "per prompt, --num_generations sampled completions scored by the --reward functions; "
                     "advantages within each prompt's group; --num_iterations optimizer updates per rollout "
                     "batch (trainer/grpo.py)"),
    "ppo": ("PPO", "per prompt, --num_generations sampled completions scored by the --reward functions (the KL to "
                   "the reference paid per token), a critic's values, GAE advantages; --ppo_epochs optimizer "
                   "updates per rollout batch (trainer/ppo.py)"),
    "model": ("model", None),
    MODEL_CONFIG_GROUP: ("model config", None),
    "data": ("data", None),
    "optimisation": ("optimisation", None),
    "schedule": ("schedule", None),
    "checkpoint": ("output, checkpoints and resume", None),
    "distributed": ("distributed", "several processes: how long a collective waits for the others before the job "
                                   "fails (a dead node, a cut network)"),
    "logging": ("logging and validation", None),
    "diagnostics": ("diagnostics", None),
}


COPY_GROUPS = {"pretrain": "pretrain", "sft": "sft"}  # each task's --help section of the copy flags
_COPY_ROWS_HELP = ("copy rows added to each micro-batch (0: none): sequences of 128 tokens, half random, half the "
                   "batch's own text, with a span repeated and the loss on the repeat only")
# SFT's copy rows when it gives a plain model smeared keys (docs/tools.md, Copying learned in SFT).
COPY_ROWS_TO_LEARN = 8


def _flag(group: str | dict[str, str], default: Any, help: str | dict[str, str]) -> Any:
    """A TrainArgs field that is a trainer flag: its default, its --help section (a FLAG_GROUPS key) and help. A
    flag several tasks own (TASK_FLAGS) may give each task its own section and help: {task: ...}."""
    return field(default=default, metadata={"group": group, "help": help})


def for_task(value: str | dict[str, str], task: str) -> str:
    return value[task] if isinstance(value, dict) else value


def _choices(values: Any) -> str:
    return " | ".join(str(value) for value in values)


@dataclass
class TrainArgs:
    """Every trainer flag, with its default, --help section and help text (a None default: see its help)."""

    task: str = "pretrain"
    # Data and output.
    data_path: str | None = _flag("data", None, "training data, a jsonl file (default: the trainer's embedded "
                                                "data, built on first use; GRPO and PPO: arithmetic word problems, "
                                                "dataset/arithmetic.py)")
    val_data_path: str | None = _flag("data", None, "validation data, a jsonl file (default: the embedded data's "
                                                    "validation split, or --val_fraction of --data_path)")
    val_fraction: float = _flag("data", 0.01, "the fraction of --data_path's documents held out for validation when "
                                              "no --val_data_path is given")
    out_dir: str | None = _flag("checkpoint", None, "where the run writes its model, checkpoints and metrics "
                                                    "(default: out/pretrain, out/sft, out/lora, out/dpo, "
                                                    "out/distill, out/grpo or out/ppo by trainer; trainer/run_dir.py)")
    tokenizer_path: str | None = _flag("data", None, "tokenizer directory (default: the committed tokenizer in "
                                                     "model/)")
    skip_bad_lines: bool = _flag("data", False, "skip malformed jsonl lines (counted and logged) instead of "
                                                "stopping at the first one")
    control_tokens_in_text: bool = _flag("data", False, "read control-token strings in pretraining text "
                                                        "(<|im_start|>, <|im_end|>, <|endoftext|>, ...) as the control "
                                                        "tokens, as MiniMind's pretrain_hq.jsonl is written; without "
                                                        "it they are text, a few ordinary tokens")
    num_proc: int | None = _flag("data", None, "processes that tokenize the data, for multi-GB files, at most "
                                               "4096 (default: one)")
    # Schedule.
    epochs: int = _flag("schedule", 1, "passes over the training data (with --max_steps -1)")
    max_steps: int = _flag("schedule", -1, "optimizer steps; -1: as many as --epochs give (not used with "
                                           "--time_budget_s)")
    time_budget_s: float = _flag("schedule", 0.0, "> 0: train this many seconds (see trainer/budget.py); 0: off")
    batch_size: int = _flag("optimisation", 16, "samples per process, per micro-step (the global batch is "
                                                "batch_size x accumulation_steps x processes)")
    accumulation_steps: int = _flag("optimisation", 1, "micro-steps per optimizer step (gradient accumulation)")
    learning_rate: float = _flag("optimisation", 2e-3, "AdamW's peak learning rate (with --optimizer muon: the "
                                                       "embedding's, LM head's and norms')")
    min_lr_ratio: float = _flag("schedule", 0.1, "the schedule decays to peak lr x min_lr_ratio")
    warmup_steps: int = _flag("schedule", 50, "optimizer steps of linear warmup (one not shorter than the run is cut "
                                              "to it: the rate never reaches its peak, and the run notes it)")
    lr_schedule: str = _flag("schedule", "cosine", f"{_choices(LRSchedule)}: cosine decay after the warmup, or wsd "
                                                   f"(warmup, stable, then linear decay over --decay_fraction)")
    decay_fraction: float = _flag("schedule", 0.2, "wsd: the last fraction of the steps that decays")
    weight_decay: float = _flag("optimisation", 0.1, "AdamW's weight decay, on matrices (not embeddings, norms, "
                                                     "biases)")
    optimizer: str = _flag("optimisation", "adamw", f"{_choices(OptimizerName)}: AdamW for every parameter, or Muon "
                                                    f"for the hidden matrices and AdamW for the rest")
    muon_lr: float = _flag("optimisation", 0.02, "Muon's peak learning rate, before --muon_adjust_lr's shape factor")
    muon_weight_decay: float = _flag("optimisation", 0.01, "Muon's decoupled weight decay (x muon_lr per step: "
                                                           "0.01 x 0.02 = 2e-4, as AdamW's 0.1 x 2e-3)")
    muon_momentum: float = _flag("optimisation", 0.95, "Muon's Nesterov momentum")
    muon_adjust_lr: str = _flag("optimisation", "original", f"{_choices(MuonAdjustLR)}: how Muon's lr scales with a "
                                                            f"matrix's shape (trainer/optim.py, MuonAdjustLR)")
    grad_clip: float = _flag("optimisation", 1.0, "clip the gradient's global norm to this; 0: no clipping (nor "
                                                  "does a value above every norm, e.g. 1e300)")
    max_seq_len: int = _flag("data", 256, "tokens per training sample")
    dtype: str = _flag("optimisation", "auto", f"{_choices(DTYPES)}: the training precision; auto: see "
                                               f"trainer/machine.py, resolve_dtype")
    compile: str = _flag("optimisation", "auto", f"{_choices(COMPILE_MODES)}: the whole model under torch.compile; "
                                                 f"auto: on for runs of {COMPILE_AUTO_MIN_STEPS} optimizer steps or "
                                                 f"{COMPILE_AUTO_MIN_BUDGET_S} s or more (trainer/machine.py); "
                                                 "GRPO/PPO/distillation sampling decodes through a compiled step "
                                                 "unless off")
    threads: str = _flag("optimisation", THREADS_AUTO, THREADS_HELP)
    gradient_checkpointing: bool = _flag("optimisation", False, "recompute each block in the backward: less "
                                                                "activation memory")
    seed: int = _flag("data", 42, "random seed: the initial weights, the validation split and the data order")
    # Logging, evaluation, checkpoints.
    log_interval: int = _flag("logging", 10, "optimizer steps between progress-bar (and wandb) updates of the loss, "
                                             "lr, tokens/s and MFU (and at the last step; past the run: there only)")
    eval_interval: int = _flag("logging", 200, "optimizer steps between validations (there is one at the end too; "
                                               "past the run: that one only)")
    eval_batches: int = _flag("logging", 50, "cap of validation batches per evaluation; 0 = the whole validation "
                                             "set")
    save_interval: int = _flag("checkpoint", 200, "optimizer steps between checkpoints (past the run: none; the "
                                                  "run's end writes its model)")
    keep_checkpoints: int = _flag("checkpoint", 2, "how many of the newest checkpoints to keep (more than the run "
                                                   "writes: all)")
    resume: str | None = _flag("checkpoint", None, "\"auto\" (the newest complete checkpoint in --out_dir, if any) "
                                                   "or a checkpoint directory (default: start afresh)")
    overwrite: bool = _flag("checkpoint", False, "where --out_dir holds another run (a finished model or checkpoints): "
                                                 "remove its files and start anew there (without it: refused; "
                                                 "--resume continues a directory's own run without it)")
    # trainer/distributed.py applies the two timeouts.
    dist_init_timeout: int = _flag("distributed", 1800, "seconds; during set-up (the main process prepares the data "
                                                        "while the others wait), resume and the first optimizer "
                                                        "step")
    dist_timeout: int = _flag("distributed", 300, "seconds, from the end of the first optimizer step on")
    from_weight: str | None = _flag("model", None, "fine-tuning: the model directory to start from (default: the "
                                                   "previous stage's output; trainer/run_dir.py)")
    use_wandb: bool = _flag("logging", False, "log to Weights & Biases, the full config attached")
    wandb_project: str = _flag("logging", "MiniNorm", "wandb project")
    wandb_run_name: str | None = _flag("logging", None, "wandb run name (default: wandb's)")
    wandb_group: str | None = _flag("logging", None, "wandb group (default: none)")
    diag_interval: int = _flag("diagnostics", 0, "optimizer steps between norm diagnostics, from the first step "
                                                 "and on the last (docs/diagnostics.md; past the run: those two "
                                                 "only); 0: off")
    peak_flops: float | None = _flag("logging", None, "the device's peak FLOP/s, for MFU (default: a known value "
                                                      "for the device, trainer/flops.py)")
    sample_prompt: str | None = _flag("logging", None, "prompt of the text sample generated at the end (default: "
                                                       "a built-in one)")
    # LoRA (trainer/train_lora.py; GRPO and PPO with --lora).
    lora: bool = _flag(ROLLOUT_GROUPS, False, "train the policy as LoRA adapters on its frozen starting weights, "
                                              "saved as a PEFT adapter directory; the KL's reference is the same "
                                              "model without them")
    lora_rank: int = _flag(LORA_GROUPS, 8, "rank r of the adapters")
    lora_alpha: float = _flag(LORA_GROUPS, 16.0, "alpha: the adapters' output is scaled by alpha / r")
    lora_dropout: float = _flag(LORA_GROUPS, 0.0, "dropout on the adapters' input")
    lora_targets: str = _flag(LORA_GROUPS, "all", "comma-separated projections, or all / attention / mlp")
    merge: bool = _flag(LORA_GROUPS, False, "also write the merged plain model to OUT_DIR/merged")
    # DPO (trainer/train_dpo.py).
    beta: float = _flag({"dpo": "dpo", **ROLLOUT_GROUPS}, 0.15,
                        {"dpo": "the strength of the pull toward the reference model",
                         "grpo": "the weight of the k3 KL to the reference model (a frozen copy of the starting "
                                 "weights); 0: no reference model",
                         "ppo": "the weight of the KL to the reference model (a frozen copy of the starting "
                                "weights), paid per token in the rewards (TRL's and MiniMind's kl_coef); 0: no "
                                "reference model"})
    # Copy rows beside pretraining or SFT (dataset/copy_rows.py, trainer/objectives.py).
    copy_rows: int | None = _flag(COPY_GROUPS, 0, {
        "pretrain": _COPY_ROWS_HELP,
        "sft": f"{_COPY_ROWS_HELP}; unset: {COPY_ROWS_TO_LEARN} when this run gives the model smeared keys (they "
               f"must learn to copy), else 0: a model pretrained with them copies already (default: unset)"})
    copy_weight: float = _flag(COPY_GROUPS, 1.0, "the weight of the copy rows' mean loss beside the "
                                                 "language-modeling loss for the first --copy_steps steps (>= 0)")
    copy_steps: int = _flag(COPY_GROUPS, 250, "the steps at --copy_weight; later steps use --copy_weight_after "
                                              "(>= 0; past the run: --copy_weight all run)")
    copy_weight_after: float = _flag(COPY_GROUPS, 0.1, "the copy loss's weight after --copy_steps steps (>= 0; 0: "
                                                       "the rows stop and the copying they taught fades)")
    copy_cue_pairs: int = _flag(COPY_GROUPS, 0, "the (cue, partner) token pairs of the copy rows (0: none): the span "
                                                "follows a pair's cue, the repeat its partner, and the repeat's "
                                                "first token is in the loss too (docs/tools.md, Cue pairs)")
    # The embedded SFT set (dataset/corpus.py).
    sft_data: str | None = _flag("sft", None, f"{_choices(SFT_DATA)}: the embedded SFT set used without "
                                              "--data_path: the corpus's conversations plus 20,000 tool-use "
                                              "dialogues (wiki lookups, calculations, unit conversions) and 3,000 "
                                              "chit-chats with the tools offered and none called (docs/tools.md), "
                                              "or the conversations alone (default: tools)")
    # Distillation (trainer/train_distillation.py).
    teacher: str | None = _flag("distill", None, "the teacher's model directory, which must use the student's "
                                                 f"tokenizer and may be larger (default: "
                                                 f"{DEFAULT_OUT_DIRS[DEFAULT_TEACHER]})")
    alpha: float = _flag("distill", 0.5, "the weight of the cross-entropy to the labels, in [0, 1]; the soft term "
                                         "to the teacher (--distill_loss) has 1 - alpha")
    temperature: float = _flag({"distill": "distill", **ROLLOUT_GROUPS}, 2.0,
                               {"distill": "T, the softmax temperature of both distributions in the soft term (> 0)",
                                "grpo": f"the rollouts' sampling temperature ({SAMPLED_TEMPERATURES}, OpenAI's range "
                                        f"as chat's)",
                                "ppo": f"the rollouts' sampling temperature ({SAMPLED_TEMPERATURES}, OpenAI's range "
                                        f"as chat's)"})
    distill_data: str = _flag("distill", "sft", f"{_choices(DISTILL_DATA)}: the kind of --data_path (and of the "
                                                f"default data): SFT conversations (the assistant's tokens are "
                                                f"supervised) or pretraining text (every token)")
    distill_loss: str = _flag("distill", DistillLoss.KL.value,
                              f"{_choices(DistillLoss)}: the soft term D, Hinton's KL(teacher^T || student^T) or GKD's "
                              f"generalized Jensen-Shannon divergence interpolated by --jsd_beta (TRL's GKDTrainer)")
    jsd_beta: float = _flag("distill", 0.5, "--distill_loss jsd's beta, in [0, 1]: 0 the forward "
                                            "KL(teacher^T || student^T), 1 the reverse KL(student^T || teacher^T), "
                                            "between them the JSD to the mixture beta x teacher + (1 - beta) x "
                                            "student (TRL's beta)")
    lmbda: float = _flag("distill", 0.0, "the probability, in [0, 1], that an optimizer step trains on completions "
                                         "the student samples for the data's prompts (each conversation but its "
                                         "last answer) instead of on the data's answers: GKD's on-policy data "
                                         "(TRL's lmbda; 0: never)")
    seq_kd: bool = _flag("distill", False, "a step that does not sample the student's completions trains on the "
                                           "teacher's: sequence-level KD (TRL's seq_kd)")
    max_new_tokens: int = _flag("distill", 128, "the most tokens a sampled completion has (--lmbda, --seq_kd; TRL's "
                                                "max_new_tokens); it also ends where the model's context is full")
    sampling_temperature: float = _flag("distill", 0.9, f"the sampling temperature of the completions (--lmbda, "
                                                        f"--seq_kd; {SAMPLED_TEMPERATURES}, OpenAI's range as chat's; "
                                                        f"TRL's temperature), apart from --temperature, the loss's T")
    # GRPO and PPO (trainer/train_grpo.py, trainer/train_ppo.py).
    reward: list[str] | None = _flag(ROLLOUT_GROUPS, None,
                                     f"a reward function: a built-in ({', '.join(BUILTIN)}) or "
                                     f"path/to/file.py:function with TRL's signature; repeat the flag for several "
                                     f"(default: {DEFAULT_REWARD} unless "
                                     f"--reward_model is given; it needs an \"answer\" field in the data, which the "
                                     f"default arithmetic problems have)")
    reward_model: str | None = _flag(ROLLOUT_GROUPS, None, "a learned reward model: a transformers "
                                                           "AutoModelForSequenceClassification directory (one label) "
                                                           "scoring prompt + completion in its tokenizer's chat "
                                                           "template; alone, or beside the --reward functions "
                                                           "(default: none)")
    reward_weights: list[float] | None = _flag(ROLLOUT_GROUPS, None, "one weight per --reward, in their order, then "
                                                                     "one for --reward_model; not all 0 (default: 1 "
                                                                     "each)")
    num_generations: int = _flag(ROLLOUT_GROUPS, 4, {"grpo": "G: completions sampled per prompt (>= 2)",
                                                     "ppo": "completions sampled per prompt (>= 1)"})
    max_completion_length: int = _flag(ROLLOUT_GROUPS, 64, "the most tokens a completion has")
    top_p: float = _flag(ROLLOUT_GROUPS, 1.0, "the rollouts' nucleus sampling threshold, in (0, 1]")
    open_thinking: bool = _flag(ROLLOUT_GROUPS, False, "render the prompts with the thinking block open, so the "
                                                       "policy may think before it answers (the think_format "
                                                       "reward needs it); without it: the empty block, a direct answer")
    loss_type: str = _flag({"grpo": "grpo", "dpo": "dpo"}, LossType.GRPO.value,
                           {"grpo": f"{_choices(LossType)} (trainer/rl_losses.py, policy_loss; docs/post_training.md)",
                            "dpo": f"{_choices(DPOLossType)}, TRL's names: DPO's -log sigmoid of the reward "
                                   f"margin, or another of TRL's preference losses (formulas: trainer/dpo.py, "
                                   f"docs/post_training.md); several (space- or comma-separated, e.g. sigmoid sft) "
                                   f"are summed with --loss_weights"})
    loss_weights: list[float] | None = _flag("dpo", None, "one weight per --loss_type, in their order, for the "
                                                          "weighted sum of several, as TRL's loss_weights: each >= 0, "
                                                          "one > 0 at least (default: 1 each)")
    label_smoothing: float = _flag("dpo", 0.0, f"eps in [0, 0.5): the assumed probability that a pair's preference "
                                               f"is flipped (conservative DPO for sigmoid, robust DPO's, at most "
                                               f"{ROBUST_MAX_EPS} there, EXO's epsilon, > 0 there, the paper's 1e-3); "
                                               f"only "
                                               f"{', '.join(LABEL_SMOOTHED)} read it (0: none)")
    discopop_tau: float = _flag("dpo", DEFAULT_DISCOPOP_TAU, "tau of --loss_type discopop: the temperature of the "
                                                             "sigmoid of the margin that blends its logistic and "
                                                             "exponential terms (> 0; TRL's and the paper's 0.05)")
    rpo_alpha: float | None = _flag("dpo", None, "RPO (Pang et al. 2024): add alpha x the chosen answers' NLL (sft's "
                                                 "term: the token mean over the optimizer step's chosen tokens, "
                                                 "TRL's) to the loss, >= 0, the paper's 1.0 (default: none)")
    ld_alpha: float | None = _flag("dpo", None, "LD-DPO (Liu et al. 2024), in [0, 1]: both models' log-probability "
                                                "of an answer weighs its tokens past the shorter answer's length by "
                                                "alpha (default: none: the plain sum)")
    use_weighting: bool = _flag("dpo", False, "WPO (Zhou et al. 2024): weigh each pair's loss by min(1, w_c w_r), w "
                                              "the exp of the answer's mean token log(p / sum of p^2) under the "
                                              f"policy, without gradient (not with {', '.join(SORTED)})")
    f_divergence_type: str = _flag("dpo", FDivergence.REVERSE_KL.value,
                                   f"{_choices(FDivergence)}: f-DPO's divergence to the reference (Wang et al. 2023) "
                                   f"in the margin of --loss_type {', '.join(F_DIVERGENCE_READERS)}; reverse_kl is "
                                   f"DPO's")
    f_alpha_divergence_coef: float = _flag("dpo", DEFAULT_F_ALPHA_DIVERGENCE_COEF,
                                           "alpha of --f_divergence_type alpha_divergence, whose psi(u) is -u^-alpha "
                                           "/ alpha (> 0; TRL's 1.0)")
    epsilon: float = _flag(ROLLOUT_GROUPS, 0.2,
                           {"grpo": "the clip range of the importance ratio: [1 - epsilon, 1 + epsilon_high]",
                            "ppo": "the clip range of the importance ratio: [1 - epsilon, 1 + epsilon] (MiniMind's "
                                   "clip_epsilon, TRL's cliprange)"})
    scale_rewards: str | None = _flag("grpo", None, f"{_choices(ScaleRewards)}: what divides the rewards centred "
                                                    f"on their group's mean (TRL's scale_rewards): the group's std, "
                                                    f"the std over the step's global batch, or nothing (default: "
                                                    f"none with --loss_type dr_grpo, else group)")
    epsilon_high: float | None = _flag("grpo", None, "the ratio's upper clip range (default: --epsilon)")
    num_iterations: int = _flag("grpo", 1, "optimizer updates per rollout batch (TRL's num_iterations): the "
                                           "later ones take the importance ratio against the log-probs of the "
                                           "policy that sampled, so the clipping acts; --max_steps counts rollouts")
    importance_sampling_level: str = _flag("grpo", ImportanceSamplingLevel.TOKEN.value,
                                           f"{_choices(ImportanceSamplingLevel)}: the importance ratio per token, "
                                           f"or one per completion, exp of the mean of its tokens' log-ratios, "
                                           f"clipped as one (GSPO; TRL's importance_sampling_level; sequence needs "
                                           f"--num_iterations > 1)")
    tools: str | None = _flag(ROLLOUT_GROUPS, None, {
        task: f"comma-separated built-in tools (wiki, calculator, convert_units; dataset/tools.py) whose calls a "
              f"rollout runs: a turn that ends with calls gets their results as context ({context}) and sampling "
              f"goes on, all within --max_completion_length (trainer/tool_rollouts.py; the prompts offer these "
              f"tools) (default: none: single completions)"
        for task, context in (("grpo", "out of the loss and the KL"),
                              ("ppo", "out of the losses and the KL; GAE steps over them to the next sampled "
                                      "token"))})
    max_tool_rounds: int = _flag(ROLLOUT_GROUPS, 2, "--tools: rounds of tool calls per rollout (1 to 16); the calls "
                                                    "of a turn after the last round are not run")
    # PPO (trainer/train_ppo.py).
    ppo_epochs: int = _flag("ppo", 2, "optimizer updates per rollout batch, each over the whole batch (MiniMind's "
                                      "ppo_update_iters, TRL's num_ppo_epochs); --max_steps counts rollouts")
    gamma: float = _flag("ppo", 1.0, "GAE's discount per token, in [0, 1]")
    lam: float = _flag("ppo", 0.95, "GAE's lambda, in [0, 1]")
    vf_coef: float = _flag("ppo", 0.1, "the weight of the critic's value loss beside the policy loss (> 0)")
    cliprange_value: float = _flag("ppo", 0.2, "the value loss is clipped where a value moves more than this from "
                                               "the rollout's (> 0)")
    kl_estimator: str = _flag("ppo", KLEstimator.K1.value,
                              f"{_choices(KLEstimator)}: the per-token estimate of the KL that the rewards pay, "
                              f"logp - ref_logp or (r - 1) - log r with r = exp(ref_logp - logp) (TRL's "
                              f"kl_estimator)")
    whiten_rewards: bool = _flag("ppo", False, "whiten the per-token rewards before GAE with the mean and variance "
                                               "of the step's completion tokens, keeping their mean (TRL's "
                                               "whiten_rewards)")
    missing_eos_penalty: float = _flag("ppo", 0.0, "subtracted from the score of a completion that did not end with "
                                                   "its end-of-turn token (the length limit cut it), >= 0 (TRL's "
                                                   "missing_eos_penalty; 0: none)")
    # Model.
    preset: str = _flag("model", "cpu-default", f"named model shape: {_choices(PRESETS)} (model/config.py; "
                                                f"fine-tuning takes the shape of --from_weight)")
    # MiniNormConfig overrides given as flags or YAML (not the task's defaults: requested_model_fields)
    model: dict[str, Any] = field(default_factory=dict)
    # Not a flag: the flags the command line or its --config gave (parse_args), so that a value typed equal to its
    # default can be told from none (a resume compares a typed --preset with the checkpoint's).
    given: frozenset[str] = field(default=frozenset(), compare=False)
    # Not flags: the given flags nobody typed for this run (a --config YAML's, every flag of a sweep's trial), which
    # the unused-flag rule notes instead of refusing, and the ones it set back to their defaults for being unused,
    # each (name, its value as the note quotes it, what turns it on) (trainer/arg_checks.py, DEPENDENT_FLAGS).
    untyped: frozenset[str] = field(default=frozenset(), compare=False)
    ignored: tuple[tuple[str, str, str], ...] = field(default=(), compare=False)

    def resolved_out_dir(self) -> Path:
        return resolve_path(self.out_dir or DEFAULT_OUT_DIRS[self.task])

    def to_dict(self) -> dict[str, Any]:
        """The run's settings: the task, its trainer's flags and the model overrides (not other tasks' flags)."""
        keep = task_flags(self.task) | {"task", "model"}
        return {name: value for name, value in dataclasses.asdict(self).items() if name in keep}




def task_flags(task: str) -> set[str]:
    """The TrainArgs fields that are flags of `task`'s trainer: the shared ones and its own."""
    others = {name for owner, names in TASK_FLAGS.items() if owner != task for name in names}
    others -= set(TASK_FLAGS.get(task, ()))  # a flag this task shares with another
    return {f.name for f in dataclasses.fields(TrainArgs)} - _NOT_FLAGS - others


def resolve_copy_rows(args: TrainArgs, added_switches: Sequence[str]) -> int:
    """The copy rows a run adds to each micro-batch: --copy_rows, or unset (SFT's default) COPY_ROWS_TO_LEARN when
    the run gives the model its smeared keys (`added_switches`, the switches turned on in the starting weights),
    else 0."""
    if args.copy_rows is not None:
        return args.copy_rows
    return COPY_ROWS_TO_LEARN if "smeared_keys" in added_switches else 0


# TrainArgs' fields that no command line sets
_NOT_FLAGS = frozenset({"task", "model", "given", "untyped", "ignored"})
FLAG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainArgs)}  # before a task's TASK_DEFAULTS


def task_default(task: str, name: str) -> Any:
    """Flag `name`'s default in `task`'s trainer: its TASK_DEFAULTS entry, else TrainArgs'."""
    return TASK_DEFAULTS.get(task, {}).get(name, FLAG_DEFAULTS[name])


def recorded_input_paths(flags: Mapping[str, Any]) -> dict[str, Any]:
    """`flags` (a run's TrainArgs.to_dict()) with each input path (INPUT_PATH_FLAGS, --reward's file specs) as the
    run records it (trainer/run_dir.py's recorded_input_path): one found only from the current directory made
    absolute, so that `--config RUN/train_config.yaml --resume auto` finishes the run from any directory; one read
    from the repo root as typed."""
    recorded = dict(flags)
    for name in INPUT_PATH_FLAGS:
        value = flags.get(name)
        if isinstance(value, str) and not (name == "resume" and value == "auto"):
            recorded[name] = recorded_input_path(value)
    if isinstance(rewards := flags.get("reward"), (list, tuple)):
        recorded["reward"] = [_recorded_reward(spec) for spec in rewards]
    return recorded


def _recorded_reward(spec: Any) -> Any:
    parts = reward_file_spec(spec) if isinstance(spec, str) else None
    return spec if parts is None else f"{recorded_input_path(parts[0])}:{parts[1]}"


def flags_in_effect(flags: Mapping[str, Any]) -> dict[str, Any]:
    """`flags` (a run's TrainArgs.to_dict(), or the config its checkpoint or train_config.yaml records) with each
    flag left unset (null) whose value other flags decide written out as that value: GRPO's --epsilon_high
    (--epsilon), DPO's --loss_weights (1 per --loss_type), GRPO's and PPO's --reward_weights (1 per --reward, and 1
    for --reward_model), SFT's --sft_data without a --data_path (tools). The one place these values are decided:
    the trainer builds its objective and picks its embedded data from them, and a resume compares them, so that a
    flag given at the value it has unset is no change. A flag `flags` lacks stays out (a run recorded before it)."""
    unset = {name for name, value in flags.items() if value is None}
    resolved = dict(flags)
    epsilon = flags.get("epsilon")
    if "epsilon_high" in unset and isinstance(epsilon, (int, float)) and not isinstance(epsilon, bool):
        resolved["epsilon_high"] = epsilon
    if "loss_weights" in unset and flags.get("task") == "dpo" and isinstance(flags.get("loss_type"), str):
        try:
            resolved["loss_weights"] = [1.0] * len(parse_loss_types(flags["loss_type"]))
        except ValueError:  # a recorded config's unknown loss type: nothing to resolve it by
            pass
    if "sft_data" in unset and flags.get("data_path") is None:
        resolved["sft_data"] = DEFAULT_SFT_DATA
    rewards = flags.get("reward") or []
    if "reward_weights" in unset and isinstance(rewards, list):
        resolved["reward_weights"] = [1.0] * (len(rewards) + bool(flags.get("reward_model")))
    return resolved


def rollout_tools(args: TrainArgs) -> tuple[str, ...]:
    """--tools as the names it lists (empty: none), in its order."""
    return tuple(name.strip() for name in (args.tools or "").split(",") if name.strip())


def loss_multipliers_set(args: TrainArgs) -> list[str]:
    """The loss multipliers (LOSS_MULTIPLIER_FLAGS) `args` sets away from their defaults, each as "--flag value", in
    the table's order: a flag of the run's task at another value than its default (both as flags_in_effect
    resolves them: --loss_weights 1 1 is the default of two loss types), a model field by another value than the
    preset (or config) gives it."""
    names = (*LOSS_MULTIPLIER_FLAGS, *LOSS_MULTIPLIER_TASK_FLAGS.get(args.task, ()))
    flags = args.to_dict()
    defaults = {**flags, **{name: task_default(args.task, name) for name in names if name in flags}}
    given, default = flags_in_effect(flags), flags_in_effect(defaults)
    shown = []
    for name in names:
        if name in MODEL_FIELDS:
            if name in args.model and args.model[name] != field_default(args.preset, args.model, name):
                shown.append(f"--{name} {_flag_value(args.model[name])}")
        elif name in given and given[name] != default.get(name):
            shown.append(f"--{name} {_flag_value(given[name])}")
    return shown


def _flag_value(value: Any) -> str:
    """A flag's value as a command line types it: a list as its items, space-separated."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return " ".join(f"{item:g}" if isinstance(item, float) else str(item) for item in items)


def given_preset(args: TrainArgs) -> str | None:
    """--preset as a command asks for it: None where the command leaves it out (a resume then takes the
    checkpoint's); TrainArgs made in code give it by a value other than the task's default."""
    asked = "preset" in args.given or args.preset != task_default(args.task, "preset")
    return args.preset if asked else None


def holds_out_validation(args: TrainArgs) -> bool:
    """Whether the run splits its validation set off its training data by --val_fraction: only a --data_path
    without --val_data_path (trainer/data.py; the embedded data has its own split, a --val_data_path is one)."""
    return args.data_path is not None and args.val_data_path is None


def uses_lora(args: TrainArgs) -> bool:
    """Whether the run trains LoRA adapters: train_lora.py, or GRPO/PPO with --lora."""
    return args.task == "lora" or (args.lora and args.task in ROLLOUT_TASKS)


def scored_against_starting_weights(args: TrainArgs) -> bool:
    """Whether the run's objective reads --from_weight's weights as its frozen reference model all along (not only
    to start from them, which a checkpoint's weights replace): DPO, and GRPO and PPO with --beta > 0 but without
    --lora (with it, the reference is the base model under the adapters, which a checkpoint holds)."""
    return args.task == "dpo" or (args.task in ROLLOUT_TASKS and args.beta > 0 and not uses_lora(args))



def requested_model_fields(args: TrainArgs) -> dict[str, Any]:
    """The model fields a run asks for: its flags (`args.model`, what the user gave) over its task's defaults
    (TASK_MODEL_DEFAULTS). Kept apart until the model is built, so that a resume can tell a flag the user gave from
    a task's default, which the checkpoint's value overrides."""
    return {**TASK_MODEL_DEFAULTS.get(args.task, {}), **args.model}


def refuse_fixed_model_fields(args: TrainArgs) -> None:
    """A fine-tuning run's model flag it may not set (settable_model_fields): its model is --from_weight's, whose
    shape no flag changes; one line naming the first such flag (pretraining sets them all). Before the preset's
    config is built from the flags (trainer/arg_checks.py, validate), whose refusal would name a preset's field the
    run never uses ("it must divide hidden_size=256" for a --num_attention_heads 3)."""
    if args.task == "pretrain":
        return
    fixed = sorted(set(requested_model_fields(args)) - set(settable_model_fields(args.task)))
    if fixed:
        turned_on = "".join(f", and --{name} true" for name in ADDABLE_MODEL_FIELDS.get(args.task, ()))
        raise ValueError(f"--{fixed[0]} cannot change when fine-tuning a pretrained model (--from_weight); only "
                         f"{', '.join('--' + f for f in RUNTIME_MODEL_FIELDS)} may be set{turned_on}")


def build_model_config(args: TrainArgs, vocab_size: int | None = None, special_ids: bool = True) -> MiniNormConfig:
    """The model config a fresh pretraining run uses: the preset, then the flag overrides. `special_ids` False: the
    config's bos, eos and pad ids left unset, as the flags' own checks build it: a fresh run takes them from its
    tokenizer (trainer/run_inputs.py), so the config's defaults (eos 2) must not refuse a --vocab_size 2 by their
    name; the tokenizer's size refuses it once loaded, naming the flag."""
    overrides = requested_model_fields(args)
    if vocab_size is not None:
        overrides.setdefault("vocab_size", vocab_size)
    if not special_ids:
        overrides.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return MiniNormConfig.from_preset(args.preset, **overrides)
