"""Reading and checking a sweep YAML before anything runs: wandb's schema and a first proposal, and, when its
program is one of this repo's trainers, every parameter value (the trainer's own flag checks) and the metric; plus
the `--only` filter of a grid sweep."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dataset.atomic_io import NAME_MAX
from dataset.shown_value import shown_name, shown_text, shown_value
from scripts.sweep_runner.command import (DEFAULT_COMMAND, FLAG_MACROS, build_command, format_arg, program_path,
                                          trainer_of)
from scripts.sweep_runner.engine import plain, propose_next, sweeps_module
from scripts.sweep_runner.errors import SweepConfigError
from trainer.run_dir import TRAINER_SCRIPTS, logged_metrics
from trainer.sweep_dir import is_folder_name, swept_names
from trainer.yaml_file import read_yaml

METHODS = ("grid", "random", "bayes")
# the keys of a parameter spec in wandb's schema (its nested `parameters` aside, refused here)
PARAMETER_KEYS = ("value", "values", "distribution", "probabilities", "min", "max", "mu", "sigma", "q", "a", "b")
AGENT_ONLY_SETTINGS = ("early_terminate", "scheduler", "metric.target")  # wandb's agent and server act on them


def agent_only_settings(config: dict[str, Any]) -> list[str]:
    """The settings of a sweep YAML, among AGENT_ONLY_SETTINGS, that it gives: wandb's server stops trials early
    (early_terminate) or the sweep at a target, which a serverless runner cannot; the YAML stays valid for both."""
    given = set(config) | {f"metric.{key}" for key in config.get("metric") or {}}
    return [name for name in AGENT_ONLY_SETTINGS if name in given]


def validate_sweep_config(config: Any, source: str = "sweep config", notes: list[str] | None = None) -> dict[str, Any]:
    """Check a parsed sweep YAML; raise SweepConfigError naming the first bad field. `notes`, when given, gets the
    lines the sweep should say once when it starts (a swept parameter some trials do not use)."""
    def bad(field: str, message: str) -> SweepConfigError:
        return SweepConfigError(f"{source}: {field}: {message}")

    if not isinstance(config, dict):
        raise SweepConfigError(f"{source}: expected a mapping (method, metric, parameters, ...)")
    _check_method_and_metric(config, bad)
    _check_sweep_name(config, bad)
    parameters = _check_parameter_specs(config, bad)
    command = _check_command_and_program(config, bad)
    _check_wandb_schema(config, parameters, source, bad)
    _check_sweep_ends(config, bad)
    first = _first_trial(config, bad)
    task = trainer_of(config)
    if task is not None:  # another program's flags and metrics are its own business
        _check_metric(config, task, bad)
        found = _check_parameters(config, task, first, bad)
        if notes is not None:
            notes.extend(found)
    _check_program_exists(config, command, bad)
    return config


def _check_method_and_metric(config: dict[str, Any], bad: Any) -> None:
    """The search method, and the metric's name and goal (which bayes search needs)."""
    if config.get("method") not in METHODS:
        raise bad("method", f"{shown_value(config.get('method'))} is not one of {', '.join(METHODS)}")
    metric = config.get("metric")
    if config["method"] == "bayes" and metric is None:
        raise bad("metric", "bayes search needs a metric (name and goal)")
    if metric is not None:
        if not isinstance(metric, dict) or not isinstance(metric.get("name"), str):
            raise bad("metric.name", "expected a metric name, e.g. val_loss")
        if metric.get("goal", "minimize") not in ("minimize", "maximize"):
            raise bad("metric.goal", f"{shown_value(metric.get('goal'))} is not one of minimize, maximize")


def _check_sweep_name(config: dict[str, Any], bad: Any) -> None:
    if "name" in config and not is_folder_name(config["name"]):
        # the sweep's folder is out/sweeps/<name>: a path there would put it (and its trials) anywhere
        raise bad("name", f"{shown_value(config['name'])} is not a folder name (letters, digits, '.', '_', '=', '-'; "
                         f"at most {NAME_MAX} characters)")


def _check_parameter_specs(config: dict[str, Any], bad: Any) -> dict[str, Any]:
    """The `parameters` mapping: non-empty, each spec checked (_check_parameter_spec); returned."""
    parameters = config.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        raise bad("parameters", "expected a non-empty mapping of parameter name to spec")
    for name, spec in parameters.items():
        _check_parameter_spec(name, spec, bad)
    return parameters


