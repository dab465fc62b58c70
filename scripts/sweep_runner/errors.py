"""The runner's refusals, each one line that names the file, field or flag (scripts/sweep.py reports them, exit 2)."""

from __future__ import annotations


class SweepConfigError(ValueError):
    """A sweep YAML that wandb would reject; the message names the file and the field."""


class SweepWriteError(ValueError):
    """The runner could not write to the sweep (or records) folder; the message names the trial and the file."""
