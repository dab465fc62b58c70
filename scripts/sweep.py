"""Run a wandb sweep YAML with no wandb server: `python scripts/sweep.py scripts/sweep_configs/FILE.yaml`.

The YAML is wandb's own sweep format, so the same file also runs on a server (`wandb sweep FILE` +
`wandb agent ID`). Here, wandb's own sweep engine (the `sweeps` package, `from sweeps import next_run`) proposes
the trials; each trial runs as a training subprocess built from the YAML's `command` (wandb agent's macros
`${env} ${interpreter} ${program} ${args}` ...), logs to wandb (offline unless logged in; one group per sweep)
and writes its own directory under SWEEP_DIR/trials/. Outcomes go to SWEEP_DIR/results.jsonl, one line per
trial, appended whole.

Checked before anything runs: the YAML (wandb's schema, a first proposal) and, when its program is one of this
repo's trainers, every parameter value (the trainer's own flag checks, trainer/args.py check_args) and the metric
(one the trainer logs, trainer/run_dir.py logged_metrics).

Resumable: the proposed trials are kept in SWEEP_DIR/sweep_state.json (written atomically); restarted, the
runner skips trials already recorded as finished or diverged, reruns any trial that was cut off (with
`--resume auto`, so a trial with checkpoints continues from its last one, and `--overwrite`, so one without starts
anew) and retries crashed ones. `--workers N` runs N trials at a time: worker threads only wait on their
subprocesses, the main thread proposes and records every trial, so the state and the results have one writer.
A trial is tied to the runner with whatever it starts (trainer/tether.py, on POSIX systems): Ctrl-C or SIGTERM stops
it with the runner, and so does a runner killed outright (SIGKILL, the OOM killer), so no trial trains on unseen in
a folder that the next run uses.
Exit code 3 from the trainer is a divergence (NaN/inf): recorded as "diverged", not as a crash. Any other
failure is recorded as "failed" (with the tail of its log) and the sweep goes on, unless --stop_on_failure.

`--records_dir DIR` keeps what is worth committing (trainer/sweep_dir.py says what) in DIR, saved after every
trial: on another machine the same command brings the done trials back and runs only the rest. `--only
NAME=VALUE[,VALUE]` (a grid sweep; repeatable) runs just the trials with those values now; the others stay
proposed for a later run without it.
"""

from __future__ import annotations

import hashlib
import json
import math
import netrc
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple


if __package__ in (None, ""):  # run as a script, from the repo root or from scripts/
    # The repo root replaces scripts/ on sys.path: nothing in scripts/ may shadow an installed package (the
    # folder of sweep YAMLs once shadowed wandb's engine, `sweeps`).
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import quiet_ctrl_c_while_loading  # noqa: E402

quiet_ctrl_c_while_loading(__name__)  # a Ctrl-C while the imports below load: one line, exit 130

from dataset.atomic_io import check_folder_path, make_dirs, path_overlap  # noqa: E402
from trainer.cli import INTERRUPTED_LINE, ToolParser, int_within, run_main, seed  # noqa: E402
from trainer.yaml_file import read_yaml  # noqa: E402
from trainer.run_dir import (EXIT_DIVERGED, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_NOT_FOUND,  # noqa: E402
                             FINAL_METRIC_PLACES, REPO_ROOT, SUMMARY_FILE, TRAINER_SCRIPTS, final_metric,
                             logged_metrics, read_summary, report_error, resolve_input_path, resolve_path,
                             trainer_task)
from trainer.sweep_dir import (DONE_STATUSES, RESULT_SUMMARY_KEYS, RESULTS_FILE, TRIAL_LOG, TRIALS_DIR,  # noqa: E402
                               append_result, default_sweep_dir, done_records, is_folder_name, read_state,
                               restore_records, save_records, swept_names, sweep_dir_lock, trial_dir_name, write_state)

METHODS = ("grid", "random", "bayes")
# the keys of a parameter spec in wandb's schema (its nested `parameters` aside, refused here)
PARAMETER_KEYS = ("value", "values", "distribution", "probabilities", "min", "max", "mu", "sigma", "q", "a", "b")
FLAG_MACROS = {"${args}", "${args_no_boolean_flags}"}  # wandb agent's macros that pass the parameters as --flags
DEFAULT_PROGRAM = "trainer/train_pretrain.py"  # a YAML without `program` or `command`: as wandb agent's defaults
DEFAULT_COMMAND = ["${env}", "${interpreter}", "${program}", "${args}"]
INSTALL_HINT = ("the wandb sweep engine is missing: pip install --no-deps sweeps==0.3.0 && "
                "pip install jsonschema==4.26.0 jsonref==1.1.0 scipy==1.17.1 scikit-learn==1.9.1")


class SweepConfigError(ValueError):
    """A sweep YAML that wandb would reject; the message names the file and the field."""


# --------------------------------------------------------------------------- config
def _sweeps_module():
    try:
        import warnings
        with warnings.catch_warnings():  # sweeps' pydantic models use v1 config names
            warnings.simplefilter("ignore")
            import sweeps
        return sweeps
    except ImportError as error:
        raise SystemExit(f"error: {INSTALL_HINT} ({error})") from None


AGENT_ONLY_SETTINGS = ("early_terminate", "scheduler", "metric.target")  # wandb's agent and server act on them


