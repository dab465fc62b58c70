"""The one rule for a flag the run will not use (trainer/arg_checks.py, DEPENDENT_FLAGS): typed on the command line
at a value other than its trainer's default while its feature is off, it is refused in one line naming the flag,
its value and what turns its feature on; given by a --config YAML (or a sweep trial's command line) it is set back
to its default and named in one note line on stderr; at its default it is taken silently, wherever it comes from."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainer.arg_fields import task_default

SWEEP_VARIABLES = ("WANDB_SWEEP_ID", "MININORM_SWEEP_TRIAL")

# (task, the flags that leave the feature off, the dependent flag, a value other than its default, what turns the
# feature on as the refusal names it): one per family of DEPENDENT_FLAGS.
UNUSED = [
    ("sft", [], "muon_lr", "0.05", "only --optimizer muon uses it"),
    ("pretrain", ["--optimizer", "adamw"], "muon_momentum", "0.9", "only --optimizer muon uses it"),
    ("lora", [], "muon_adjust_lr", "match_rms_adamw", "only --optimizer muon uses it"),
    ("pretrain", [], "wandb_group", "g", "only --use_wandb uses it"),
    ("dpo", [], "wandb_project", "other", "only --use_wandb uses it"),
    ("pretrain", [], "decay_fraction", "0.5", "only --lr_schedule wsd uses it"),
    ("pretrain", ["--time_budget_s", "60"], "max_steps", "100", "only a run without --time_budget_s uses it"),
    ("pretrain", [], "epochs", "3", "only --max_steps -1 or --time_budget_s uses it"),
    ("pretrain", [], "copy_weight", "2", "only --copy_rows N > 0 uses it"),
    ("sft", ["--copy_rows", "0"], "copy_steps", "10", "only --copy_rows N > 0 uses it"),
    ("grpo", [], "lora_rank", "4", "only --lora uses it"),
    ("ppo", [], "merge", "true", "only --lora uses it"),
    ("sft", ["--data_path", "my.jsonl"], "sft_data", "chat", "only a run without --data_path"),
    ("pretrain", [], "val_fraction", "0.2", "only a --data_path without --val_data_path"),
    ("dpo", ["--data_path", "a.jsonl", "--val_data_path", "b.jsonl"], "val_fraction", "0.2",
     "only a --data_path without --val_data_path"),
    ("distill", [], "jsd_beta", "0.3", "only --distill_loss jsd uses it"),
    ("distill", ["--lmbda", "0"], "max_new_tokens", "64", "only --lmbda > 0 or --seq_kd"),
    ("distill", [], "sampling_temperature", "0.5", "only --lmbda > 0 or --seq_kd"),
    ("dpo", [], "discopop_tau", "0.1", "only --loss_type discopop uses it"),
    ("dpo", ["--loss_type", "hinge"], "label_smoothing", "0.1", "only --loss_type sigmoid, robust, exo_pair"),
    ("dpo", ["--loss_type", "sft"], "rpo_alpha", "1.0", "only a --loss_type other than sft alone uses it"),
    ("dpo", ["--loss_type", "sft"], "ld_alpha", "0.5", "only a --loss_type other than sft alone uses it"),
    ("dpo", ["--loss_type", "nca_pair"], "f_divergence_type", "js_divergence", "only --loss_type sigmoid, hinge"),
    ("dpo", [], "f_alpha_divergence_coef", "0.5", "only --f_divergence_type alpha_divergence uses it"),
    ("ppo", ["--beta", "0"], "kl_estimator", "k3", "only --beta > 0 (the KL the rewards pay) uses it"),
    ("grpo", [], "importance_sampling_level", "sequence", "only --num_iterations 2 or more"),
    ("grpo", [], "max_tool_rounds", "3", "only --tools (rollouts that call tools) uses it"),
    ("ppo", [], "max_tool_rounds", "3", "only --tools (rollouts that call tools) uses it"),
]
IDS = [f"{task}-{flag}" for task, _, flag, _, _ in UNUSED]


@pytest.fixture(autouse=True)
def _not_a_sweep_trial(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*SWEEP_VARIABLES, "RANK"):
        monkeypatch.delenv(name, raising=False)


def _stderr_of(capsys: pytest.CaptureFixture, task: str, argv: list[str]) -> tuple[object, list[str]]:
    from trainer.args import parse_args

    try:
        args = parse_args(task, argv)
    except SystemExit:
        args = None
    return args, capsys.readouterr().err.splitlines()


def _yaml(tmp_path: Path, flag: str, value: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(f"{flag}: {value}\n", encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("task, off, flag, value, used_by", UNUSED, ids=IDS)
def test_an_unused_flag_typed_on_the_command_line_is_refused(task, off, flag, value, used_by, capsys):
    args, err = _stderr_of(capsys, task, [*off, f"--{flag}", value])
    assert args is None
    assert err[0].startswith(f"error: --{flag}=") and " is not allowed; " in err[0], err
    assert used_by in err[0] and err[0].endswith(f"or leave --{flag} out"), err[0]


@pytest.mark.parametrize("task, off, flag, value, used_by", UNUSED, ids=IDS)
def test_an_unused_flag_from_a_config_yaml_is_noted_and_left_at_its_default(task, off, flag, value, used_by, capsys,
                                                                           tmp_path):
    args, err = _stderr_of(capsys, task, [*off, "--config", _yaml(tmp_path, flag, value)])
    assert args is not None, err
    assert getattr(args, flag) == task_default(task, flag)  # the run records what it uses
    assert flag not in args.given
    assert len(err) == 1 and err[0].startswith("note: unused flags left at their defaults: "), err
    assert f"--{flag}=" in err[0] and f"({used_by}" in err[0], err[0]


@pytest.mark.parametrize("task, off, flag, value, used_by", UNUSED, ids=IDS)
def test_an_unused_flag_at_its_default_is_taken_silently(task, off, flag, value, used_by, capsys, tmp_path):
    default = task_default(task, flag)
    args, err = _stderr_of(capsys, task, [*off, f"--{flag}", str(default)])
    assert args is not None and err == [], err
    assert getattr(args, flag) == default
    args, err = _stderr_of(capsys, task, [*off, "--config", _yaml(tmp_path, flag, "null" if default is None
                                                                                 else str(default))])
    assert args is not None and err == [], err


def test_the_command_line_typing_a_yaml_flag_again_is_refused(capsys, tmp_path):
    """A flag the YAML gives and the command line types again is the command line's (its value wins)."""
    args, err = _stderr_of(capsys, "sft", ["--config", _yaml(tmp_path, "muon_lr", "0.03"), "--muon_lr", "0.05"])
    assert args is None and err[0].startswith("error: --muon_lr=0.05 is not allowed; only --optimizer muon")


