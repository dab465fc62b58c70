"""Exact resume: a run killed (SIGKILL) mid-save and resumed with --resume auto reproduces the uninterrupted run bit
for bit, dropout on; a resume with another batch size or accumulation continues at exactly the next sample of the
epoch's order; a resume that could not (other data, --max_seq_len, --seed, --val_fraction) is refused in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from accelerate.state import AcceleratorState

from safetensors.torch import load_file

from model.config import MiniNormConfig
from tests.training_runs import (MUON_FLAGS, REPO, STEPS, TINY, pretrain_argv, refused_run, run_in_process, sft_argv,
                                 strict_json_files, train_losses, write_jsonl)
from trainer.args import parse_args
from trainer.command import main
from trainer.core import Trainer
from trainer.run_dir import read_metrics

KILL_DURING_SECOND_SAVE = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import accelerate
original = accelerate.Accelerator.save_state
def save_then_die(self, output_dir=None, **kwargs):
    result = original(self, output_dir, **kwargs)
    if "step_00000006" in str(output_dir):  # mid-save: state written, not yet marked complete nor renamed
        os.kill(os.getpid(), signal.SIGKILL)
    return result
accelerate.Accelerator.save_state = save_then_die
from trainer.command import main
main("pretrain", {argv!r})
"""


def test_resume_after_sigkill_with_dropout_reproduces_the_run_bit_for_bit(train_data, tmp_path):
    # One thread pinned: under --threads auto a loaded machine can give the two runs different thread counts, and
    # the thread count moves the last bits of some reductions (trainer/threads.py).
    flags = ("--batch_size", "4", "--dropout", "0.1", "--threads", "1")
    uninterrupted = tmp_path / "uninterrupted"
    run_in_process("pretrain", pretrain_argv(train_data, uninterrupted, *flags))
    out_dir = tmp_path / "killed"
    argv = pretrain_argv(train_data, out_dir, *flags)
    script = KILL_DURING_SECOND_SAVE.format(repo=str(REPO), argv=argv)
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    checkpoints = sorted(p.name for p in (out_dir / "checkpoints").iterdir())
    assert "step_00000003" in checkpoints and "step_00000006" not in checkpoints  # the torn save left no trace
    assert not (out_dir / "run_summary.json").exists()
    run_in_process("pretrain", argv + ["--resume", "auto"])
    # Dropout draws from the restored RNG state: every step's loss and every validation equal, bit for bit.
    assert train_losses(out_dir) == train_losses(uninterrupted)
    assert read_metrics(out_dir / "metrics.jsonl", "val") == read_metrics(uninterrupted / "metrics.jsonl", "val")


def test_muon_run_resumed_from_a_checkpoint_reproduces_it_bit_for_bit(train_data, muon_reference_run, tmp_path):
    """--optimizer muon (WSD schedule): resumed at step 3, Muon's momentum buffers and AdamW's moments come back from
    the checkpoint, and every later loss, validation and final weight equals the uninterrupted run's exactly."""
    resumed = tmp_path / "resumed"
    run_in_process("pretrain", pretrain_argv(train_data, resumed, "--batch_size", "4", *MUON_FLAGS, "--resume",
                                             str(muon_reference_run / "checkpoints" / "step_00000003")))
    assert train_losses(resumed) == train_losses(muon_reference_run)[3:]
    assert read_metrics(resumed, "val") == read_metrics(muon_reference_run, "val")
    ours, theirs = load_file(resumed / "model.safetensors"), load_file(muon_reference_run / "model.safetensors")
    assert all(torch.equal(ours[name], tensor) for name, tensor in theirs.items())
    # Both learning rates follow one schedule (each record holds the lr of the next step): WSD holds the peak
    # through step 4, then decays linearly over the last half to the floor.
    steps = read_metrics(muon_reference_run, "train")
    assert [r["muon_lr"] / r["lr"] for r in steps] == pytest.approx([0.02 / 3e-3] * STEPS)
    assert [r["muon_lr"] for r in steps[2:]] == pytest.approx([0.02, 0.0155, 0.011, 0.0065, 0.002, 0.002])


