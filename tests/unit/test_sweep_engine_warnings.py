"""scripts/sweep.py prints nothing but its own output: importing wandb's sweep engine (`sweeps` 0.3.0, pydantic v1
model configs) warns twice under pydantic 2, and exactly those two warnings are silenced where it is imported
(scripts/sweep_runner/engine.py), any other warning of the import still showing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.paths import REPO


def _python(args: list[str], cwd: Path = REPO, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    # -W always: every warning is printed, even those Python hides by default (DeprecationWarning outside __main__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (extra_path, REPO) if p)}
    return subprocess.run([sys.executable, "-W", "always", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_help_writes_nothing_to_stderr() -> None:
    done = _python(["scripts/sweep.py", "--help"])
    assert done.returncode == 0 and "--max_trials" in done.stdout
    assert done.stderr == ""


def test_importing_the_engine_writes_nothing_to_stderr() -> None:
    done = _python(["-c", "from scripts.sweep_runner.engine import sweeps_module; print(sweeps_module().__name__)"])
    assert (done.returncode, done.stdout, done.stderr) == (0, "sweeps\n", "")


def test_checking_a_sweep_yaml_writes_nothing_to_stderr(tmp_path: Path) -> None:
    # the runner's first use of the engine: the YAML's checks and a first proposal, then no trial (--max_trials 0)
    done = _python(["scripts/sweep.py", "scripts/sweep_configs/study2_smoke.yaml", "--max_trials", "0",
                    "--sweep_dir", str(tmp_path / "sweep"), "--wandb_mode", "disabled"])
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_another_warning_of_the_import_still_shows(tmp_path: Path) -> None:
    # a stand-in `sweeps` that warns the silenced messages from its own module and one thing more: only that shows
    fake = tmp_path / "fake" / "sweeps"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "import warnings\n"
        "warnings.warn('Support for class-based `config` is deprecated', DeprecationWarning)\n"
        "warnings.warn('something else entirely', UserWarning)\n", encoding="utf-8")
    done = _python(["-c", "from scripts.sweep_runner.engine import sweeps_module; sweeps_module()"],
                   extra_path=fake.parent)
    assert done.returncode == 0, done.stderr
    assert "UserWarning: something else entirely" in done.stderr and "class-based" not in done.stderr