def test_a_used_flag_is_kept_whatever_its_source(capsys, tmp_path):
    args, err = _stderr_of(capsys, "sft", ["--config", _yaml(tmp_path, "muon_lr", "0.05"), "--optimizer", "muon"])
    assert args.muon_lr == 0.05 and err == []
    args, err = _stderr_of(capsys, "sft", ["--optimizer", "muon", "--muon_lr", "0.05"])
    assert args.muon_lr == 0.05 and err == []


def test_the_note_names_every_unused_flag_on_one_line_from_the_main_process_only(capsys, tmp_path, monkeypatch):
    config = tmp_path / "config.yaml"
    config.write_text("muon_lr: 0.05\nwandb_group: g\ndecay_fraction: 0.5\nlearning_rate: 0.001\n", encoding="utf-8")
    args, err = _stderr_of(capsys, "sft", ["--config", str(config)])
    assert err == ["note: unused flags left at their defaults: --muon_lr=0.05 (only --optimizer muon uses it); "
                   "--wandb_group='g' (only --use_wandb uses it); --decay_fraction=0.5 (only --lr_schedule wsd "
                   "uses it)"]
    assert (args.muon_lr, args.wandb_group, args.decay_fraction, args.learning_rate) == (0.02, None, 0.2, 0.001)
    monkeypatch.setenv("RANK", "1")  # another process of a multi-process run: the same flags, no second note
    args, err = _stderr_of(capsys, "sft", ["--config", str(config)])
    assert err == [] and args.muon_lr == 0.02