def agent_only_settings(config: dict[str, Any]) -> list[str]:
    """The settings of a sweep YAML, among AGENT_ONLY_SETTINGS, that it gives: wandb's server stops trials early
    (early_terminate) or the sweep at a target, which a serverless runner cannot; the YAML stays valid for both."""
    given = set(config) | {f"metric.{key}" for key in config.get("metric") or {}}
    return [name for name in AGENT_ONLY_SETTINGS if name in given]


def validate_sweep_config(config: Any, source: str = "sweep config") -> dict[str, Any]:
    """Check a parsed sweep YAML; raise SweepConfigError naming the first bad field."""
    def bad(field: str, message: str) -> SweepConfigError:
        return SweepConfigError(f"{source}: {field}: {message}")

    if not isinstance(config, dict):
        raise SweepConfigError(f"{source}: expected a mapping (method, metric, parameters, ...)")
    if config.get("method") not in METHODS:
        raise bad("method", f"{config.get('method')!r} is not one of {', '.join(METHODS)}")
    metric = config.get("metric")
    if config["method"] == "bayes" and metric is None:
        raise bad("metric", "bayes search needs a metric (name and goal)")
    if metric is not None:
        if not isinstance(metric, dict) or not isinstance(metric.get("name"), str):
            raise bad("metric.name", "expected a metric name, e.g. val_loss")
        if metric.get("goal", "minimize") not in ("minimize", "maximize"):
            raise bad("metric.goal", f"{metric.get('goal')!r} is not one of minimize, maximize")
    if "name" in config and not is_folder_name(config["name"]):
        # the sweep's folder is out/sweeps/<name>: a path there would put it (and its trials) anywhere
        raise bad("name", f"{config['name']!r} is not a folder name (letters, digits, '.', '_', '=', '-')")
    parameters = config.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        raise bad("parameters", "expected a non-empty mapping of parameter name to spec")
    for name, spec in parameters.items():
        if not isinstance(name, str):  # wandb's engine asserts on it (a traceback)
            raise bad("parameters", f"parameter names must be strings, got {name!r}")
        if not isinstance(spec, dict):
            raise bad(f"parameters.{name}", "expected a mapping such as {values: [...]} or {value: x}")
        if "parameters" in spec:
            raise bad(f"parameters.{name}", "nested parameters are not supported by the trainer's flat flags")
        # wandb's schema names only the parameter ("invalid hyperparameter configuration: seed"), not what is wrong
        unknown = [key for key in spec if key not in PARAMETER_KEYS]
        if unknown:
            raise bad(f"parameters.{name}.{unknown[0]}", f"not a key of a parameter spec; allowed: "
                                                         f"{', '.join(PARAMETER_KEYS)}")
        if "values" in spec and not (isinstance(spec["values"], list) and spec["values"]):
            raise bad(f"parameters.{name}.values", f"expected a non-empty list of values, got {spec['values']!r}")
        # NaN or inf would be proposed and run as a trial (`--seed=nan`), and NaN never equals itself, so a trial
        # holding one is never found again on resume.
        numbers = [(key, spec.get(key)) for key in ("value", "min", "max", "mu", "sigma", "q") if key in spec]
        if isinstance(spec.get("values"), list):
            numbers += [(f"values[{i}]", value) for i, value in enumerate(spec["values"])]
        for key, value in numbers:
            if isinstance(value, float) and not math.isfinite(value):
                raise bad(f"parameters.{name}.{key}", f"{value} is not a finite number")
        # A YAML date or !!binary cannot go into a trial's JSON (${args_json}, the state file): the state would be
        # written with str() in its place and the next start would call its own folder a different config.
        fields = [(key, value) for key, value in spec.items() if key != "values"]
        if isinstance(spec.get("values"), list):
            fields += [(f"values[{i}]", value) for i, value in enumerate(spec["values"])]
        for key, value in fields:
            if not _is_json(value):
                raise bad(f"parameters.{name}.{key}", f"{value!r} is not a JSON value (a string, number, boolean, "
                                                      f"null, list or mapping); quote it to make it a string")
    command = config.get("command")
    if command is not None and not (isinstance(command, list) and all(isinstance(c, str) for c in command)):
        raise bad("command", "expected a list of strings")
    if command is not None and not FLAG_MACROS.intersection(command):
        # The trainer reads its whole config from its command line (it does not look at wandb.config), under
        # this runner and under `wandb agent` alike.
        raise bad("command", f"must pass the parameters as flags with {' or '.join(sorted(FLAG_MACROS))}")
    if "program" in config and not isinstance(config["program"], str):
        raise bad("program", "expected a path to the training script")
    violations = _sweeps_module().schema_violations_from_proposed_config(config)
    if violations:
        name = violations[-1].removeprefix("invalid hyperparameter configuration: ")
        if name != violations[-1] and name in parameters:
            raise bad(f"parameters.{name}", f"{parameters[name]!r} is not a parameter spec wandb accepts; expected "
                                            f"{{value: X}}, {{values: [X, ...]}} or a distribution (distribution, "
                                            f"min, max, mu, sigma, q, a, b)")
        raise SweepConfigError(f"{source}: {violations[-1]}")
    if config["method"] in ("random", "bayes") and not isinstance(config.get("run_cap"), int):
        raise bad("run_cap", f"{config['method']} search never ends by itself; set run_cap (an integer) so the "
                             f"serverless runner knows when to stop")
    if config["method"] == "grid":
        _check_grid_size(config["parameters"], bad)
    # The schema accepts some specs the engine then refuses (e.g. {min, max} under grid): ask it for a first
    # trial now, so the error comes before the sweep folder exists rather than at the first proposal.
    try:
        first = propose_next(config, [], seed=0)
    except ValueError as error:
        raise bad("parameters", f"wandb's sweep engine cannot propose a trial: {error}".replace("\n", " ")) from None
    task = trainer_of(config)
    if task is not None:  # another program's flags and metrics are its own business
        _check_metric(config, task, bad)
        _check_parameters(config, task, first, bad)
    if "${program}" in (command or DEFAULT_COMMAND) and not Path(program_path(config)).exists():
        # every trial would fail at once, the same way: said once, before the sweep folder exists
        raise bad("program", f"{program_path(config)} does not exist (the script each trial runs; a relative path "
                             f"is taken from the repo root)")
    return config


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
        elif kind == HyperParameter.INT_UNIFORM:
            sizes[name] = spec["max"] - spec["min"] + 1
        elif kind == HyperParameter.Q_UNIFORM:  # np.arange(min, max, q), as the engine lists it
            sizes[name] = max(0, math.ceil((spec["max"] - spec["min"]) / spec["q"]))
    total = math.prod(sizes.values())
    if total > MAX_GRID_TRIALS:
        shown = " x ".join(f"{name}: {size}" for name, size in sizes.items() if size > 1)
        raise bad("parameters", f"a grid of {total} trials ({shown} values) is more than the serverless runner lists "
                                f"(at most {MAX_GRID_TRIALS}); use fewer values, or method random or bayes with a "
                                f"run_cap")