def _run_recording_rows(argv: list[str]) -> list[torch.Tensor]:
    """Run the trainer in this process; return every training row its model saw, in order."""
    AcceleratorState._reset_state(reset_partial_state=True)
    rows: list[torch.Tensor] = []
    try:
        trainer = Trainer(parse_args("pretrain", argv))
        embed = trainer.unwrapped.model.embed_tokens
        embed.register_forward_pre_hook(lambda module, args: rows.extend(args[0].clone()) if module.training else None)
        trainer.run()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    return rows


def test_resume_with_another_batch_size_continues_at_the_next_sample(train_data, tmp_path):
    """A batch-4 run checkpointed at step 3 has trained on the first 12 samples of the epoch's order. Resumed with
    batch 2 x 2 accumulation it must see samples 12-23 in order (and, the global batch being the same, give the
    same losses); resumed with batch 8 it must see samples 12-19."""
    base = tmp_path / "batch4"
    seen = _run_recording_rows(pretrain_argv(train_data, base, "--batch_size", "4", "--max_steps", "6"))
    assert len(seen) == 24
    checkpoint = base / "checkpoints" / "step_00000003"
    resumed = tmp_path / "batch2x2"
    seen_2x2 = _run_recording_rows(pretrain_argv(train_data, resumed, "--batch_size", "2", "--accumulation_steps",
                                                 "2", "--max_steps", "6", "--resume", str(checkpoint)))
    assert len(seen_2x2) == 12 and all(torch.equal(a, b) for a, b in zip(seen_2x2, seen[12:24]))
    assert train_losses(resumed)[-3:] == pytest.approx(train_losses(base)[3:], rel=1e-5)
    seen_8 = _run_recording_rows(pretrain_argv(train_data, tmp_path / "batch8", "--batch_size", "8", "--max_steps",
                                               "4", "--resume", str(checkpoint)))
    assert len(seen_8) == 8 and all(torch.equal(a, b) for a, b in zip(seen_8, seen[12:20]))


def test_a_resume_names_the_settings_it_changes(train_data, reference_run, tmp_path, capsys):
    """A resume may change the length or the learning rate (the schedule follows them): it says so in one line, and
    says nothing when the command line is the checkpoint's."""
    checkpoint = reference_run / "checkpoints" / "step_00000003"

    def changed_lines(*flags: str) -> list[str]:
        run_in_process("pretrain", pretrain_argv(train_data, tmp_path / "-".join(flags or ("same",)), "--batch_size",
                                                 "4", *flags, "--resume", str(checkpoint)))
        captured = capsys.readouterr()
        return [line for line in (captured.out + captured.err).splitlines() if "changed since the checkpoint" in line]

    assert changed_lines("--max_steps", "5", "--learning_rate", "0.002") == [
        f"changed since the checkpoint: --max_steps was {STEPS} there and is 5 now, --learning_rate was 0.003 there "
        "and is 0.002 now; the run goes on with the new values"]
    assert changed_lines() == []


def _edited_copy(data: Path, tmp_path: Path) -> Path:
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[0] = {"text": "an edited first document about something else entirely"}
    return write_jsonl(tmp_path / "edited.jsonl", rows)


@pytest.mark.parametrize("change, message", [
    (("--max_seq_len", "64"), "--max_seq_len was 32 there and is 64 now"),
    (("--seed", "7"), "--seed was 42 there and is 7 now"),
    (("--val_fraction", "0.05"), "--val_fraction was 0.01 there and is 0.05 now"),
    ("other data", "--data_path was "),
])
def test_resume_that_cannot_map_the_data_position_is_refused(change, message, train_data, reference_run,
                                                              tmp_path, capsys):
    argv = pretrain_argv(train_data, tmp_path / "resumed", "--batch_size", "4", "--resume",
                         str(reference_run / "checkpoints" / "step_00000003"))
    if change == "other data":
        argv[argv.index("--data_path") + 1] = str(_edited_copy(train_data / "pretrain.jsonl", tmp_path))
    else:
        argv += list(change)
    error = refused_run("pretrain", argv, capsys, after_progress=True)
    assert error.startswith("error: --resume step_00000003: ") and message in error
    if change == "other data":
        assert "edited.jsonl" in error and "pretrain.jsonl" in error
    assert not (tmp_path / "resumed" / "metrics.jsonl").exists()  # refused before anything ran


