"""Pretraining with copy rows (--copy_rows, trainer/objectives.py) end to end: it logs the copy loss beside the loss,
a resumed run reproduces the uninterrupted one bit for bit (the rows and the weight schedule are functions of the
step), and two processes take the steps of one process with two micro-batches (the rows follow the global batch)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.training_runs import (assert_same_logged_metrics, assert_same_model, launch_two_processes,
                                 pretrain_argv, run_in_process, train_losses)
from trainer.run_dir import read_metrics

# The weight drops from 1.0 to 0.5 after step 4, so a run resumed at step 3 crosses the switch.
COPY = ("--copy_rows", "2", "--copy_steps", "4", "--copy_weight", "1.0", "--copy_weight_after", "0.5",
        "--smeared_keys", "true", "--batch_size", "4")


@pytest.fixture(scope="module")
def copying(train_data, tmp_path_factory):
    """One process, two micro-batches of 4 rows a step."""
    out_dir = tmp_path_factory.mktemp("copy") / "run"
    run_in_process("pretrain", pretrain_argv(train_data, out_dir, *COPY, "--accumulation_steps", "2"))
    return out_dir


def test_a_run_with_copy_rows_logs_the_copy_loss(copying):
    train = read_metrics(copying, "train")
    assert len(train) == 8 and all(record["copy_loss"] > 0 for record in train)
    # the copy rows' loss is added to the language modeling one: the logged loss exceeds it by weight x copy_loss
    assert all(record["loss"] > record["copy_loss"] for record in train if record["step"] <= 4)
    config = (copying / "train_config.yaml").read_text()
    assert "copy_rows: 2" in config and "smeared_keys: true" in config


def test_a_resumed_run_with_copy_rows_reproduces_it_bit_for_bit(copying, train_data, tmp_path):
    resumed = tmp_path / "resumed"
    run_in_process("pretrain", pretrain_argv(train_data, resumed, *COPY, "--accumulation_steps", "2", "--resume",
                                             str(copying / "checkpoints" / "step_00000003")))
    assert train_losses(resumed) == [loss for record, loss in zip(read_metrics(copying, "train"),
                                                                    train_losses(copying)) if record["step"] > 3]
    ours, theirs = load_file(resumed / "model.safetensors"), load_file(copying / "model.safetensors")
    assert all(torch.equal(ours[name], tensor) for name, tensor in theirs.items())


def test_two_processes_with_copy_rows_train_like_one_process(copying, train_data, tmp_path):
    """torchrun, two processes of one micro-batch each against one process of two: the same data, the same copy
    rows (drawn by global micro-batch index), the same step."""
    out_dir = tmp_path / "two"
    run = launch_two_processes("torchrun", "pretrain", pretrain_argv(train_data, out_dir, *COPY), tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert_same_logged_metrics(out_dir, copying)
    assert_same_model(out_dir, copying)