@pytest.mark.parametrize("variable", SWEEP_VARIABLES)
def test_a_sweep_trials_command_line_is_noted_not_refused(variable, capsys, monkeypatch):
    """A sweep passes its parameters on the trial's command line, varying --optimizer and --muon_lr
    (scripts/sweep_configs/recipe_cpu.yaml): wandb agent sets WANDB_SWEEP_ID, scripts/sweep.py's runner
    MININORM_SWEEP_TRIAL."""
    monkeypatch.setenv(variable, "1")
    args, err = _stderr_of(capsys, "pretrain", ["--optimizer", "adamw", "--muon_lr", "0.05"])
    assert args.muon_lr == task_default("pretrain", "muon_lr") and len(err) == 1 and "--muon_lr=0.05" in err[0]


def test_a_sweeps_check_of_its_parameters_takes_them_as_a_trials(monkeypatch):
    from trainer.args import check_args

    args = check_args("pretrain", ["--optimizer", "adamw", "--muon_lr", "0.05"])
    assert args.muon_lr == task_default("pretrain", "muon_lr") and args.ignored
    with pytest.raises(ValueError, match="--muon_lr=-1.0 is not allowed; it must be a positive number"):
        check_args("pretrain", ["--optimizer", "adamw", "--muon_lr", "-1"])  # a bad value is bad wherever from


def test_the_sweep_runner_marks_its_trials(tmp_path):
    from scripts.sweep_runner.config import load_sweep_config
    from scripts.sweep_runner.runner import SweepRunner
    from tests.paths import REPO

    config = load_sweep_config(REPO / "scripts/sweep_configs/smoke.yaml")
    runner = SweepRunner(config, "smoke", tmp_path / "sweep", None, "disabled", {}, seed=0, workers=1, dry_run=True)
    assert runner.env["MININORM_SWEEP_TRIAL"] == "1"  # every trial's environment


@pytest.mark.parametrize("task, off, flag, value, message", [
    ("distill", [], "jsd_beta", "1.5", "--jsd_beta=1.5 is not allowed; it must be in [0, 1]"),
    ("ppo", ["--beta", "0"], "kl_estimator", "k2", "--kl_estimator='k2' is not allowed; choose one of k1, k3"),
    ("dpo", ["--loss_type", "sft"], "rpo_alpha", "-1", "--rpo_alpha=-1.0 is not allowed; it must be a number >= 0"),
    ("dpo", [], "f_divergence_type", "forward_kl", "--f_divergence_type='forward_kl' is not allowed; choose one of"),
    ("grpo", [], "lora_rank", "0", "--lora_rank=0 is not allowed; it must be >= 1"),
    ("pretrain", [], "copy_steps", "-1", "--copy_steps=-1 is not allowed; it must be >= 0"),
    ("sft", [], "muon_momentum", "1", "--muon_momentum=1.0 is not allowed; it must be in [0, 1)"),
])
def test_a_bad_value_of_an_unused_flag_from_a_yaml_is_refused_all_the_same(task, off, flag, value, message, capsys,
                                                                           tmp_path):
    """The rule sets back a value that is valid but unused: one its flag would refuse is refused wherever from."""
    args, err = _stderr_of(capsys, task, [*off, "--config", _yaml(tmp_path, flag, value)])
    assert args is None and err[0].startswith(f"error: {message}"), err


def test_dpo_options_a_yaml_leaves_unused_reach_no_loss_type_refusal(capsys, tmp_path):
    """DPO's loss types refuse an option they do not read (trainer/dpo.py, check_options): from a YAML the rule has
    the option set back first, the divergence's coefficient with it (it reads the divergence the rule set back),
    and the coefficient typed on the command line is then refused as unused."""
    config = tmp_path / "config.yaml"
    config.write_text("loss_type: nca_pair\nf_divergence_type: alpha_divergence\nf_alpha_divergence_coef: 0.5\n"
                      "label_smoothing: 0.1\n", encoding="utf-8")
    args, err = _stderr_of(capsys, "dpo", ["--config", str(config)])
    assert (args.f_divergence_type, args.f_alpha_divergence_coef, args.label_smoothing) == ("reverse_kl", 1.0, 0.0)
    assert len(err) == 1 and all(f"--{name}=" in err[0] for name in ("f_divergence_type", "f_alpha_divergence_coef",
                                                                      "label_smoothing")), err
    config.write_text("loss_type: nca_pair\nf_divergence_type: alpha_divergence\n", encoding="utf-8")
    args, err = _stderr_of(capsys, "dpo", ["--config", str(config), "--f_alpha_divergence_coef", "0.5"])
    assert args is None and err[0].startswith("error: --f_alpha_divergence_coef=0.5 is not allowed; only "
                                              "--f_divergence_type alpha_divergence uses it"), err