def _is_json(value: Any) -> bool:
    """Whether `value` is JSON as it is (json.dumps would not need default=str, and it reads back equal)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if isinstance(value, list):
        return all(_is_json(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _is_json(item) for key, item in value.items())
    return False


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


def _check_metric(config: dict[str, Any], task: str, bad: Any) -> None:
    """A metric the trainer never logs would leave every trial's metric None (and a bayes search blind)."""
    metric = (config.get("metric") or {}).get("name")
    allowed = logged_metrics(task)
    if metric is not None and metric not in allowed:
        raise bad("metric.name", f"{metric!r} is not a metric {TRAINER_SCRIPTS[task]} logs; allowed: "
                                 f"{', '.join(allowed)}")


def _check_parameters(config: dict[str, Any], task: str, first: dict[str, Any] | None, bad: Any) -> None:
    """Each value a parameter may take (its `value`, each of its `values`, the bounds of its {min, max}), put in the
    first proposed trial in place of that parameter's, must pass the trainer's own parsing and checks
    (trainer/args.py, check_args): a flag it lacks or a value it refuses is found now, not as failed trials. A value
    refused only beside another swept one is refused too: in a grid that pair is one of its trials."""
    from trainer.args import check_args  # torch: only for sweeps that drive one of this repo's trainers

    program = program_path(config)

    def refusal(params: dict[str, Any]) -> str | None:
        command = build_command(config, params, [])
        try:
            check_args(task, command[command.index(program) + 1:])
        except ValueError as error:
            return str(error)
        return None

    def refuse(name: str, key: str, value: Any, error: str) -> SweepConfigError:
        # repr, and the trainer's message (which quotes the value) escaped: a value holding a newline stays one line
        return bad(f"parameters.{name}.{key}", f"{TRAINER_SCRIPTS[task]} refuses {value!r}: {_one_line(error)}")

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
                raise bad(f"parameters.{name}", f"{TRAINER_SCRIPTS[task]} refuses {base[name]!r}, the "
                                                f"first trial's: {_one_line(error)}")
        raise bad("parameters", f"{TRAINER_SCRIPTS[task]} refuses the first trial {base}: {_one_line(error)}")
    for name, values in candidates.items():
        for key, value in values:
            if name not in base or value != base[name]:
                error = refusal({**base, name: value})
                if error is not None:
                    raise refuse(name, key, value, error)


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
    return [(key, _plain(parameter.ppf(quantile))) for key, quantile in (("min", np.nextafter(0.0, 1.0)),
                                                                         ("max", 1.0))]


def load_sweep_config(path: str | Path) -> dict[str, Any]:
    """A sweep YAML, read and validated; a SweepConfigError names the file and what is wrong with it."""
    path = Path(path)
    try:
        config = read_yaml(path, "a sweep YAML")
    except ValueError as error:
        raise SweepConfigError(str(error)) from None
    return validate_sweep_config(config, str(path))


def sweep_name(config: dict[str, Any], path: str | Path) -> str:
    return str(config.get("name") or Path(path).stem)


# --------------------------------------------------------------------------- trials
def _plain(value: Any) -> Any:
    """numpy scalars (from the random/bayes samplers) → Python values, so they print and serialize plainly."""
    return value.item() if hasattr(value, "item") else value


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


@contextmanager
def _seeded_global_rngs(seed: int) -> Iterator[None]:
    """numpy's and Python's global generators seeded with ``seed`` for the block, then put back as they were.

    wandb's engine takes no generator: it calls random.uniform/shuffle (params.py, grid_search.py) and np.random.*
    (bayes_search.py; its Gaussian process has a fixed random_state) on the globals, so local generators cannot
    seed it. Saving and restoring the globals keeps run_sweep from changing the RNG state of a Python caller (a
    training loop, a test) while the proposals stay those of a plain reseed. Only the main thread proposes."""
    import numpy as np

    numpy_state, python_state = np.random.get_state(), random.getstate()
    np.random.seed(seed % 2**32)
    random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)


