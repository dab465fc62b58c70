"""The trainers' command line: parse_args (what a trainer runs on), check_args (a sweep's check of a trainer's
flags, raising instead of exiting) and args_from_run_config (a finished run's recorded flags), each a TrainArgs.

A flag's value comes from its default (TrainArgs' field or the task's TASK_DEFAULTS, trainer/arg_fields.py) <
--config YAML (trainer/arg_yaml.py) < the command line (trainer/arg_parser.py), then goes through the checks of
trainer/arg_checks.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any, NoReturn, Sequence

from dataset.shown_value import shown_value
from trainer.arg_checks import unused_flags_note, validate
from trainer.arg_fields import MODEL_FIELDS, TrainArgs
from trainer.arg_parser import SEVERAL_NAMES, build_parser
from trainer.arg_yaml import load_yaml_config
from trainer.run_dir import RUN_ID_KEY
from trainer.sweep_dir import SWEEP_TRIAL_VARIABLE


# Set in a sweep trial's environment: by `wandb agent` (its sweep's id) and by scripts/sweep.py's runner. A trial's
# command line is the sweep's, which varies some flags and fixes the others (a Muon rate beside --optimizer adamw):
# the unused-flag rule notes its unused flags as a --config YAML's, instead of refusing them.
SWEEP_TRIAL_VARIABLES = ("WANDB_SWEEP_ID", SWEEP_TRIAL_VARIABLE)


def parse_args(task: str, argv: Sequence[str] | None = None) -> TrainArgs:
    """Parse a trainer's command line (with an optional --config YAML underneath it); the main process says in one
    note line on stderr which unused flags a YAML or a sweep gave (trainer/arg_checks.py, DEPENDENT_FLAGS)."""
    parser = build_parser(task)
    try:
        args = _parse(task, parser, argv, sweep_trial=any(os.environ.get(name) for name in SWEEP_TRIAL_VARIABLES))
    except ValueError as error:
        parser.error(str(error))
    note = unused_flags_note(args)
    if note and os.environ.get("RANK", "0") == "0":  # the main process (torchrun and accelerate set RANK)
        print(note, file=sys.stderr)
    return args


def check_args(task: str, argv: Sequence[str]) -> TrainArgs:
    """What parse_args makes of `argv`, but a command line the trainer would refuse raises a ValueError with the
    trainer's own message instead of exiting: a sweep checks its parameters with it before any trial runs, so `argv`
    is taken as a sweep trial's (its unused flags set back to their defaults, not refused)."""
    parser = build_parser(task)

    def refuse(message: str) -> NoReturn:
        raise ValueError(message)

    parser.error = refuse  # argparse's own refusals (an unknown flag, a bad value) go through error()
    return _parse(task, parser, argv, sweep_trial=True)


def _parse(task: str, parser: argparse.ArgumentParser, argv: Sequence[str] | None, sweep_trial: bool) -> TrainArgs:
    pre, _ = parser.parse_known_args(argv)
    from_config = load_yaml_config(pre.config, task, parser) if pre.config else {}
    parser.set_defaults(**from_config)
    namespace = vars(parser.parse_args(argv))
    namespace.pop("config")
    model = _model_overrides(namespace)
    for name in MODEL_FIELDS:
        namespace.pop(name)
    for flag_task, name in SEVERAL_NAMES:
        if task == flag_task:
            namespace[name] = _joined_names(namespace[name])
    if isinstance(namespace.get("loss_weights"), list):
        namespace["loss_weights"] = [value for item in namespace["loss_weights"]
                                     for value in (item if isinstance(item, list) else [item])]
    typed = _typed_flags(task, argv)
    given = frozenset(from_config) | typed
    # a flag the YAML gives and the command line types again is the command line's
    untyped = given if sweep_trial else frozenset(from_config) - typed
    args = TrainArgs(task=task, model=model, given=given, untyped=untyped, **namespace)
    validate(args)  # with the model config's own checks (but a resume's: trainer/arg_checks.py), before any data work
    return args


def _joined_names(value: str | list[str]) -> str:
    """A SEVERAL_NAMES flag's values (`a b`, `a,b`, a YAML list or string) as one comma-separated string."""
    items = value if isinstance(value, list) else [value]
    return ",".join(name.strip() for item in items for name in str(item).split(","))


def _typed_flags(task: str, argv: Sequence[str] | None) -> frozenset[str]:
    """The flags `argv` (the command line if None) gives, whatever their values: the trainer's parser with every
    default suppressed, so that only what was typed lands in the namespace."""
    parser = build_parser(task)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    typed, _ = parser.parse_known_args(argv)
    return frozenset(vars(typed)) - {"config"}



def args_from_run_config(config: dict[str, Any]) -> TrainArgs:
    """The TrainArgs a run directory's train_config.yaml records (the trainer's effective config, with the model
    fields flat beside the flags), e.g. to rebuild a finished run's data exactly."""
    names = {f.name for f in dataclasses.fields(TrainArgs)} - {"model", "given", "untyped", "ignored"}
    unknown = sorted(set(config) - names - set(MODEL_FIELDS) - {RUN_ID_KEY})
    if unknown:
        raise ValueError(f"run config: unknown key {shown_value(unknown[0])}; expected the trainer's flags")
    return TrainArgs(**{k: v for k, v in config.items() if k in names},
                     model={k: v for k, v in config.items() if k in MODEL_FIELDS and v is not None})



def _model_overrides(values: dict[str, Any]) -> dict[str, Any]:
    return {name: values[name] for name in MODEL_FIELDS if values.get(name) is not None}

