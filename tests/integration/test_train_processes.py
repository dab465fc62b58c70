"""Two CPU processes over gloo, started the README's ways (torchrun; accelerate with cpu_2proc.yaml for DDP and with
fsdp_cpu_2proc.yaml for FSDP2), against one process on the same global batch: losses, validation and final weights
equal at fp32 tolerance. Covered on the way: SFT's uneven label masks over processes, a DDP run resumed from a
one-process checkpoint under --compile on, and FSDP2 training, validating, sampling, checkpointing, resuming
(--resume auto, compiled) and saving the whole model without hanging; a refusal of the data, which the main process
prepares first, is one line on every process."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.training_runs import (MUON_FLAGS, SFT_STEPS, STEPS, assert_same_model, launch_two_processes, pretrain_argv,
                                 run_in_process, sft_argv, train_losses, val_losses)
from trainer.run_dir import read_metrics


def assert_finished_cleanly(run: subprocess.CompletedProcess, setup: str) -> None:
    assert run.returncode == 0, run.stderr[-4000:]
    # One data-parallel job over two processes (not one process, nor two independent jobs).
    assert run.stdout.count("MiniNorm ") == 1 and f"x2, float32, {setup}" in run.stdout, run.stdout[-3000:]
    assert "terminate called" not in run.stderr  # no abort at interpreter exit


def test_torchrun_sft_with_uneven_label_masks_matches_one_process(train_data, reference_run, sft_reference_run,
                                                                  tmp_path):
    """The two processes' micro-batches hold different numbers of supervised tokens: dividing each process's loss
    by its own count (a per-process mean) gives a different gradient and fails this."""
    out_dir = tmp_path / "ddp_sft"
    run = launch_two_processes("torchrun", "sft", sft_argv(train_data, reference_run, out_dir, "--batch_size", "2"),
                               tmp_path)
    assert_finished_cleanly(run, "MULTI_CPU")
    assert train_losses(out_dir) == pytest.approx(train_losses(sft_reference_run), rel=1e-5)
    assert val_losses(out_dir) == pytest.approx(val_losses(sft_reference_run), rel=1e-5)
    assert_same_model(out_dir, sft_reference_run)


def test_ddp_resumes_a_one_process_checkpoint_compiled(train_data, reference_run, tmp_path):
    """accelerate + cpu_2proc.yaml picks up the one-process reference at step 3 (the data position carries over to
    two processes of batch 2) with the model compiled, and ends where the reference ended."""
    out_dir = tmp_path / "ddp"
    argv = pretrain_argv(train_data, out_dir, "--batch_size", "2", "--compile", "on", "--resume",
                         str(reference_run / "checkpoints" / "step_00000003"))
    run = launch_two_processes("ddp", "pretrain", argv, tmp_path)
    assert_finished_cleanly(run, "MULTI_CPU")
    assert "compile on" in run.stdout
    assert train_losses(out_dir) == pytest.approx(train_losses(reference_run)[3:], rel=1e-5)
    assert val_losses(out_dir) == pytest.approx(val_losses(reference_run), rel=1e-5)
    assert_same_model(out_dir, reference_run)


def test_fsdp2_sft_that_adds_smeared_keys_matches_one_process(train_data, reference_run, tmp_path):
    """SFT's default route from a plain pretrained model: the new key weights are missing from it on purpose, and
    FSDP's memory-efficient loading leaves the second process's weights on the meta device (the finite-weights check
    read them there: a RuntimeError traceback on one process, a lost peer on the other). With norm diagnostics on:
    their gradient norm, gathered from the shards, is the one clipping saw. (One launch for both: FSDP2 SFT
    against one process was a launch of its own without smeared keys; torchrun's SFT test above keeps that route.)"""
    one, two = tmp_path / "one", tmp_path / "fsdp"
    run_in_process("sft", sft_argv(train_data, reference_run, one, "--batch_size", "4", "--smeared_keys", "true"))
    run = launch_two_processes("fsdp", "sft", sft_argv(train_data, reference_run, two, "--batch_size", "2",
                                                       "--smeared_keys", "true", "--diag_interval", "2"), tmp_path)
    assert_finished_cleanly(run, "FSDP")
    assert len(train_losses(two)) == SFT_STEPS
    assert train_losses(two) == pytest.approx(train_losses(one), rel=1e-5)
    assert val_losses(two) == pytest.approx(val_losses(one), rel=1e-5)
    assert_same_model(two, one)
    train = {r["step"]: r for r in read_metrics(two, "train")}
    diag = read_metrics(two, "diag")
    assert [r["step"] for r in diag] == [1, 3, 5, 6]  # every 2 from the first, and the last
    for record in diag:
        assert record["diag/grad_norm_global"] == pytest.approx(train[record["step"]]["grad_norm"], rel=1e-5)
        assert 0 < record["diag/update_ratio_global"] < 1


def test_fsdp2_with_muon_trains_checkpoints_resumes_and_saves_like_one_process(train_data, muon_reference_run,
                                                                             tmp_path):
    """FSDP2 trains (Muon), validates, samples, checkpoints, resumes compiled and saves the whole model, gathered from
    both shards, as one process does. (One launch pair for what was two tests, AdamW's and Muon's: FSDP2 with AdamW
    at fp32 tolerance is the SFT test's above.)
    Under FSDP2 Muon's step (trainer/optim.py) receives DTensor shards of each matrix; DTensor's sharding
    propagation gathers what the Newton-Schulz products need, so each matrix is orthogonalized whole, as in one
    process. Muon orthogonalizes in bf16 and the sharded products sum in another order, so this is not fp32
    agreement: the losses agree to 1e-4 (measured: 1.5e-5), where orthogonalizing each process's shard on its own
    (checked by breaking it) is 6e-3 off by step 2; single weights differ by up to 5e-3 (bf16 rounding amplified by
    Muon's large steps)."""
    out_dir = tmp_path / "fsdp_muon"
    argv = pretrain_argv(train_data, out_dir, "--batch_size", "2", *MUON_FLAGS)
    run = launch_two_processes("fsdp", "pretrain", argv, tmp_path)
    assert_finished_cleanly(run, "FSDP")
    assert "optimizer muon" in run.stdout
    assert train_losses(out_dir) == pytest.approx(train_losses(muon_reference_run), rel=1e-4)
    assert val_losses(out_dir) == pytest.approx(val_losses(muon_reference_run), rel=1e-4)
    assert_same_model(out_dir, muon_reference_run, rtol=0, atol=1e-2)  # the whole model, gathered from both shards
    summary = json.loads((out_dir / "run_summary.json").read_text())
    assert summary["steps"] == STEPS and summary["sample"].startswith("The history of")
    checkpoint = out_dir / "checkpoints" / "step_00000006"
    assert (checkpoint / "pytorch_model_fsdp_0").is_dir() and (checkpoint / "random_states_1.pkl").is_file()
    # --resume auto in the finished directory restarts from step 6, compiled this time: steps 7 and 8 again.
    first = train_losses(out_dir)
    first_model = tmp_path / "first"
    first_model.mkdir()
    shutil.copy(out_dir / "model.safetensors", first_model / "model.safetensors")
    run = launch_two_processes("fsdp", "pretrain", argv + ["--resume", "auto", "--compile", "on"], tmp_path)
    assert_finished_cleanly(run, "FSDP")
    assert "resumed from" in run.stdout and "at optimizer step 6" in run.stdout and "compile on" in run.stdout
    assert len(read_metrics(out_dir / "metrics.jsonl", "train")) == STEPS
    assert train_losses(out_dir) == pytest.approx(first, rel=1e-5)
    assert_same_model(out_dir, first_model)


def test_time_budget_under_torchrun_stops_every_process_at_the_main_ones_length(train_data, tmp_path):
    """Each process times its own steps; if each fixed its own length, one would wait forever in a collective the
    other never joins. The main process decides, the others follow: the run ends (no process waits), on the main
    process's plan."""
    out_dir = tmp_path / "budget"
    argv = pretrain_argv(train_data, out_dir, "--batch_size", "2", "--time_budget_s", "2", "--save_interval", "1000")
    result = launch_two_processes("torchrun", "pretrain", argv, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    # The main process re-plans after every step as its pace changes (a loaded machine) and prints a plan when it is
    # new or has moved by 5% or more: the run ends within 5% of the plan it printed last.
    announced = int(output.split("--time_budget_s 2: ")[-1].split()[0])
    final = [r["step"] for r in read_metrics(out_dir, "train")][-1]
    assert abs(final - announced) < 0.05 * announced, (final, announced)
    assert f"done: {final} steps" in output


def test_a_data_refusal_met_by_the_main_process_is_one_line_on_every_process(train_data, tmp_path):
    """The main process prepares the run's data first while the others wait (main_process_first,
    trainer/distributed.py). A refusal of it (here a --val_data_path that does not exist) was the main process's one
    line, and the other process, left in Accelerate's barrier, met a lost peer: a gloo RuntimeError traceback and
    exit 1 (watched). Every process now ends with the one line and exit 2 (two torchrun nodes: each reports its own
    process's code)."""
    from tests.paths import REPO
    from tests.training_runs import run_two_nodes
    from trainer.run_dir import EXIT_ERROR

    missing = tmp_path / "missing.jsonl"
    argv = pretrain_argv(train_data, tmp_path / "out", "--val_data_path", str(missing))
    for node, (returncode, stderr) in enumerate(run_two_nodes([str(REPO / "trainer" / "train_pretrain.py"), *argv],
                                                              tmp_path)):
        assert returncode not in (0, 124, 137), f"node {node}: {stderr[-3000:]}"  # not stopped by `timeout`
        assert f"exitcode  : {EXIT_ERROR}" in stderr, f"node {node}: {stderr[-3000:]}"
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert errors == [f"error: no such data file: {missing}"], f"node {node}: {stderr[-3000:]}"