@pytest.mark.parametrize("task, argv, flag", [
    ("distill", ["--jsd_beta", "1.5"], "jsd_beta"),  # also out of [0, 1]: _validate_gkd's refusal
    ("ppo", ["--beta", "0", "--kl_estimator", "k3", "--missing_eos_penalty", "-1"], "kl_estimator"),  # PPO's own
])
def test_a_typed_unused_flag_is_refused_by_the_rule_before_the_trainers_own_checks(task, argv, flag, capsys):
    """The rule refuses a typed unused flag first (validate), so the first thing the user learns is that the run
    would not read it, not a range or another flag's refusal that applies to a value it would never use."""
    args, err = _stderr_of(capsys, task, argv)
    assert args is None
    assert err[0].startswith(f"error: --{flag}=") and err[0].endswith(f"or leave --{flag} out"), err[0]


def test_train_loras_adapter_flags_are_used_without_a_lora_flag(capsys):
    """train_lora.py always trains adapters and has no --lora: its --lora_rank, --lora_alpha, --lora_dropout,
    --lora_targets and --merge are used as typed, not refused as GRPO's and PPO's are without --lora."""
    args, err = _stderr_of(capsys, "lora", ["--lora_rank", "16", "--lora_alpha", "32", "--lora_dropout", "0.1",
                                            "--merge"])
    assert args is not None and err == [], err
    assert (args.lora_rank, args.lora_alpha, args.lora_dropout, args.merge) == (16, 32, 0.1, True)


def test_a_long_unused_value_is_quoted_short_on_one_line(capsys, tmp_path):
    """The refusal and the note quote a long value as dataset/shown_value does (cut at MAX_SHOWN characters), not
    whole: a 5,000-character --wandb_group made a 5,000-character line."""
    from dataset.shown_value import MAX_SHOWN

    long = "g" * 5000
    args, err = _stderr_of(capsys, "pretrain", ["--wandb_group", long])
    assert args is None and len(err[0]) < 300 and f"--wandb_group='{long[:MAX_SHOWN - 4]}..." in err[0], err[0][:400]
    args, err = _stderr_of(capsys, "pretrain", ["--config", _yaml(tmp_path, "wandb_group", long)])
    assert len(err) == 1 and len(err[0]) < 300 and err[0].endswith("... (only --use_wandb uses it)"), err[0][:400]


def test_a_long_dpo_option_value_is_quoted_short_on_one_line(capsys):
    """trainer/dpo.py's option refusals quote as the flags' do: a 5,000-character --f_divergence_type is cut."""
    args, err = _stderr_of(capsys, "dpo", ["--loss_type", "sigmoid", "--f_divergence_type", "k" * 5000])
    assert args is None and len(err[0]) < 300 and err[0].startswith("error: --f_divergence_type='kkk"), err[0][:400]


# The model's own (model/config.py, SWITCHED_FIELDS), pretraining's flags: (the flags that leave the switch off, the
# field, a value other than its default, what turns it on as the refusal names it).
MODEL_UNUSED = [
    ([], "prms_p", "0.25", "only --norm_type prmsnorm uses it"),
    (["--norm_type", "layernorm"], "dyt_alpha_init", "0.8", "only --norm_type dyt uses it"),
    (["--norm_type", "dyt"], "norm_eps", "1e-05", "only --norm_type rmsnorm, prmsnorm or layernorm uses it"),
    (["--norm_type", "none"], "qk_norm", "true", "only a --norm_type other than none uses it"),
    ([], "qk_norm_scope", "full", "only --qk_norm true uses it"),
    (["--norm_placement", "post"], "mix_ln_ratio", "0.5", "only --norm_placement mix uses it"),
    (["--norm_placement", "deepnorm"], "init_depth_scaling", "false",
     "only a --norm_placement other than deepnorm uses it"),
    ([], "num_experts_per_tok", "2", "only --num_experts > 0 uses it"),
    (["--num_experts", "0"], "moe_intermediate_size", "64", "only --num_experts > 0 uses it"),
    (["--preset", "cpu-wide"], "norm_topk_prob", "true", "only --num_experts > 0 uses it"),
    ([], "router_aux_loss_coef", "0.01", "only --num_experts > 0 uses it"),
    ([], "router_z_loss_coef", "0.001", "only --num_experts > 0 uses it"),
]
MODEL_IDS = [flag for _, flag, _, _ in MODEL_UNUSED]