def _field(name: str) -> str:
    """The field of a parameter, as an error's prefix names it: its name is a key the user wrote, quoted by
    shown_name (a 5,000-character name made a 5,000-character prefix; one holding a newline split the line)."""
    return f"parameters.{shown_name(name)}"


def _check_parameter_spec(name: Any, spec: Any, bad: Any) -> None:
    """One parameter's spec: a flat mapping of wandb's keys, its values a non-empty list, every number finite and
    every value JSON."""
    if not isinstance(name, str):  # wandb's engine asserts on it (a traceback)
        raise bad("parameters", f"parameter names must be strings, got {shown_value(name)}")
    if not isinstance(spec, dict):
        raise bad(_field(name), "expected a mapping such as {values: [...]} or {value: x}")
    if "parameters" in spec:
        raise bad(_field(name), "nested parameters are not supported by the trainer's flat flags")
    # wandb's schema names only the parameter ("invalid hyperparameter configuration: seed"), not what is wrong
    unknown = [key for key in spec if key not in PARAMETER_KEYS]
    if unknown:
        raise bad(f"{_field(name)}.{shown_name(str(unknown[0]))}", f"not a key of a parameter spec; allowed: "
                                                     f"{', '.join(PARAMETER_KEYS)}")
    if "values" in spec and not (isinstance(spec["values"], list) and spec["values"]):
        got = shown_value(spec["values"])
        raise bad(f"{_field(name)}.values", f"expected a non-empty list of values, got {got}")
    # NaN or inf would be proposed and run as a trial (`--seed=nan`), and NaN never equals itself, so a trial
    # holding one is never found again on resume.
    numbers = [(key, spec.get(key)) for key in ("value", "min", "max", "mu", "sigma", "q") if key in spec]
    if isinstance(spec.get("values"), list):
        numbers += [(f"values[{i}]", value) for i, value in enumerate(spec["values"])]
    for key, value in numbers:
        if isinstance(value, float) and not math.isfinite(value):
            raise bad(f"{_field(name)}.{key}", f"{value} is not a finite number")
    # A YAML date or !!binary cannot go into a trial's JSON (${args_json}, the state file): the state would be
    # written with str() in its place and the next start would call its own folder a different config.
    fields = [(key, value) for key, value in spec.items() if key != "values"]
    if isinstance(spec.get("values"), list):
        fields += [(f"values[{i}]", value) for i, value in enumerate(spec["values"])]
    for key, value in fields:
        if not _is_json(value):
            raise bad(f"{_field(name)}.{key}", f"{shown_value(value)} is not a JSON value (a string, number, "
                                                  f"boolean, null, list or mapping); quote it to make it a string")


def _check_command_and_program(config: dict[str, Any], bad: Any) -> list[str] | None:
    """`command` (a list of strings passing the parameters as flags) and `program` (a path), when given; the
    command returned."""
    command = config.get("command")
    if command is not None and not (isinstance(command, list) and all(isinstance(c, str) for c in command)):
        raise bad("command", "expected a list of strings")
    if command is not None and not FLAG_MACROS.intersection(command):
        # The trainer reads its whole config from its command line (it does not look at wandb.config), under
        # this runner and under `wandb agent` alike.
        raise bad("command", f"must pass the parameters as flags with {' or '.join(sorted(FLAG_MACROS))}")
    if "program" in config and not isinstance(config["program"], str):
        raise bad("program", "expected a path to the training script")
    return command


def _check_wandb_schema(config: dict[str, Any], parameters: dict[str, Any], source: str, bad: Any) -> None:
    """wandb's own schema; a parameter it refuses is named with the spec shapes it takes."""
    violations = sweeps_module().schema_violations_from_proposed_config(config)
    if violations:
        name = violations[-1].removeprefix("invalid hyperparameter configuration: ")
        if name != violations[-1] and name in parameters:
            raise bad(_field(name), f"{shown_value(parameters[name])} is not a parameter spec wandb accepts; "
                                    f"expected {{value: X}}, {{values: [X, ...]}} or a distribution "
                                    f"(distribution, min, max, mu, sigma, q, a, b)")
        raise SweepConfigError(f"{source}: {_quoted_violation(config, violations[-1])}")


