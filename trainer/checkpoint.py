"""Resumable training state, written atomically, and the agreement of every process on what to resume.

A checkpoint is a directory `step_XXXXXXXX/` holding Accelerate's state (fp32 model weights, optimizer,
scheduler, every process's RNG states) plus `trainer_state.json` (step, data position, counters, the list of the
checkpoint's files; the names are trainer/run_dir.py's). It is written under a temporary name and renamed into
place only when complete, so a save killed midway leaves the previous checkpoint intact; `trainer_state.json` is
written last and marks a checkpoint complete. Complete means every process's part is in place where the processes
that need it can read it: the save checks that before it writes `trainer_state.json`.

Several machines: `--out_dir` is either one directory every process sees (shared storage: the main process writes
the checkpoint) or one directory per machine (each machine's first process writes a whole copy there, its
processes their own RNG states; possible when every process holds the whole model and optimizer, as under DDP).
`probe_storage` (trainer/storage_probe.py) finds out which at start-up. On resume the main process decides which
checkpoint every process loads (with --resume auto, the newest one that every process holds) and tells the others;
every process then checks that it can read each file it needs, its own RNG state included, and the job stops in one
line naming the rank and the path otherwise: a process never silently starts from another step, or from its seed,
while the others resume.
A resume reads its trainer state through `read_trainer_state` (trainer/checkpoint_state.py, the one place that
validates it) and loads every file (`load_checkpoint`, which names a damaged one) before --overwrite removes the
directory's previous run. `trainer_state.json` also records the size and sha256 of every file its writer holds (the
writer hashes them once every process has written its part), and a resume checks them before it loads anything
(agree_on_start): a file copied in from another checkpoint, truncated or replaced is refused in one line naming it.
A checkpoint written before digests were recorded resumes unverified, with a note saying so.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import RNG_STATE_NAME, broadcast_object_list, gather_object

from dataset.atomic_io import atomic_write_text, first_line, give_open_modes
from dataset.json_text import strict_json
from trainer.arg_fields import (ADDABLE_MODEL_FIELDS, MODEL_FIELDS, RUNTIME_MODEL_FIELDS, TrainArgs, flags_in_effect,
                                given_preset, scored_against_starting_weights, uses_lora)
from trainer.checkpoint_state import (DATA_KEYS, DIGESTS_KEY, FILES_KEY, CheckpointDamaged, file_digests,
                                      read_trainer_state, verify_digests)
from trainer.rl_losses import default_scale_rewards
from trainer.run_dir import (CHECKPOINT_DIR, CONFIG_FILE, CREATE_COMMANDS, RUN_ID_KEY, STATE_FILE, checkpoint_name,
                             checkpoint_step, clear_previous_run, finish_command, is_adapter_dir, is_model_dir,
                             list_checkpoints, previous_run, read_summary, recorded_config, recorded_run_id,
                             refuse_previous_run, starting_directory)
from trainer.storage_probe import STORAGE_HELP

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
_RNG_FILE = re.compile(rf"{RNG_STATE_NAME}_(\d+)\.pkl")


class CheckpointUnreadable(FileNotFoundError):
    """A process cannot read a file of the checkpoint it must save or resume; the message names the rank and path."""


@dataclass(frozen=True)
class ResumePoint:
    path: Path              # this process's path to the checkpoint
    state: dict[str, Any]   # its trainer state, as the main process read it
    note: str = ""          # why it is not the main process's newest checkpoint, if it is not


def rng_state_file(rank: int) -> str:
    return f"{RNG_STATE_NAME}_{rank}.pkl"


def files_needed_by(files: list[str], rank: int, saved_processes: int) -> list[str]:
    """The files of a checkpoint that process `rank` reads to resume from it: all but the other processes' RNG
    states, its own included when the checkpoint has one for it (a checkpoint of fewer processes has none for the
    extra ones: they start from the seed, as the docs say), and trainer_state.json."""
    needed = [name for name in files if (match := _RNG_FILE.fullmatch(name)) is None or int(match[1]) == rank]
    if rank < saved_processes and rng_state_file(rank) not in needed:
        needed.append(rng_state_file(rank))
    return [STATE_FILE, *needed] if STATE_FILE not in needed else needed


def _files_under(path: Path) -> list[str]:
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()) if path.is_dir() else []


def _readable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.R_OK)


class _TiedHeadNotice(logging.Filter):
    """Drops Accelerate's "Removed shared tensor {...lm_head.weight} while saving" notice: safetensors stores a tied
    tensor once, and the LM head tied to the embedding is restored from it on load. Other names still show."""

    _NOTICE = re.compile(r"Removed shared tensor \{(.*)\} while saving")

    def filter(self, record: logging.LogRecord) -> bool:
        match = self._NOTICE.search(record.getMessage())
        return match is None or not all(name.strip().strip("'").endswith("lm_head.weight")
                                        for name in match[1].split(","))


@contextmanager
def _tied_head_notice_silenced():
    logger, notice = logging.getLogger("accelerate.utils.other"), _TiedHeadNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


def save_checkpoint(accelerator: Accelerator, root: Path, step: int, state: dict[str, Any], keep: int,
                    shared_storage: bool = True) -> Path:
    """Collective: every process calls it. Returns the checkpoint directory. With `shared_storage` False each
    machine's local main process writes a whole copy under its own `root`. Raises CheckpointUnreadable, on every
    process, when a process cannot read a part it would need to resume (nothing is marked complete then)."""
    final = root / checkpoint_name(step)
    tmp = root / f".tmp_{checkpoint_name(step)}"
    writer = accelerator.is_main_process if shared_storage else accelerator.is_local_main_process
    if writer:
        _remove_leftovers(root)  # this save's own temp folder among them
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.project_configuration.save_on_each_node = not shared_storage
    with _tied_head_notice_silenced():
        accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    views = gather_object([(str(tmp), _files_under(tmp))])
    files = sorted(set().union(*(set(view) for _, view in views)))
    for rank, (path, view) in enumerate(views):
        missing = [name for name in files_needed_by(files, rank, len(views)) if name != STATE_FILE and name not in view]
        if missing:
            raise CheckpointUnreadable(f"checkpoint {final.name} is incomplete: rank {rank} cannot read "
                                       f"{Path(path) / missing[0]}, which another process wrote; --out_dir must be "
                                       f"storage that process can read ({STORAGE_HELP})")
    if writer:
        give_open_modes(tmp)
        # The writer's digest of each file it holds (on shared storage, every process's; on one directory per
        # machine, that machine's copy), read back once all are written: Accelerate writes them, each its own way.
        digests = file_digests(tmp, views[accelerator.process_index][1])
        atomic_write_text(tmp / STATE_FILE, strict_json({**state, FILES_KEY: files, DIGESTS_KEY: digests}, indent=2))
        if final.exists():
            _remove_checkpoint(final)
        os.replace(tmp, final)
        for old in list_checkpoints(root)[:-keep]:
            _remove_checkpoint(old)
    accelerator.wait_for_everyone()
    return final


def _remove_leftovers(root: Path) -> None:
    """Remove what a kill left under `root` (a run's CHECKPOINT_DIR), which no resume reads and nothing else removed:
    the temp folder of a save cut short (".tmp_step_N", removed only by a later save of the same step) and a
    checkpoint folder whose removal was cut short (no trainer_state.json). One run writes its folder at a time."""
    if not root.is_dir():
        return
    for path in root.iterdir():
        name = path.name.removeprefix(".tmp_")
        complete = name == path.name and (path / STATE_FILE).is_file()
        if path.is_dir() and not path.is_symlink() and checkpoint_step(name) is not None and not complete:
            shutil.rmtree(path, ignore_errors=True)


def _remove_checkpoint(path: Path) -> None:
    """Remove a checkpoint directory, its trainer_state.json first: a removal cut short (a kill) leaves no
    checkpoint that is listed as complete without all of its files."""
    (path / STATE_FILE).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def drop_later_checkpoints(accelerator: Accelerator, root: Path, resumed: Path, writer: bool) -> list[str]:
    """Collective. A run resumed from one of its own checkpoints (`resumed`, under `root`, its CHECKPOINT_DIR)
    replaces what followed it, as its metrics.jsonl drops the later records: the `writer` processes remove its later
    checkpoints, which would stay the newest (a `--resume auto` would go on from them, over the new steps, whose
    records it would keep) and push the new ones out under --keep_checkpoints. Returns the names removed."""
    step = checkpoint_step(resumed.name)
    later = []
    if writer and step is not None and resumed.resolve().parent == root.resolve():
        later = [path for path in list_checkpoints(root) if checkpoint_step(path.name) > step]
        for path in later:
            _remove_checkpoint(path)
    accelerator.wait_for_everyone()
    return [path.name for path in later]


def check_resume_compatible(path: Path, state: dict[str, Any], args: TrainArgs, data: dict[str, Any]) -> None:
    """Refuse, in one line naming the flag with its old and new value, to resume where the data position would
    not map exactly (other data, another --max_seq_len, --seed or --val_fraction) or, for LoRA, where the saved
    adapters have another shape (--lora_rank, --lora_targets) or are absent (GRPO/PPO's --lora), or, for
    distillation, where --teacher names another directory, or, for a run scored against its starting weights (DPO's
    reference model, GRPO's and PPO's KL reference), where --from_weight does."""
    saved = state.get("config", {})
    _keep_saved(path, saved, {flag: getattr(args, flag) for flag in DATA_ORDER_FLAGS},
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
# whose place is compared as the directory it resolves to (REWARD_MODEL_FLAG: _reward_model_change).
_NOT_NOTED = frozenset({"resume", "overwrite", "out_dir", "data_path", "val_data_path", "tokenizer_path",
                        "from_weight", "teacher", "reward_model", "threads"})
REWARD_MODEL_FLAG = "reward_model"


def changed_flags(state: dict[str, Any], config: dict[str, Any]) -> str:
    """The run's settings that differ from the checkpoint's (a resume may change them: the learning rate, the
    length, the intervals, the rewards: --reward and --reward_model, the latter as the directory it names), as
    '--a was 1 there and is 2 now, ...'; "" when none does. The kept flags are refused before this
    (check_resume_compatible), so what is named here is what the run goes on with anew."""
    saved = _with_implied_flags(state.get("config", {}))
    now = {name: value for name, value in config.items() if name not in _NOT_NOTED}
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
    unset) scaled as its loss type's default does now (dr_grpo: none, else group)."""
    before = _FLAGS_BEFORE.get(saved["task"], {}) if isinstance(saved.get("task"), str) else {}
    saved = {**saved, **{name: value for name, value in before.items() if name not in saved}}
    if saved.get("task") == "grpo" and saved.get("scale_rewards") is None and isinstance(saved.get("loss_type"), str):
        return {**saved, "scale_rewards": default_scale_rewards(saved["loss_type"])}
    return saved


# What a command line may change and still ask for the same run: how it starts, where it is written (train_config.yaml
# records it resolved), the threads (picked for the machine).
_NOT_THE_RUN = frozenset({"resume", "overwrite", "out_dir", "threads"})


def finished_run_asked_again(out_dir: Path, args: TrainArgs) -> dict[str, Any]:
    """The summary of the run that finished in `out_dir` where `args` (a `--resume auto`) ask for that very run
    again: every flag its train_config.yaml records as the command gives it (paths as typed; a flag the command
    leaves unset, which the run resolves, e.g. SFT's --copy_rows, aside; model fields only where the command gives
    them; _NOT_THE_RUN aside; --reward_model compared as the directory it names, one left out counting:
    _reward_model_change), and no checkpoint past the finished step (a longer continuation stopped before its end);
    {} otherwise."""
    summary = read_summary(out_dir)
    model_saved = is_adapter_dir(out_dir) if uses_lora(args) else is_model_dir(out_dir)
    if summary.get("status") != "finished" or not model_saved:
        return {}
    checkpoints = list_checkpoints(out_dir / CHECKPOINT_DIR)
    if checkpoints and (checkpoint_step(checkpoints[-1].name) or 0) > summary.get("steps", 0):
        return {}
    recorded = _with_implied_flags(recorded_config(out_dir))
    asked = {**{name: value for name, value in args.to_dict().items() if name != "model"}, **args.model}
    if "preset" in asked:
        asked["preset"] = given_preset(args)  # the default is no flag given: a finished cpu-deep run is this run
    recorded_in_effect, asked_in_effect = flags_in_effect(recorded), flags_in_effect(asked)
    differs = any(name not in _NOT_THE_RUN and name != REWARD_MODEL_FLAG and value is not None
                  and _comparable(recorded[name]) != _comparable(value)
                  and _comparable(recorded_in_effect[name]) != _comparable(asked_in_effect[name])
                  for name, value in asked.items() if name in recorded)
    differs = differs or bool(_reward_model_change(recorded, asked))
    return {} if differs or not recorded else summary


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
    return ", ".join(f"{dashes}{name} was {old} there and is {new} now" for name, (old, new) in changes.items())


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
    saved = state.get("config", {})
    # args.model holds the flags the user gave only: a task's default (SFT's smeared keys) is applied under them
    # when the model is built (requested_model_fields), so the checkpoint's value wins over it.
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


def check_saved_architecture(path: Path, state: dict[str, Any], config: Any) -> None:
    """The model built for a resume (its `config`) has the checkpoint's architecture: else one line naming each
    field that differs (a fine-tuning run resumed with a --from_weight of another shape), not a state_dict
    traceback or, for a field the weights do not show (norm_eps, rope_theta), another model without a word."""
    built = {name: getattr(config, name) for name in ARCHITECTURE_FIELDS if hasattr(config, name)}
    changes = _changes(state.get("config", {}), built)
    if changes:
        raise _refuse_architecture(path, _was_and_is(changes, flags=False))


def _describe(data: dict[str, Any], other_tokens: bool = False) -> str:
    """A data identity in words; `other_tokens`: its counts are the checkpoint's, and only its digest differs."""
    return (f"{data.get('path')} ({data.get('train_samples')} training samples, {data.get('tokens')} tokens"
            + (", other token ids in the samples compared)" if other_tokens else ")"))


@dataclass(frozen=True)
class RunStart:
    """What every process starts: a run id (the resumed checkpoint's run, or a new one), the checkpoint to resume
    (None: start fresh) and whether a previous run's files in --out_dir are to go before this run writes there
    (`clear_previous_files`)."""

    run_id: str
    resume: ResumePoint | None
    clear: bool = False


def agree_on_start(accelerator: Accelerator, resume: str | None, out_dir: Path, path: Path | None,
                   overwrite: bool = False, shared_storage: bool = True) -> RunStart:
    """Collective: which run every process starts, decided once by the main process and broadcast, then checked by
    every process. `resume`: None, "auto" (the newest checkpoint under out_dir/checkpoints, this process's, that
    every process holds) or a checkpoint directory, `path` (resolved on each machine). One directory holds one run:
    a fresh start where `out_dir` holds a finished model or checkpoints, or a resume of another run's checkpoint
    there (run ids differ), is refused unless `overwrite`, and then that run's files are to be removed
    (`RunStart.clear`; clear_previous_files removes them once the new run's inputs have all been checked). Nothing
    is written here. The processes that wrote the checkpoint (`shared_storage`: the main one; else each machine's
    first) check each file of theirs against the digests their save recorded, before anything is loaded. Raises, on
    every process with the same one line, ValueError for such a refusal, FileNotFoundError when there is no such
    checkpoint, CheckpointUnreadable naming the first rank and path that cannot be read and CheckpointDamaged naming
    the first file that is not the one saved."""
    root = out_dir / CHECKPOINT_DIR
    held = [p.name for p in list_checkpoints(root)] if resume == "auto" else []
    views = gather_object([(str(root), held)])
    decision: dict[str, Any] = {}
    if accelerator.is_main_process:
        decision = _decide(resume, views, path) if resume else {}
        if "error" not in decision and "refused" not in decision:
            decision.update(_one_run_per_directory(decision, resume, out_dir, path, overwrite))
    decision = broadcast_object_list([decision])[0]
    if "error" in decision:
        raise FileNotFoundError(decision["error"])
    if "refused" in decision:
        raise ValueError(decision["refused"])
    clear = bool(decision.get("clear"))
    if "name" not in decision:
        return RunStart(decision["run_id"], None, clear)
    mine = root / decision["name"] if resume == "auto" else path
    state = decision["state"]
    needed = files_needed_by(state.get(FILES_KEY, decision["files"]), accelerator.process_index,
                             state.get("processes", 1))
    unreadable = next((str(mine / name) for name in needed if not _readable(mine / name)), None)
    problems = gather_object([unreadable])
    if len(problems) == 1 and unreadable is not None:  # one process: no other storage to blame
        raise CheckpointUnreadable(f"--resume {resume}: {unreadable} is missing or cannot be read; the checkpoint is "
                                   f"incomplete: {_way_on(mine)}")
    for rank, problem in enumerate(problems):
        if problem is not None:
            raise CheckpointUnreadable(f"--resume {resume}: rank {rank} cannot read {problem}; every process needs "
                                       f"the checkpoint's model, optimizer and scheduler state and its own RNG state "
                                       f"({STORAGE_HELP})")
    writer = accelerator.is_main_process if shared_storage else accelerator.is_local_main_process
    mismatch = _check_digests(mine, state, accelerator.is_main_process) if writer else None
    mismatches = gather_object([mismatch])
    for rank, mismatch in enumerate(mismatches):
        if mismatch is not None:
            where = f"rank {rank}: " if len(mismatches) > 1 else ""
            raise CheckpointDamaged(f"--resume {resume}: {where}{mismatch}; {_way_on(mine)}")
    unverified = (f"its {STATE_FILE} records no digests of its files (written before MiniNorm recorded them): they "
                  f"were not verified") if state.get(DIGESTS_KEY) is None else ""
    note = "; ".join(part for part in (decision["note"], unverified) if part)
    return RunStart(decision["run_id"], ResumePoint(mine, state, note), clear)


def _check_digests(path: Path, state: dict[str, Any], main: bool) -> str | None:
    """A writer's check of its copy of the checkpoint `path` (`state`: the main process's trainer state; another
    machine's first process reads its own, which records its own copy's files): the first file that is not the one
    saved, in words, or None (a checkpoint written before digests were recorded is not checked)."""
    if not main:
        try:
            state = read_trainer_state(path)
        except (FileNotFoundError, CheckpointDamaged) as error:
            return str(error)
    digests = state.get(DIGESTS_KEY)
    try:
        mismatch = verify_digests(path, digests) if digests is not None else None
    except OSError as error:  # a file that cannot be read: every process must still hear of it, not wait
        return f"{error.filename or path} cannot be read ({error.strerror or error})"
    if mismatch is None:
        return None
    return f"{mismatch}: not the file this checkpoint saved (replaced, truncated or damaged since)"


def clear_previous_files(accelerator: Accelerator, out_dir: Path, start: RunStart, writer: bool) -> tuple[str, ...]:
    """Collective where `start.clear` (agree_on_start's decision, the same on every process): the `writer` processes
    remove the previous run's files from `out_dir`. Called once every input of the new run has been checked and
    before it writes there, so that a run refused for a bad flag leaves the previous one whole. Returns the names
    this process removed."""
    cleared: tuple[str, ...] = ()
    if start.clear:
        if writer:
            cleared = tuple(clear_previous_run(out_dir))
        accelerator.wait_for_everyone()
    return cleared


def _one_run_per_directory(decision: dict[str, Any], resume: str | None, out_dir: Path, path: Path | None,
                           overwrite: bool) -> dict[str, Any]:
    """The main process's check that the run starting in `out_dir` (`decision`: _decide's) mixes with no other:
    {"run_id"} and, where --overwrite removes the previous run's files first, {"clear": True}; or {"refused"}."""
    held = previous_run(out_dir)
    if "name" not in decision:  # a new run
        if held and not overwrite:
            return {"refused": refuse_previous_run(out_dir, held, resuming=resume == "auto").args[0]}
        return {"run_id": uuid.uuid4().hex[:12], "clear": bool(held)}
    checkpoint = out_dir / CHECKPOINT_DIR / decision["name"] if resume == "auto" else path
    inside = checkpoint.resolve().parent == (out_dir / CHECKPOINT_DIR).resolve()
    theirs, ours = decision["state"].get(RUN_ID_KEY), recorded_run_id(out_dir)
    # A checkpoint continues the directory's run when the run ids agree; where either predates run ids, a
    # directory's own checkpoints are its run's (the data-order checks of check_resume_compatible still apply).
    same_run = theirs == ours if theirs and ours else inside
    run_id = theirs or uuid.uuid4().hex[:12]
    if same_run:
        return {"run_id": run_id}
    if inside:
        return {"refused": f"--resume {resume}: {checkpoint} is a checkpoint of run {theirs}, but "
                           f"{out_dir / CONFIG_FILE} records run {ours}: the directory mixes two runs; resume into "
                           f"another --out_dir"}
    if held and not overwrite:
        source = f"run {theirs}" if theirs else "another run"
        refusal = refuse_previous_run(out_dir, held, f" (run {ours})" if ours else "")
        return {"refused": f"--resume {checkpoint}: that checkpoint is of {source}, and {refusal.args[0]}"}
    # Another run's checkpoint into a directory that holds no finished run: the directory continues that run, and a
    # cut-short run's leftovers (metrics.jsonl) must not join its curve.
    return {"run_id": run_id, "clear": True}


def _decide(resume: str, views: list[tuple[str, list[str]]], path: Path | None) -> dict[str, Any]:
    """The main process's choice of a checkpoint for agree_on_start: {} (start fresh), {"error"} or {"name", "state",
    "files" (its listing, for checkpoints written before trainer_state.json listed them), "note"}."""
    note = ""
    if resume == "auto":
        ours = views[0][1]
        common = [name for name in ours if all(name in held for _, held in views)]
        if not ours:
            return {}
        if not common:
            rank = next(rank for rank, (_, held) in enumerate(views) if ours[-1] not in held)
            return {"error": f"--resume auto: rank {rank} holds none of rank 0's checkpoints ({', '.join(ours)}) "
                             f"under {views[rank][0]} ({STORAGE_HELP})"}
        if common[-1] != ours[-1]:
            rank = next(rank for rank, (_, held) in enumerate(views) if ours[-1] not in held)
            note = f"rank {rank} does not hold {ours[-1]}; {common[-1]} is the newest checkpoint every process holds"
        chosen = Path(views[0][0]) / common[-1]
    else:
        chosen = path
        if not chosen.is_dir():
            return {"error": f"--resume {chosen}: no such checkpoint directory"}
    try:
        state = read_trainer_state(chosen)
    except FileNotFoundError as error:
        return {"error": str(error)}
    except CheckpointDamaged as error:
        return {"refused": f"--resume {resume}: {error}; {_way_on(chosen)}"}
    return {"name": chosen.name, "state": state, "files": _files_under(chosen), "note": note}


def load_checkpoint(accelerator: Accelerator, path: Path, resume: str) -> None:
    """Collective: restore model, optimizer, scheduler and RNG states (agree_on_start has checked every file is
    there). A file that cannot be read raises CheckpointDamaged naming it (and the rank, with several processes) on
    every process. The trainer calls this before --overwrite removes anything: a refused resume leaves the
    directory's previous run whole."""
    problem = None
    try:
        _restore_rng_state(path / rng_state_file(accelerator.process_index))
        accelerator.load_state(str(path))
    except CheckpointDamaged as error:
        problem = str(error)
    except Exception as error:  # noqa: BLE001 -- torch, safetensors and pickle raise any kind on a damaged file
        problem = _damage_report(path, error)
    problems = gather_object([problem])
    for rank, problem in enumerate(problems):
        if problem is not None:
            where = f"rank {rank}: " if len(problems) > 1 else ""
            raise CheckpointDamaged(f"--resume {resume}: {where}{problem}; {_way_on(path)}")


def _way_on(path: Path) -> str:
    """What to do about the damaged or incomplete checkpoint `path` (which `--resume auto` would pick again): resume
    from the complete one before it, where its folder holds one, else start anew."""
    step = checkpoint_step(path.name)
    earlier = [p for p in list_checkpoints(path.parent) if step is not None and checkpoint_step(p.name) < step]
    return (f"resume from the checkpoint before it with --resume {earlier[-1]}" if earlier
            else "there is no earlier checkpoint to resume from: start the run anew (--overwrite)")


# What Accelerate restores from a process's random_states_N.pkl on every device (and a save always writes).
_RNG_KEYS = ("random_state", "numpy_random_seed", "torch_manual_seed")


def _restore_rng_state(file: Path) -> None:
    """Set the Python, NumPy and torch generators from `file` (its absence is no error: a checkpoint of fewer
    processes has none for the extra ones, which start from the seed). Accelerate's load_state sets them too but
    only logs, at info level, when it cannot: the resume would go on from the seed's state, inexactly, unseen."""
    if not file.is_file():
        return
    import random

    import numpy as np
    import torch
    from accelerate.utils import load

    try:
        states = load(file)
        if not isinstance(states, dict) or not all(key in states for key in _RNG_KEYS):
            raise ValueError(f"no {', '.join(_RNG_KEYS)} in it")
        random.setstate(states["random_state"])
        np.random.set_state(states["numpy_random_seed"])
        torch.set_rng_state(states["torch_manual_seed"])
    except Exception as error:  # noqa: BLE001 -- unpickling and the generators raise any kind on bad values
        raise CheckpointDamaged(f"{file} is damaged ({first_line(error, named=True)}); the random states cannot be "
                                f"restored, and the resume would not be exact") from None


def _damage_report(path: Path, error: BaseException) -> str:
    """Which file of the checkpoint `path` made its load fail with `error`: each file is read again on its own (only
    after a failure), in the order Accelerate reads them."""
    from accelerate.utils import load
    from safetensors import safe_open

    order = ("model", "optimizer", "scheduler")
    files = sorted((p for p in path.rglob("*") if p.is_file() and p.name != STATE_FILE),
                   key=lambda p: (next((i for i, name in enumerate(order) if p.name.startswith(name)), len(order)),
                                  str(p)))
    for file in files:
        try:
            if file.suffix == ".safetensors":
                with safe_open(str(file), framework="pt") as tensors:
                    for key in tensors.keys():
                        tensors.get_tensor(key)
            elif file.suffix in (".bin", ".pt", ".pkl"):
                load(file, map_location="cpu")  # as Accelerate reads them: weights only, no code run
        except Exception as damage:  # noqa: BLE001 -- as above
            return f"{file} is damaged ({first_line(damage, named=True)})"
    return f"{path} cannot be loaded into this run's model or optimizer ({first_line(error, named=True)})"