@pytest.mark.parametrize("off, flag, value, used_by", MODEL_UNUSED, ids=MODEL_IDS)
def test_an_unused_model_flag_typed_on_the_command_line_is_refused(off, flag, value, used_by, capsys):
    args, err = _stderr_of(capsys, "pretrain", [*off, f"--{flag}", value])
    assert args is None
    assert err[0].startswith(f"error: --{flag}=") and " is not allowed; " in err[0], err
    assert used_by in err[0] and err[0].endswith(f"or leave --{flag} out"), err[0]


@pytest.mark.parametrize("off, flag, value, used_by", MODEL_UNUSED, ids=MODEL_IDS)
def test_an_unused_model_flag_from_a_config_yaml_is_noted_and_left_to_the_preset(off, flag, value, used_by, capsys,
                                                                                 tmp_path):
    from model.config import MiniNormConfig
    from trainer.arg_fields import build_model_config

    args, err = _stderr_of(capsys, "pretrain", [*off, "--config", _yaml(tmp_path, flag, value)])
    assert args is not None, err
    assert flag not in args.model and flag not in args.given  # the model built has the preset's value
    built = build_model_config(args)
    assert getattr(built, flag) == getattr(MiniNormConfig.from_preset(args.preset, **args.model), flag)
    assert len(err) == 1 and err[0].startswith("note: unused flags left at their defaults: "), err
    assert f"--{flag}=" in err[0] and f"({used_by}" in err[0], err[0]


@pytest.mark.parametrize("argv", [
    ["--norm_type", "prmsnorm", "--prms_p", "0.25"],
    ["--norm_type", "dyt", "--dyt_alpha_init", "0.8"],
    ["--norm_type", "layernorm", "--norm_eps", "1e-05"],
    ["--qk_norm", "--qk_norm_scope", "full"],
    ["--norm_placement", "mix", "--mix_ln_ratio", "0.5"],
    ["--norm_placement", "peri", "--init_depth_scaling", "false"],  # an alias: its placement
    ["--num_experts", "4", "--num_experts_per_tok", "2", "--router_z_loss_coef", "0.001"],
    ["--preset", "cpu-moe", "--norm_topk_prob", "true", "--moe_intermediate_size", "64"],  # the preset's experts
])
def test_a_model_flag_its_switch_turns_on_is_kept(argv, capsys):
    args, err = _stderr_of(capsys, "pretrain", argv)
    assert args is not None and err == [], err
    assert args.model[argv[-2].removeprefix("--")] is not None and not args.ignored


def test_a_model_flag_at_the_value_its_preset_gives_is_taken_silently(capsys, tmp_path):
    """The default of a model field is its preset's config's value: the recorded model fields of a dense run (its
    moe_intermediate_size is resolved to intermediate_size's) given back as a --config draw no note."""
    from model.config import MiniNormConfig
    from trainer.arg_fields import MODEL_FIELDS

    config = MiniNormConfig.from_preset("cpu-wide")
    recorded = tmp_path / "config.yaml"
    recorded.write_text(yaml.safe_dump({name: getattr(config, name) for name in MODEL_FIELDS}), encoding="utf-8")
    args, err = _stderr_of(capsys, "pretrain", ["--config", str(recorded), "--preset", "cpu-wide"])
    assert args is not None and err == [], err
    assert args.model["moe_intermediate_size"] == config.intermediate_size
    args, err = _stderr_of(capsys, "pretrain", ["--prms_p", "0.0625", "--preset", "minimind-3-moe",
                                                "--router_aux_loss_coef", "0.0005", "--num_experts", "0"])
    assert args is not None and err == [], err  # each at its preset's value, whatever the switch