def _quoted_violation(config: dict[str, Any], violation: str) -> str:
    """wandb's schema violation as an error shows it: jsonschema's message quotes the refused value, or a key the
    YAML gives that the schema lacks, whole by repr (a 5,000-character key or value made a 5,000-character line);
    here the value is quoted by shown_value and the key by shown_name, after the field that holds it. A violation
    of wandb's own words (no schema error) is shown as it is."""
    error = next((error for error in sweeps_module().config.cfg.validator.iter_errors(config)
                  if error.message == violation), None)
    if error is None:
        return violation
    field = ".".join(shown_name(str(part)) for part in error.absolute_path)
    where = f"{field}: " if field else ""
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = error.schema.get("properties", {})
        extra = next((key for key in error.instance if key not in allowed), None)
        if extra is not None:
            return (f"{where}{shown_name(str(extra))}: not a key wandb's sweep schema allows here; allowed: "
                    f"{', '.join(allowed)}")
    quoted = repr(error.instance)
    if error.message.startswith(quoted):  # jsonschema's "<value> is not of type ...", "<value> does not match ..."
        return f"{where}{shown_value(error.instance)}{error.message[len(quoted):]}"
    return where + shown_text(error.message)


def _check_sweep_ends(config: dict[str, Any], bad: Any) -> None:
    """A random or bayes search needs run_cap to stop; a grid must be small enough to list."""
    if config["method"] in ("random", "bayes") and not isinstance(config.get("run_cap"), int):
        raise bad("run_cap", f"{config['method']} search never ends by itself; set run_cap (an integer) so the "
                             f"serverless runner knows when to stop")
    if config["method"] == "grid":
        _check_grid_size(config["parameters"], bad)


def _first_trial(config: dict[str, Any], bad: Any) -> dict[str, Any] | None:
    """The engine's first proposal. The schema accepts some specs the engine then refuses (e.g. {min, max} under
    grid): asking for a first trial now makes the error come before the sweep folder exists rather than at the
    first proposal."""
    try:
        return propose_next(config, [], seed=0)
    except ValueError as error:
        raise bad("parameters", f"wandb's sweep engine cannot propose a trial: {error}".replace("\n", " ")) from None


def _check_program_exists(config: dict[str, Any], command: list[str] | None, bad: Any) -> None:
    if "${program}" in (command or DEFAULT_COMMAND) and not Path(program_path(config)).exists():
        # every trial would fail at once, the same way: said once, before the sweep folder exists
        raise bad("program", f"{program_path(config)} does not exist (the script each trial runs; a relative path "
                             f"is taken from the repo root)")


MAX_GRID_TRIALS = 10_000  # wandb's grid engine lists every point of the grid at each proposal


def _check_grid_size(parameters: dict[str, Any], bad: Any) -> None:
    """A grid the engine cannot list: it builds every point (an int_uniform range as a list of its integers) at each
    proposal, so a huge one runs out of memory (a MemoryError traceback, or the machine's memory first)."""
    from sweeps.params import HyperParameter

    sizes = {}
    for name, spec in parameters.items():
        kind = HyperParameter(name, spec).type
        if kind == HyperParameter.CATEGORICAL:
            sizes[name] = len(spec["values"])
            _check_distinct_values(name, spec["values"], bad)
        elif kind == HyperParameter.INT_UNIFORM:
            sizes[name] = spec["max"] - spec["min"] + 1
        elif kind == HyperParameter.Q_UNIFORM:  # np.arange(min, max, q), as the engine lists it
            sizes[name] = max(0, math.ceil((spec["max"] - spec["min"]) / spec["q"]))
    total = math.prod(sizes.values())
    if total > MAX_GRID_TRIALS:
        shown = " x ".join(f"{shown_name(name)}: {size}" for name, size in sizes.items() if size > 1)
        raise bad("parameters", f"a grid of {total} trials ({shown} values) is more than the serverless runner lists "
                                f"(at most {MAX_GRID_TRIALS}); use fewer values, or method random or bayes with a "
                                f"run_cap")


def _check_distinct_values(name: str, values: list[Any], bad: Any) -> None:
    """A grid runs one trial per distinct value: a value listed twice (a typo for another) left the grid a trial
    short per repeat without a word."""
    seen: dict[str, int] = {}
    for index, value in enumerate(values):
        first = seen.setdefault(_value_identity(value), index)
        if first != index:
            raise bad(f"{_field(name)}.values[{index}]", f"{shown_value(value)} is values[{first}] again; a grid runs "
                                                         f"each value once: list each value once")


def _value_identity(value: Any) -> str:
    """The one rule for when two of a parameter's values are the same value to a trial (a grid's repeat, a random
    search's values that sweep nothing, a value already checked in the first trial): their JSON text with equal
    numbers alike (_equal_numbers_alike: 1 and 1.0 are one value, true and 1 or "1" and 1 are not)."""
    return _key(_equal_numbers_alike(value))