MAX_REDRAWS = 100  # proposals of one trial index that are all trials already: the search space is used up


def propose_next(config: dict[str, Any], trials: list[dict[str, Any]], seed: int, redraw: int = 0
                 ) -> dict[str, Any] | None:
    """The next trial's parameters from wandb's engine, or None when the sweep is complete.

    The samplers draw from numpy's and Python's global generators: seeding them from (seed, trial index, `redraw`:
    how many proposals of this index were trials already) makes the proposals the same on every restart, given
    the same history. The caller's generators are left as they were (_seeded_global_rngs)."""
    sweeps = _sweeps_module()
    cap = config.get("run_cap")
    if cap is not None and len(trials) >= cap:
        return None
    metric = (config.get("metric") or {}).get("name")
    runs = []
    for trial in trials:
        value = trial.get("metric")
        finished = trial.get("status") in DONE_STATUSES
        runs.append(sweeps.SweepRun(
            name=trial["trial_id"], config={k: {"value": v} for k, v in trial["params"].items()},
            state=sweeps.RunState.finished if finished else sweeps.RunState.running,
            summary_metrics={metric: value} if metric and value is not None else {}))
    with _seeded_global_rngs(seed * 100_003 + len(trials) + redraw * 1_000_003):
        run = sweeps.next_run(config, runs)
    if run is None:
        return None
    return {name: _plain(spec["value"]) for name, spec in run.config.items()}


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
            raise SweepConfigError(f"--only {spec!r}: expected NAME=VALUE[,VALUE] with NAME one of {', '.join(swept)}")
        grid = config["parameters"][name].get("values", [])
        for text in values.split(","):
            picked = [value for value in grid if _format_arg(value) == text or _same_number(value, text)]
            if not picked:
                raise SweepConfigError(f"--only {name}={text}: not in the grid; allowed: "
                                       + ", ".join(_format_arg(value) for value in grid))
            only.setdefault(name, []).extend(picked)
    return only


def _same_number(value: Any, text: str) -> bool:
    try:
        return not isinstance(value, (bool, str)) and float(value) == float(text)
    except (TypeError, ValueError):
        return False


# --------------------------------------------------------------------------- running one trial
def default_wandb_mode() -> str:
    """online when a wandb API key is configured, else offline (no server needed)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
        if netrc.netrc().authenticators(host):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    return "offline"


def _format_arg(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def build_command(config: dict[str, Any], params: dict[str, Any], extra: list[str]) -> list[str]:
    """The trial's command line: the YAML's `command` with wandb agent's macros expanded, then `extra` flags
    (out dir, run name, group) appended so they win over anything the YAML sets."""
    program = program_path(config)
    template = config.get("command") or DEFAULT_COMMAND
    flags = [f"--{k}={_format_arg(v)}" for k, v in params.items()]
    macros: dict[str, list[str]] = {
        "${env}": [] if os.name == "nt" else ["/usr/bin/env"],
        "${interpreter}": [sys.executable],
        "${program}": [program],
        "${args}": flags,
        "${args_no_hyphens}": [f"{k}={_format_arg(v)}" for k, v in params.items()],
        "${args_no_boolean_flags}": [f"--{k}" if v is True else f"--{k}={_format_arg(v)}"
                                     for k, v in params.items() if v is not False],
        "${args_json}": [json.dumps(params)],
    }
    command: list[str] = []
    for item in template:
        if item in macros:
            command.extend(macros[item])
        elif "${" in item:
            raise SweepConfigError(f"command: macro {item!r} is not supported by the serverless runner")
        else:
            command.append(item)
    return command + extra


TAIL_LINES = 15  # a failed trial's last lines of output, kept as its error
TETHER = REPO_ROOT / "trainer" / "tether.py"  # runs a trial tied to this process


@dataclass
class TrialOutcome:
    status: str              # finished | diverged | failed
    returncode: int
    summary: dict[str, Any]
    error: str = ""          # a failed trial's: one message, or (log_tail) the last lines of its output
    log_tail: bool = False   # error is the trial's own output, not a message of the runner's


class _Trials:
    """The trials' subprocesses in flight (several with --workers), which a signal stops with the runner. A worker
    starts its trial under the lock, so a stop that comes while one starts still reaches it."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # a second signal may come while the handler of the first holds it
        self.running: set[subprocess.Popen] = set()
        self.stopping = False

    def start(self, command: list[str], **popen: Any) -> subprocess.Popen:
        with self.lock:
            child = subprocess.Popen(command, **popen)
            self.running.add(child)
            if self.stopping:
                child.terminate()
        return child

    def done(self, child: subprocess.Popen) -> None:
        with self.lock:
            self.running.discard(child)

    def stop(self) -> None:
        """Stop the running trials with us; their directories have no run_summary.json, so a restart reruns them."""
        with self.lock:
            self.stopping = True
            for child in self.running:
                if child.poll() is None:
                    child.terminate()


_trials = _Trials()


def _terminate_child(signum, frame) -> None:  # noqa: ARG001
    _trials.stop()
    raise SystemExit(128 + signum)


def _interrupt(signum, frame) -> None:  # noqa: ARG001
    # The trials stop here, in the handler: unwinding first would wait in the worker pool's exit for trials that a
    # `kill -INT` of the runner alone leaves running.
    _trials.stop()
    raise KeyboardInterrupt


