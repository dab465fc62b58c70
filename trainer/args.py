"""The trainers' command line: parse_args (what a trainer runs on), check_args (a sweep's check of a trainer's
flags, raising instead of exiting) and args_from_run_config (a finished run's recorded flags), each a TrainArgs.

A flag's value comes from its default (TrainArgs' field or the task's TASK_DEFAULTS, trainer/arg_fields.py) <
--config YAML (trainer/arg_yaml.py) < the command line (trainer/arg_parser.py), then goes through the checks of
trainer/arg_checks.py.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, NoReturn, Sequence

from trainer.arg_checks import validate
from trainer.arg_fields import MODEL_FIELDS, TrainArgs, build_model_config
from trainer.arg_parser import SEVERAL_NAMES, build_parser
from trainer.arg_yaml import load_yaml_config
from trainer.run_dir import RUN_ID_KEY


def parse_args(task: str, argv: Sequence[str] | None = None) -> TrainArgs:
    """Parse a trainer's command line (with an optional --config YAML underneath it)."""
    parser = build_parser(task)
    try:
        return _parse(task, parser, argv)
    except ValueError as error:
        parser.error(str(error))


def check_args(task: str, argv: Sequence[str]) -> TrainArgs:
    """What parse_args makes of `argv`, but a command line the trainer would refuse raises a ValueError with the
    trainer's own message instead of exiting: a sweep checks its parameters with it before any trial runs."""
    parser = build_parser(task)

    def refuse(message: str) -> NoReturn:
        raise ValueError(message)

    parser.error = refuse  # argparse's own refusals (an unknown flag, a bad value) go through error()
    return _parse(task, parser, argv)


def _parse(task: str, parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> TrainArgs:
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
    given = frozenset(from_config) | _typed_flags(task, argv)
    args = TrainArgs(task=task, model=model, given=given, **namespace)
    validate(args)
    build_model_config(args)  # fail fast on model-field errors, before any data work
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
    names = {f.name for f in dataclasses.fields(TrainArgs)} - {"model", "given"}
    unknown = sorted(set(config) - names - set(MODEL_FIELDS) - {RUN_ID_KEY})
    if unknown:
        raise ValueError(f"run config: unknown key {unknown[0]!r}; expected the trainer's flags")
    return TrainArgs(**{k: v for k, v in config.items() if k in names},
                     model={k: v for k, v in config.items() if k in MODEL_FIELDS and v is not None})



def _model_overrides(values: dict[str, Any]) -> dict[str, Any]:
    return {name: values[name] for name in MODEL_FIELDS if values.get(name) is not None}