def _equal_numbers_alike(value: Any) -> Any:
    """`value` with each float equal to an integer as that integer (1.0 as 1, in lists and mappings too): the trial's
    flag reads "1" and "1.0" as one number, which json.dumps writes apart. A bool stays a bool (true is not 1), a
    string a string ("1" is not 1)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_equal_numbers_alike(item) for item in value]
    if isinstance(value, dict):
        return {key: _equal_numbers_alike(item) for key, item in value.items()}
    return value


def _is_json(value: Any) -> bool:
    """Whether `value` is JSON as it is (json.dumps would not need default=str, and it reads back equal)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if isinstance(value, list):
        return all(_is_json(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _is_json(item) for key, item in value.items())
    return False


def _check_metric(config: dict[str, Any], task: str, bad: Any) -> None:
    """A metric the trainer never logs would leave every trial's metric None (and a bayes search blind)."""
    metric = (config.get("metric") or {}).get("name")
    allowed = logged_metrics(task)
    if metric is not None and metric not in allowed:
        raise bad("metric.name", f"{shown_value(metric)} is not a metric {TRAINER_SCRIPTS[task]} logs; allowed: "
                                 f"{', '.join(allowed)}")


def _check_parameters(config: dict[str, Any], task: str, first: dict[str, Any] | None, bad: Any) -> list[str]:
    """Each value a parameter may take (its `value`, each of its `values`, the bounds of its {min, max}), put in the
    first proposed trial in place of that parameter's, must pass the trainer's own parsing and checks
    (trainer/args.py, check_args): a flag it lacks or a value it refuses is found now, not as failed trials. A value
    refused only beside another swept one is refused too: in a grid that pair is one of its trials. A swept
    parameter the trainer sets back as unused (the unused-flag rule) is refused where no trial checked uses it, and
    noted once otherwise (_unused_parameters); the notes are returned."""
    from trainer.args import check_args  # torch: only for sweeps that drive one of this repo's trainers

    program = program_path(config)
    checked: dict[str, tuple[str | None, Any]] = {}  # a trial's parameters (as JSON) -> (refusal, its TrainArgs)

    def check(params: dict[str, Any]) -> tuple[str | None, Any]:
        key = _key(params)
        if key not in checked:
            command = build_command(config, params, [])
            try:
                checked[key] = (None, check_args(task, command[command.index(program) + 1:]))
            except ValueError as error:
                checked[key] = (str(error), None)
        return checked[key]

    def refusal(params: dict[str, Any]) -> str | None:
        return check(params)[0]

    def refuse(name: str, key: str, value: Any, error: str) -> SweepConfigError:
        # repr, and the trainer's message (which quotes the value) escaped: a value holding a newline stays one line
        return bad(f"{_field(name)}.{key}",
                   f"{TRAINER_SCRIPTS[task]} refuses {shown_value(value)}: {_one_line(error)}")

    candidates = {name: _candidates(name, spec) for name, spec in config["parameters"].items()}
    base = first or {name: spec["value"] for name, spec in config["parameters"].items() if "value" in spec}
    error = refusal(base)
    if error is not None:  # the first trial: blame the parameter without which it passes
        for name in base:
            rest = {k: v for k, v in base.items() if k != name}
            if refusal(rest) is None:
                for key, value in candidates[name]:
                    if (refused := refusal({**rest, name: value})) is not None:
                        raise refuse(name, key, value, refused)
                raise bad(_field(name), f"{TRAINER_SCRIPTS[task]} refuses {shown_value(base[name])}, the "
                                                f"first trial's: {_one_line(error)}")
        raise bad("parameters", f"{TRAINER_SCRIPTS[task]} refuses the first trial {shown_value(base)}: "
                                f"{_one_line(error)}")
    for name, values in candidates.items():
        for key, value in values:
            # Python's == takes false for 0 and true for 1: such a value was never put to the trainer
            if name not in base or _value_identity(value) != _value_identity(base[name]):
                error = refusal({**base, name: value})
                if error is not None:
                    raise refuse(name, key, value, error)
    return _unused_parameters(config, base, candidates, check, bad)


def _unused_parameters(config: dict[str, Any], base: dict[str, Any], candidates: dict[str, list[tuple[str, Any]]],
                       check: Any, bad: Any) -> list[str]:
    """The swept parameters (more than one value) that the trainer's unused-flag rule sets back in some trial
    (trainer/arg_checks.py, DEPENDENT_FLAGS, through check_args' `ignored`): each value of one is tried in the first
    trial and beside each value of every other swept parameter (a switch another parameter turns on is found; one
    that needs two of them at once is not). Unused in every such trial: a SweepConfigError (its values would make
    identical trials); used in some: one note line, returned, naming it and what turns it on."""
    from trainer.arg_checks import flag_default, flag_value

    swept = [name for name, values in candidates.items() if len({_value_identity(value) for _, value in values}) > 1
             or "distribution" in config["parameters"][name]]
    # the trials checked so far (the first, and each value in it): only a parameter set back in one is looked into
    set_back: set[str] = set()
    for name in swept:
        for _, value in candidates[name]:
            _, args = check({**base, name: value})
            set_back.update(flag for flag, _, _ in (args.ignored if args is not None else ()))
    notes = []
    for name in (name for name in swept if name in set_back):
        reads, unused_by = [], None
        others = [(other, value) for other in swept if other != name for _, value in candidates[other]]
        for _, value in candidates[name]:
            for params in ({**base, name: value}, *({**base, other: another, name: value}
                                                    for other, another in others)):
                _, args = check(params)
                if args is None:  # a pair the trainer refuses runs no trial that could read it
                    continue
                ignored = {flag: used_by for flag, _, used_by in args.ignored}
                if name in ignored:
                    unused_by = ignored[name]
                    reads.append(False)
                elif flag_value(args, name) != flag_default(args, name):
                    reads.append(True)
        if unused_by is None:
            continue
        if not any(reads):
            raise bad(_field(name), f"no trial uses it: only {unused_by} uses it, which no trial turns on, "
                                            f"so its values would make identical trials (fix it with value:, or "
                                            f"sweep what turns it on)")
        notes.append(f"note: {_field(name)}: only {unused_by} uses it; a trial without that runs at its "
                     f"default, so its values make identical trials there (each trial notes it)")
    return notes


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr)


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _candidates(name: str, spec: dict[str, Any]) -> list[tuple[str, Any]]:
    """(field, value) for the values a parameter spec may give a trial: a distribution's bounds as wandb's engine
    samples them (its own type: int_uniform gives ints; log_uniform's min and max are exponents); none for a
    distribution without bounds (normal, beta)."""
    if "value" in spec:
        return [("value", spec["value"])]
    if "values" in spec:
        return [(f"values[{index}]", value) for index, value in enumerate(spec["values"])]
    if "min" not in spec or "max" not in spec:
        return []
    import numpy as np
    from sweeps.params import HyperParameter

    parameter = HyperParameter(name, spec)
    # ppf(0) of int_uniform is min - 1; the smallest positive quantile is min for every bounded distribution.
    return [(key, plain(parameter.ppf(quantile))) for key, quantile in (("min", np.nextafter(0.0, 1.0)),
                                                                         ("max", 1.0))]