def test_model_flags_an_earlier_entry_sets_back_turn_the_later_off(capsys, tmp_path):
    """qk_norm_scope reads qk_norm, which norm_type none leaves unused: from a YAML both are set back."""
    config = tmp_path / "config.yaml"
    config.write_text("norm_type: none\nqk_norm: true\nqk_norm_scope: full\n", encoding="utf-8")
    args, err = _stderr_of(capsys, "pretrain", ["--config", str(config)])
    assert args.model == {"norm_type": "none"}
    assert len(err) == 1 and "--qk_norm=True" in err[0] and "--qk_norm_scope='full'" in err[0], err


def test_a_bad_model_value_a_yaml_leaves_unused_is_refused_all_the_same(capsys, tmp_path):
    args, err = _stderr_of(capsys, "pretrain", ["--config", _yaml(tmp_path, "prms_p", "1.5")])
    assert args is None and err[0].startswith("error: prms_p=1.5 is not allowed; it must be a float in (0, 1]"), err


@pytest.mark.parametrize("argv", [["--prms_p", "0.25"], ["--num_attention_heads", "3"], ["--hidden_size", "96"]])
def test_fine_tuning_model_flags_are_not_judged_by_the_preset(argv, capsys):
    """A fine-tuning run's model is its starting model (--from_weight), unknown when parsing: a model flag is not
    refused against a preset's switch or shape ("it must divide hidden_size=256", the preset's, for
    --num_attention_heads 3), but as one a fine-tuning run may not set (trainer/arg_fields.py,
    refuse_fixed_model_fields: only --norm_impl, --dropout and SFT's --smeared_keys may change)."""
    args, err = _stderr_of(capsys, "sft", argv)
    assert args is None and err[0] == (
        f"error: {argv[0]} cannot change when fine-tuning a pretrained model (--from_weight); only --norm_impl, "
        f"--dropout may be set, and --smeared_keys true"), err
    args, err = _stderr_of(capsys, "sft", ["--dropout", "0.1", "--norm_impl", "eager"])
    assert args is not None and err == [] and args.model == {"dropout": 0.1, "norm_impl": "eager"}


def test_a_resume_leaves_a_switch_it_does_not_give_to_the_checkpoint(capsys):
    """A bare resume takes its architecture from the checkpoint (trainer/resume_checks.py, adopt_saved_architecture):
    a model flag whose switch the command leaves unset is taken as given (the checkpoint's architecture check compares
    it), not refused against the preset's switch; a switch the command gives is judged as in a fresh run."""
    args, err = _stderr_of(capsys, "pretrain", ["--resume", "auto", "--prms_p", "0.25"])
    assert args is not None and err == [] and args.model == {"prms_p": 0.25}
    args, err = _stderr_of(capsys, "pretrain", ["--resume", "auto", "--norm_type", "rmsnorm", "--prms_p", "0.25"])
    assert args is None and "only --norm_type prmsnorm uses it" in err[0], err


def _resume_args(argv: list[str], untyped_yaml: dict[str, object] | None = None):
    from trainer.args import check_args

    args = check_args("pretrain", ["--resume", "auto", *argv])
    args.untyped = frozenset(untyped_yaml or {})  # check_args takes everything as a sweep trial's: say what is
    return args


def test_a_resumed_untyped_model_flag_the_checkpoint_does_not_read_is_set_back():
    """A sweep's cut-off trial rerun with --resume auto: its fixed --dyt_alpha_init beside no --norm_type was set
    back at its first start (a saved rmsnorm model, dyt_alpha_init 0.5), so the rerun goes on; typed, it is compared
    with the checkpoint's and refused where it differs."""
    from trainer.resume_checks import adopt_saved_architecture

    saved = {"config": {"task": "pretrain", "preset": "cpu-wide", "norm_type": "rmsnorm", "dyt_alpha_init": 0.5,
                        "hidden_size": 320}}
    args = _resume_args(["--dyt_alpha_init", "0.8"], {"dyt_alpha_init": 0.8})
    adopt_saved_architecture(Path("step_00000002"), saved, args)
    assert args.model == {"norm_type": "rmsnorm", "dyt_alpha_init": 0.5, "hidden_size": 320}
    args = _resume_args(["--dyt_alpha_init", "0.8"])
    with pytest.raises(ValueError, match="dyt_alpha_init was 0.5 there and is 0.8 now"):
        adopt_saved_architecture(Path("step_00000002"), saved, args)
    saved["config"]["norm_type"] = "dyt"  # read there: an untyped value is compared as given
    args = _resume_args(["--dyt_alpha_init", "0.8"], {"dyt_alpha_init": 0.8})
    with pytest.raises(ValueError, match="dyt_alpha_init was 0.5 there and is 0.8 now"):
        adopt_saved_architecture(Path("step_00000002"), saved, args)


