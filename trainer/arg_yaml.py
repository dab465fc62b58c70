"""A trainer's --config YAML: each key one of the trainer's flags, each value converted and checked as the flag's
command-line value would be; a run's own train_config.yaml given as --config starts that run's flags anew."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from dataset.shown_value import shown_value
from trainer.arg_fields import FLAG_DEFAULTS, MODEL_FIELDS, settable_model_fields, task_flags
from trainer.arg_parser import build_parser, takes_several
from trainer.cli import boolean
from trainer.number_text import ascii_hint, number_reader
from trainer.run_dir import CREATE_COMMANDS, RUN_ID_KEY, TASKS, resolve_input_path
from trainer.yaml_file import read_yaml


def load_yaml_config(path: str | Path, task: str = "pretrain",
                     parser: argparse.ArgumentParser | None = None) -> dict[str, Any]:
    """Read a --config YAML for `task`'s trainer: each value converted and checked as its flag's command-line value
    would be (`parser`: the trainer's). An unknown key, a value its flag would refuse, a file that cannot be read:
    a ValueError naming the file and the key."""
    path = resolve_input_path(path)
    try:
        data = read_yaml(path) or {}
    except ValueError as error:
        raise ValueError(f"--config {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    if "task" in data:
        data = _recorded_run_flags(path, data, task)
    known = task_flags(task) | set(MODEL_FIELDS)
    for key in data:
        if key not in known:
            raise ValueError(f"--config {path}: unknown key {shown_value(key)}; allowed keys are the trainer's flags "
                             f"(see --help)")
    actions = {action.dest: action for action in (parser or build_parser(task))._actions}
    values = {}
    for key, value in data.items():
        try:
            values[key] = _from_yaml(actions[key], value)
        except (ValueError, argparse.ArgumentTypeError) as error:
            raise ValueError(f"--config {path}: key {shown_value(key)}: {error}") from None
    return values


# What a run's train_config.yaml records of how that run started, not of what it trains: a --config made of it
# starts a run of its own (its own id; a file in the way of --out_dir is refused, not removed, unless the command
# line says --overwrite).
_RUN_START_KEYS = (RUN_ID_KEY, "resume", "overwrite")


def _recorded_run_flags(path: Path, recorded: dict[str, Any], task: str) -> dict[str, Any]:
    """The flags of a run's train_config.yaml (it has `task:`) given as --config: the same task's trainer takes
    them, less how that run started (_RUN_START_KEYS) and, for a fine-tuning run, the starting model's architecture
    (recorded for the record: it comes from --from_weight again)."""
    theirs = recorded["task"]
    if theirs != task:
        if theirs not in TASKS:
            raise ValueError(f"--config {path}: key 'task': {_shown(theirs)} is not one of {', '.join(TASKS)}")
        raise ValueError(f"--config {path}: a {theirs} run's config (task: {theirs}); this is the {task} trainer: "
                         f"run it with `{CREATE_COMMANDS[theirs]} --config {path}`")
    keep_model = set(MODEL_FIELDS) if task == "pretrain" else set(settable_model_fields(task))
    # A flag the trainer no longer has is left out too: a file written before --preset became pretraining's alone
    # records it for every task (and --from_weight for pretraining), and the run it records is still this one.
    flags = task_flags(task)
    return {key: value for key, value in recorded.items()
            if key != "task" and key not in _RUN_START_KEYS
            and (key in keep_model if key in MODEL_FIELDS else key in flags or key not in FLAG_DEFAULTS)}


_NOUNS = {int: "an integer", float: "a number", str: "a string", bool: "a boolean (true/false)"}


def _shown(value: Any) -> str:
    """A YAML value as an error shows it: null, true, a list, 'text', 1.5."""
    if value is None or isinstance(value, bool):
        return yaml.safe_dump(value).split("\n")[0]
    if isinstance(value, (list, dict)):
        return "a list" if isinstance(value, list) else "a mapping"
    if isinstance(value, int) and value.bit_length() > 64:
        return "an integer of more than 64 bits"  # str() refuses one of over 4,300 digits
    return repr(value) if isinstance(value, str) else str(value)


def _from_yaml(action: argparse.Action, value: Any) -> Any:
    """A YAML value as `action`'s flag takes it on the command line: through the flag's type (its text, for a
    number) and its choices; a list for a flag that takes several values. Null only unsets a flag that may be
    unset."""
    if value is None:
        if action.dest == "out_dir":  # an empty `out_dir:` of a templated YAML with --overwrite cleared out/<task>
            raise ValueError("expected a directory, got null (an empty value); leave the key out for the task's "
                             "default")
        if action.default is None or getattr(action.type, "unsettable", False):
            return None
    if takes_several(action):
        items = value if isinstance(value, list) else [value]
        if not items:
            raise ValueError("expected one or more values, got an empty list")
        return [_yaml_scalar(action, item) for item in items]
    return _yaml_scalar(action, value)


def _yaml_scalar(action: argparse.Action, value: Any) -> Any:
    kind = bool if action.type is boolean else getattr(action.type, "kind", action.type or str)
    expected = f"expected {_NOUNS.get(kind, 'a value')}, got {_shown(value)}"
    if isinstance(value, bool) and kind is bool:
        return value
    if isinstance(value, bool):  # `compile: off` is YAML's false
        quote = " (YAML reads unquoted on/off/yes/no as booleans: quote it)" if kind is str else ""
        raise ValueError(expected + quote)
    if not isinstance(value, (str, int, float)):  # null, a list, a mapping, a date
        raise ValueError(expected)
    try:
        # the flag's reader, as the command line's (ToolParser reads an int or float flag with number_text.py's)
        converted = number_reader(action.type or str)(value if isinstance(value, str) else repr(value))
    except argparse.ArgumentTypeError as error:
        raise ValueError(str(error)) from None
    except (TypeError, ValueError):
        hint = ascii_hint(value) if isinstance(value, str) and kind in (int, float) else ""
        raise ValueError(expected + hint) from None
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"expected one of {', '.join(map(str, action.choices))}, got {_shown(value)}")
    return converted

