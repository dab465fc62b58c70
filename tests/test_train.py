"""The training core end to end on a tiny model: outputs, exact resume after SIGKILL, gradient accumulation and
2-process DDP against one process on the same global batch, SFT from a pretrained dir, divergence handling."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from accelerate.state import AcceleratorState
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from trainer.args import args_from_run_config, build_model_config, parse_args
from trainer.core import Trainer, TrainingDiverged
from trainer.run_dir import read_metrics

REPO = Path(__file__).resolve().parents[1]
TINY = ["--hidden_size", "32", "--num_hidden_layers", "2", "--num_attention_heads", "4", "--num_key_value_heads",
        "2", "--max_seq_len", "32", "--dtype", "float32", "--norm_impl", "eager", "--log_interval", "2",
        "--eval_interval", "4", "--eval_batches", "0", "--warmup_steps", "2", "--learning_rate", "3e-3"]
STEPS = 8


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    rng = random.Random(0)
    words = ("the quick brown fox jumps over a lazy dog while birds sing in tall green trees near the river "
             "and children play").split()
    root = tmp_path_factory.mktemp("train_data")
    texts = [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(10, 60)))} for _ in range(240)]
    _write_jsonl(root / "pretrain.jsonl", texts)
    chats = [{"conversations": [{"role": "user", "content": f"What comes after {i}?"},
                                {"role": "assistant", "content": f"{i + 1} comes after {i}."}]} for i in range(160)]
    _write_jsonl(root / "sft.jsonl", chats)
    return root


def _run_in_process(task: str, argv: list[str]):
    AcceleratorState._reset_state(reset_partial_state=True)  # each run builds its own Accelerator
    try:
        return Trainer(parse_args(task, argv)).run()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _pretrain_argv(data_dir: Path, out_dir: Path, *extra: str) -> list[str]:
    return ["--data_path", str(data_dir / "pretrain.jsonl"), "--out_dir", str(out_dir), "--max_steps", str(STEPS),
            "--save_interval", "3", *TINY, *extra]


def _train_losses(out_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out_dir / "metrics.jsonl", "train")]


@pytest.fixture(scope="module")
def reference_run(data_dir, tmp_path_factory) -> Path:
    """8 optimizer steps, batch 4, one process: the curve the other runs must reproduce."""
    out_dir = tmp_path_factory.mktemp("reference")
    _run_in_process("pretrain", _pretrain_argv(data_dir, out_dir, "--batch_size", "4"))
    return out_dir


def test_pretrain_writes_a_loadable_hf_model_dir(reference_run):
    summary = json.loads((reference_run / "run_summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == STEPS
    losses = _train_losses(reference_run)
    assert len(losses) == STEPS and losses[-1] < losses[0]
    val = read_metrics(reference_run / "metrics.jsonl", "val")
    assert [r["step"] for r in val] == [4, 8] and summary["final_val"]["loss"] == pytest.approx(val[-1]["val_loss"])
    model = AutoModelForCausalLM.from_pretrained(reference_run)
    assert type(model).__name__ == "MiniNormForCausalLM"
    assert model.config.norm_type == "rmsnorm" and model.config.norm_placement == "pre"
    assert model.generation_config.eos_token_id == 2
    tokenizer_config = json.loads((reference_run / "tokenizer_config.json").read_text())
    template = tokenizer_config.get("chat_template") or (reference_run / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template
    # The resumable state keeps its weights in fp32. (The last checkpoint is step 6 of 8, so its values are not
    # the final model's; resume tests compare the continued curve instead.)
    checkpoint = sorted((reference_run / "checkpoints").iterdir())[-1]
    weights = load_file(checkpoint / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in weights.values())


def test_run_config_gives_back_the_run_args(data_dir, reference_run):
    """train_config.yaml, as the trainer wrote it, rebuilds the run's arguments and its model config."""
    recorded = yaml.safe_load((reference_run / "train_config.yaml").read_text())
    args = args_from_run_config(recorded)
    expected = parse_args("pretrain", _pretrain_argv(data_dir, reference_run, "--batch_size", "4"))
    assert {k: v for k, v in args.to_dict().items() if k not in ("model", "out_dir")} == \
        {k: v for k, v in expected.to_dict().items() if k not in ("model", "out_dir")}
    assert args.resolved_out_dir() == expected.resolved_out_dir()
    assert build_model_config(args, 6400).to_dict() == build_model_config(expected, 6400).to_dict()
    with pytest.raises(ValueError, match="unknown key 'hidden'"):
        args_from_run_config({**recorded, "hidden": 3})


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
from trainer.core import main
main("pretrain", {argv!r})
"""


def test_resume_after_sigkill_continues_the_same_curve(data_dir, reference_run, tmp_path):
    out_dir = tmp_path / "killed"
    argv = _pretrain_argv(data_dir, out_dir, "--batch_size", "4")
    script = KILL_DURING_SECOND_SAVE.format(repo=str(REPO), argv=argv)
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    checkpoints = sorted(p.name for p in (out_dir / "checkpoints").iterdir())
    assert "step_00000003" in checkpoints and "step_00000006" not in checkpoints  # the torn save left no trace
    assert not (out_dir / "run_summary.json").exists()
    _run_in_process("pretrain", argv + ["--resume", "auto"])
    assert _train_losses(out_dir) == _train_losses(reference_run)  # bit-identical, every step
    assert read_metrics(out_dir / "metrics.jsonl", "val") == read_metrics(reference_run / "metrics.jsonl", "val")


def test_gradient_accumulation_matches_the_full_batch(data_dir, reference_run, tmp_path):
    out_dir = tmp_path / "accumulated"
    _run_in_process("pretrain", _pretrain_argv(data_dir, out_dir, "--batch_size", "2", "--accumulation_steps", "2"))
    assert _train_losses(out_dir) == pytest.approx(_train_losses(reference_run), rel=1e-5)


# The README's two commands for two CPU processes.
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(REPO / "trainer" / "accelerate" / "cpu_2proc.yaml")],
}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_two_cpu_processes_match_one_process(launcher, data_dir, reference_run, tmp_path):
    out_dir = tmp_path / "ddp"
    argv = _pretrain_argv(data_dir, out_dir, "--batch_size", "2")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([*LAUNCHERS[launcher], str(REPO / "trainer" / "train_pretrain.py"), *argv],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    # One data-parallel job over two processes (not one process, nor two independent jobs).
    assert run.stdout.count("MiniNorm pretrain:") == 1 and "x2, float32" in run.stdout, run.stdout[-3000:]
    assert _train_losses(out_dir) == pytest.approx(_train_losses(reference_run), rel=1e-5)
    ours, theirs = load_file(out_dir / "model.safetensors"), load_file(reference_run / "model.safetensors")
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-4, atol=1e-5)
    val_ours = read_metrics(out_dir / "metrics.jsonl", "val")[-1]["val_loss"]
    val_ref = read_metrics(reference_run / "metrics.jsonl", "val")[-1]["val_loss"]
    assert val_ours == pytest.approx(val_ref, rel=1e-5)


def test_sft_continues_from_the_pretrained_dir(data_dir, reference_run, tmp_path):
    out_dir = tmp_path / "sft"
    argv = ["--data_path", str(data_dir / "sft.jsonl"), "--from_weight", str(reference_run), "--out_dir",
            str(out_dir), "--max_steps", "6", "--batch_size", "4", "--save_interval", "100", "--max_seq_len", "48",
            "--dtype", "float32", "--norm_impl", "eager", "--eval_interval", "100", "--learning_rate", "3e-3"]
    summary = _run_in_process("sft", argv)
    assert summary.status == "finished" and summary.steps == 6
    losses = _train_losses(out_dir)
    assert losses[-1] < losses[0]
    pretrained = load_file(reference_run / "model.safetensors")
    tuned = load_file(out_dir / "model.safetensors")
    assert pretrained.keys() == tuned.keys() and any(not torch.equal(pretrained[k], tuned[k]) for k in tuned)
    with pytest.raises(ValueError, match="--hidden_size cannot change"):
        _run_in_process("sft", argv + ["--hidden_size", "64"])


def test_nan_loss_stops_with_the_step_and_a_saved_state(data_dir, tmp_path, monkeypatch):
    out_dir = tmp_path / "nan"
    AcceleratorState._reset_state(reset_partial_state=True)
    trainer = Trainer(parse_args("pretrain", _pretrain_argv(data_dir, out_dir, "--batch_size", "4")))
    calls = {"n": 0}

    def poison_after_five(module, inputs, output):
        calls["n"] += module.training  # count training forwards only, not evaluation
        return output * float("nan") if calls["n"] > 5 else output

    trainer.unwrapped.lm_head.register_forward_hook(poison_after_five)
    try:
        with pytest.raises(TrainingDiverged, match="optimizer step 6") as error:
            trainer.run()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert error.value.checkpoint.name == "step_00000005"
    weights = load_file(error.value.checkpoint / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())  # the last good weights, not NaN ones
    assert json.loads((out_dir / "run_summary.json").read_text())["status"] == "diverged"


def test_yaml_config_with_command_line_overrides(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 0.01\nnorm_type: prmsnorm\nprms_p: 0.25\nbatch_size: 3\n")
    args = parse_args("pretrain", ["--config", str(config), "--batch_size", "5"])
    assert args.learning_rate == 0.01 and args.batch_size == 5
    assert args.model == {"norm_type": "prmsnorm", "prms_p": 0.25}
    config.write_text("learning_rat: 0.01\n")
    with pytest.raises(SystemExit):
        parse_args("pretrain", ["--config", str(config)])


@pytest.mark.parametrize("argv, message", [
    (["--norm_type", "batchnorm"], "invalid choice: 'batchnorm'"),
    (["--prms_p", "1.5"], "prms_p=1.5 is not allowed"),
    (["--dtype", "int8"], "--dtype='int8' is not allowed"),
    (["--batch_size", "0"], "--batch_size=0 is not allowed"),
])
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args("pretrain", argv)
    assert message in capsys.readouterr().err


def test_scripts_run_from_repo_root_and_from_trainer_dir():
    for cwd, script in ((REPO, "trainer/train_pretrain.py"), (REPO / "trainer", "train_full_sft.py")):
        run = subprocess.run([sys.executable, script, "--help"], cwd=cwd, capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0 and "--norm_placement" in run.stdout, run.stderr


def test_resume_survives_a_metrics_line_cut_short_by_a_kill(tmp_path):
    from trainer.metrics_log import MetricsLog
    log = MetricsLog(tmp_path, enabled=True)
    for step in (1, 2, 3):
        log.write({"step": step, "split": "train", "loss": float(step)})
    with open(log.path, "a") as handle:
        handle.write('{"step": 4, "split": "tra')  # the process died mid-write
    log.truncate_after(2)
    assert [r["step"] for r in read_metrics(log.path)] == [1, 2]


@pytest.mark.parametrize("cuda, cuda_bf16, cpu_fast_bf16, expected", [
    (True, True, False, "bfloat16"),
    (True, False, True, "float16"),   # an older GPU: fp16 with loss scaling, whatever the CPU
    (False, False, True, "bfloat16"),
    (False, False, False, "float32"),
])
def test_dtype_auto_picks_by_hardware(cuda, cuda_bf16, cpu_fast_bf16, expected, monkeypatch):
    import trainer.args
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: cuda_bf16)
    monkeypatch.setattr(trainer.args, "cpu_has_fast_bf16", lambda: cpu_fast_bf16)
    assert trainer.args.resolve_dtype("auto") == expected
    assert trainer.args.resolve_dtype("float32") == "float32"  # an explicit choice is kept


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("loss, grad_norm, scaler_skipped, expected", [
    (2.0, 0.5, None, "applied"),       # bf16/fp32: no grad scaler
    (2.0, INF, None, "diverged"),
    (2.0, NAN, None, "diverged"),
    (NAN, 0.5, None, "diverged"),
    (2.0, 0.5, False, "applied"),      # fp16: the scaler stepped
    (2.0, INF, True, "skipped"),       # fp16 overflow: the scaler skipped the update and lowered its scale
    (2.0, NAN, True, "skipped"),
    (INF, INF, True, "diverged"),      # a non-finite loss is divergence under any precision
])
def test_step_outcome_tells_an_fp16_overflow_from_divergence(loss, grad_norm, scaler_skipped, expected):
    from trainer.core import step_outcome
    assert step_outcome(loss, grad_norm, scaler_skipped) == expected