def test_a_resume_of_a_run_saved_before_the_rule_notes_no_change_for_the_flags_it_sets_back(capsys, tmp_path):
    """A pretraining run saved before the rule recorded flags it never read (a Muon rate and a wandb group beside
    --optimizer adamw and no --use_wandb, a DyT alpha beside RMSNorm); resumed unfinished with its own
    train_config.yaml, the rule sets them back, and the resume compared the two: "changed since the checkpoint:
    --muon_lr was 0.05 there and is 0.0375 now". Both sides are compared after the rule; a flag the run reads and
    changes is still named."""
    from trainer.arg_fields import MODEL_FIELDS, build_model_config
    from trainer.args import check_args
    from trainer.resume_checks import adopt_saved_architecture, changed_flags

    def effective(args) -> dict[str, object]:  # trainer/run_inputs.py, effective_config
        built = build_model_config(args, vocab_size=6400)
        return {**{k: v for k, v in args.to_dict().items() if k != "model"},
                **{name: getattr(built, name) for name in MODEL_FIELDS}}

    before = check_args("pretrain", ["--optimizer", "adamw", "--out_dir", str(tmp_path / "run")])
    saved = {**effective(before), "muon_lr": 0.05, "wandb_group": "g", "dyt_alpha_init": 0.8}
    recorded = tmp_path / "train_config.yaml"
    recorded.write_text(yaml.safe_dump(saved), encoding="utf-8")
    for extra, changes in (([], ""), (["--learning_rate", "0.002"], "--learning_rate was 0.01 there and is 0.002 now")):
        args, err = _stderr_of(capsys, "pretrain", ["--config", str(recorded), "--resume", "auto", *extra])
        assert args is not None and "--muon_lr=0.05" in err[0] and "--dyt_alpha_init=0.8" in err[0], err
        adopt_saved_architecture(Path("step_00000002"), {"config": saved}, args)  # the saved model's fields
        assert changed_flags({"config": saved}, effective(args)) == changes


def test_distillations_soft_flags_at_alpha_1_are_used_for_the_logged_divergence(capsys):
    """At --alpha 1 the loss has no teacher term (it is the CE exactly), but the run still computes and logs the
    divergence at --temperature with --distill_loss (and --jsd_beta): those flags are read, so they are taken, not
    refused or noted. The logged KL is checked against KL(q_t || q_s) at T written out in fp64."""
    import torch

    from trainer.distillation_losses import distillation_losses

    args, err = _stderr_of(capsys, "distill", ["--alpha", "1", "--temperature", "4", "--distill_loss", "jsd",
                                               "--jsd_beta", "0.3"])
    assert args is not None and err == [] and (args.temperature, args.distill_loss, args.jsd_beta) == (4.0, "jsd", 0.3)
    generator = torch.Generator().manual_seed(0)
    student, teacher = (torch.randn(3, 5, generator=generator, dtype=torch.float64) for _ in range(2))
    targets = torch.tensor([0, 2, 4])
    for temperature in (1.0, 4.0):
        loss, ce, kl = distillation_losses(student, teacher, targets, 1.0, temperature)
        q_t, q_s = (torch.softmax(logits / temperature, dim=-1) for logits in (teacher, student))
        assert torch.equal(loss, ce)  # no teacher term
        torch.testing.assert_close(kl, (q_t * (q_t.log() - q_s.log())).sum(dim=-1), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(distillation_losses(student, teacher, targets, 1.0, 1.0)[2],
                              distillation_losses(student, teacher, targets, 1.0, 4.0)[2])  # the logged value reads T