@contextmanager
def _tie() -> Iterator[int | None]:
    """The reading end of a pipe for one trial's tether (None where there is no tether: not POSIX). Its writing
    end stays in this process alone (not inherited) until the trial is done, so the kernel closes it when this
    process ends in any way, a SIGKILL too, and the tether then stops the trial."""
    if os.name != "posix":
        yield None
        return
    read_end, write_end = os.pipe()
    try:
        yield read_end
    finally:
        os.close(read_end)
        os.close(write_end)


def run_trial(command: list[str], trial_dir: Path, env: dict[str, str], keep_finished: bool = False
              ) -> TrialOutcome:
    """Run one trial in `trial_dir` (the caller makes it) and read its outcome. `keep_finished`: the program is one
    of this repo's trainers, whose `--resume auto` returns a run that finished there with the same flags as it is
    (a runner killed after its trial finished, before recording it): its summary is kept for it to find."""
    log_path = trial_dir / TRIAL_LOG
    summary_path = trial_dir / SUMMARY_FILE
    if summary_path.exists() and not (keep_finished and read_summary(trial_dir).get("status") == "finished"):
        summary_path.unlink()  # a stale summary must not be read as this attempt's outcome
    with open(log_path, "ab") as log:
        log.write(f"\n$ {shlex.join(command)}\n".encode())
        log.flush()
        # the log holds earlier attempts and this one's command line: its own output starts here
        output_start = os.fstat(log.fileno()).st_size
        with _tie() as tie:  # tied to this process with all it starts (trainer/tether.py; POSIX's process groups)
            tethered = [sys.executable, str(TETHER), str(tie), *command] if tie is not None else command
            try:
                child = _trials.start(tethered, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      pass_fds=() if tie is None else (tie,))
            except OSError as error:  # untethered (not POSIX): the tether's one line, said here
                return TrialOutcome("failed", EXIT_NOT_FOUND, {}, f"cannot run {command[0]}: {error.strerror}")
            try:
                returncode = child.wait()
            finally:
                _trials.done(child)
    summary = read_summary(trial_dir)
    if returncode == 0 and summary.get("status") == "finished":
        return TrialOutcome("finished", returncode, summary)
    if returncode == EXIT_DIVERGED or summary.get("status") == "diverged":
        return TrialOutcome("diverged", returncode, summary)
    with open(log_path, "rb") as log:
        log.seek(output_start)
        tail = log.read().decode(errors="replace").strip().splitlines()[-TAIL_LINES:]
    if not tail:  # e.g. killed by the OOM killer; the log's last line is then the command, which is no error
        return TrialOutcome("failed", returncode, summary, f"it printed nothing (its command is in {log_path})")
    return TrialOutcome("failed", returncode, summary, "\n".join(tail), log_tail=True)


def metric_value(summary: dict[str, Any], metric: str | None) -> float | None:
    """The sweep metric of a finished trial, from its run_summary.json: a metric a trainer logs (trainer/run_dir.py,
    FINAL_METRIC_PLACES); for another program, a number of that name in its summary or in the summary's final_val."""
    if not metric or not summary:
        return None
    if metric in FINAL_METRIC_PLACES:
        return final_metric(summary, metric)
    value = summary.get(metric, (summary.get("final_val") or {}).get(metric))
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# --------------------------------------------------------------------------- the sweep
def _load_state(sweep_dir: Path, name: str, config: dict[str, Any], flag: str = "--sweep_dir") -> dict[str, Any]:
    state = read_state(sweep_dir)
    if state is None:
        return {"name": name, "config": config, "trials": []}
    if state.get("config") != config:
        raise SweepConfigError(f"{sweep_dir}: holds sweep {state.get('name')!r} with a different config; "
                               f"use another {flag} (or delete it to start over)")
    return state


def _cannot_write(error: OSError, path: Path) -> str:
    return f"{error.filename or path}: cannot be written ({error.strerror or error})"


class SweepWriteError(ValueError):
    """The runner could not write to the sweep (or records) folder; the message names the trial and the file."""


@contextmanager
def _writing(folder: Path, trial: str = "") -> Iterator[None]:
    """The runner's writes to the sweep (or records) folder, for `trial` (its label, "[2] seed-2_eca4f571", when the
    write is one trial's): a full disk, or a folder turned read-only, ends the sweep in one line naming the trial and
    the file (a SweepWriteError), not an OSError traceback; what was written before stays whole."""
    try:
        yield
    except OSError as error:
        raise SweepWriteError(f"{f'trial {trial}: ' if trial else ''}{_cannot_write(error, folder)}; the done trials "
                              f"are kept: run the same command again once it can be") from None


def _restore_records(sweep_dir: Path, records_dir: Path, name: str, config: dict[str, Any]) -> None:
    """Bring the done trials of the records folder back into the sweep folder (trainer/sweep_dir.py)."""
    # another sweep in either folder: refused before anything is copied, not mixed
    _load_state(sweep_dir, name, config)
    _load_state(records_dir, name, config, "--records_dir")
    restored = restore_records(records_dir, sweep_dir)
    print(f"{len(restored)} done trials brought back from {records_dir}", flush=True)


class _Attempt(NamedTuple):
    """A trial this run started: its entry in the state, its number as printed, and when it started."""
    trial: dict[str, Any]
    index: int
    started: float

    def label(self) -> str:
        return _label(self.index, self.trial)


def _label(index: int, trial: dict[str, Any]) -> str:
    """A trial as the runner's lines name it: its number and its id."""
    return f"[{index}] {trial['trial_id']}"