def test_a_bare_resume_auto_continues_the_runs_architecture(train_data, tmp_path):
    """A --norm_type prmsnorm run resumed with the documented bare `--resume auto` stays prmsnorm (it used to load
    into an RMSNorm model without a word) and reproduces the uninterrupted run."""
    flags = ("--batch_size", "4", "--max_steps", "4")
    arch = ("--norm_type", "prmsnorm", "--prms_p", "0.25", "--norm_eps", "1e-5", "--rope_theta", "5000",
            "--preset", "cpu-deep")
    uninterrupted = tmp_path / "uninterrupted"
    run_in_process("pretrain", pretrain_argv(train_data, uninterrupted, *flags, *arch))
    interrupted = tmp_path / "interrupted"
    run_in_process("pretrain", pretrain_argv(train_data, interrupted, *flags, *arch, "--save_interval", "2"))
    for name in ("run_summary.json", "model.safetensors", "config.json", "generation_config.json"):
        (interrupted / name).unlink()
    run_in_process("pretrain", pretrain_argv(train_data, interrupted, *flags, "--resume", "auto"))
    config = json.loads((interrupted / "config.json").read_text())
    assert (config["norm_type"], config["prms_p"], config["norm_eps"], config["rope_theta"]) == (
        "prmsnorm", 0.25, 1e-5, 5000.0)
    assert yaml.safe_load((interrupted / "train_config.yaml").read_text())["preset"] == "cpu-deep"  # not the default
    assert train_losses(interrupted) == train_losses(uninterrupted)


def test_another_trainers_checkpoint_is_refused_naming_its_trainer(train_data, reference_run, tmp_path, capsys):
    """An SFT run resumed a pretraining checkpoint as if it were its own (its optimizer, its step count, its run id;
    a LoRA run ended in a cut-off state_dict error)."""
    checkpoint = reference_run / "checkpoints" / "step_00000003"
    argv = sft_argv(train_data, reference_run, tmp_path / "sft", "--resume", str(checkpoint))
    error = refused_run("sft", argv, capsys)
    # the command named goes on in the run's own folder with its own flags (a bare --resume would write out/pretrain)
    assert error == (f"error: --resume step_00000003: a pretrain run's checkpoint; this is the sft trainer: go on "
                     f"with that run with `python trainer/train_pretrain.py --config {reference_run}/train_config.yaml "
                     f"--out_dir {reference_run} --resume auto`, or start this run without --resume")
    assert not (tmp_path / "sft").exists()


@pytest.mark.parametrize("flags, message", [
    (("--norm_type", "layernorm"), "--norm_type was rmsnorm there and is layernorm now"),
    (("--norm_placement", "post"), "--norm_placement was pre there and is post now"),
    (("--qk_norm", "true"), "--qk_norm was False there and is True now"),
    (("--hidden_size", "64", "--smeared_keys", "true"),
     "--hidden_size was 32 there and is 64 now, --smeared_keys was False there and is True now"),
    (("--norm_eps", "0.1"), "--norm_eps was 1e-06 there and is 0.1 now"),
    (("--rope_theta", "100"), "--rope_theta was 1000000.0 there and is 100.0 now"),
    # it was said to go on "with the new values", and the checkpoint's model went on as it was
    (("--preset", "cpu-deep"), "--preset was cpu-wide there and is cpu-deep now"),
])
def test_a_resume_with_another_architecture_is_refused_in_one_line(flags, message, train_data, reference_run,
                                                                   tmp_path, capsys):
    """Some used to end in a `RuntimeError: Error(s) in loading state_dict` traceback, the others (norm_eps,
    rope_theta) to train the saved weights as another model without a word."""
    argv = pretrain_argv(train_data, tmp_path / "resumed", "--batch_size", "4", *flags, "--resume",
                         str(reference_run / "checkpoints" / "step_00000003"))
    error = refused_run("pretrain", argv, capsys)
    assert error.startswith("error: --resume step_00000003: the checkpoint's model differs: ") and message in error
    assert not (tmp_path / "resumed").exists()


