"""A trial from its parameters: its id (its folder's name), the program it runs and its command line, built from
the YAML's `command` with wandb agent's macros as `wandb agent` builds it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from typing import Any

from dataset.shown_value import shown_value
from scripts.sweep_runner.errors import SweepConfigError
from trainer.run_dir import resolve_path, trainer_task

FLAG_MACROS = {"${args}", "${args_no_boolean_flags}"}  # wandb agent's macros that pass the parameters as --flags
DEFAULT_PROGRAM = "trainer/train_pretrain.py"  # a YAML without `program` or `command`: as wandb agent's defaults
DEFAULT_COMMAND = ["${env}", "${interpreter}", "${program}", "${args}"]


def program_path(config: dict[str, Any]) -> str:
    """The program `${program}` runs: the YAML's `program` as the trainers read a path (resolve_path: `~` and
    `$VARS` expanded, a relative path from the repo root), so the trial runs the program trainer_of names."""
    return str(resolve_path(config.get("program", DEFAULT_PROGRAM)))


def trainer_of(config: dict[str, Any]) -> str | None:
    """The task whose trainer (trainer/run_dir.py, TRAINER_SCRIPTS) a sweep's trials run: its `program`, when its
    `command` runs `${program}`; None for any other program."""
    if "${program}" not in (config.get("command") or DEFAULT_COMMAND):
        return None
    return trainer_task(program_path(config))


def trial_id(params: dict[str, Any], swept: list[str]) -> str:
    """Deterministic from the parameters: a readable part over the swept ones plus a hash of all of them."""
    digest = hashlib.sha1(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:8]
    def short(name: str) -> str:
        return "".join(part[:1] for part in name.split("_")) if "_" in name else name[:4]
    def fmt(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)
    readable = "_".join(f"{short(name)}-{fmt(params[name])}" for name in swept if name in params)
    readable = re.sub(r"[^A-Za-z0-9._=-]+", "", readable)[:80]
    return f"{readable}_{digest}" if readable else digest


def format_arg(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def build_command(config: dict[str, Any], params: dict[str, Any], extra: list[str]) -> list[str]:
    """The trial's command line: the YAML's `command` with wandb agent's macros expanded, then `extra` flags
    (out dir, run name, group) appended so they win over anything the YAML sets."""
    program = program_path(config)
    template = config.get("command") or DEFAULT_COMMAND
    flags = [f"--{k}={format_arg(v)}" for k, v in params.items()]
    macros: dict[str, list[str]] = {
        "${env}": [] if os.name == "nt" else ["/usr/bin/env"],
        "${interpreter}": [sys.executable],
        "${program}": [program],
        "${args}": flags,
        "${args_no_hyphens}": [f"{k}={format_arg(v)}" for k, v in params.items()],
        "${args_no_boolean_flags}": [f"--{k}" if v is True else f"--{k}={format_arg(v)}"
                                     for k, v in params.items() if v is not False],
        "${args_json}": [json.dumps(params)],
    }
    command: list[str] = []
    for item in template:
        if item in macros:
            command.extend(macros[item])
        elif "${" in item:
            raise SweepConfigError(f"command: macro {shown_value(item)} is not supported by the serverless runner")
        else:
            command.append(item)
    return command + extra
