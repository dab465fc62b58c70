"""Quiet logs: a tiny pretraining run and a tiny LoRA run, each saving a checkpoint of a model with tied weights,
print no warning lines (stdout and stderr together): no Accelerate notice about the tied LM head, no deprecation
warning from the libraries."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.training_runs import REPO, finetune_argv, pretrain_argv

# Python's warnings ("FutureWarning: ...", "warnings.warn("), logging's WARNING level, Accelerate's notice, any
# deprecation. Case matters: the runs' paths hold this test's name.
WARNING_LINE = re.compile(r"Warning\b|\bWARNING\b|warnings\.warn|Removed shared tensor|[Dd]eprecat")


def _output(script: str, argv: list[str]) -> str:
    run = subprocess.run([sys.executable, str(REPO / "trainer" / script), *argv], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout + run.stderr


def test_tiny_runs_print_no_warnings(train_data, tiny_models, tmp_path):
    pretrain = _output("train_pretrain.py", pretrain_argv(train_data, tmp_path / "pretrain", "--batch_size", "4",
                                                          "--max_steps", "4"))
    lora = _output("train_lora.py", finetune_argv("lora", train_data, tiny_models.sft, tmp_path / "lora",
                                                  "--max_steps", "4", "--save_interval", "3"))
    for output in (pretrain, lora):
        assert [line for line in re.split(r"[\r\n]", output) if WARNING_LINE.search(line)] == []
    # Both saved a checkpoint (where Accelerate's notice used to come from) and a model.
    assert (tmp_path / "pretrain" / "checkpoints" / "step_00000003").is_dir()
    assert (tmp_path / "lora" / "checkpoints" / "step_00000003").is_dir()
