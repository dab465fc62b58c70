"""The trainers' argparse parsers, built from TrainArgs' fields (trainer/arg_fields.py): one flag per field, in its
--help section with its help text and its trainer's default, and the flag types that turn a field's annotation into
a checked value (a path that is not empty, a flag that `none` unsets, a repeatable reward)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from dataset.shown_value import shown_value
from trainer.arg_fields import (ADDABLE_MODEL_FIELDS, FLAG_GROUPS, INPUT_PATH_FLAGS, MODEL_CONFIG_GROUP, MODEL_FIELDS,
                                RUNTIME_MODEL_FIELDS, TASK_DEFAULTS, TASK_MODEL_DEFAULTS, TrainArgs, for_task,
                                task_flags)
from trainer.cli import DefaultsHelpFormatter, ToolParser, boolean, flag_type, path_arg, seed, utf8_text
from trainer.number_text import ascii_float, ascii_hint, number_reader

# The flags that name a file or directory: never empty, and `none` is not their default (an unset shell variable
# in `--out_dir "$DIR" --overwrite` would otherwise clear the default run).
PATH_FLAGS = (*INPUT_PATH_FLAGS, "out_dir")
UNSET_WORDS = ("none", "null")  # what a flag that may be unset takes for unset (not a path flag)


def _optional(kind: type) -> Any:
    """The type of a flag that may be unset: `none` or `null` (or an empty value) unsets it."""
    def parse(text: str) -> Any:
        return None if str(text).lower() in (*UNSET_WORDS, "") else number_reader(kind)(text)
    parse.__name__ = kind.__name__
    parse.unsettable = True
    return flag_type(getattr(kind, "kind", kind), parse)


def _path(text: str) -> str:
    """A path flag's value: not empty, and not a word that unsets other flags (leaving the flag out does)."""
    if text.strip().lower() in UNSET_WORDS:
        raise argparse.ArgumentTypeError(f"{shown_value(text)} is not a path; leave the flag out for its default")
    return path_arg(text)


flag_type(str, _path)


def _reward_spec(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a built-in or path/to/file.py:function, got an empty value")
    return text


flag_type(str, _reward_spec)


def section_heading(key: str, task: str) -> tuple[str, str | None]:
    """The title and description of --help's section `key` for `task`'s trainer."""
    if key != MODEL_CONFIG_GROUP:
        return FLAG_GROUPS[key]
    title = FLAG_GROUPS[key][0]
    if task == "pretrain":
        return f"{title} (default: the preset's value)", None
    *others, last = [f"--{name}" for name in RUNTIME_MODEL_FIELDS]
    allowed = f"fine-tuning may change only {', '.join(others)} and {last}"
    for name in ADDABLE_MODEL_FIELDS.get(task, ()):
        default = " (the default)" if TASK_MODEL_DEFAULTS.get(task, {}).get(name) else ""
        allowed += f", and turn on --{name} in a model without it{default}"
    return f"{title} (default: the starting model's value)", allowed


def build_parser(task: str) -> argparse.ArgumentParser:
    parser = ToolParser(
        description=f"MiniNorm {task}: train on the embedded default corpus or your own jsonl",
        formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--config", type=path_arg, help="YAML file of flag values; command-line flags override it")
    defaults = TrainArgs(task=task, **TASK_DEFAULTS.get(task, {}))
    sections: dict[str, list[dataclasses.Field]] = {key: [] for key in FLAG_GROUPS}
    for f in dataclasses.fields(TrainArgs):
        if f.name in task_flags(task):
            sections[for_task(f.metadata["group"], task)].append(f)  # a KeyError: a group FLAG_GROUPS lacks
    for key, members in sections.items():
        if not members and key != MODEL_CONFIG_GROUP:
            continue  # another task's section
        group = parser.add_argument_group(*section_heading(key, task))
        for f in members:
            if (task, f.name) in SEVERAL_NAMES:
                group.add_argument(f"--{f.name}", type=utf8_text, nargs="+", default=getattr(defaults, f.name),
                                   metavar=f.name.upper(), help=for_task(f.metadata["help"], task))
                continue
            _add_flag(group, f.name, str(f.type), getattr(defaults, f.name), for_task(f.metadata["help"], task))
        if key == MODEL_CONFIG_GROUP:
            for name, (kind, choices, help) in MODEL_FIELDS.items():
                if kind is bool:
                    group.add_argument(f"--{name}", type=boolean, nargs="?", const=True, default=None,
                                       metavar="BOOL", help=help)
                else:
                    # plain strings: argparse lists the choices by repr, which for an enum member is <Enum.X: 'x'>
                    shown = None if choices is None else tuple(map(str, choices))
                    group.add_argument(f"--{name}", type=kind, choices=shown, default=None, help=help)
    return parser


class _Repeated(argparse.Action):
    """A repeatable flag: its values in order; the first use on the command line replaces the default."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest, None)  # None: parsed with defaults suppressed (_typed_flags)
        setattr(namespace, self.dest, [*(current if current is not self.default and current else []), values])


def _add_flag(group: argparse._ArgumentGroup, name: str, hint: str, default: Any, help: str) -> None:
    """One TrainArgs field as a flag; `hint` is its annotation, a string here (e.g. "int | None")."""
    if isinstance(default, bool):
        group.add_argument(f"--{name}", type=boolean, nargs="?", const=True, default=default, metavar="BOOL",
                           help=help)
        return
    if hint.startswith("list[str]"):  # repeatable: each use adds one; the command line replaces a YAML list
        group.add_argument(f"--{name}", action=_Repeated, type=_reward_spec, default=default, help=help)
        return
    if hint.startswith("list[float]"):
        group.add_argument(f"--{name}", type=FLAG_TYPES.get(name, float), nargs="+", default=default, help=help)
        return
    # A text flag is checked as text: argv's bytes that are not UTF-8 failed in the tokenizer after the run trained
    base = int if hint.startswith("int") else float if hint.startswith("float") else utf8_text
    kind = _optional(base) if "None" in hint else base
    group.add_argument(f"--{name}", type=FLAG_TYPES.get(name, kind), default=default, help=help)


def _numbers(text: str) -> list[float]:
    """One value of a flag of several numbers: a number, or several comma-separated (`0.8,0.2`)."""
    try:
        return [ascii_float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown_value(text)} is not a number or comma-separated numbers"
                                         f"{ascii_hint(text)}") from None


flag_type(float, _numbers)
# Text flags of one or several names (space-separated as TRL's list flags, or comma-separated), kept as
# one comma-separated string: DPO's --loss_type (GRPO's takes one name).
SEVERAL_NAMES = {("dpo", "loss_type")}
# Flags whose type is not their annotation's plain one (the path flags: unset only by leaving them out).
# --scale_rewards takes TRL's value `none`, which for other flags unsets them: leaving it out unsets it.
FLAG_TYPES: dict[str, Any] = {"seed": seed, "scale_rewards": utf8_text, "loss_weights": _numbers,
                              **{name: _path for name in PATH_FLAGS}}



def takes_several(action: argparse.Action) -> bool:
    """Whether `action`'s flag takes a list of values (repeated, or several after one flag), not one value."""
    return isinstance(action, _Repeated) or action.nargs == "+"
