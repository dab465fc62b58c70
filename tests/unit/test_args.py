"""The trainers' --help: every flag has a help text, sits in a named section and shows its trainer's default."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

from trainer.arg_fields import (FLAG_GROUPS, MODEL_CONFIG_GROUP, MODEL_FIELDS, TASK_FLAGS, loss_multipliers_set,
                                task_flags)
from trainer.arg_parser import build_parser, section_heading
from trainer.threads import threads_allowed, usable_cores
from tests.paths import REPO

TASKS = ("pretrain", "sft", "lora", "dpo", "distill", "grpo", "ppo")
THREADS_ALLOWED = threads_allowed(usable_cores())  # --threads' bound: this machine's cores (test_threads.py)
GENERAL = {"-h", "--config"}  # argparse's own "options" section
SECTIONS = {"model", MODEL_CONFIG_GROUP, "data", "optimisation", "schedule", "checkpoint", "distributed", "logging",
            "diagnostics", "pretrain", "sft", "lora", "dpo", "distill", "grpo", "ppo"}


def help_entries(text: str) -> dict[str, tuple[str, str]]:
    """--help's entry per flag -> (its section's title, the entry on one line: invocation and help text)."""
    entries, section, current = {}, None, None
    for line in text.splitlines():
        if re.match(r"^\S.*:$", line):
            section, current = line[:-1], None
        elif line.startswith("  -") and section is not None:
            current = line.split()[0].rstrip(",")
            entries[current] = (section, line.strip())
        elif current is not None and line.startswith("    "):
            entries[current] = (section, f"{entries[current][1]} {line.strip()}")
        else:
            current = None  # a blank line or a section's description
    return entries


def section_titles(task: str) -> set[str]:
    return {section_heading(key, task)[0] for key in FLAG_GROUPS}


def test_the_sections_are_the_named_ones():
    assert set(FLAG_GROUPS) == SECTIONS


@pytest.mark.parametrize("task", TASKS)
def test_every_flag_has_help_and_a_named_section(task):
    parser = build_parser(task)
    flags = {action.option_strings[0]: action for action in parser._actions}
    assert set(flags) == GENERAL | {f"--{name}" for name in task_flags(task) | set(MODEL_FIELDS)}
    for flag, action in flags.items():
        assert action.help and action.help.strip(), f"{task}: {flag} has no help text"
    entries = help_entries(parser.format_help())
    assert set(entries) == set(flags)  # the parser above reads every entry of the --help text
    for flag, (section, entry) in entries.items():
        if flag in GENERAL:
            assert section == "options", (flag, section)
            continue
        assert section in section_titles(task), f"{task}: {flag} is under {section!r}, not a named section"
        if flag.removeprefix("--") in MODEL_FIELDS:
            assert section.startswith(FLAG_GROUPS[MODEL_CONFIG_GROUP][0]), (flag, section)
        else:
            assert "(default: " in entry, f"{task}: {flag}'s help does not show its default: {entry!r}"


@pytest.mark.parametrize("task", TASKS)
def test_task_only_flags_show_only_for_their_task(task):
    entries = help_entries(build_parser(task).format_help())
    for names in TASK_FLAGS.values():
        for name in names:  # a flag several tasks own (GRPO's --beta, --temperature) shows for each of them
            owned = name in TASK_FLAGS.get(task, ())
            assert (f"--{name}" in entries) == owned, (task, name)
    own_sections = {FLAG_GROUPS[owner][0] for owner in TASK_FLAGS if owner == task}
    other_sections = {FLAG_GROUPS[owner][0] for owner in TASK_FLAGS if owner != task}
    sections = {section for section, _ in entries.values()}
    assert own_sections <= sections and not other_sections & sections


@pytest.mark.parametrize("task, flag, default", [
    ("pretrain", "optimizer", "muon"),
    ("pretrain", "learning_rate", "0.01"),
    ("pretrain", "preset", "cpu-wide"),
    ("pretrain", "max_steps", "400"),
    ("sft", "optimizer", "adamw"),
    ("sft", "learning_rate", "0.002"),
    ("sft", "max_steps", "2400"),
    ("sft", "max_seq_len", "384"),
    ("sft", "copy_rows", "unset"),
    ("sft", "copy_steps", "1200"),
    ("lora", "weight_decay", "0.0"),
    ("lora", "lora_rank", "8"),
    ("lora", "merge", "False"),
    ("dpo", "batch_size", "8"),
    ("dpo", "beta", "0.15"),
    ("dpo", "loss_type", "sigmoid"),
    ("dpo", "label_smoothing", "0.0"),
    ("dpo", "discopop_tau", "0.05"),
    ("dpo", "loss_weights", "1 each"),
    ("distill", "alpha", "0.5"),
    ("distill", "temperature", "2.0"),
    ("distill", "distill_data", "sft"),
    ("distill", "teacher", "out/sft"),
    ("grpo", "beta", "0.02"),
    ("grpo", "temperature", "1.0"),
    ("grpo", "num_generations", "4"),
    ("grpo", "loss_type", "grpo"),
    ("grpo", "num_iterations", "1"),
    ("ppo", "num_generations", "1"),
    ("ppo", "beta", "0.05"),
    ("ppo", "ppo_epochs", "2"),
    ("ppo", "lam", "0.95"),
])
def test_help_shows_the_tasks_own_default(task, flag, default):
    _, entry = help_entries(build_parser(task).format_help())[f"--{flag}"]
    assert entry.endswith(f"(default: {default})"), entry


@pytest.mark.parametrize("script, default", [("trainer/train_pretrain.py", "muon"),
                                             ("trainer/train_full_sft.py", "adamw")])
def test_trainer_help_command(script, default, capsys, monkeypatch):
    """The script itself, run as `python SCRIPT --help` would run it (in this process: no interpreter start-up)."""
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / script), run_name="__main__")
    assert exit_info.value.code == 0
    entries = help_entries(capsys.readouterr().out)
    assert entries["--optimizer"][1].endswith(f"(default: {default})")
    assert entries["--norm_type"][0].startswith("model config (default: ")


@pytest.mark.parametrize("task, flag, section, words", [
    ("dpo", "beta", "DPO", "pull toward the reference model"),
    ("dpo", "loss_type", "DPO", "sigmoid | ipo | hinge | robust | exo_pair | nca_pair | bco_pair | sppo_hard | aot | "
                                "aot_unpaired | aot_pair | apo_zero | apo_down | discopop | sigmoid_norm | sft, "
                                "TRL's names: DPO's -log sigmoid"),
    ("grpo", "loss_type", "GRPO", "grpo | dr_grpo | bnpo | dapo | cispo (trainer/rl_losses.py"),
    ("grpo", "beta", "GRPO", "the k3 KL to the reference model"),
    ("distill", "temperature", "distillation", "softmax temperature"),
    ("grpo", "temperature", "GRPO", "sampling temperature"),
    ("ppo", "beta", "PPO", "paid per token in the rewards"),
    ("ppo", "reward", "PPO", "TRL's signature"),
])
def test_a_shared_flag_has_each_tasks_section_and_help(task, flag, section, words):
    found, entry = help_entries(build_parser(task).format_help())[f"--{flag}"]
    assert found == section and words in entry


def test_scale_rewards_none_is_a_value_and_unset_resolves_by_loss_type(tmp_path):
    """TRL's `none` is --scale_rewards' value (no std), not the word that unsets other flags; unset, the run records
    the value it uses: group, and none for dr_grpo (the behaviour before the flag)."""
    from trainer.args import parse_args

    assert parse_args("grpo", []).scale_rewards == "group"
    assert parse_args("grpo", ["--loss_type", "dr_grpo"]).scale_rewards == "none"
    for loss_type in ("bnpo", "dapo", "cispo"):  # TRL's default, group, for every loss type but Dr. GRPO
        assert parse_args("grpo", ["--loss_type", loss_type]).scale_rewards == "group"
    assert parse_args("grpo", ["--loss_type", "dr_grpo", "--scale_rewards", "group"]).scale_rewards == "group"
    assert parse_args("grpo", ["--scale_rewards", "none"]).scale_rewards == "none"
    assert parse_args("grpo", ["--scale_rewards", "batch"]).to_dict()["scale_rewards"] == "batch"
    config = tmp_path / "grpo.yaml"
    config.write_text("scale_rewards: none\n")
    assert parse_args("grpo", ["--config", str(config)]).scale_rewards == "none"
    _, entry = help_entries(build_parser("grpo").format_help())["--scale_rewards"]
    assert "group | batch | none: what divides" in entry and entry.endswith("(default: none with --loss_type dr_grpo, "
                                                                        "else group)")


def test_grpo_rewards_repeat_and_the_command_line_replaces_the_configs(tmp_path):
    from trainer.args import parse_args

    assert parse_args("grpo", []).reward == ["math_answer"]
    args = parse_args("grpo", ["--reward", "a.py:f", "--reward", "length_penalty", "--reward_weights", "1", "0.5"])
    assert args.reward == ["a.py:f", "length_penalty"] and args.reward_weights == [1.0, 0.5]
    config = tmp_path / "grpo.yaml"
    config.write_text("reward: [math_answer, repetition_penalty]\n")
    assert parse_args("grpo", ["--config", str(config)]).reward == ["math_answer", "repetition_penalty"]
    assert parse_args("grpo", ["--config", str(config), "--reward", "b.py:g"]).reward == ["b.py:g"]


def test_dpo_loss_types_and_weights_take_trls_space_separated_lists_and_commas(tmp_path):
    """`--loss_type sigmoid sft --loss_weights 0.8 0.2` (TRL's list flags) and `sigmoid,sft` / `0.8,0.2` are one
    setting, kept as one comma-separated string and a list of floats; a YAML config takes a list or the string a
    run's train_config.yaml records; GRPO's --loss_type stays one name."""
    from trainer.args import parse_args

    spaced = parse_args("dpo", ["--loss_type", "sigmoid", "sft", "--loss_weights", "0.8", "0.2"])
    commas = parse_args("dpo", ["--loss_type", "sigmoid,sft", "--loss_weights", "0.8,0.2"])
    assert (spaced.loss_type, spaced.loss_weights) == (commas.loss_type, commas.loss_weights) == ("sigmoid,sft",
                                                                                                  [0.8, 0.2])
    assert spaced.to_dict()["loss_type"] == "sigmoid,sft" and parse_args("dpo", []).loss_weights is None
    for text in ("loss_type: [bco_pair, sft]\nloss_weights: [1, 0.5]\n", "loss_type: bco_pair,sft\n"
                                                                      "loss_weights: [1.0, 0.5]\n",
                 "loss_type: bco_pair, sft\nloss_weights: [1.0, 0.5]\n"):  # the space after the comma dropped
        config = tmp_path / "dpo.yaml"
        config.write_text(text)
        args = parse_args("dpo", ["--config", str(config)])
        assert (args.loss_type, args.loss_weights) == ("bco_pair,sft", [1.0, 0.5])
    with pytest.raises(SystemExit):
        parse_args("grpo", ["--loss_type", "grpo", "dapo"])


@pytest.mark.parametrize("flags, message", [
    (["--num_generations", "1"], "--num_generations=1 is not allowed; it must be >= 2 (advantages compare a "
                                 "prompt's completions with each other)"),
    (["--loss_type", "ppo"], "--loss_type='ppo' is not allowed; choose one of grpo, dr_grpo, bnpo, dapo, cispo"),
    (["--beta", "-1"], "--beta=-1.0 is not allowed; it must be a number >= 0 (0: no reference model)"),
    (["--top_p", "0"], "--top_p=0.0 is not allowed; it must be in (0, 1]"),
    (["--reward", "math_answer", "--reward_weights", "1", "2"],
     "--reward_weights=[1.0, 2.0] is not allowed; give one weight per --reward (1)"),
])
def test_bad_grpo_flags_are_one_line(flags, message, capsys):
    from trainer.args import parse_args

    with pytest.raises(SystemExit):
        parse_args("grpo", flags)
    assert capsys.readouterr().err.splitlines()[0] == f"error: {message}"


DPO_LOSS_TYPES = ("sigmoid, ipo, hinge, robust, exo_pair, nca_pair, bco_pair, sppo_hard, aot, aot_unpaired, aot_pair, "
                  "apo_zero, apo_down, discopop, sigmoid_norm, sft")
SMOOTHING_REFUSED = ("--label_smoothing=0.1 is not allowed; only --loss_type sigmoid, robust, exo_pair, aot, "
                     "aot_unpaired, aot_pair uses it: give one of those loss types with it, or leave --label_smoothing "
                     "out")


@pytest.mark.parametrize("task, flags, message", [
    ("grpo", ["--num_iterations", "0"], "--num_iterations=0 is not allowed; it must be >= 1"),
    ("ppo", ["--num_generations", "0"], "--num_generations=0 is not allowed; it must be >= 1"),
    ("ppo", ["--ppo_epochs", "0"], "--ppo_epochs=0 is not allowed; it must be >= 1"),
    ("ppo", ["--gamma", "1.5"], "--gamma=1.5 is not allowed; it must be in [0, 1]"),
    ("ppo", ["--vf_coef", "0"], "--vf_coef=0.0 is not allowed; it must be a positive number"),
    ("ppo", ["--epsilon", "-0.2"], "--epsilon=-0.2 is not allowed; it must be a positive number"),
    ("sft", ["--sft_data", "tool"], "--sft_data='tool' is not allowed; choose one of tools, chat"),
    ("dpo", ["--loss_type", "grpo"], f"--loss_type='grpo' is not allowed; choose one or several (comma-separated) of "
                                     f"{DPO_LOSS_TYPES}"),
    ("dpo", ["--loss_type", "sigmoid", "kto"], f"--loss_type='kto' is not allowed; choose one or several "
                                               f"(comma-separated) of {DPO_LOSS_TYPES}"),
    ("dpo", ["--loss_type", "sigmoid,sft", "--loss_weights", "1"],
     "--loss_weights=[1.0] is not allowed; give one weight per --loss_type (2)"),
    ("dpo", ["--loss_type", "sigmoid", "sft", "--loss_weights", "1,nan"],
     "--loss_weights=[1.0, nan] is not allowed; every weight must be a finite number >= 0"),
    # a negative weight was taken and maximised its loss (the DPO loss rose, 0.693 -> 0.71, the preference turned
    # round); all 0 trained nothing at a logged loss of 0 (found by a hostile flag-value hunt)
    ("dpo", ["--loss_weights", "-1"], "--loss_weights=[-1.0] is not allowed; every weight must be a finite number "
                                      ">= 0"),
    ("dpo", ["--loss_type", "sigmoid", "sft", "--loss_weights", "1", "-0.5"],
     "--loss_weights=[1.0, -0.5] is not allowed; every weight must be a finite number >= 0"),
    ("dpo", ["--loss_type", "sigmoid", "sft", "--loss_weights", "0", "0"],
     "--loss_weights=[0.0, 0.0] is not allowed; at least one weight must be > 0 (all 0: the loss is 0 and nothing "
     "trains)"),
    ("dpo", ["--loss_weights", "a"], "argument --loss_weights: 'a' is not a number or comma-separated numbers"),
    ("dpo", ["--loss_type", "exo_pair"], "--label_smoothing=0.0 is not allowed; --loss_type exo_pair needs its "
                                         "epsilon > 0 (the EXO paper recommends 1e-3)"),
    ("dpo", ["--loss_type", "discopop", "--discopop_tau", "0"],
     "--discopop_tau=0.0 is not allowed; it must be a positive number"),
    ("dpo", ["--loss_type", "discopop", "--discopop_tau", "inf"],
     "--discopop_tau=inf is not allowed; it must be a positive number"),
    ("dpo", ["--loss_weights", "1", "0.5"], "--loss_weights=[1.0, 0.5] is not allowed; give one weight per --loss_type "
                                            "(1)"),
    ("dpo", ["--discopop_tau", "0.1"], "--discopop_tau=0.1 is not allowed; only --loss_type discopop uses it: give "
                                       "--loss_type discopop with it, or leave --discopop_tau out"),
    ("grpo", ["--scale_rewards", "std"], "--scale_rewards='std' is not allowed; choose one of group, batch, none"),
    # all 0 were taken: every score 0, GRPO's advantages 0 (a 2-step run logged loss 0.0 at each step), PPO's policy
    # moved by its critic's noise alone (found by a hostile flag-value hunt); a negative weight (a penalty) is taken
    *[(task, ["--reward", "math_answer", "--reward", "length_penalty", "--reward_weights", "0", "0"],
       "--reward_weights=[0.0, 0.0] is not allowed; at least one weight must be non-zero (all 0: every score is 0 and "
       "the policy learns from none)") for task in ("grpo", "ppo")],
    ("ppo", ["--scale_rewards", "group"], "unrecognized arguments: --scale_rewards group"),
    # a rollout's temperature past OpenAI's 2 (chat's and the server's bound) sampled every token all but alike
    *[(task, ["--temperature", value], f"--temperature={shown} is not allowed; it must be in 1e-05 .. 2 (OpenAI's "
                                       f"range, chat's and the server's, less its 0: the completions are sampled)")
      for task in ("grpo", "ppo") for value, shown in (("1e308", "1e+308"), ("2.01", "2.01"), ("1e-6", "1e-06"))],
    ("dpo", ["--label_smoothing", "0.5"], "--label_smoothing=0.5 is not allowed; it must be in [0, 0.5)"),
    ("dpo", ["--label_smoothing", "-0.1"], "--label_smoothing=-0.1 is not allowed; it must be in [0, 0.5)"),
    # robust's loss is DPO's minus eps / (1 - 2 eps) x the margin: 0.4999999 trained to a loss of about -82,000
    ("dpo", ["--loss_type", "robust", "--label_smoothing", "0.4999999"],
     "--label_smoothing=0.4999999 is not allowed; --loss_type robust takes it in [0, 0.4]: its loss is DPO's minus "
     "eps / (1 - 2 eps) x the margin, which grows without bound as eps nears 0.5"),
    ("dpo", ["--loss_type", "hinge", "--label_smoothing", "0.1"],
     SMOOTHING_REFUSED),
    ("dpo", ["--loss_type", "ipo", "--label_smoothing", "0.1"],
     SMOOTHING_REFUSED),
    ("dpo", ["--loss_type", "bco_pair,sft", "--label_smoothing", "0.1"], SMOOTHING_REFUSED),
    ("dpo", ["--label_smoothing", "nan"], "--label_smoothing=nan is not allowed; it must be in [0, 0.5)"),
    ("dpo", ["--beta", "inf"], "--beta=inf is not allowed; it must be a positive number"),
    ("grpo", ["--label_smoothing", "0.1"], "unrecognized arguments: --label_smoothing 0.1"),
    ("pretrain", ["--copy_cue_pairs", "-1"], "--copy_cue_pairs=-1 is not allowed; it must be >= 0 (0: no cue pairs)"),
    # 1 was taken and refused once the run had started, by the dataset ("max_seq_len must be at least 2, got 1")
    *[(task, ["--max_seq_len", "1"], "--max_seq_len=1 is not allowed; it must be >= 2 (a sample's first token and the "
                                     "next one it learns to predict)") for task in ("pretrain", "sft", "dpo")],
    # 10**30 rows were a TypeError traceback from torch.randint once the model was built (found by fuzzing the flags)
    ("pretrain", ["--copy_rows", str(10 ** 30)], f"--copy_rows={10 ** 30} is not allowed; it must be in 0 .. "
                                                 f"2147483647 (0: no copy rows)"),
    # the copy flags shape rows that --copy_rows 0 (pretraining's default) leaves out: they were taken and ignored
    ("pretrain", ["--copy_cue_pairs", "4"], "--copy_cue_pairs=4 is not allowed; only --copy_rows N > 0 uses it: give "
                                            "--copy_rows N with it, or leave --copy_cue_pairs out"),
    ("sft", ["--copy_rows", "0", "--copy_weight", "2"], "--copy_weight=2.0 is not allowed; only --copy_rows N > 0 "
                                                        "uses it: give --copy_rows N with it, or leave --copy_weight "
                                                        "out"),
    ("sft", ["--sft_data", "tools", "--data_path", "my.jsonl"],
     "--sft_data='tools' is not allowed; only a run without --data_path (the file is the data) uses it: leave "
     "--data_path out, or leave --sft_data out"),
])
def test_bad_task_flags_are_one_line(task, flags, message, capsys):
    from trainer.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(task, flags)
    assert capsys.readouterr().err.splitlines()[0] == f"error: {message}"


def test_an_unknown_task_lists_the_tasks_as_every_choice_is_listed():
    """The tasks joined by commas, as every other "choose one of" message lists its values, where this one printed
    the Python tuple ("choose one of ('pretrain', 'sft', ...)")."""
    from trainer.args import check_args

    with pytest.raises(ValueError) as refused:
        check_args("pretrian", [])
    assert str(refused.value) == ("--task='pretrian' is not allowed; choose one of pretrain, sft, lora, dpo, distill, "
                                  "grpo, ppo")


def test_sft_gives_the_model_smeared_keys_unless_told_not_to():
    """SFT's default adds smeared keys (its copy rows need them); --smeared_keys false keeps a plain model plain;
    the other fine-tuning tasks set no model field by default."""
    from trainer.arg_fields import requested_model_fields
    from trainer.args import parse_args

    assert requested_model_fields(parse_args("sft", [])) == {"smeared_keys": True}
    assert requested_model_fields(parse_args("sft", ["--smeared_keys", "false"])) == {"smeared_keys": False}
    assert all(requested_model_fields(parse_args(task, [])) == {} for task in ("lora", "dpo", "distill", "grpo", "ppo"))


def test_unset_copy_rows_teach_only_a_model_given_smeared_keys_in_this_run():
    from trainer.arg_fields import COPY_ROWS_TO_LEARN, resolve_copy_rows
    from trainer.args import parse_args
    sft = parse_args("sft", [])
    assert sft.copy_rows is None
    assert resolve_copy_rows(sft, ["smeared_keys"]) == COPY_ROWS_TO_LEARN > 0
    assert resolve_copy_rows(sft, []) == 0
    assert resolve_copy_rows(parse_args("sft", ["--copy_rows", "3"]), []) == 3
    assert resolve_copy_rows(parse_args("pretrain", []), []) == 0


# A --config YAML value goes through its flag's own conversion and checks: (task, YAML, the error after the file).
@pytest.mark.parametrize("task, text, message", [
    ("pretrain", "batch_size: null\n", "key 'batch_size': expected an integer, got null"),
    ("pretrain", "batch_size: 1.5\n", "key 'batch_size': expected an integer, got 1.5"),
    ("pretrain", "batch_size: true\n", "key 'batch_size': expected an integer, got true"),
    ("pretrain", "max_steps: 2.5\n", "key 'max_steps': expected an integer, got 2.5"),
    ("pretrain", "seed: 1.5\n", "key 'seed': 1.5 is not an integer in 0 .. 4294967295"),
    ("pretrain", "seed: -1\n", "key 'seed': -1 is not an integer in 0 .. 4294967295"),
    ("pretrain", "learning_rate: [0.1]\n", "key 'learning_rate': expected a number, got a list"),
    ("pretrain", "learning_rate: fast\n", "key 'learning_rate': expected a number, got 'fast'"),
    ("pretrain", "compile: off\n", "key 'compile': expected a string, got false (YAML reads unquoted on/off/yes/no "
                                   "as booleans: quote it)"),
    ("pretrain", "qk_norm: maybe\n", "key 'qk_norm': expected a boolean (true/false), got 'maybe'"),
    ("pretrain", "hidden_size: 64.5\n", "key 'hidden_size': expected an integer, got 64.5"),
    ("pretrain", "norm_type: bogus\n", "key 'norm_type': expected one of rmsnorm, prmsnorm, layernorm, dyt, none, "
                                       "got 'bogus'"),
    ("pretrain", "out_dir: ''\n", "key 'out_dir': expected a path, got an empty value"),
    # with --overwrite, a templated `out_dir:` left empty cleared out/pretrain
    ("pretrain", "out_dir:\n", "key 'out_dir': expected a directory, got null (an empty value); leave the key out "
                                "for the task's default"),
    ("pretrain", "data_path: none\n", "key 'data_path': 'none' is not a path; leave the flag out for its default"),
    # a lone surrogate no file name holds: the run failed later, "'utf-8' codec can't encode character", naming no key
    ("pretrain", 'out_dir: "run\\ud800"\n', "key 'out_dir': not valid UTF-8 (U+D800 at character 3)"),
    ("sft", 'data_path: "\\udfff.jsonl"\n', "key 'data_path': not valid UTF-8 (U+DFFF at character 0)"),
    ("pretrain", "gradient_checkpointing: {a: 1}\n", "key 'gradient_checkpointing': expected a boolean (true/false), "
                                                     "got a mapping"),
    ("lora", "lora_targets: [q_proj, v_proj]\n", "key 'lora_targets': expected a string, got a list"),
    ("grpo", "reward: [math_answer, null]\n", "key 'reward': expected a string, got null"),
    ("grpo", "reward: []\n", "key 'reward': expected one or more values, got an empty list"),
    ("grpo", "reward_weights: [1, x]\n", "key 'reward_weights': expected a number, got 'x'"),
    ("grpo", "reward_weights: null\nreward: [a.py:f, b.py:g]\n", None),  # null: unset, then 1 each
])
def test_config_values_are_converted_and_checked_as_their_flags(task, text, message, tmp_path, capsys):
    from trainer.args import parse_args

    config = tmp_path / "run.yaml"
    config.write_text(text)
    if message is None:
        parse_args(task, ["--config", str(config)])
        return
    with pytest.raises(SystemExit):
        parse_args(task, ["--config", str(config)])
    assert capsys.readouterr().err.splitlines()[0] == f"error: --config {config}: {message}"


def test_config_values_take_what_the_command_line_takes(tmp_path, monkeypatch):
    import trainer.threads
    from trainer.args import parse_args

    monkeypatch.setattr(trainer.threads, "usable_cores", lambda: 4)  # threads: 3 within them on any machine

    config = tmp_path / "run.yaml"
    config.write_text("reward: length_penalty\nreward_weights: 2\nthreads: 3\nlearning_rate: 1\npeak_flops: 1e12\n"
                      "data_path: null\nhidden_size: null\ndropout: 0.25\nbatch_size: '4'\nmax_steps: 7\n")
    args = parse_args("grpo", ["--config", str(config)])
    assert (args.reward, args.reward_weights, args.threads) == (["length_penalty"], [2.0], "3")
    assert (args.learning_rate, args.peak_flops, args.data_path) == (1.0, 1e12, None)
    assert (args.model, args.batch_size, args.max_steps) == ({"dropout": 0.25}, 4, 7)  # what fine-tuning may set
    assert parse_args("grpo", ["--config", str(config), "--batch_size", "2"]).batch_size == 2  # flags still win


def test_a_runs_recorded_config_is_taken_by_its_own_trainer_only(tmp_path, capsys):
    """train_config.yaml (`task:` and `run_id:` beside the flags) is a --config: its own task's trainer takes its
    flags, not how that run started (its id, --resume, --overwrite: a copy never clears the run it came from), and a
    fine-tuning run's recorded architecture is the starting model's, which --from_weight gives again."""
    from trainer.args import parse_args

    config = tmp_path / "train_config.yaml"
    config.write_text("task: pretrain\nrun_id: 0123abcd\nresume: auto\noverwrite: true\nbatch_size: 3\n"
                      "hidden_size: 80\nnorm_impl: eager\n")
    args = parse_args("pretrain", ["--config", str(config)])
    assert (args.batch_size, args.resume, args.overwrite) == (3, None, False)
    assert args.model == {"hidden_size": 80, "norm_impl": "eager"}
    assert parse_args("pretrain", ["--config", str(config), "--resume", "auto"]).resume == "auto"
    config.write_text("task: sft\nrun_id: 0123abcd\nbatch_size: 3\nhidden_size: 48\nnorm_type: layernorm\n"
                      "norm_impl: eager\ndropout: 0.1\nsmeared_keys: true\n")
    args = parse_args("sft", ["--config", str(config)])
    assert args.model == {"norm_impl": "eager", "dropout": 0.1, "smeared_keys": True} and args.batch_size == 3
    for task, text, message in (
            ("pretrain", "task: sft\n", f"a sft run's config (task: sft); this is the pretrain trainer: run it with "
                                        f"`python trainer/train_full_sft.py --config {config}`"),
            ("sft", "task: chat\n", "key 'task': 'chat' is not one of pretrain, sft, lora, dpo, distill, grpo, ppo"),
            ("pretrain", "run_id: 0123abcd\n", "unknown key 'run_id'; allowed keys are the trainer's flags (see "
                                               "--help)")):  # a hand-written YAML: only flags
        config.write_text(text)
        with pytest.raises(SystemExit):
            parse_args(task, ["--config", str(config)])
        assert capsys.readouterr().err.splitlines()[0] == f"error: --config {config}: {message}"


def test_every_committed_config_still_parses():
    from trainer.args import parse_args

    variants = sorted((REPO / "scripts/sweep_configs/study2_variants").glob("*.yaml"))
    variants += sorted((REPO / "scripts/sweep_configs/study2_lr_seed2_rates").glob("*.yaml"))
    assert len(variants) == 24
    for path in variants:
        parse_args("pretrain", ["--config", str(path)])
    # runs' own train_config.yaml, written when every trainer recorded --preset and --from_weight: the way to
    # finish a stopped run (README) takes them, less the flag the trainer no longer has
    recorded = sorted((REPO / "eval/studies/results").rglob("train_config.yaml"))
    assert recorded
    for path in recorded:
        parse_args("pretrain", ["--config", str(path)])


def test_a_recorded_config_of_a_fine_tuning_run_from_before_preset_was_pretrainings_parses(tmp_path):
    from trainer.args import parse_args

    config = tmp_path / "train_config.yaml"
    config.write_text("task: sft\nrun_id: 0123abcd\npreset: cpu-default\nfrom_weight: out/pretrain\nbatch_size: 3\n")
    args = parse_args("sft", ["--config", str(config)])
    assert (args.from_weight, args.batch_size) == ("out/pretrain", 3)


def test_a_config_that_is_not_a_utf8_file_is_one_line(tmp_path, capsys):
    from trainer.args import parse_args

    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"wandb_run_name: caf\xe9\n")
    twice = tmp_path / "twice.yaml"  # PyYAML keeps the last silently: which one did the user mean?
    twice.write_text("learning_rate: 0.01\nbatch_size: 4\nlearning_rate: 0.001\n", encoding="utf-8")
    for config, message in ((tmp_path, "is a directory, not a YAML file"),
                            (latin, "not valid UTF-8 (byte 0xe9 at offset 19)"),
                            (twice, 'duplicate key "learning_rate" (line 3)')):
        with pytest.raises(SystemExit):
            parse_args("pretrain", ["--config", str(config)])
        assert capsys.readouterr().err.splitlines()[0] == f"error: --config {config}: {message}"


def test_a_config_that_is_a_fifo_is_refused_before_it_is_opened(tmp_path, capsys):
    """train_grpo.py --config on a FIFO nobody writes to (a shell's <(...) whose command waits) waited in open() for
    ever, without a word; a --config that is not a regular file is refused unopened, as a data path is."""
    import os
    import subprocess

    from trainer.args import parse_args

    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    refusal = (f"error: --config {fifo}: is a FIFO (a pipe), not a regular file; a YAML file must be a regular file "
               f"(write it to one first)")
    # in a process of its own: opened, the FIFO would hold the test up, not fail it
    run = subprocess.run([sys.executable, "trainer/train_grpo.py", "--config", str(fifo), "--max_steps", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.splitlines()[0] == refusal
    for task in ("ppo", "pretrain"):
        with pytest.raises(SystemExit):
            parse_args(task, ["--config", str(fifo)])
        assert capsys.readouterr().err.splitlines()[0] == refusal


@pytest.mark.parametrize("text, message", [
    # PyYAML's patterns take these for a date, a bool, an int: its constructors then failed as Python does
    ("seed: 1\nwandb_run_name: 2001-02-30\n", '"2001-02-30" is not a valid timestamp (day is out of range for month) '
                                              "(line 2)"),
    ("compile: !!bool maybe\n", '"maybe" is not a valid bool (line 1)'),  # was a KeyError traceback
    ("wandb_run_name: !!timestamp soon\n", '"soon" is not a valid timestamp (line 1)'),  # an AttributeError one
    # a long value quoted as every refusal quotes one (dataset/shown_value.py's cut: the quote mark and 56 more of
    # its 60 characters, then "..."), as written (not \u escapes), a newline escaped: one short line
    ("seed: " + "9" * 5000 + "\n", f'"{"9" * 56}... is not a valid int (line 1)'),
    ('seed: !!int "' + "é" * 5000 + '\\nx"\n', f'"{"é" * 56}... is not a valid int (line 1)'),
    ('seed: !!int "1\\n2"\n', '"1\\n2" is not a valid int (line 1)'),
    ("seed: !!map 3\n", "expected a mapping node, but found scalar (line 1)"),  # a ValueError of unpacking
    ("seed: " + "[" * 3000 + "]" * 3000 + "\n", "invalid YAML (nested too deeply)"),  # a RecursionError traceback
    ("seed: !!python/object:os.system {}\n",
     "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object:os.system' (line 1)"),
])
def test_a_config_value_yaml_cannot_construct_is_one_line_naming_the_file_and_line(tmp_path, capsys, text, message):
    config, refusal = _config_refusal(tmp_path, capsys, text)
    assert refusal == f"error: --config {config}: {message}"


def _config_refusal(tmp_path: Path, capsys, text: str) -> tuple[Path, str]:
    """A --config file holding `text`, and the first line of pretraining's refusal of it."""
    from trainer.args import parse_args

    config = tmp_path / "run.yaml"
    config.write_text(text, encoding="utf-8")
    with pytest.raises(SystemExit):
        parse_args("pretrain", ["--config", str(config)])
    return config, capsys.readouterr().err.splitlines()[0]


# A path flag never takes an empty value ("$UNSET") or none for its default: --out_dir "" --overwrite would clear
# the default run's directory.
EMPTY = "expected a path, got an empty value"
NOT_A_PATH = "is not a path; leave the flag out for its default"


@pytest.mark.parametrize("task, flags, message", [
    ("pretrain", ["--out_dir", ""], f"argument --out_dir: {EMPTY}"),
    ("pretrain", ["--out_dir", " "], f"argument --out_dir: {EMPTY}"),
    ("pretrain", ["--out_dir", "none"], f"argument --out_dir: 'none' {NOT_A_PATH}"),
    ("pretrain", ["--data_path", ""], f"argument --data_path: {EMPTY}"),
    ("pretrain", ["--val_data_path", "NULL"], f"argument --val_data_path: 'NULL' {NOT_A_PATH}"),
    ("pretrain", ["--tokenizer_path", ""], f"argument --tokenizer_path: {EMPTY}"),
    ("pretrain", ["--resume", ""], f"argument --resume: {EMPTY}"),
    ("pretrain", ["--config", ""], f"argument --config: {EMPTY}"),
    ("sft", ["--from_weight", ""], f"argument --from_weight: {EMPTY}"),
    ("sft", ["--from_weight", "none"], f"argument --from_weight: 'none' {NOT_A_PATH}"),
    ("distill", ["--teacher", ""], f"argument --teacher: {EMPTY}"),
    ("grpo", ["--reward_model", ""], f"argument --reward_model: {EMPTY}"),
    ("grpo", ["--reward", ""], "argument --reward: expected a built-in or path/to/file.py:function, got an empty "
                               "value"),
])
def test_empty_path_flags_are_refused(task, flags, message, capsys):
    from trainer.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(task, flags)
    assert capsys.readouterr().err.splitlines()[0] == f"error: {message}"


def test_a_path_of_bytes_that_are_not_utf8_is_still_a_path():
    """argv holds a file name's bytes that are not UTF-8 as U+DC80..U+DCFF, which name that file: taken as given."""
    from trainer.args import parse_args

    assert parse_args("pretrain", ["--data_path", "caf\udce9.jsonl"]).data_path == "caf\udce9.jsonl"


@pytest.mark.parametrize("flags, message", [
    (["--seed", "-1"], "argument --seed: -1 is not an integer in 0 .. 4294967295"),
    (["--seed", str(2 ** 32)], "argument --seed: 4294967296 is not an integer in 0 .. 4294967295"),
    (["--max_steps", "0"], "--max_steps=0 is not allowed; it must be >= 1, or -1 (as many as --epochs give)"),
    (["--max_steps", "-5"], "--max_steps=-5 is not allowed; it must be >= 1, or -1 (as many as --epochs give)"),
    (["--peak_flops", "-1"], "--peak_flops=-1.0 is not allowed; it must be a positive number"),
    (["--peak_flops", "nan"], "--peak_flops=nan is not allowed; it must be a positive number"),
    (["--grad_clip", "nan"], "--grad_clip=nan is not allowed; it must be a number >= 0 (0: no clipping)"),
    (["--grad_clip", "-1"], "--grad_clip=-1.0 is not allowed; it must be a number >= 0 (0: no clipping)"),
    (["--num_proc", "-1"], "--num_proc=-1 is not allowed; it must be >= 1"),
    (["--num_proc", "0"], "--num_proc=0 is not allowed; it must be >= 1"),
    # each of these was a traceback once the run had started (an OverflowError, wandb's UsageError, torch's)
    (["--time_budget_s", "1e308"], "--time_budget_s=1e+308 is not allowed; it must be a number of seconds in 0 .. "
                                   "31536000 (a year; 0: no time budget)"),
    (["--dist_init_timeout", "100000000000000"], "--dist_init_timeout=100000000000000 is not allowed; it must be a "
                                                 "number of seconds in 1 .. 31536000 (a year)"),
    (["--dist_timeout", "0"], "--dist_timeout=0 is not allowed; it must be a number of seconds in 1 .. 31536000 "
                              "(a year)"),
    (["--wandb_project", "a/b"], "--wandb_project='a/b' is not allowed; it must be 1 to 128 characters, none of # % "
                                 "/ : ? \\"),
    (["--wandb_project", ""], "--wandb_project='' is not allowed; it must be 1 to 128 characters, none of # % / : ? "
                              "\\"),
    (["--threads", "99999999999"], f"--threads='99999999999' is not allowed; {THREADS_ALLOWED}"),
    # decoupled weight decay scales each weight by 1 - lr x decay per step: at lr x decay >= 1 it zeroes or flips the
    # weights; --weight_decay 1e30 trained one step into non-finite weights and crashed in the final sample
    (["--weight_decay", "1e30"], "--weight_decay=1e+30 is not allowed; with --learning_rate=0.01 it must be below "
                                 "1 / 0.01 (each step scales a weight by 1 - learning_rate x weight_decay)"),
    (["--learning_rate", "0.5", "--weight_decay", "2"], "--weight_decay=2.0 is not allowed; with --learning_rate=0.5 "
                                                        "it must be below 1 / 0.5 (each step scales a weight by 1 - "
                                                        "learning_rate x weight_decay)"),
    # the flag typed is the one named, beside the other's default
    (["--learning_rate", "1e30"], "--learning_rate=1e+30 is not allowed; with --weight_decay=0.1 it must be below "
                                  "1 / 0.1 (each step scales a weight by 1 - learning_rate x weight_decay)"),
    (["--optimizer", "muon", "--muon_lr", "0.5", "--muon_weight_decay", "2"],
     "--muon_weight_decay=2.0 is not allowed; with --muon_lr=0.5 it must be below 1 / 0.5 (each step scales a "
     "weight by 1 - muon_lr x muon_weight_decay)"),
])
def test_bad_numbers_are_one_line_naming_the_flag(flags, message, capsys):
    from trainer.args import parse_args

    with pytest.raises(SystemExit):
        parse_args("pretrain", flags)
    assert capsys.readouterr().err.splitlines()[0] == f"error: {message}"



ASCII_HINT = "(numbers are written in ASCII digits 0-9, without '_')"


@pytest.mark.parametrize("task, flag, value, refusal", [
    # Python's int() and float() read other scripts' digits and '_' between digits: each was taken (3, 10, 1.5)
    ("pretrain", "--max_steps", "٣", "argument --max_steps: invalid int value: '٣'"),
    ("pretrain", "--max_steps", "1_0", "argument --max_steps: invalid int value: '1_0'"),
    ("pretrain", "--learning_rate", "１.５", "argument --learning_rate: invalid float value: '１.５'"),
    ("pretrain", "--hidden_size", "٦٤", "argument --hidden_size: invalid int value: '٦٤'"),  # a model field's
    ("pretrain", "--num_proc", "1_6", "argument --num_proc: invalid int value: '1_6'"),  # unsettable int
    ("pretrain", "--seed", "٤٢", "argument --seed: ٤٢ is not an integer in 0 .. 4294967295"),
    ("pretrain", "--threads", "٢", f"--threads='٢' is not allowed; {THREADS_ALLOWED}"),
    ("grpo", "--reward_weights", "1_0", "argument --reward_weights: invalid float value: '1_0'"),
    ("dpo", "--loss_weights", "1,٢", "argument --loss_weights: '1,٢' is not a number or comma-separated numbers"),
])
def test_a_number_flag_takes_ascii_numbers_only(task, flag, value, refusal, capsys):
    from trainer.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(task, [flag, value])
    assert capsys.readouterr().err.splitlines()[0] == f"error: {refusal} {ASCII_HINT}"


@pytest.mark.parametrize("text, message", [
    ('max_steps: "٣"\n', "key 'max_steps': expected an integer, got '٣'"),
    ("learning_rate: '1_0.5'\n", "key 'learning_rate': expected a number, got '1_0.5'"),
    ('seed: "٤٢"\n', "key 'seed': ٤٢ is not an integer in 0 .. 4294967295"),
    ('hidden_size: "٦٤"\n', "key 'hidden_size': expected an integer, got '٦٤'"),
])
def test_a_configs_quoted_number_takes_ascii_numbers_only(text, message, tmp_path, capsys):
    """A --config value is read by its flag's reader: a quoted '٣' was max_steps 3."""
    config, refusal = _config_refusal(tmp_path, capsys, text)
    assert refusal == f"error: --config {config}: {message} {ASCII_HINT}"


@pytest.mark.parametrize("task, flags", [
    ("pretrain", ["--learning_rate", "0.5", "--weight_decay", "1.999"]),  # lr x decay just below 1
    ("pretrain", ["--learning_rate", "100", "--weight_decay", "0"]),  # no decay: no bound on the lr from it
    ("pretrain", ["--copy_rows", "2147483647"]),  # model/config.py's MAX_SIZE itself
    ("sft", ["--copy_weight", "2", "--copy_cue_pairs", "4"]),  # SFT's unset --copy_rows is resolved after parsing
    ("dpo", ["--loss_type", "sigmoid,sft", "--loss_weights", "0,1"]),  # one loss type weighed 0: the other's
    ("ppo", ["--reward", "length_penalty", "--reward_weights", "-0.5"]),  # a penalty alone, not all 0
])
def test_values_at_the_new_bounds_are_taken(task, flags):
    """The refusals of e1bec58 (lr x decay >= 1; Muon's pair beside AdamW is unused: test_args_unused.py) and
    91da41d (--copy_rows past MAX_SIZE, a copy flag beside --copy_rows 0) stop at their bounds: the values just
    inside still parse."""
    from trainer.args import parse_args

    args = parse_args(task, flags)
    assert all(flag[2:] in args.given for flag in flags[::2])


def test_the_documented_unset_words_still_unset():
    from trainer.args import parse_args

    args = parse_args("pretrain", ["--copy_rows", "none", "--num_proc", "null", "--max_steps", "-1", "--grad_clip",
                                   "0", "--seed", "0"])
    assert (args.copy_rows, args.num_proc, args.max_steps, args.grad_clip, args.seed) == (None, None, -1, 0.0, 0)


@pytest.mark.parametrize("flag", ["--sample_prompt", "--wandb_project", "--lora_targets"])
def test_a_text_flag_that_is_not_utf8_is_refused_at_the_start(flag, capsys):
    """argv keeps bytes that are not UTF-8 as lone surrogates: --sample_prompt failed in the tokenizer after the
    whole run had trained, with a traceback and no run_summary.json."""
    from trainer.args import parse_args

    with pytest.raises(SystemExit):
        parse_args("lora", [flag, "ab\udcffcd"])
    assert capsys.readouterr().err.splitlines()[0] == f"error: argument {flag}: not valid UTF-8 (byte 0xff at " \
                                                      "character 2)"


@pytest.mark.parametrize("task, flags", [("pretrain", ["--from_weight", "out/sft"]), ("sft", ["--preset", "cpu-deep"]),
                                         ("grpo", ["--preset", "cpu-deep"])])
def test_a_flag_the_task_would_ignore_is_not_its_flag(task, flags, capsys):
    """Pretraining starts a fresh model (--from_weight was taken and ignored, even a missing directory); a fine-tuning
    run takes its starting model's shape (--preset was taken and ignored)."""
    from trainer.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(task, flags)
    assert capsys.readouterr().err.splitlines()[0] == f"error: unrecognized arguments: {' '.join(flags)}"


@pytest.mark.parametrize("task", ["grpo", "ppo"])
@pytest.mark.parametrize("flag, bad, good", [("--lora_rank", "0", "4"), ("--lora_dropout", "5", "0.1"),
                                             ("--lora_targets", "nope", "q_proj"), ("--lora_alpha", "-1", "32"),
                                             ("--merge", "maybe", "true")])
def test_adapter_flags_without_lora_are_refused(task, flag, bad, good, capsys):
    """Without --lora an RL run trains the whole policy: the adapter flags were taken, invalid values too, and
    changed nothing (no adapters, no merged/ folder). Now a valid value is refused as unused, an invalid one as
    invalid (wherever it came from)."""
    from trainer.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(task, [flag, good])
    error = capsys.readouterr().err.splitlines()[0]
    assert error.startswith(f"error: {flag}=") and f"give --lora with it, or leave {flag} out" in error
    with pytest.raises(SystemExit):
        parse_args(task, [flag, bad])
    error = capsys.readouterr().err.splitlines()[0]
    assert f"{flag}" in error.split(";")[0] and "give --lora" not in error, error
    assert parse_args(task, ["--lora", flag, good]).lora


@pytest.mark.parametrize("task, flag, default, words", [
    ("ppo", "kl_estimator", "k1", "k1 | k3: the per-token estimate of the KL"),
    ("ppo", "whiten_rewards", "False", "whiten the per-token rewards before GAE"),
    ("ppo", "missing_eos_penalty", "0.0", "did not end with its end-of-turn token"),
    ("grpo", "importance_sampling_level", "token", "token | sequence: the importance ratio per token"),
])
def test_trls_rollout_options_are_their_trainers_flags_with_trls_defaults(task, flag, default, words):
    """TRL's PPOConfig kl_estimator, whiten_rewards, missing_eos_penalty (None there: no penalty, 0 here) and
    GRPOConfig importance_sampling_level, in their trainer's --help section with TRL's defaults; the other rollout
    trainer does not take them (TRL's GRPO has no missing_eos_penalty, its PPO no sequence-level ratio)."""
    from trainer.args import parse_args

    section, entry = help_entries(build_parser(task).format_help())[f"--{flag}"]
    assert section.startswith(task.upper()) and words in entry and entry.endswith(f"(default: {default})"), entry
    assert str(getattr(parse_args(task, []), flag)) == default
    other = "grpo" if task == "ppo" else "ppo"
    assert f"--{flag}" not in help_entries(build_parser(other).format_help())


@pytest.mark.parametrize("settings, task, fields", [
    ("trainer.ppo:PPOSettings", "ppo", {"kl_estimator": "kl_estimator", "whiten_rewards": "whiten_rewards",
                                        "missing_eos_penalty": "missing_eos_penalty"}),
    ("trainer.grpo:RolloutSettings", "grpo", {"importance_sampling_level": "importance_sampling_level"}),
    ("trainer.distillation:CompletionSettings", "distill", {"lmbda": "lmbda", "seq_kd": "seq_kd",
                                                            "max_new_tokens": "max_new_tokens",
                                                            "temperature": "sampling_temperature"}),
])
def test_an_objectives_settings_default_to_their_flags_defaults(settings, task, fields):
    """The settings dataclasses the trainer fills from the flags default to the flags' own defaults (TRL's), so one
    built in code without them behaves as a run without the flags (mutants of each default survived every test)."""
    import dataclasses
    import importlib

    from trainer.arg_fields import task_default

    module, name = settings.split(":")
    defaults = {field.name: field.default for field in dataclasses.fields(getattr(importlib.import_module(module),
                                                                                 name))}
    assert {field: defaults[field] for field in fields} == {field: task_default(task, flag)
                                                            for field, flag in fields.items()}


@pytest.mark.parametrize("task, flags, message", [
    ("ppo", ["--kl_estimator", "k2"], "--kl_estimator='k2' is not allowed; choose one of k1, k3"),
    # --beta 0 loads no reference: the rewards pay no KL and the logged one is 0, whatever the estimator
    ("ppo", ["--kl_estimator", "k3", "--beta", "0"], "--kl_estimator='k3' is not allowed; only --beta > 0 (the KL "
                                                     "the rewards pay) uses it: give --beta > 0 with it, or leave "
                                                     "--kl_estimator out"),
    ("ppo", ["--missing_eos_penalty", "-1"],
     "--missing_eos_penalty=-1.0 is not allowed; it must be a number >= 0 (0: no penalty)"),
    ("ppo", ["--missing_eos_penalty", "nan"],
     "--missing_eos_penalty=nan is not allowed; it must be a number >= 0 (0: no penalty)"),
    ("ppo", ["--missing_eos_penalty", "inf"],
     "--missing_eos_penalty=inf is not allowed; it must be a number >= 0 (0: no penalty)"),
    ("grpo", ["--importance_sampling_level", "seq"],
     "--importance_sampling_level='seq' is not allowed; choose one of token, sequence"),
    # at a rollout's only update the ratio is 1 and the sequence ratio's gradient the per-token one's: no GSPO
    ("grpo", ["--importance_sampling_level", "sequence"],
     "--importance_sampling_level='sequence' is not allowed; only --num_iterations 2 or more (a rollout's later "
     "updates) uses it: give --num_iterations 2 or more with it, or leave --importance_sampling_level out"),
    ("grpo", ["--missing_eos_penalty", "1"], "unrecognized arguments: --missing_eos_penalty 1"),
    ("ppo", ["--importance_sampling_level", "sequence"],
     "unrecognized arguments: --importance_sampling_level sequence"),
])
def test_bad_trl_rollout_options_are_one_line(task, flags, message, capsys):
    from trainer.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(task, flags)
    assert capsys.readouterr().err.splitlines()[0] == f"error: {message}"
    good = {"--kl_estimator": "k3", "--missing_eos_penalty": "1.5", "--importance_sampling_level": "sequence"}
    if "unrecognized" not in message:
        parsed = parse_args(task, [flags[0], good[flags[0]], *(["--num_iterations", "2"] if task == "grpo" else [])])
        assert str(getattr(parsed, flags[0][2:])) == good[flags[0]]


HUGE = str(10 ** 30)
PAST_MAX_SIZE = "it must be at most 2147483647 (MAX_SIZE, model/config.py: past it no run ends, no batch or group fits)"


@pytest.mark.parametrize("task, flag", [
    *[(task, flag) for task in ("pretrain", "sft", "lora", "dpo", "distill", "grpo", "ppo")
      for flag in ("--max_steps", "--epochs", "--batch_size", "--accumulation_steps")],
    ("grpo", "--num_generations"), ("ppo", "--num_generations"), ("grpo", "--num_iterations"), ("ppo", "--ppo_epochs"),
    ("distill", "--max_new_tokens"),
])
def test_a_count_past_max_size_is_refused_in_one_line(task, flag, capsys):
    """10**30 was taken: --max_steps 10**30 trained on with no end, and GRPO's and PPO's --num_generations 10**30
    listed the group's prompts for ever (so did 2**31 - 1, and with --lmbda distillation sampled to the context's
    end each step)."""
    from trainer.args import parse_args

    lmbda = ["--lmbda", "0.5"] if flag == "--max_new_tokens" else []
    with pytest.raises(SystemExit):
        parse_args(task, [flag, HUGE, *lmbda])
    assert capsys.readouterr().err.splitlines()[0] == f"error: {flag}={HUGE} is not allowed; {PAST_MAX_SIZE}"


def test_a_rollout_group_one_forward_cannot_hold_is_refused_and_one_token_less_taken(capsys):
    """GRPO's micro-batch holds --batch_size prompts x --num_generations completions of up to --max_seq_len +
    --max_completion_length tokens (2 x G x 320 here): past MAX_SIZE tokens in all it is refused, naming the flag
    typed; G = 3,355,443 makes 2,147,483,520 tokens, the most that fits, and is taken."""
    from trainer.args import parse_args

    fits = 2147483647 // (2 * 320)
    assert parse_args("grpo", ["--batch_size", "2", "--num_generations", str(fits)]).num_generations == fits
    with pytest.raises(SystemExit):
        parse_args("grpo", ["--batch_size", "2", "--num_generations", str(fits + 1)])
    assert capsys.readouterr().err.splitlines()[0] == (
        f"error: --num_generations={fits + 1} is not allowed; one micro-batch would hold --batch_size 2 prompts x "
        f"--num_generations {fits + 1} completions of up to --max_seq_len + --max_completion_length = 320 tokens, "
        f"{2 * (fits + 1) * 320} in all, more than the 2147483647 (MAX_SIZE, model/config.py) one forward holds")


def test_a_micro_batch_of_exactly_max_size_tokens_is_taken():
    """The bound is MAX_SIZE tokens itself: one PPO prompt x one completion of --max_seq_len 256 +
    --max_completion_length 2**31 - 1 - 256 tokens holds 2,147,483,647, and is taken (MAX_SIZE is prime, so a rollout
    of one row is the one way to meet it exactly); a micro-batch past it is refused (the tests beside this one)."""
    from model.config import MAX_SIZE
    from trainer.args import parse_args

    args = parse_args("ppo", ["--batch_size", "1", "--num_generations", "1", "--max_seq_len", "256",
                              "--max_completion_length", str(MAX_SIZE - 256)])
    assert args.batch_size * args.num_generations * (args.max_seq_len + args.max_completion_length) == MAX_SIZE


@pytest.mark.parametrize("task, flags, named", [
    ("pretrain", ["--batch_size", "10000000"], "--batch_size=10000000"),  # x 256 tokens
    ("sft", ["--max_seq_len", "1000000", "--batch_size", "4096"], "--batch_size=4096"),
    ("ppo", ["--max_completion_length", "1000000000"], "--max_completion_length=1000000000"),  # 8 x 1 x 1000000256
])
def test_a_micro_batch_past_max_size_tokens_names_the_flag_typed(task, flags, named, capsys):
    from trainer.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(task, flags)
    error = capsys.readouterr().err.splitlines()[0]
    assert error.startswith(f"error: {named} is not allowed; one micro-batch would hold ") and error.endswith(
        "in all, more than the 2147483647 (MAX_SIZE, model/config.py) one forward holds")


@pytest.mark.parametrize("task, flags", [
    ("pretrain", ["--max_steps", "2147483647", "--accumulation_steps", "2147483647"]),
    ("pretrain", ["--max_steps", "-1", "--epochs", "2147483647"]),  # --epochs is used with --max_steps -1 only
    ("grpo", ["--num_iterations", "2147483647", "--batch_size", "1", "--num_generations", "2"]),
    ("ppo", ["--ppo_epochs", "2147483647"]),
    ("distill", ["--max_new_tokens", "2147483647", "--lmbda", "1"]),
    # "never" and "off": past any run (or any gradient's norm) they are taken, each the run's help says so
    ("pretrain", ["--eval_interval", HUGE, "--save_interval", HUGE, "--log_interval", HUGE, "--diag_interval", HUGE,
                  "--keep_checkpoints", HUGE, "--grad_clip", "1e300", "--copy_rows", "1", "--copy_steps", HUGE]),
])
def test_counts_at_max_size_and_never_meaning_values_are_taken(task, flags):
    from trainer.args import parse_args

    args = parse_args(task, flags)
    assert all(flag[2:] in args.given for flag in flags[::2])


@pytest.mark.parametrize("flag, words", [
    ("--grad_clip", "nor does a value above every norm, e.g. 1e300"),
    ("--log_interval", "past the run: there only"),
    ("--eval_interval", "past the run: that one only"),
    ("--save_interval", "past the run: none; the run's end writes its model"),
    ("--diag_interval", "past the run: those two only"),
    ("--keep_checkpoints", "more than the run writes: all"),
    ("--copy_steps", "past the run: --copy_weight all run"),
    ("--warmup_steps", "one not shorter than the run is cut to it"),
    ("--rope_theta", "at most the largest fp32, 3.4e38"),
])
def test_a_huge_value_that_means_never_or_off_says_so_in_its_help(flag, words):
    """The values past any run (10**30) or any gradient's norm (1e300) that mean "never" or "off" stay taken
    (test_counts_at_max_size_and_never_meaning_values_are_taken), and each flag's --help says what they mean."""
    _, entry = help_entries(build_parser("pretrain").format_help())[flag]
    assert words in entry, entry


def test_tokenizing_processes_past_any_machines_cores_are_refused(capsys):
    """--num_proc 10**30 was taken and datasets started one process per record (240 for a 240-line file: a
    million-line file would start a million); the bound is --threads' (MAX_THREADS), itself taken."""
    from trainer.args import parse_args

    assert parse_args("pretrain", ["--num_proc", "4096"]).num_proc == 4096
    with pytest.raises(SystemExit):
        parse_args("sft", ["--num_proc", HUGE])
    assert capsys.readouterr().err.splitlines()[0] == (
        f"error: --num_proc={HUGE} is not allowed; it must be at most 4096 (more than any machine's cores; datasets "
        f"starts that many processes, up to one per record)")


def test_distillations_max_new_tokens_help_says_the_context_ends_a_completion_too():
    """--max_new_tokens 2**31 - 1 is taken and ends each completion where the model's context is full (a run with
    10**30 sampled to the context's end at every step): the help says that a larger value means no other limit."""
    _, entry = help_entries(build_parser("distill").format_help())["--max_new_tokens"]
    assert "it also ends where the model's context is full" in entry, entry


def test_a_run_records_an_input_found_only_from_here_as_its_absolute_path(tmp_path, monkeypatch):
    """A run records each input path so that it names the same file from any directory (its train_config.yaml is
    the --config of `--resume auto` from the repo root): one found only from the current directory (or found here
    where the same relative path from the repo root is another file) as its absolute path; one read from the repo
    root, an absolute one, one found nowhere, --resume auto and a built-in reward as typed."""
    from trainer.arg_fields import INPUT_PATH_FLAGS, recorded_input_paths
    from trainer.arg_parser import PATH_FLAGS

    assert set(PATH_FLAGS) == {*INPUT_PATH_FLAGS, "out_dir"}  # one list of the input flags
    here = tmp_path / "here"
    (here / "ckpt").mkdir(parents=True)
    (here / "auto").mkdir()  # --resume auto is the word, not this folder
    (here / "mine.jsonl").write_text("")
    (here / "mine.py").write_text("")
    monkeypatch.chdir(here)
    flags = {"data_path": "mine.jsonl", "val_data_path": None, "tokenizer_path": "model", "resume": "ckpt",
             "from_weight": str(tmp_path / "elsewhere"), "teacher": "absent", "reward_model": None,
             "reward": ["math_answer", "mine.py:score", "tests/paths.py:REPO", "absent.py:f"], "out_dir": "out/x",
             "learning_rate": 0.1}
    assert recorded_input_paths(flags) == {
        **flags, "data_path": str(here / "mine.jsonl"), "resume": str(here / "ckpt"),
        "reward": ["math_answer", f"{here / 'mine.py'}:score", "tests/paths.py:REPO", "absent.py:f"]}
    assert recorded_input_paths({"resume": "auto"}) == {"resume": "auto"}
    (here / "model").mkdir()  # found here, and another folder from the repo root: the one read here
    assert recorded_input_paths({"tokenizer_path": "model"}) == {"tokenizer_path": str(here / "model")}
    monkeypatch.chdir(REPO)  # from the repo root every path stays as typed
    assert recorded_input_paths({"tokenizer_path": "model", "reward": ["tests/paths.py:REPO"]}) == {
        "tokenizer_path": "model", "reward": ["tests/paths.py:REPO"]}


@pytest.mark.parametrize("task, argv, named", [
    ("dpo", ["--beta", "1e30"], ["--beta 1e+30"]),
    ("dpo", ["--loss_type", "sigmoid", "sft", "--loss_weights", "1", "1"], []),  # the two types' default weights
    ("dpo", ["--loss_type", "sigmoid", "sft", "--loss_weights", "1", "2", "--rpo_alpha", "0.5"],
     ["--loss_weights 1 2", "--rpo_alpha 0.5"]),
    ("grpo", ["--beta", "0.02", "--reward_weights", "3"], ["--reward_weights 3"]),  # 0.02: GRPO's default beta
    ("ppo", ["--vf_coef", "1e30", "--temperature", "0.5"], ["--vf_coef 1e+30"]),  # a sampling temperature
    ("distill", ["--temperature", "1e20", "--alpha", "0.5"], ["--temperature 1e+20"]),  # the soft term's T^2
    ("pretrain", ["--copy_rows", "2", "--copy_weight", "1e30"], ["--copy_weight 1e+30"]),
    ("pretrain", ["--num_experts", "2", "--router_aux_loss_coef", "0.001", "--router_z_loss_coef", "2"],
     ["--router_z_loss_coef 2"]),
    ("pretrain", [], []),
])
def test_loss_multipliers_set_away_from_their_defaults(task, argv, named):
    """What a diverged run's line names (trainer/run_summary.py's TrainingDiverged): the loss multipliers its flags
    set away from their task's (or the preset's) defaults, as typed."""
    from trainer.args import parse_args

    assert loss_multipliers_set(parse_args(task, argv)) == named
