"""A sweep whose swept parameter its trials do not use (trainer/arg_checks.py, DEPENDENT_FLAGS: the trainer sets it
back with a note in each such trial): refused before anything runs where no trial uses it (every value would make
the same trial), said once when the sweep starts where only some do (scripts/sweep_runner/config.py,
_unused_parameters, through the trainer's own check_args)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from scripts.sweep_runner.config import validate_sweep_config
from scripts.sweep_runner.errors import SweepConfigError

SWEEP_VARIABLES = ("WANDB_SWEEP_ID", "MININORM_SWEEP_TRIAL")


@pytest.fixture(autouse=True)
def _not_a_sweep_trial(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*SWEEP_VARIABLES, "RANK"):
        monkeypatch.delenv(name, raising=False)


def _sweep(parameters: dict[str, Any], method: str = "grid") -> dict[str, Any]:
    config = {"program": "trainer/train_pretrain.py", "method": method,
              "metric": {"name": "val_loss", "goal": "minimize"}, "parameters": parameters}
    if method != "grid":
        config["run_cap"] = 4
    return config


@pytest.mark.parametrize("parameters, name, used_by", [
    ({"optimizer": {"value": "adamw"}, "muon_lr": {"values": [0.01, 0.05]}}, "muon_lr", "--optimizer muon"),
    ({"norm_type": {"value": "rmsnorm"}, "prms_p": {"values": [0.125, 0.5]}}, "prms_p", "--norm_type prmsnorm"),
    ({"seed": {"values": [0, 1]}, "decay_fraction": {"distribution": "uniform", "min": 0.1, "max": 0.5}},
     "decay_fraction", "--lr_schedule wsd"),
])
def test_a_swept_parameter_no_trial_uses_is_refused(parameters, name, used_by):
    method = "random" if any("distribution" in spec for spec in parameters.values()) else "grid"
    notes: list[str] = []
    with pytest.raises(SweepConfigError) as refused:
        validate_sweep_config(_sweep(parameters, method), "s.yaml", notes)
    message = str(refused.value)
    assert message.startswith(f"s.yaml: parameters.{name}: no trial uses it: only {used_by} uses it"), message
    assert "\n" not in message and notes == []


@pytest.mark.parametrize("parameters, name, used_by", [
    # scripts/sweep_configs/recipe_cpu.yaml's shape: the Muon rate swept beside the optimizer
    ({"optimizer": {"values": ["adamw", "muon"]}, "muon_lr": {"values": [0.01, 0.05]}, "seed": {"values": [0, 1]}},
     "muon_lr", "--optimizer muon"),
    ({"norm_type": {"values": ["rmsnorm", "prmsnorm"]}, "prms_p": {"values": [0.125, 0.5]}}, "prms_p",
     "--norm_type prmsnorm"),
    ({"lr_schedule": {"values": ["cosine", "wsd"]}, "decay_fraction": {"values": [0.2, 0.5]}}, "decay_fraction",
     "--lr_schedule wsd"),
])
def test_a_swept_parameter_some_trials_use_is_noted_once(parameters, name, used_by):
    notes: list[str] = []
    validate_sweep_config(_sweep(parameters), "s.yaml", notes)
    assert notes == [f"note: parameters.{name}: only {used_by} uses it; a trial without that runs at its default, "
                     f"so its values make identical trials there (each trial notes it)"]


@pytest.mark.parametrize("parameters", [
    {"optimizer": {"value": "muon"}, "muon_lr": {"values": [0.01, 0.05]}},  # every trial uses it
    {"optimizer": {"value": "adamw"}, "muon_lr": {"value": 0.05}},  # fixed: each trial notes it, no trial repeats
    {"optimizer": {"value": "adamw"}, "muon_lr": {"values": [0.02]}},  # one value: nothing is swept
    # equal numbers are one value to the flag (a grid refuses them as a repeat): a random search's [1, 1.0] sweeps
    # nothing either; it was refused as values making identical trials
    {"optimizer": {"value": "adamw"}, "muon_lr": {"values": [1, 1.0]}},
    {"learning_rate": {"values": [0.001, 0.01]}, "seed": {"values": [0, 1]}},
])
def test_a_sweep_whose_swept_parameters_every_trial_uses_says_nothing(parameters):
    notes: list[str] = []
    method = "random" if parameters.get("muon_lr", {}).get("values") == [1, 1.0] else "grid"  # a grid refuses it
    validate_sweep_config(_sweep(parameters, method), "s.yaml", notes)
    assert notes == []


def test_the_sweep_says_the_note_once_when_it_starts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Four trials, two of which (adamw) differ only in the unused Muon rate: one note line at the start, after the
    sweep's own first line, not one per trial."""
    import yaml

    from scripts.sweep_runner.runner import run_sweep

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_sweep({"optimizer": {"values": ["adamw", "muon"]},
                                           "muon_lr": {"values": [0.01, 0.05]}})), encoding="utf-8")
    trials = run_sweep(path, tmp_path / "sweep", wandb_mode="disabled", dry_run=True)
    out = capsys.readouterr().out.splitlines()
    assert len(trials) == 4
    notes = [line for line in out if line.startswith("note: parameters.")]
    assert notes == ["note: parameters.muon_lr: only --optimizer muon uses it; a trial without that runs at its "
                     "default, so its values make identical trials there (each trial notes it)"]
    assert out.index(notes[0]) == 1 and out[0].startswith("sweep 's' (grid)")