@pytest.mark.parametrize("content", [b"damaged", b""])
def test_a_damaged_rng_state_is_refused_naming_the_file(content, train_data, reference_run, tmp_path, capsys):
    """Accelerate only logs (at info level) that it could not load the random states: the run went on from the
    seed's, "resumed" but not exactly (other dropout masks), without a word. The checkpoint's digests name the file
    before anything is loaded; one saved before digests were recorded is named when its states are restored."""
    checkpoint = tmp_path / "step_00000003"
    shutil.copytree(reference_run / "checkpoints" / "step_00000003", checkpoint)
    (checkpoint / "random_states_0.pkl").write_bytes(content)
    argv = pretrain_argv(train_data, tmp_path / "resumed", "--batch_size", "4", "--dropout", "0.1", "--resume",
                         str(checkpoint))
    error = refused_run("pretrain", argv, capsys)
    assert error.startswith(f"error: --resume {checkpoint}: {checkpoint / 'random_states_0.pkl'} holds "
                            f"{len(content)} bytes, where trainer_state.json records "), error
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["digests"]
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    error = refused_run("pretrain", argv, capsys)
    assert error.startswith(f"error: --resume {checkpoint}: {checkpoint / 'random_states_0.pkl'} is damaged"), error
    assert not (tmp_path / "resumed" / "metrics.jsonl").exists()


def test_a_resume_from_an_older_checkpoint_replaces_the_later_ones(train_data, reference_run, tmp_path, capsys):
    """A run resumed from one of its own older checkpoints (after a divergence, with a lower learning rate) replaces
    what followed it: metrics.jsonl dropped the later records, but the later checkpoints stayed, the newest, and a
    `--resume auto` after that continuation stopped went on from the replaced one: here from the old step 6, over
    the new steps 4-5, and step 6's record was lost."""
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    older = run / "checkpoints" / "step_00000003"
    capsys.readouterr()
    run_in_process("pretrain", pretrain_argv(train_data, run, "--batch_size", "4", "--max_steps", "5",
                                             "--resume", str(older)))
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000003"]
    assert ("resumed from step_00000003: removed the later checkpoints of the continuation it replaces "
            "(step_00000006)") in capsys.readouterr().out
    # What kills leave there: a save's temp folder, a checkpoint whose removal was cut short (its state file gone
    # first); nothing resumes from them, and they stayed for ever (the temp one until a save of the same step)
    for leftover in ("step_00000004", ".tmp_step_00000005"):
        (run / "checkpoints" / leftover).mkdir()
        (run / "checkpoints" / leftover / "model.safetensors").write_bytes(b"torn")
    run_in_process("pretrain", pretrain_argv(train_data, run, "--batch_size", "4", "--resume", "auto"))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]
    assert [r["step"] for r in read_metrics(run, "train")] == list(range(1, STEPS + 1))
    assert train_losses(run) == train_losses(reference_run)  # the same flags: the same curve