def load_sweep_config(path: str | Path, notes: list[str] | None = None) -> dict[str, Any]:
    """A sweep YAML, read and validated; a SweepConfigError names the file and what is wrong with it. `notes`:
    validate_sweep_config's."""
    path = Path(path)
    try:
        config = read_yaml(path, "a sweep YAML")
    except ValueError as error:
        raise SweepConfigError(str(error)) from None
    return validate_sweep_config(config, str(path), notes)


def sweep_name(config: dict[str, Any], path: str | Path) -> str:
    return str(config.get("name") or Path(path).stem)


def parse_only(config: dict[str, Any], specs: list[str]) -> dict[str, list[Any]]:
    """`--only NAME=VALUE[,VALUE]` flags -> {name: the grid values they pick}; a SweepConfigError names a flag
    that is not a swept parameter of a grid sweep, or a value its grid does not hold, with the allowed ones."""
    if specs and config["method"] != "grid":
        raise SweepConfigError(f"--only needs a grid sweep; this one is {config['method']!r}")
    swept = swept_names(config)
    only: dict[str, list[Any]] = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        if not sep or name not in swept:
            raise SweepConfigError(f"--only {shown_value(spec)}: expected NAME=VALUE[,VALUE] with NAME one of "
                                   f"{', '.join(map(shown_name, swept))}")
        grid = config["parameters"][name].get("values", [])
        for text in values.split(","):
            picked = [value for value in grid if format_arg(value) == text or _same_number(value, text)]
            if not picked:
                raise SweepConfigError(f"--only {shown_name(name)}={shown_text(text)}: not in the grid; allowed: "
                                       + ", ".join(format_arg(value) for value in grid))
            only.setdefault(name, []).extend(picked)
    return only


def _same_number(value: Any, text: str) -> bool:
    try:
        return not isinstance(value, (bool, str)) and float(value) == float(text)
    except (TypeError, ValueError):
        return False
