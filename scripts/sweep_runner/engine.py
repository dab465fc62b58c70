"""wandb's sweep engine (the `sweeps` package, installed on its own): imported with a one-line hint when it is
missing, and asked for the next trial with its global generators seeded, so a restart proposes the same trials."""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from trainer.sweep_dir import DONE_STATUSES

# What importing sweeps 0.3.0 warns, each silenced alone (any other warning of the import still shows): its pydantic
# models declare a v1 `class Config` with v1 key names, which pydantic 2 renames (a UserWarning from pydantic's
# config module, shown by default) and deprecates (from sweeps.run, shown under -W or pytest).
_SWEEPS_IMPORT_WARNINGS = (
    (r"Valid config keys have changed in V2", UserWarning, r"pydantic\._internal\._config"),
    (r"Support for class-based `config` is deprecated", DeprecationWarning, r"sweeps(\.|$)"),
)
INSTALL_HINT = ("the wandb sweep engine is missing: pip install --no-deps sweeps==0.3.0 && "
                "pip install jsonschema==4.26.0 jsonref==1.1.0 scipy==1.17.1 scikit-learn==1.9.1")


def sweeps_module() -> ModuleType:
    """wandb's engine, imported; without it, one line naming the install command."""
    try:
        with warnings.catch_warnings():
            for message, category, module in _SWEEPS_IMPORT_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=category, module=module)
            import sweeps
        return sweeps
    except ImportError as error:
        raise SystemExit(f"error: {INSTALL_HINT} ({error})") from None


def plain(value: Any) -> Any:
    """numpy scalars (from the random/bayes samplers) → Python values, so they print and serialize plainly."""
    return value.item() if hasattr(value, "item") else value


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


def propose_next(config: dict[str, Any], trials: list[dict[str, Any]], seed: int, redraw: int = 0
                 ) -> dict[str, Any] | None:
    """The next trial's parameters from wandb's engine, or None when the sweep is complete.

    The samplers draw from numpy's and Python's global generators: seeding them from (seed, trial index, `redraw`:
    how many proposals of this index were trials already) makes the proposals the same on every restart, given
    the same history. The caller's generators are left as they were (_seeded_global_rngs)."""
    sweeps = sweeps_module()
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
    return {name: plain(spec["value"]) for name, spec in run.config.items()}