def test_a_resume_whose_max_steps_is_below_the_checkpoint_is_refused_and_its_step_ends_the_run(
        train_data, reference_run, tmp_path, capsys):
    """--max_steps below the newest checkpoint's step (6) trained nothing and "finished": the run's model replaced
    by step 6's weights, a summary of 6 steps for a --max_steps of 5, no step timed. Refused in one line naming
    the step and the flag, with the run left whole; --max_steps 6 ends the run at that checkpoint, with its model."""
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    before = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    error = refused_run("pretrain", pretrain_argv(train_data, run, "--batch_size", "4", "--max_steps", "5",
                                                  "--resume", "auto"), capsys, after_progress=True)
    assert error == ("error: --resume step_00000006: --max_steps is 5 and the checkpoint is at optimizer step 6; a "
                     "run cannot end before the step it resumes at (resume with --max_steps 6 or more (6: the run "
                     "ends there, with its model), or start a new run)")
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == before
    run_in_process("pretrain", pretrain_argv(train_data, run, "--batch_size", "4", "--max_steps", "6",
                                             "--resume", "auto"))
    said = capsys.readouterr().out
    assert "the run's length is the checkpoint's step (6): nothing left to train; the run ends there" in said
    summary = strict_json_files(run)[run / "run_summary.json"][0]
    assert (summary["status"], summary["steps"], summary["median_step_time_s"]) == ("finished", 6, None)
    saved = load_file(run / "model.safetensors")
    checkpoint = load_file(run / "checkpoints" / "step_00000006" / "model.safetensors")
    assert saved.keys() == checkpoint.keys() and all(torch.equal(saved[k], checkpoint[k]) for k in saved)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("step", ['"2"', "null", "2.5", "-1", "1", "0"])
def test_a_metrics_line_whose_step_is_no_step_refuses_the_resume_and_leaves_the_run_as_it_was(
        step, train_data, reference_run, tmp_path, capsys):
    """A hand-edited metrics.jsonl (a step that is not an integer >= 0, or one that repeats or goes back before its
    split's previous one): the resume keeps the records up to its step, and its comparison failed with a TypeError
    traceback after the run's summary was removed and its config rewritten (a repeated step went on into the
    curve); now it is refused in one line naming FILE:LINE before anything changes, and goes on once repaired."""
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    assert lines[1].startswith('{"step": 2, ')
    metrics.write_text("".join([lines[0], lines[1].replace('"step": 2', f'"step": {step}', 1), *lines[2:]]))
    before = _files(run)
    error = refused_run("pretrain", pretrain_argv(train_data, run, "--batch_size", "4", "--max_steps", "10",
                                                  "--resume", "auto"), capsys)
    shown = {'"2"': "'2'", "null": "None"}.get(step, step)
    why = (f"the 'train' record of step {step} {'repeats' if step == '1' else 'comes after'} step 1 ({metrics}:1); "
           f"a run appends each split's steps in increasing order: remove the repeated or out-of-order line"
           if step in ("1", "0") else f"step is {shown}, expected an integer >= 0 (the optimizer step)")
    assert error == (f"error: --resume auto: {metrics}:2: {why}; the resumed run continues that file: repair it (or "
                     f"move it away) and resume again")
    assert _files(run) == before
    metrics.write_text("".join(lines))
    run_in_process("pretrain", pretrain_argv(train_data, run, "--batch_size", "4", "--max_steps", "10",
                                             "--resume", "auto"))
    assert [record["step"] for record in read_metrics(run, "train")] == list(range(1, 11))


def test_a_run_resumed_where_it_ends_logs_that_steps_val_record_once(train_data, tmp_path):
    """A resume with --max_steps at its checkpoint's step ends there, and its final evaluation logs that step's val
    record: the truncated metrics.jsonl kept the periodic one of that step too, a step twice (a curve read by step
    took the last in silence; read_metrics refuses it). The final evaluation's record is the one kept."""
    run, flags = tmp_path / "run", ("--batch_size", "4", "--save_interval", "2", "--eval_interval", "2")
    run_in_process("pretrain", pretrain_argv(train_data, run, *flags, "--max_steps", "4"))
    for name in ("run_summary.json", "model.safetensors"):  # as if stopped after its checkpoint at step 2
        (run / name).unlink()
    run_in_process("pretrain", pretrain_argv(train_data, run, *flags, "--max_steps", "2",
                                             "--resume", str(run / "checkpoints" / "step_00000002")))
    val = read_metrics(run, "val")
    assert [record["step"] for record in val] == [2]
    assert val[0]["val_loss"] == json.loads((run / "run_summary.json").read_text())["final_val"]["loss"]


