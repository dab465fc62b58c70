"""What a resume may change, what it notes and what it refuses, decided from the checkpoint's trainer state
(trainer/checkpoint_state.py) and the run's flags; and whether a `--resume auto` asks again for the run that already
finished in its directory.

A checkpoint holds only for the samples in the order it counted its position in (the data-order flags, the data
itself), for its adapters' shape, its teacher, its reference model and its model's architecture: another value is
refused in one line naming each flag with both values and what to do (check_resume_compatible,
adopt_saved_architecture, check_saved_architecture), as is a run of another task (check_same_task) or one that ends
before the checkpoint's step (check_resume_length). What a resume may change (the learning rate, the length, the
rewards...) it does, and says so (changed_flags). A checkpoint recorded before a flag existed is read to have run as
that flag's value then says (_FLAGS_BEFORE), not as its default now.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from dataset.json_text import strict_json
from model.config import SWITCHED_FIELDS, preset_fields
from trainer.arg_fields import (ADDABLE_MODEL_FIELDS, MODEL_FIELDS, RUNTIME_MODEL_FIELDS, TrainArgs, flags_in_effect,
                                given_preset, holds_out_validation, recorded_input_paths,
                                scored_against_starting_weights, uses_lora)
from trainer.checkpoint_state import DATA_KEYS, CheckpointDamaged
from trainer.rl_losses import default_scale_rewards
from trainer.run_dir import (CHECKPOINT_DIR, CONFIG_FILE, CREATE_COMMANDS, STATE_FILE, checkpoint_step, finish_command,
                             is_adapter_dir, is_count, is_model_dir, list_checkpoints, read_summary,
                             recorded_config, starting_directory)

# The flags a resume keeps: a checkpoint holds only for the values its config records, so a command line that gives
# another is refused, in one line naming each such flag with both values (_keep_saved). The architecture fields a
# command line leaves unset are taken from the checkpoint (adopt_saved_architecture); the other kept flags are not:
# left unset, they take their defaults, which must match too.

# Which samples the training set holds and in which order: a checkpoint's data position means nothing under other
# values. (--batch_size, --accumulation_steps and the number of processes only group the same sample order
# differently: the position, counted in samples, maps.)
DATA_ORDER_FLAGS = ("max_seq_len", "seed", "val_fraction")
# The shapes of a LoRA run's trainable tensors: the checkpoint's adapters fit no other value.
ADAPTER_FLAGS = ("lora", "lora_rank", "lora_targets")
# The model fields that decide the saved weights' set, shapes or meaning: all but what only changes how the model
# runs (norm_impl) or trains (dropout), which a resume may change as it may the learning rate.
ARCHITECTURE_FIELDS = tuple(name for name in MODEL_FIELDS if name not in RUNTIME_MODEL_FIELDS)


def check_resume_compatible(path: Path, state: dict[str, Any], args: TrainArgs, data: dict[str, Any]) -> None:
    """Refuse, in one line naming the flag with its old and new value, to resume where the data position would
    not map exactly (other data, another --max_seq_len, --seed or --val_fraction) or, for LoRA, where the saved
    adapters have another shape (--lora_rank, --lora_targets) or are absent (GRPO/PPO's --lora), or, for
    distillation, where --teacher names another directory, or, for a run scored against its starting weights (DPO's
    reference model, GRPO's and PPO's KL reference), where --from_weight does."""
    saved = state.get("config", {})
    # --val_fraction only where it splits the data: a run that never read it (the embedded data, a --val_data_path)
    # resumes whatever its checkpoint recorded, as the unused-flag rule sets a YAML's value back (arg_checks.py)
    order_flags = [flag for flag in DATA_ORDER_FLAGS if flag != "val_fraction" or holds_out_validation(args)]
    _keep_saved(path, saved, {flag: getattr(args, flag) for flag in order_flags},
                "the saved data position is only valid for the same samples in the same order")
    if uses_lora(args) or saved.get("lora"):
        _keep_saved(path, saved, {flag: getattr(args, flag) for flag in ADAPTER_FLAGS},
                    "the saved adapters have that shape")
    if args.task == "distill" and "teacher" in saved:
        from trainer.distillation import teacher_directory
        _keep_saved(path, {"teacher": str(teacher_directory(saved["teacher"]))},
                    {"teacher": str(teacher_directory(args.teacher))}, "a run distils from one teacher")
    if scored_against_starting_weights(args) and "from_weight" in saved:
        _keep_saved(path, {"from_weight": str(starting_directory(args.task, saved["from_weight"]))},
                    {"from_weight": str(starting_directory(args.task, args.from_weight))},
                    "the run is scored against its starting weights (its reference model), which the checkpoint "
                    "does not hold")
    old_data = state.get("data")
    same = old_data is None or {k: v for k, v in old_data.items() if k != "path"} == {
        k: v for k, v in data.items() if k != "path"}
    if not same:
        now = _describe(data, other_tokens=all(old_data.get(key) == data.get(key) for key in DATA_KEYS - {"path"}))
        raise _refused(path, f"--data_path was {_describe(old_data)} there and is {now} now",
                       "the saved data position is only valid for the same training data", "resume with the same file")
    samples = data.get("train_samples")
    if samples is not None and state["samples_done_in_epoch"] > samples:
        raise CheckpointDamaged(f"--resume {path.name}: {STATE_FILE}: 'samples_done_in_epoch' is "
                                f"{state['samples_done_in_epoch']}, more than the {samples} training samples")


def check_resume_length(path: Path, state: dict[str, Any], args: TrainArgs, total_steps: int) -> None:
    """Refuse, in one line naming the checkpoint's step and the flag, a resume whose run ends before the step it
    resumes at (`total_steps`, the length the run planned: --max_steps below the checkpoint's step, or fewer
    --epochs than the checkpoint has begun). It would train nothing and still finish, writing the checkpoint's
    model and a summary of more steps than asked, with no step timed. A length equal to the step is allowed: the
    run ends at its checkpoint (its final evaluation and model), as a user stopping a run there asks."""
    step = state["step"]
    if total_steps >= step:
        return
    why = "a run cannot end before the step it resumes at"
    if args.max_steps > 0 and not args.time_budget_s:
        raise _refused(path, f"--max_steps is {args.max_steps} and the checkpoint is at optimizer step {step}", why,
                       f"resume with --max_steps {step} or more ({step}: the run ends there, with its model)")
    raise _refused(path, f"--epochs is {args.epochs} and the checkpoint is at optimizer step {step}, in epoch "
                         f"{state['epoch'] + 1}", why, f"resume with --epochs {state['epoch'] + 1} or more")


# Flags a resume compares elsewhere, or that name a place rather than a setting (a moved file is the same file), or
# whose place is compared as the directory it resolves to (REWARD_MODEL_FLAG: _reward_model_change), or that say how
# this machine does the work, not what the run computes: --num_proc (the tokenizing workers; the rows and their order
# are the same) and the two collective timeouts (--threads says its own note: trainer/threads.py keep_runs).
_NOT_NOTED = frozenset({"resume", "overwrite", "out_dir", "data_path", "val_data_path", "tokenizer_path",
                        "from_weight", "teacher", "reward_model", "threads", "num_proc", "dist_init_timeout",
                        "dist_timeout"})
REWARD_MODEL_FLAG = "reward_model"


def changed_flags(state: dict[str, Any], config: dict[str, Any]) -> str:
    """The run's settings that differ from the checkpoint's (a resume may change them: the learning rate, the
    length, the intervals, the rewards: --reward and --reward_model, the latter as the directory it names), as
    '--a was 1 there and is 2 now, ...'; "" when none does. The kept flags are refused before this
    (check_resume_compatible), so what is named here is what the run goes on with anew; a flag neither side's run
    reads (trainer/arg_checks.py, unused_flags) is compared at its default (_unused_at_defaults)."""
    # both sides after the unused-flag rule: a checkpoint saved before it records flags its run never read (a Muon
    # rate beside --optimizer adamw), which its own train_config.yaml given again as --config now sets back
    saved = _unused_at_defaults(_with_implied_flags(state.get("config", {})))
    now = {name: value for name, value in _unused_at_defaults(config).items() if name not in _NOT_NOTED}
    changes = _changes(saved, now, flags_in_effect(saved), flags_in_effect(config))
    return _was_and_is({**changes, **_reward_model_change(saved, config)})


def _reward_model_change(saved: dict[str, Any], now: dict[str, Any]) -> _Changes:
    """{"reward_model": (its directory there, its directory now)} where the flags `now` of a GRPO or PPO run score
    with another reward model than the flags `saved` (a checkpoint's or a finished run's config) recorded; {}
    otherwise. A reward model changes the objective as the --reward functions do, but its flag names a place: the
    two are compared as the directories they resolve to (through symlinks), so the same directory named otherwise
    is no change; one given or left out where the other was not is (None: no reward model; a run recorded before
    the flag had none). Nothing is compared where `now` has no such flag or `saved` records no run's flags."""
    if REWARD_MODEL_FLAG not in now or saved.get("task") is None:
        return {}
    from trainer.reward_model import reward_model_directory

    there, here = (None if value is None else reward_model_directory(value)
                   for value in (saved.get(REWARD_MODEL_FLAG), now[REWARD_MODEL_FLAG]))
    if there == here or (there is not None and here is not None and there.resolve() == here.resolve()):
        return {}
    return {REWARD_MODEL_FLAG: tuple(None if path is None else str(path) for path in (there, here))}


# Flags a run recorded before they existed ran as their value here says (the behaviour before them), written out: a
# later change of a flag's default must not change what an old run is read to have done. A DPO run had the plain sigmoid
# loss, unsmoothed, one loss type of weight 1 (--loss_weights null, the default), no discopop loss (its tau unread), no
# RPO term, LD-DPO reweighting or WPO weights, and DPO's reverse KL (alpha unread); a distillation run Hinton's KL on
# the data's answers (the sampling flags, which shape only what it did not do, at the values they came with); GRPO
# per-token ratios; PPO the k1 KL, rewards not whitened, no missing-eos penalty.
_FLAGS_BEFORE = {"dpo": {"loss_type": "sigmoid", "label_smoothing": 0.0, "discopop_tau": 0.05, "rpo_alpha": None,
                         "ld_alpha": None, "use_weighting": False, "f_divergence_type": "reverse_kl",
                         "f_alpha_divergence_coef": 1.0},
                 "grpo": {"importance_sampling_level": "token"},
                 "ppo": {"kl_estimator": "k1", "whiten_rewards": False, "missing_eos_penalty": 0.0},
                 "distill": {"distill_loss": "kl", "jsd_beta": 0.5, "lmbda": 0.0, "seq_kd": False,
                             "max_new_tokens": 128, "sampling_temperature": 0.9}}


def _with_implied_flags(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config with the flags it predates (names it does not hold) but whose value it implies filled in
    (_FLAGS_BEFORE), so that a resume asking for another value notes the change, and a finished run asked again with
    it is another run, not an unrecorded flag; a GRPO run recorded before --scale_rewards existed (or with it null:
    unset) scaled as its loss type's default does now (dr_grpo: none, else group); a model recorded before head_dim
    existed had heads of hidden_size / num_attention_heads (a resume asking for other heads is refused in one line,
    not at loading the weights)."""
    before = _FLAGS_BEFORE.get(saved["task"], {}) if isinstance(saved.get("task"), str) else {}
    saved = {**saved, **{name: value for name, value in before.items() if name not in saved}}
    width, heads = saved.get("hidden_size"), saved.get("num_attention_heads")
    if "head_dim" not in saved and isinstance(width, int) and isinstance(heads, int) and heads > 0:
        saved["head_dim"] = width // heads
    if saved.get("task") == "grpo" and saved.get("scale_rewards") is None and isinstance(saved.get("loss_type"), str):
        return {**saved, "scale_rewards": default_scale_rewards(saved["loss_type"])}
    return saved


# What a command line may change and still ask for the same run: how it starts, where it is written (train_config.yaml
# records it resolved), the threads (picked for the machine).
_NOT_THE_RUN = frozenset({"resume", "overwrite", "out_dir", "threads"})


def finished_run_asked_again(out_dir: Path, args: TrainArgs) -> dict[str, Any]:
    """The summary of the run that finished in `out_dir` where `args` (a `--resume auto`) ask for that very run
    again: every flag its train_config.yaml records as the command gives it (input paths as a run records them,
    recorded_input_paths; a flag the command leaves unset, which the run resolves, e.g. SFT's --copy_rows, aside;
    model fields only where the command gives them; _NOT_THE_RUN aside; a flag the recorded run did not use at its
    default: _unused_at_defaults; --reward_model compared as the directory it names, one left out counting:
    _reward_model_change), and no checkpoint past the finished step (a longer continuation stopped before its end);
    {} otherwise."""
    summary = read_summary(out_dir)
    model_saved = is_adapter_dir(out_dir) if uses_lora(args) else is_model_dir(out_dir)
    if summary.get("status") != "finished" or not model_saved:
        return {}
    if not is_count(summary.get("steps")):  # a summary edited by hand: no finished run this could be
        return {}
    checkpoints = list_checkpoints(out_dir / CHECKPOINT_DIR)
    if checkpoints and (checkpoint_step(checkpoints[-1].name) or 0) > summary["steps"]:
        return {}
    recorded = _unused_at_defaults(_with_implied_flags(recorded_config(out_dir)))
    # the model fields nobody typed that the recorded model does not read are set back, as the run's start does (a
    # sweep trial's --prms_p beside no --norm_type: the finished trial's start set it back)
    asked_model = copy.copy(args)
    _set_back_unread_untyped(recorded, asked_model)
    # its input paths as the run would record them (a file found only from here: absolute)
    asked = {**recorded_input_paths({name: value for name, value in args.to_dict().items() if name != "model"}),
             **asked_model.model}
    if "preset" in asked:
        asked["preset"] = given_preset(args)  # the default is no flag given: a finished cpu-deep run is this run
    recorded_in_effect, asked_in_effect = flags_in_effect(recorded), flags_in_effect(asked)
    differs = any(name not in _NOT_THE_RUN and name != REWARD_MODEL_FLAG and value is not None
                  and _comparable(recorded[name]) != _comparable(value)
                  and _comparable(recorded_in_effect[name]) != _comparable(asked_in_effect[name])
                  for name, value in asked.items() if name in recorded)
    differs = differs or bool(_reward_model_change(recorded, asked))
    return {} if differs or not recorded else summary


def _unused_at_defaults(recorded: dict[str, Any]) -> dict[str, Any]:
    """A run's recorded config with the flags it did not use (trainer/arg_checks.py, unused_flags: a run finished
    before the unused-flag rule may record one) at their defaults, as the rule sets them back in a command given that
    config as --config: the run never read them, so they tell it from no other run. As recorded where it is no
    TrainArgs (an unknown key, a value the table cannot read)."""
    from trainer.arg_checks import flag_default, unused_flags
    from trainer.args import args_from_run_config

    try:
        args = args_from_run_config(recorded)
        found = unused_flags(args)
    except (TypeError, ValueError):
        return recorded
    # a flag it does not record stays out (a run from before the flag: not compared)
    return {**recorded, **{flag.name: flag_default(args, flag.name) for flag in found if flag.name in recorded}}


def _comparable(value: Any) -> Any:
    """A config value as trainer_state.json holds it (tuples are lists there)."""
    return json.loads(strict_json(value))


_Changes = dict[str, tuple[Any, Any]]  # name -> (its value in the checkpoint's config, its value now)


def _changes(saved: dict[str, Any], now: dict[str, Any], saved_in_effect: dict[str, Any] | None = None,
             now_in_effect: dict[str, Any] | None = None) -> _Changes:
    """Each name of `now` whose value differs from the one the checkpoint's config `saved` records, compared as
    trainer_state.json holds them. A name it does not record is no change (an older checkpoint, from before the
    flag); one it records as null is a value (the flag left unset), so a resume that gives the flag is a change,
    unless the two sides' values in effect (`saved_in_effect`, `now_in_effect`: flags_in_effect's, where given)
    agree: a flag given at the value it has unset (GRPO's --epsilon_high at --epsilon's) is no change."""
    def same_in_effect(name: str) -> bool:
        return (saved_in_effect is not None and now_in_effect is not None
                and _comparable(saved_in_effect[name]) == _comparable(now_in_effect[name]))

    return {name: (_comparable(saved[name]), _comparable(value)) for name, value in now.items()
            if name in saved and _comparable(saved[name]) != _comparable(value) and not same_in_effect(name)}


def _was_and_is(changes: _Changes, flags: bool = True) -> str:
    """'--a was 1 there and is 2 now, ...' (`flags` False: fields of the built model's config, named bare)."""
    dashes = "--" if flags else ""
    return ", ".join(f"{dashes}{name} was {_shown(old)} there and is {_shown(new)} now"
                     for name, (old, new) in changes.items())


def _shown(value: Any) -> Any:
    """A flag's value as a note names it: None (a flag left unset, or one a run recorded before it did not have) is
    `unset`, not Python's None."""
    return "unset" if value is None else value


def _refused(path: Path, changes: str, why: str, advice: str) -> ValueError:
    """A refused resume in one line: what changed, why the checkpoint holds only for what it was, what to do."""
    return ValueError(f"--resume {path.name}: {changes}; {why} ({advice}, or start a new run)")


def _keep_saved(path: Path, saved: dict[str, Any], now: dict[str, Any], why: str) -> None:
    """Refuse to resume with other values of the flags `now` than the checkpoint's config `saved` records, naming
    each one that differs and `why` the checkpoint holds only for its own values (a flag it records as null, unset
    there: resume without it)."""
    changes = _changes(saved, now)
    if changes:
        given = " ".join(f"--{name} {old}" for name, (old, _) in changes.items() if old is not None)
        unset = " ".join(f"--{name}" for name, (old, _) in changes.items() if old is None)
        advice = "resume " + " and ".join(part for part in (given and f"with {given}", unset and f"without {unset}")
                                          if part)
        raise _refused(path, _was_and_is(changes), why, advice)


def _refuse_architecture(path: Path, changes: str) -> ValueError:
    return _refused(path, f"the checkpoint's model differs: {changes}", "the saved weights have that architecture",
                    "resume without those flags")


def check_same_task(path: Path, state: dict[str, Any], args: TrainArgs) -> None:
    """A checkpoint goes on only in the kind of run that saved it: another trainer's optimizer, step count and
    model (a LoRA run's adapters, an SFT run's full weights) are not this run's to continue."""
    saved = state.get("config", {}).get("task")
    if saved is not None and saved != args.task:
        run = path.parent.parent  # RUN/checkpoints/step_N
        go_on = (finish_command(saved, run) if saved in CREATE_COMMANDS and (run / CONFIG_FILE).is_file()
                 else f"{CREATE_COMMANDS.get(saved, saved)} --resume {path}")
        raise ValueError(f"--resume {path.name}: a {saved} run's checkpoint; this is the {args.task} trainer: go on "
                         f"with that run with `{go_on}`, or start this run without --resume")


def adopt_saved_architecture(path: Path, state: dict[str, Any], args: TrainArgs) -> None:
    """A resume continues the checkpoint's model (docs/training.md: a bare `--resume auto` continues the run):
    each architecture field the command line leaves unset is taken from the checkpoint's config into `args.model`
    (a fine-tuning run's other fields come from --from_weight, checked by check_saved_architecture); one given with
    another value is refused in one line naming each such flag with its old and new value."""
    saved = _with_implied_flags(state.get("config", {}))
    # args.model holds the flags the user gave only: a task's default (SFT's smeared keys) is applied under them
    # when the model is built (requested_model_fields), so the checkpoint's value wins over it.
    _set_back_unread_untyped(saved, args)
    given = {name: args.model[name] for name in ARCHITECTURE_FIELDS if name in args.model}
    # --preset names a shape too: one given is compared; the default takes the checkpoint's (a bare resume of a
    # minimind-26m run goes on as one)
    if given_preset(args) is not None:  # only pretraining has the flag
        given["preset"] = args.preset
    changes = _changes(saved, given)
    if changes:
        raise _refuse_architecture(path, _was_and_is(changes))
    if args.task == "pretrain" and saved.get("preset") is not None:
        args.preset = saved["preset"]
    for name in ARCHITECTURE_FIELDS:
        if saved.get(name) is not None and (args.task == "pretrain" or name in ADDABLE_MODEL_FIELDS.get(args.task, ())):
            args.model[name] = saved[name]


def _set_back_unread_untyped(saved: dict[str, Any], args: TrainArgs) -> None:
    """A pretraining resume's model field that nobody typed (a --config YAML's, a sweep trial's) and whose switch the
    command left to the checkpoint, where the checkpoint's model does not read it (model/config.py, SWITCHED_FIELDS:
    a --prms_p beside a saved rmsnorm), is set back as the unused-flag rule sets one back where the switch is given
    (trainer/arg_checks.py): a sweep's cut-off trial, rerun with --resume auto, goes on instead of being refused for
    a value its first start set back. One typed is compared as given (refused where it differs)."""
    if args.task != "pretrain":
        return
    recorded = {name: value for name, value in saved.items() if name in MODEL_FIELDS}
    preset = saved.get("preset") or args.preset
    for entry in SWITCHED_FIELDS:  # in order: an entry's switch may be a field an earlier one set back
        undecided = any(name not in args.model for name in entry.switches)  # at parsing (arg_checks.py)
        # a switch a checkpoint does not record had its default (model/config.py: the model it was)
        if undecided and not entry.active(preset_fields(preset, {**recorded, **args.model})):
            args.model = {name: value for name, value in args.model.items()
                          if name not in entry.fields or name not in args.untyped}


def check_saved_architecture(path: Path, state: dict[str, Any], config: Any) -> None:
    """The model built for a resume (its `config`) has the checkpoint's architecture: else one line naming each
    field that differs (a fine-tuning run resumed with a --from_weight of another shape), not a state_dict
    traceback or, for a field the weights do not show (norm_eps, rope_theta), another model without a word."""
    built = {name: getattr(config, name) for name in ARCHITECTURE_FIELDS if hasattr(config, name)}
    changes = _changes(_with_implied_flags(state.get("config", {})), built)
    if changes:
        raise _refuse_architecture(path, _was_and_is(changes, flags=False))


def _describe(data: dict[str, Any], other_tokens: bool = False) -> str:
    """A data identity in words; `other_tokens`: its counts are the checkpoint's, and only its digest differs."""
    return (f"{data.get('path')} ({data.get('train_samples')} training samples, {data.get('tokens')} tokens"
            + (", other token ids in the samples compared)" if other_tokens else ")"))
