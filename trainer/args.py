"""Training arguments: one dataclass, filled from defaults < --config YAML < command line.

Flag names follow MiniMind's where MiniMind has them. Every MiniNormConfig field is also a flag
(`--hidden_size`, `--norm_type`, ...); left unset, it comes from `--preset` (or from `--from_weight`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from model.config import PRESETS, MiniNormConfig, NormImpl, NormPlacement, NormType
from trainer.optim import MuonAdjustLR, OptimizerName
from trainer.run_dir import DEFAULT_OUT_DIRS, TASKS, resolve_path
from trainer.schedule import LRSchedule

DTYPES = ("auto", "bfloat16", "float16", "float32")
COMPILE_MODES = ("auto", "on", "off")

# Model config fields exposed as flags, with their types and (for switches) allowed values.
MODEL_FIELDS: dict[str, tuple[type, tuple[str, ...] | None]] = {
    "vocab_size": (int, None), "hidden_size": (int, None), "num_hidden_layers": (int, None),
    "num_attention_heads": (int, None), "num_key_value_heads": (int, None), "intermediate_size": (int, None),
    "max_position_embeddings": (int, None), "rope_theta": (float, None), "tie_word_embeddings": (bool, None),
    "dropout": (float, None), "initializer_range": (float, None),
    "norm_type": (str, tuple(NormType)), "norm_placement": (str, tuple(NormPlacement)),
    "prms_p": (float, None), "norm_eps": (float, None), "norm_impl": (str, tuple(NormImpl)), "qk_norm": (bool, None),
}
# Per-task defaults where they differ from TrainArgs', sized so each default run takes under 10 minutes on
# 2 CPU cores (see README).
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    # The recipe found by scripts/sweep_configs/recipe_cpu.yaml and checked at equal time (docs/recipe.md): Muon on
    # the 2-layer, 320-wide shape, small batches, a short warmup.
    "pretrain": {"max_steps": 400, "warmup_steps": 10, "optimizer": "muon", "learning_rate": 0.01, "muon_lr": 0.0375,
                 "batch_size": 8, "preset": "cpu-wide"},
    "sft": {"max_steps": 150, "learning_rate": 5e-4, "warmup_steps": 20},
    "lora": {"max_steps": 120, "learning_rate": 2e-3, "warmup_steps": 10, "weight_decay": 0.0},
    "dpo": {"max_steps": 60, "batch_size": 8, "learning_rate": 5e-5, "warmup_steps": 10, "weight_decay": 0.0},
}
# Flags that only one kind of run has (its --help and --config YAML show them; the others' do not).
TASK_FLAGS: dict[str, tuple[str, ...]] = {
    "lora": ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "merge"),
    "dpo": ("beta",),
}
# What a fine-tuning run may change on a pretrained model without changing its weights' meaning.
RUNTIME_MODEL_FIELDS = ("norm_impl", "dropout")


@dataclass
class TrainArgs:
    task: str = "pretrain"
    # Data and output.
    data_path: str | None = None          # jsonl; None: the embedded default corpus (built on first use)
    val_data_path: str | None = None      # jsonl; None: default corpus's val split, or val_fraction of data_path
    val_fraction: float = 0.01
    out_dir: str | None = None            # None: out/pretrain or out/sft (trainer/run_dir.py)
    tokenizer_path: str | None = None     # None: the committed tokenizer in model/
    skip_bad_lines: bool = False
    num_proc: int | None = None
    # Schedule.
    epochs: int = 1
    max_steps: int = -1                   # optimizer steps; -1: as many as `epochs` give
    time_budget_s: float = 0.0            # > 0: train this many seconds (see trainer/budget.py); 0: off
    batch_size: int = 16                  # per process, per micro-step
    accumulation_steps: int = 1
    learning_rate: float = 2e-3           # AdamW's (with --optimizer muon: the embedding, LM head, norms)
    min_lr_ratio: float = 0.1             # the schedule decays to peak lr * min_lr_ratio
    warmup_steps: int = 50
    lr_schedule: str = "cosine"           # cosine | wsd (warmup, stable, then linear decay over decay_fraction)
    decay_fraction: float = 0.2           # wsd: the last fraction of the steps that decays
    weight_decay: float = 0.1             # AdamW's, on matrices (not embeddings, norms, biases)
    optimizer: str = "adamw"              # adamw | muon (Muon for the hidden matrices, AdamW for the rest)
    muon_lr: float = 0.02                 # Muon's peak lr, before muon_adjust_lr's shape factor
    muon_weight_decay: float = 0.01       # Muon's decoupled decay (x muon_lr per step: 2e-4, as AdamW's default)
    muon_momentum: float = 0.95           # Muon's Nesterov momentum
    muon_adjust_lr: str = "original"      # original | match_rms_adamw (trainer/optim.py, MuonAdjustLR)
    grad_clip: float = 1.0
    max_seq_len: int = 256
    dtype: str = "auto"                   # auto: see resolve_dtype
    compile: str = "auto"                 # the whole model under torch.compile; auto: see compile_enabled
    gradient_checkpointing: bool = False  # recompute each block in the backward: less activation memory
    seed: int = 42
    # Logging, evaluation, checkpoints.
    log_interval: int = 10
    eval_interval: int = 200
    eval_batches: int = 50                # cap per evaluation; 0 = the whole validation set
    save_interval: int = 200
    keep_checkpoints: int = 2
    resume: str | None = None             # "auto" or a checkpoint directory
    # Several processes: how long a collective waits for the others before the job fails (a dead node, a cut
    # network). Set-up (the main process prepares the data while the others wait), resume and the first optimizer
    # step get the longer init timeout; trainer/distributed.py applies them.
    dist_init_timeout: int = 1800         # seconds
    dist_timeout: int = 300               # seconds, from the end of the first optimizer step on
    from_weight: str | None = None        # fine-tuning: the starting model (default: trainer/run_dir.py)
    use_wandb: bool = False
    wandb_project: str = "MiniNorm"
    wandb_run_name: str | None = None
    wandb_group: str | None = None
    diag_interval: int = 0                # 0: norm diagnostics off
    peak_flops: float | None = None       # for MFU; None: a known value for the device
    sample_prompt: str | None = None
    # LoRA (trainer/train_lora.py): adapters of rank r scaled by alpha / r on the named projections.
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = "all"             # comma-separated projections, or all / attention / mlp
    merge: bool = False                   # also write the merged plain model to OUT_DIR/merged
    # DPO (trainer/train_dpo.py): the strength of the pull toward the reference model.
    beta: float = 0.15
    # Model.
    preset: str = "cpu-default"
    model: dict[str, Any] = field(default_factory=dict)  # MiniNormConfig overrides given as flags or YAML

    def resolved_out_dir(self) -> Path:
        return resolve_path(self.out_dir or DEFAULT_OUT_DIRS[self.task])

    def to_dict(self) -> dict[str, Any]:
        """The run's settings: the task, its trainer's flags and the model overrides (not other tasks' flags)."""
        keep = task_flags(self.task) | {"task", "model"}
        return {name: value for name, value in dataclasses.asdict(self).items() if name in keep}


def _str2bool(text: str) -> bool:
    lowered = str(text).lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {text!r}")


def _optional(kind: type):
    def parse(text: str):
        return None if str(text).lower() in ("none", "null", "") else kind(text)
    parse.__name__ = kind.__name__
    return parse


def _build_parser(task: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=f"MiniNorm {task}: train on the embedded default corpus or your own jsonl",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", help="YAML file of flag values; command-line flags override it")
    defaults = TrainArgs(task=task, **TASK_DEFAULTS.get(task, {}))
    for f in dataclasses.fields(TrainArgs):
        if f.name in ("task", "model") or f.name not in task_flags(task):
            continue
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            parser.add_argument(f"--{f.name}", type=_str2bool, nargs="?", const=True, default=default)
            continue
        hint = str(f.type)  # annotations are strings here, e.g. "int | None"
        base = int if hint.startswith("int") else float if hint.startswith("float") else str
        parser.add_argument(f"--{f.name}", type=_optional(base) if "None" in hint else base, default=default)
    model_group = parser.add_argument_group("model (default: the preset's value)")
    for name, (kind, choices) in MODEL_FIELDS.items():
        if kind is bool:
            model_group.add_argument(f"--{name}", type=_str2bool, nargs="?", const=True, default=None)
        else:
            model_group.add_argument(f"--{name}", type=kind, choices=choices, default=None)
    return parser


def task_flags(task: str) -> set[str]:
    """The TrainArgs fields that are flags of `task`'s trainer: the shared ones and its own."""
    others = {name for owner, names in TASK_FLAGS.items() if owner != task for name in names}
    return {f.name for f in dataclasses.fields(TrainArgs)} - {"task", "model"} - others


def _validate(args: TrainArgs) -> None:
    def bad(name: str, value: Any, allowed: str) -> ValueError:
        return ValueError(f"--{name}={value!r} is not allowed; {allowed}")

    if args.task not in TASKS:
        raise bad("task", args.task, f"choose one of {TASKS}")
    if args.dtype not in DTYPES:
        raise bad("dtype", args.dtype, f"choose one of {', '.join(DTYPES)}")
    if args.compile not in COMPILE_MODES:
        raise bad("compile", args.compile, f"choose one of {', '.join(COMPILE_MODES)}")
    for name, enum in (("optimizer", OptimizerName), ("muon_adjust_lr", MuonAdjustLR), ("lr_schedule", LRSchedule)):
        if getattr(args, name) not in tuple(enum):
            raise bad(name, getattr(args, name), f"choose one of {', '.join(enum)}")
    if args.preset not in PRESETS:
        raise bad("preset", args.preset, f"choose one of {', '.join(PRESETS)}")
    for name in ("epochs", "batch_size", "accumulation_steps", "max_seq_len", "log_interval", "eval_interval",
                 "save_interval", "keep_checkpoints", "dist_init_timeout", "dist_timeout"):
        if getattr(args, name) < 1:
            raise bad(name, getattr(args, name), "it must be >= 1")
    for name in ("warmup_steps", "eval_batches", "diag_interval"):
        if getattr(args, name) < 0:
            raise bad(name, getattr(args, name), "it must be >= 0")
    for name in ("learning_rate", "muon_lr"):
        if not (getattr(args, name) > 0 and math.isfinite(getattr(args, name))):
            raise bad(name, getattr(args, name), "it must be a positive number")
    for name in ("weight_decay", "muon_weight_decay"):
        if not (getattr(args, name) >= 0 and math.isfinite(getattr(args, name))):
            raise bad(name, getattr(args, name), "it must be a number >= 0")
    if not 0 <= args.muon_momentum < 1:
        raise bad("muon_momentum", args.muon_momentum, "it must be in [0, 1)")
    if not 0 < args.decay_fraction <= 1:
        raise bad("decay_fraction", args.decay_fraction, "it must be in (0, 1]")
    if not (args.time_budget_s >= 0 and math.isfinite(args.time_budget_s)):
        raise bad("time_budget_s", args.time_budget_s, "it must be a number of seconds >= 0 (0: no time budget)")
    if not 0 <= args.min_lr_ratio <= 1:
        raise bad("min_lr_ratio", args.min_lr_ratio, "it must be in [0, 1]")
    if not 0 < args.val_fraction < 1:
        raise bad("val_fraction", args.val_fraction, "it must be in (0, 1)")
    if args.task == "lora":
        from model.lora import parse_targets
        if args.lora_rank < 1:
            raise bad("lora_rank", args.lora_rank, "it must be >= 1")
        if not (args.lora_alpha > 0 and math.isfinite(args.lora_alpha)):
            raise bad("lora_alpha", args.lora_alpha, "it must be a positive number")
        if not 0 <= args.lora_dropout < 1:
            raise bad("lora_dropout", args.lora_dropout, "it must be in [0, 1)")
        parse_targets(args.lora_targets)
    if args.task == "dpo" and not (args.beta > 0 and math.isfinite(args.beta)):
        raise bad("beta", args.beta, "it must be a positive number")


def _model_overrides(values: dict[str, Any]) -> dict[str, Any]:
    return {name: values[name] for name in MODEL_FIELDS if values.get(name) is not None}


def load_yaml_config(path: str | Path, task: str = "pretrain") -> dict[str, Any]:
    """Read a --config YAML for `task`'s trainer; unknown keys are an error naming the file and the key."""
    path = resolve_path(path) if not Path(path).exists() else Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file") from None
    except yaml.YAMLError as error:
        raise ValueError(f"--config {path}: invalid YAML ({error})".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    known = task_flags(task) | set(MODEL_FIELDS)
    for key in data:
        if key not in known:
            raise ValueError(f"--config {path}: unknown key {key!r}; allowed keys are the trainer's flags "
                             f"(see --help)")
    return data


def parse_args(task: str, argv: Sequence[str] | None = None) -> TrainArgs:
    """Parse a trainer's command line (with an optional --config YAML underneath it)."""
    parser = _build_parser(task)
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        try:
            parser.set_defaults(**load_yaml_config(pre.config, task))
        except ValueError as error:
            parser.error(str(error))
    namespace = vars(parser.parse_args(argv))
    namespace.pop("config")
    model = _model_overrides(namespace)
    for name in MODEL_FIELDS:
        namespace.pop(name)
    args = TrainArgs(task=task, model=model, **namespace)
    try:
        _validate(args)
        build_model_config(args)  # fail fast on model-field errors, before any data work
    except ValueError as error:
        parser.error(str(error))
    return args


def args_from_run_config(config: dict[str, Any]) -> TrainArgs:
    """The TrainArgs a run directory's train_config.yaml records (the trainer's effective config, with the model
    fields flat beside the flags), e.g. to rebuild a finished run's data exactly."""
    names = {f.name for f in dataclasses.fields(TrainArgs)} - {"model"}
    unknown = sorted(set(config) - names - set(MODEL_FIELDS))
    if unknown:
        raise ValueError(f"run config: unknown key {unknown[0]!r}; expected the trainer's flags")
    return TrainArgs(**{k: v for k, v in config.items() if k in names},
                     model={k: v for k, v in config.items() if k in MODEL_FIELDS and v is not None})


def build_model_config(args: TrainArgs, vocab_size: int | None = None) -> MiniNormConfig:
    """The model config a fresh pretraining run uses: the preset, then the flag overrides."""
    overrides = dict(args.model)
    if vocab_size is not None:
        overrides.setdefault("vocab_size", vocab_size)
    return MiniNormConfig.from_preset(args.preset, **overrides)


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls are fast only with AMX or AVX512-BF16; on AVX2-only CPUs bf16 autocast runs ~30x slower
    than fp32 (measured on our AMD EPYC development machine)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(dtype: str) -> str:
    """The training precision `--dtype auto` stands for on this machine: bf16 on a CUDA GPU that supports it,
    else fp16 (with loss scaling) on CUDA; on CPU bf16 where it is fast (AMX/AVX512-BF16), else fp32."""
    if dtype != "auto":
        return dtype
    import torch
    if torch.cuda.is_available():
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu_has_fast_bf16() else "float32"


# Whole-model compile costs a one-time 25-55 s on our 2-core CPUs and saves 10-50% of every step after it
# (docs/benchmarks.md): it pays once a run is long enough, and short runs (smoke tests, tests) stay eager.
COMPILE_AUTO_MIN_STEPS = 1000
COMPILE_AUTO_MIN_BUDGET_S = 600  # the same rule for a run on --time_budget_s


def compile_enabled(mode: str, total_steps: int, time_budget_s: float = 0.0) -> bool:
    """Whether `--compile auto|on|off` compiles the model for a run of `total_steps` optimizer steps (or, on a
    time budget, of `time_budget_s` seconds). auto: on from COMPILE_AUTO_MIN_STEPS steps or
    COMPILE_AUTO_MIN_BUDGET_S seconds, on any device."""
    if mode != "auto":
        return mode == "on"
    if time_budget_s > 0:
        return time_budget_s >= COMPILE_AUTO_MIN_BUDGET_S
    return total_steps >= COMPILE_AUTO_MIN_STEPS