@pytest.mark.parametrize("damage", ["optimizer.bin truncated", "model.safetensors deleted"])
def test_a_damaged_newest_checkpoint_names_the_one_before_it(damage, train_data, reference_run, tmp_path, capsys):
    """A run whose newest checkpoint lost or tore a file: `--resume auto` picks that one again every time, and the
    refusal named the file but no way on (a missing file pointed to the docs on several machines)."""
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    newest, before = run / "checkpoints" / "step_00000006", run / "checkpoints" / "step_00000003"
    name, how = damage.split()
    if how == "deleted":
        (newest / name).unlink()
    else:
        (newest / name).write_bytes((newest / name).read_bytes()[:1000])
    error = refused_run("pretrain", pretrain_argv(train_data, run, "--batch_size", "4", "--max_steps", "10",
                                                  "--resume", "auto"), capsys)
    assert error.startswith(f"error: --resume auto: {newest / name} ") and "Several machines" not in error, error
    assert error.endswith(f" resume from the checkpoint before it with --resume {before}"), error
    run_in_process("pretrain", pretrain_argv(train_data, run, "--batch_size", "4", "--resume", str(before)))
    assert train_losses(run) == train_losses(reference_run)


def test_a_file_copied_in_from_another_checkpoint_is_refused_and_an_untouched_one_resumes_exactly(
        train_data, reference_run, tmp_path, capsys):
    """A model.safetensors copied from step 3 into step 6 (same names, same size): `--resume auto` went on with step
    3's weights under step 6's optimizer moments and position, without a word. Refused now in one line naming the
    file and the checkpoint to go on from, the run left whole; the checkpoint as saved resumes bit for bit, and one
    saved before digests were recorded resumes with a note."""
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    for name in ("run_summary.json", "model.safetensors"):  # as if stopped after its last checkpoint
        (run / name).unlink()
    newest, before = run / "checkpoints" / "step_00000006", run / "checkpoints" / "step_00000003"
    saved = (newest / "model.safetensors").read_bytes()
    (newest / "model.safetensors").write_bytes((before / "model.safetensors").read_bytes())
    files = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    error = refused_run("pretrain", pretrain_argv(train_data, run, "--batch_size", "4", "--resume", "auto"), capsys)
    assert error == (f"error: --resume auto: {newest / 'model.safetensors'} has another sha256 than "
                     f"trainer_state.json records: not the file this checkpoint saved (replaced, truncated or damaged "
                     f"since); resume from the checkpoint before it with --resume {before}")
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == files  # nothing removed
    (newest / "model.safetensors").write_bytes(saved)
    run_in_process("pretrain", pretrain_argv(train_data, run, "--batch_size", "4", "--resume", "auto"))
    said = capsys.readouterr().out
    assert f"resumed from {newest} at optimizer step 6 (epoch 0, sample 24 of 296)\n" in said  # verified: no note
    assert train_losses(run) == train_losses(reference_run)
    assert load_file(run / "model.safetensors").keys() == load_file(reference_run / "model.safetensors").keys()
    assert (run / "model.safetensors").read_bytes() == (reference_run / "model.safetensors").read_bytes()

    old = tmp_path / "old"  # written before checkpoints recorded digests
    shutil.copytree(reference_run / "checkpoints" / "step_00000003", old / "step_00000003")
    state = json.loads((old / "step_00000003" / "trainer_state.json").read_text())
    del state["digests"]
    (old / "step_00000003" / "trainer_state.json").write_text(json.dumps(state))
    capsys.readouterr()
    run_in_process("pretrain", pretrain_argv(train_data, tmp_path / "from_old", "--batch_size", "4", "--resume",
                                             str(old / "step_00000003")))
    assert (f"resumed from {old / 'step_00000003'} at optimizer step 3 (epoch 0, sample 12 of 296); its "
            f"trainer_state.json records no digests of its files (written before MiniNorm recorded them): they were "
            f"not verified") in capsys.readouterr().out
    assert train_losses(tmp_path / "from_old") == train_losses(reference_run)[3:]