class SweepRunner:
    """One run of a sweep over its folder, which the caller holds (sweep_dir_lock) unless it is a dry run.

    Holds the state (read back, and reconciled with the results file), the wandb mode and environment the trials
    run with, the `--only` filter and the trials this run attempted. Only the main thread calls its methods, so the
    state and the results have one writer; worker threads only wait on the trials' subprocesses (run_trial)."""

    def __init__(self, config: dict[str, Any], name: str, sweep_dir: Path, records_dir: Path | None,
                 wandb_mode: str | None, picked: dict[str, list[Any]], seed: int, workers: int,
                 dry_run: bool) -> None:
        self.config, self.name, self.sweep_dir, self.records_dir = config, name, sweep_dir, records_dir
        self.picked, self.seed, self.workers, self.dry_run = picked, seed, workers, dry_run
        self.state = _load_state(sweep_dir, name, config)
        done = done_records(sweep_dir)
        for trial in self.state["trials"]:  # the results file is the record; the state may lag a kill behind it
            if (result := done.get(trial["trial_id"])) is not None:
                trial["status"], trial["metric"] = result["status"], result.get("metric")
        self.metric = (config.get("metric") or {}).get("name")
        self.mode = wandb_mode or default_wandb_mode()
        self.env = dict(os.environ, WANDB_MODE=self.mode, WANDB_SILENT="true", PYTHONUNBUFFERED="1")
        self.env.setdefault("WANDB_DIR", str(sweep_dir))
        self.swept = swept_names(config)
        self.attempted: set[str] = set()  # a trial that fails now is retried on the next start, not in a loop now

    def announce(self) -> None:
        """The sweep's first line: its name, method, folder, wandb mode and how many trials are already done; then a
        note naming the settings of the YAML that only wandb's own agent applies."""
        done = sum(t["status"] in DONE_STATUSES for t in self.state["trials"])
        print(f"sweep {self.name!r} ({self.config['method']}) in {self.sweep_dir}; wandb {self.mode}; "
              f"{done} trials already done" + (f"; {self.workers} at a time" if self.workers > 1 else ""), flush=True)
        unapplied = agent_only_settings(self.config)
        if unapplied:
            print(f"note: {', '.join(unapplied)} {'is' if len(unapplied) == 1 else 'are'} wandb agent's; this runner "
                  f"does not apply {'it' if len(unapplied) == 1 else 'them'}: every trial runs to its end", flush=True)

    def selected(self, params: dict[str, Any]) -> bool:
        """Whether a trial's parameters pass the `--only` filter."""
        return all(params.get(key) in values for key, values in self.picked.items())

    def save(self, trial: str = "") -> None:
        """Write the state file (atomically), for `trial` (its label, when a trial's change is saved); a dry run
        writes nothing."""
        if not self.dry_run:
            with _writing(self.sweep_dir, trial):
                write_state(self.sweep_dir, self.state)

    def next_trial(self) -> dict[str, Any] | None:
        """The first trial not done (nor started by this run), else a new proposal; trials in flight count as
        running for the engine, so it never proposes one twice."""
        pending = next((t for t in self.state["trials"] if t["status"] not in DONE_STATUSES
                        and t["trial_id"] not in self.attempted and self.selected(t["params"])), None)
        while pending is None:  # with --only, proposals it leaves out stay in the state, pending, for later
            params = self._new_proposal()
            if params is None:
                return None
            proposal = {"trial_id": trial_id(params, self.swept), "params": params, "status": "pending",
                        "metric": None}
            self.state["trials"].append(proposal)
            self.save(_label(len(self.state["trials"]), proposal))
            if self.selected(params):
                pending = proposal
        return pending

    def _new_proposal(self) -> dict[str, Any] | None:
        """The engine's next parameters that are no trial yet. A random or bayes search over few values proposes a
        trial again (it was a second entry of the same trial: a run_cap slot that ran nothing); it is asked again,
        and a space with no other trial left (MAX_REDRAWS proposals all known) ends the sweep."""
        known = {trial["trial_id"] for trial in self.state["trials"]}
        for redraw in range(MAX_REDRAWS):
            params = propose_next(self.config, self.state["trials"], self.seed, redraw)
            if params is None or trial_id(params, self.swept) not in known:
                return params
        print(f"sweep {self.name!r}: its search proposed only trials it has, {MAX_REDRAWS} times; it ends with "
              f"{len(self.state['trials'])} of run_cap {self.config.get('run_cap')}", flush=True)
        return None

    def list_trials(self, max_trials: int | None) -> list[dict[str, Any]]:
        """The dry run: print the trials a real run would run now, run and write nothing; returns the trials."""
        # done in the records folder: a real run would bring these back, not run them
        restorable = set(done_records(self.records_dir)) if self.records_dir is not None else set()
        listed = 0
        while (max_trials is None or listed < max_trials) and (pending := self.next_trial()) is not None:
            pending["status"] = "finished"  # only to move on to the next proposal; nothing is saved
            self.attempted.add(pending["trial_id"])
            if pending["trial_id"] not in restorable:
                listed += 1
                print(f"[dry run] {pending['trial_id']}: {({k: pending['params'][k] for k in self.swept})}")
        restorable_note = f", {len(restorable)} done in {self.records_dir}" if restorable else ""
        print(f"[dry run] {listed} trials to run{restorable_note}; nothing was run or written")
        return self.state["trials"]

    def run_trials(self, max_trials: int | None, stop_on_failure: bool) -> list[dict[str, Any]]:
        """Run the trials, `workers` at a time, until none is left (or max_trials ran, or one failed and
        stop_on_failure); returns the trials of the state with their statuses."""
        if self.records_dir is not None:  # done trials from before the records folder existed
            save_records(self.sweep_dir, self.records_dir)
        ran, failed = 0, False
        in_flight: dict[Future, _Attempt] = {}
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            try:
                while True:
                    while (len(in_flight) < self.workers and not (failed and stop_on_failure)
                           and (max_trials is None or ran + len(in_flight) < max_trials)):
                        pending = self.next_trial()
                        if pending is None:
                            break
                        begun = self.start(pending, pool)
                        if begun is None:  # failed before it could start (recorded)
                            ran, failed = ran + 1, True
                            continue
                        attempt, future = begun
                        in_flight[future] = attempt
                    if not in_flight:
                        break
                    for future in wait(in_flight, return_when=FIRST_COMPLETED).done:
                        attempt = in_flight.pop(future)
                        outcome = future.result()
                        self.record(attempt, outcome)
                        ran += 1
                        failed = failed or outcome.status == "failed"
            except SweepWriteError as error:
                if not in_flight:
                    raise
                # The other trials would only end unrecorded (the pool's exit waits for them, hours perhaps) on a
                # disk that cannot take their results either: they stop as a Ctrl-C stops them, and run again on
                # the rerun (from their newest checkpoints); a trial that finished meanwhile is found done then.
                _trials.stop()
                try:
                    wait(in_flight)
                finally:
                    _trials.stopping = False
                stopped = ", ".join(attempt.label() for attempt in in_flight.values())
                raise SweepWriteError(f"{error}; the trials in flight were stopped ({stopped}) and run again "
                                      f"then") from None
        if failed and stop_on_failure:
            raise SystemExit(1)
        counts = {s: sum(t["status"] == s for t in self.state["trials"]) for s in ("finished", "diverged", "failed")}
        print(f"sweep {self.name!r}: {len(self.state['trials'])} trials proposed; {counts}; "
              f"results in {self.sweep_dir / RESULTS_FILE}")
        return self.state["trials"]

    def start(self, pending: dict[str, Any], pool: ThreadPoolExecutor) -> tuple[_Attempt, Future] | None:
        """Mark a trial running (saved), make its directory and hand its subprocess to a worker; None when it
        failed before it could start (recorded as failed)."""
        pending["status"] = "running"
        self.attempted.add(pending["trial_id"])
        index = self.state["trials"].index(pending) + 1
        self.save(_label(index, pending))
        trial_dir = self.sweep_dir / trial_dir_name(pending["trial_id"])
        # A rerun trial continues from its checkpoints; one cut off without any starts anew in its directory.
        extra = [f"--out_dir={trial_dir}", f"--wandb_run_name={pending['trial_id']}", f"--wandb_group={self.name}",
                 "--resume=auto", "--overwrite"]
        if "project" in self.config:
            extra.append(f"--wandb_project={self.config['project']}")
        if self.mode == "disabled":
            extra.append("--use_wandb=false")
        print(f"{_label(index, pending)} ...", end=" " if self.workers == 1 else " started\n", flush=True)
        try:
            make_dirs(trial_dir)  # here, not in the worker thread: a file in the way is one line, not a traceback
        except (ValueError, OSError) as error:  # OSError: a full disk, a folder turned read-only
            message = _cannot_write(error, trial_dir) if isinstance(error, OSError) else str(error)
            self.record(_Attempt(pending, index, time.time()), TrialOutcome("failed", EXIT_ERROR, {}, message))
            return None
        started = time.time()
        future = pool.submit(run_trial, build_command(self.config, pending["params"], extra), trial_dir, self.env,
                             trainer_of(self.config) is not None)
        return _Attempt(pending, index, started), future

    def record(self, attempt: _Attempt, outcome: TrialOutcome) -> None:
        """A trial's outcome: appended to the results file, then the state saved (and the trial's records)."""
        trial = attempt.trial
        value = metric_value(outcome.summary, self.metric) if outcome.status == "finished" else None
        result = {"trial_id": trial["trial_id"], "params": trial["params"], "status": outcome.status,
                  "returncode": outcome.returncode, "metric_name": self.metric, "metric": value,
                  **{key: outcome.summary.get(key, {} if key == "final_val" else None) for key in RESULT_SUMMARY_KEYS},
                  "wall_time_s": round(time.time() - attempt.started, 2),
                  "trial_dir": trial_dir_name(trial["trial_id"]), "wandb_mode": self.mode, "error": outcome.error,
                  "ended_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        with _writing(self.sweep_dir, attempt.label()):
            append_result(self.sweep_dir, result)
        trial["status"], trial["metric"] = outcome.status, value
        self.save(attempt.label())
        if self.records_dir is not None:
            with _writing(self.records_dir, attempt.label()):
                save_records(self.sweep_dir, self.records_dir, [trial["trial_id"]])
        self.print_outcome(attempt, outcome, value, result["wall_time_s"])

    def print_outcome(self, attempt: _Attempt, outcome: TrialOutcome, value: float | None, wall_time_s: float) -> None:
        """A recorded trial's line (and, when it failed, its error or log tail on stderr)."""
        shown = f"{self.metric}={value:.4f}" if value is not None else outcome.status
        prefix = "" if self.workers == 1 else f"{attempt.label()} "
        print(f"{prefix}{outcome.status} ({shown}, {wall_time_s:.0f} s)", flush=True)
        if outcome.status != "failed":
            return
        # on stderr, which may be read apart from stdout, and with --workers among other trials' lines: named
        failed = f"  trial {attempt.label()} failed (exit {outcome.returncode})"
        if not outcome.log_tail:
            print(f"{failed}: {outcome.error}", file=sys.stderr)
        elif "\n" not in outcome.error:  # output, not a message: said so even when it is one line
            print(f"{failed}; last line of its log: {outcome.error}", file=sys.stderr)
        else:
            print(f"{failed}; log tail:\n{outcome.error}", file=sys.stderr)


def run_sweep(config_path: str | Path, sweep_dir: str | Path | None = None, wandb_mode: str | None = None,
              max_trials: int | None = None, seed: int = 0, stop_on_failure: bool = False,
              dry_run: bool = False, workers: int = 1, records_dir: str | Path | None = None,
              only: list[str] | None = None) -> list[dict[str, Any]]:
    """Run (or resume) a sweep, ``workers`` trials at a time; returns the trials of the state file with their
    statuses. Only this process writes the state and the results (the trials run as its subprocesses), and only
    one runner at a time uses a sweep folder (a second one is refused).
    ``records_dir``: restore done trials from it first, save every trial into it (trainer/sweep_dir.py);
    ``only``: `NAME=VALUE[,VALUE]` filters, the trials run now (the rest stay proposed)."""
    config = load_sweep_config(config_path)
    name = sweep_name(config, config_path)
    picked = parse_only(config, only or [])
    sweep_dir = resolve_path(sweep_dir) if sweep_dir else default_sweep_dir(name)
    records_dir = resolve_path(records_dir) if records_dir else None
    if records_dir is not None and path_overlap(records_dir, sweep_dir) == "is":
        raise SweepConfigError(f"--records_dir must differ from the sweep folder {sweep_dir}")
    with ExitStack() as held:  # the sweep folder's lock (none for a dry run), released on every way out
        if not dry_run:
            check_folder_path(sweep_dir, "--sweep_dir")  # a file in the way: one line naming it and the flag
            if records_dir is not None:
                check_folder_path(records_dir, "--records_dir")
            for folder in (sweep_dir / TRIALS_DIR, *([] if records_dir is None else [records_dir])):
                make_dirs(folder)  # a file at trials/: one line naming it
            check_folder_path(sweep_dir / TRIALS_DIR, "--sweep_dir")  # each trial makes its folder in it
            held.enter_context(sweep_dir_lock(sweep_dir))
            if records_dir is not None:
                _restore_records(sweep_dir, records_dir, name, config)
        runner = SweepRunner(config, name, sweep_dir, records_dir, wandb_mode, picked, seed, workers, dry_run)
        runner.announce()
        if dry_run:
            return runner.list_trials(max_trials)
        return runner.run_trials(max_trials, stop_on_failure)


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(description="Run a wandb sweep YAML serverless (resumable).")
    parser.add_argument("config", help="sweep YAML in wandb's format, e.g. scripts/sweep_configs/paper_cpu.yaml")
    parser.add_argument("--sweep_dir", help="default: out/sweeps/<sweep name>/")
    parser.add_argument("--wandb_mode", choices=("offline", "online", "disabled"),
                        help="default: online if a wandb API key is configured, else offline")
    parser.add_argument("--max_trials", type=int_within(0, note="0: only bring the records back"),
                        help="run at most this many trials now, then stop (resumable); 0 runs none, only brings "
                             "the done trials of --records_dir back")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the random/bayes proposals")
    parser.add_argument("--stop_on_failure", action="store_true", help="stop at the first crashed trial")
    parser.add_argument("--dry_run", action="store_true", help="print the trials' parameters, run nothing")
    parser.add_argument("--workers", type=int_within(1), default=1,
                        help="run this many trials at a time (set OMP_NUM_THREADS so that workers x threads fits "
                             "the cores); a resumed sweep may use another number")
    parser.add_argument("--records_dir",
                        help="keep the sweep's committable record here (state, results, each done trial's summary, "
                             "config and gzipped metrics), saved after every trial; restored from on a new machine")
    parser.add_argument("--only", action="append", default=[], metavar="NAME=VALUE[,VALUE]",
                        help="grid sweeps: run only the trials with these values of a swept parameter now "
                             "(repeatable: every flag must match); the rest stay proposed for a later run")
    args = parser.parse_args(argv)
    handlers = {signal.SIGTERM: _terminate_child, signal.SIGINT: _interrupt}
    previous = {number: signal.signal(number, handler) for number, handler in handlers.items()}
    try:
        trials = run_sweep(resolve_input_path(args.config), args.sweep_dir, args.wandb_mode, args.max_trials, args.seed,
                           args.stop_on_failure, args.dry_run, args.workers, args.records_dir, args.only)
    except ValueError as error:  # SweepConfigError, or a sweep folder whose state is not readable
        return report_error(error)
    except KeyboardInterrupt:  # Ctrl-C (a terminal sends the trials one too; `kill -INT` only us: _interrupt)
        print(f"{INTERRUPTED_LINE}; the trials in flight were stopped: run the same command again to go on (done "
              "trials are kept, a cut-off trial resumes from its newest checkpoint)", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:  # main() may run inside another program (the tests): its own handlers come back
        for number, handler in previous.items():
            signal.signal(number, handler)
        _trials.stopping = False
    return 1 if any(t["status"] == "failed" for t in trials) else 0


if __name__ == "__main__":
    run_main(main)