def test_a_resumes_model_flags_are_judged_against_its_checkpoints_model(train_data, tmp_path, capsys):
    """A checkpoint 96 wide with 6 heads (2 key/value heads), resumed with --num_attention_heads 3: the flags were
    judged against --preset's width before the checkpoint was read ("it must divide hidden_size=320", cpu-wide's),
    and with the run's own train_config.yaml as --config against its 2 key/value heads ("num_key_value_heads=2 ...
    must divide num_attention_heads=3"), where the checkpoint's model is what differs: both name its 6 heads now. A
    resume typing the checkpoint's own 6 heads (no divisor of 320) goes on to its --max_steps."""
    out_dir = tmp_path / "run"
    shape = ("--hidden_size", "96", "--num_attention_heads", "6", "--num_key_value_heads", "2")
    run_in_process("pretrain", pretrain_argv(train_data, out_dir, *shape, "--max_steps", "3", "--save_interval", "2"))
    refusal = ("error: --resume step_00000002: the checkpoint's model differs: --num_attention_heads was 6 there and "
               "is 3 now; the saved weights have that architecture (resume without those flags, or start a new run)")
    # the tiny run's flags but its shape: the command leaves the model to the checkpoint
    shaped = {"--hidden_size", "--num_hidden_layers", "--num_attention_heads", "--num_key_value_heads"}
    unshaped = [flag for name, value in zip(TINY[::2], TINY[1::2]) if name not in shaped for flag in (name, value)]
    resume = ["--data_path", str(train_data / "pretrain.jsonl"), "--out_dir", str(out_dir), *unshaped, "--resume",
              "auto"]
    for argv in ([*resume, "--num_attention_heads", "3"],
                 ["--config", str(out_dir / "train_config.yaml"), "--resume", "auto", "--num_attention_heads", "3"]):
        assert refused_run("pretrain", argv, capsys) == refusal
    run_in_process("pretrain", [*resume, "--num_attention_heads", "6", "--max_steps", "4"])
    config = json.loads((out_dir / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (96, 6, 2)
    assert [record["step"] for record in read_metrics(out_dir, "train")][-1] == 4


def test_a_resume_auto_that_starts_afresh_applies_the_unused_flag_rule_as_a_plain_run(train_data, tmp_path, capsys):
    """`--resume auto` in an empty --out_dir starts a fresh model, so a model flag whose switch the command leaves
    unset is judged by --preset's switch, as without --resume: a typed --prms_p beside the default rmsnorm was taken
    silently there (the switch counted as the checkpoint's, which there is none of) and is refused in the plain run's
    line, nothing written; from a --config YAML it is set back to the preset's with the plain run's note."""
    line = ("error: --prms_p=0.5 is not allowed; only --norm_type prmsnorm uses it: give --norm_type prmsnorm with it, "
            "or leave --prms_p out")
    for resume in ((), ("--resume", "auto")):
        with pytest.raises(SystemExit) as refused:  # a flag error: its line, then argparse's pointer to --help
            main("pretrain", pretrain_argv(train_data, tmp_path / "typed", "--prms_p", "0.5", *resume))
        assert refused.value.code == 2 and capsys.readouterr().err.splitlines()[0] == line
        assert not (tmp_path / "typed").exists()
    config = tmp_path / "config.yaml"
    config.write_text("prms_p: 0.5\n", encoding="utf-8")
    out_dir = tmp_path / "from_yaml"
    run_in_process("pretrain", pretrain_argv(train_data, out_dir, "--config", str(config), "--max_steps", "1",
                                             "--resume", "auto"))
    notes = [text for text in capsys.readouterr().err.splitlines() if text.startswith("note: unused flags")]
    assert notes == ["note: unused flags left at their defaults: --prms_p=0.5 (only --norm_type prmsnorm uses it)"]
    preset = MiniNormConfig.from_preset("cpu-wide").prms_p  # pretraining's --preset
    assert preset != 0.5 and json.loads((out_dir / "config.json").read_text())["prms_p"] == preset
    assert yaml.safe_load((out_dir / "train_config.yaml").read_text())["prms_p"] == preset
