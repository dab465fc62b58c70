"""Distillation (trainer/train_distillation.py) end to end on the training core: a tiny run on SFT data lowers the
KL to the teacher and logs CE and KL beside the loss; resumed from its checkpoint it reproduces the uninterrupted
run bit for bit; two processes (torchrun) take the one process's steps; it runs on pretraining text too; a teacher
with another tokenizer is refused in one line before anything is trained, and so is prompt-only data below --lmbda 1
(naming --lmbda 1); one step of each GKD option (the JSD,
--lmbda, --seq_kd) trains as asked and is recorded, a checkpoint from before those flags resumes as before, and
the sampled steps of --lmbda 1 and --seq_kd on two processes (DDP and FSDP2) equal one process's."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.training_runs import (assert_same_logged_metrics, assert_same_model, finetune_argv, launch_two_processes,
                                 record_rollout_decodes, refused_run, run_in_process, train_losses, write_jsonl)
from trainer.run_dir import model_task, read_metrics, read_summary


def _argv(train_data, tiny_models, out_dir, *extra: str) -> list[str]:
    """The tiny SFT model teaches the untrained one on the random-word chats."""
    return finetune_argv("distill", train_data, tiny_models.pretrain, out_dir, "--teacher", str(tiny_models.sft),
                         "--learning_rate", "3e-3", "--warmup_steps", "1", "--save_interval", "3", *extra)


@pytest.fixture(scope="module")
def distilled(train_data, tiny_models, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("distill") / "run"
    run_in_process("distill", _argv(train_data, tiny_models, out_dir, "--alpha", "0.25", "--temperature", "2"))
    return out_dir


def test_a_distillation_run_lowers_the_kl_and_logs_ce_and_kl(distilled):
    train = read_metrics(distilled, "train")
    assert len(train) == 6 and all({"loss", "ce", "kl"} <= set(record) for record in train)
    for record in train:  # the loss is the stats' weighted sum (the step's token means)
        assert record["loss"] == pytest.approx(0.25 * record["ce"] + 0.75 * 4 * record["kl"], rel=1e-4)
    kl = [record["kl"] for record in train]  # measured: 1.11, 0.88, 0.94, 0.73, 0.66, 0.71
    assert sum(kl[-2:]) < 0.8 * sum(kl[:2])
    summary = read_summary(distilled)
    assert summary["status"] == "finished" and summary["final_val"]["loss"] > 0  # the student's plain CE
    assert (distilled / "model.safetensors").is_file()


def test_a_resumed_distillation_run_reproduces_it_bit_for_bit(distilled, train_data, tiny_models, tmp_path, capsys):
    resumed = tmp_path / "resumed"
    capsys.readouterr()
    run_in_process("distill", _argv(train_data, tiny_models, resumed, "--alpha", "0.25", "--temperature", "2",
                                    "--resume", str(distilled / "checkpoints" / "step_00000003")))
    out = capsys.readouterr().out
    assert "resumed from" in out and "changed since the checkpoint" not in out  # the same flags
    assert train_losses(resumed) == train_losses(distilled)[3:]
    ours, theirs = load_file(resumed / "model.safetensors"), load_file(distilled / "model.safetensors")
    assert all(torch.equal(ours[name], tensor) for name, tensor in theirs.items())


def test_two_processes_distill_like_one_process(distilled, train_data, tiny_models, tmp_path):
    """torchrun, two processes of 2 conversations against the one-process run of 4 (the same global batch): CE and
    KL are means over the supervised tokens of both processes (unequal between them), so every logged statistic,
    the validation and the final weights agree."""
    out_dir = tmp_path / "two"
    argv = _argv(train_data, tiny_models, out_dir, "--alpha", "0.25", "--temperature", "2")
    argv[argv.index("--batch_size") + 1] = "2"
    run = launch_two_processes("torchrun", "distill", argv, tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "x2, float32" in run.stdout
    assert_same_logged_metrics(out_dir, distilled)
    assert_same_model(out_dir, distilled)


def test_distillation_on_pretraining_text(train_data, tiny_models, tmp_path, capsys):
    out_dir = tmp_path / "text"
    run_in_process("distill", _argv(train_data, tiny_models, out_dir, "--distill_data", "pretrain", "--data_path",
                                    str(train_data / "pretrain.jsonl"), "--max_steps", "2", "--max_seq_len", "32"))
    # the start names the student and the teacher it read (its config records only the flags as given)
    assert f"models: --from_weight {tiny_models.pretrain}, --teacher {tiny_models.sft}\n" in capsys.readouterr().out
    train = read_metrics(out_dir, "train")
    assert len(train) == 2 and all(record["kl"] > 0 and record["ce"] > 0 for record in train)
    assert "distill_data: pretrain" in (out_dir / "train_config.yaml").read_text()
    assert model_task(out_dir) == "pretrain"  # chat and the server continue its text, without the chat template


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(train_data, tiny_models, tokenizer, tmp_path,
                                                                 capsys):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_models.sft, teacher)
    other = tokenizer.__class__.from_pretrained(teacher)
    other.add_tokens(["<|teacher_only|>"])
    other.save_pretrained(teacher)
    out_dir = tmp_path / "refused"
    error = refused_run("distill", _argv(train_data, tiny_models, out_dir, "--teacher", str(teacher)), capsys,
                        after_progress=True)  # the models' loading bars, then the error line
    assert error.startswith(f"error: --teacher {teacher}: its tokenizer differs")
    assert not list(out_dir.glob("checkpoints/*")) and not (out_dir / "model.safetensors").exists()



def test_a_teacher_whose_sampling_meets_nan_logits_ends_the_run_naming_the_teacher(train_data, tiny_models, tmp_path,
                                                                                   monkeypatch, capsys):
    """--seq_kd: the teacher samples the step's completions. Its logits NaN while it samples (its output layer's,
    from step 2's sampling on: tests/diverging_sampling.py) end the run as diverged, the state before saved, with the
    cause naming the teacher's sampling (it named the policy's, the student's, which sampled nothing). Non-finite
    teacher weights never get that far: the teacher's load refuses them (model/weight_checks.py)."""
    from safetensors.torch import save_file

    from tests.diverging_sampling import nan_logits_from
    from trainer import distillation
    from trainer.run_summary import TrainingDiverged

    monkeypatch.setattr(distillation, "sample_completions", nan_logits_from(2))
    out_dir = tmp_path / "run"
    with pytest.raises(TrainingDiverged) as error:
        run_in_process("distill", _argv(train_data, tiny_models, out_dir, "--seq_kd", "--max_new_tokens", "4",
                                        "--max_steps", "3", "--save_interval", "1"))
    checkpoint = out_dir / "checkpoints" / "step_00000001"
    assert str(error.value) == (f"training diverged at optimizer step 2 (the teacher's sampling scores became NaN or "
                                f"infinite); the last good state is saved in {checkpoint}")
    assert read_summary(out_dir)["status"] == "diverged" and (checkpoint / "model.safetensors").is_file()
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_models.sft, teacher)
    weights = load_file(teacher / "model.safetensors")
    name = sorted(weights)[0]
    weights[name][0] = float("nan")
    save_file(weights, str(teacher / "model.safetensors"), metadata={"format": "pt"})
    refused = refused_run("distill", _argv(train_data, tiny_models, tmp_path / "refused", "--seq_kd", "--teacher",
                                           str(teacher)), capsys, after_progress=True)
    assert refused.startswith(f"error: --teacher cannot load {teacher}: its weight "), refused
    assert "NaN or infinite value" in refused, refused

def test_prompt_only_data_below_lmbda_1_is_refused_naming_lmbda_1(train_data, tiny_models, tmp_path, capsys):
    """MiniMind's rlaif.jsonl (a question, then the empty turn a policy writes) with --lmbda 0.5: half the steps
    would learn its empty answers. The refusal pointed to GRPO and PPO only; on-policy distillation (--lmbda 1, or
    --seq_kd) reads such rows as its prompts, so it is named too."""
    rows = [{"conversations": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": ""}]}
            for i in range(8)]
    data = write_jsonl(tmp_path / "rlaif.jsonl", rows)
    out_dir = tmp_path / "refused"
    error = refused_run("distill", _argv(train_data, tiny_models, out_dir, "--lmbda", "0.5", "--data_path", str(data)),
                        capsys, after_progress=True)
    assert error.startswith(f"error: {data}:1: conversations[1] is an empty assistant message")
    assert error.endswith("which train_grpo.py and train_ppo.py take, and train_distillation.py with --lmbda 1 or "
                          "--seq_kd (every step samples its answers, reading such a row as its prompt)"), error
    assert not (out_dir / "model.safetensors").exists()


def test_resuming_with_another_teacher_is_refused_in_one_line(distilled, train_data, tiny_models, tmp_path, capsys):
    checkpoint = distilled / "checkpoints" / "step_00000003"
    argv = finetune_argv("distill", train_data, tiny_models.pretrain, tmp_path / "resumed", "--teacher",
                         str(tiny_models.chat), "--learning_rate", "3e-3", "--warmup_steps", "1", "--save_interval",
                         "3", "--alpha", "0.25", "--temperature", "2", "--resume", str(checkpoint))
    error = refused_run("distill", argv, capsys)
    assert error == (f"error: --resume step_00000003: --teacher was {tiny_models.sft} there and is {tiny_models.chat} "
                     f"now; a run distils from one teacher (resume with --teacher {tiny_models.sft}, or start a new "
                     f"run)")
    assert not (tmp_path / "resumed" / "metrics.jsonl").exists()


@pytest.mark.parametrize("flags, recorded, samplers", [
    (["--distill_loss", "jsd", "--jsd_beta", "0.3"],
     {"distill_loss": "jsd", "jsd_beta": 0.3, "lmbda": 0.0, "seq_kd": False}, []),
    (["--lmbda", "1", "--max_new_tokens", "6", "--sampling_temperature", "1.2", "--compile", "auto"],
     {"distill_loss": "kl", "lmbda": 1.0, "seq_kd": False, "max_new_tokens": 6, "sampling_temperature": 1.2},
     ["student"]),
    (["--seq_kd", "--max_new_tokens", "5"], {"distill_loss": "kl", "lmbda": 0.0, "seq_kd": True, "max_new_tokens": 5},
     ["teacher"]),
], ids=["jsd", "lmbda", "seq_kd"])
def test_one_step_of_each_gkd_option_trains_as_asked_and_is_recorded(flags, recorded, samplers, train_data,
                                                                     tiny_models, tmp_path, monkeypatch):
    """A 1-step run of each: its train_config.yaml records the flags; the step sampled (with the student for
    --lmbda 1, the teacher for --seq_kd) or not, and logged the divergence it used under its name; the sampling
    engine decodes the static step eagerly under --compile off, a compiled one under auto (as GRPO's rollouts)."""
    import yaml

    from trainer import distillation

    used = []
    sampled = distillation.Distillation.sampled

    def recording(self, sampler, *args):
        used.append("teacher" if sampler is self.teacher else "student")
        return sampled(self, sampler, *args)

    monkeypatch.setattr(distillation.Distillation, "sampled", recording)
    decodes = record_rollout_decodes(monkeypatch)
    out_dir = tmp_path / "run"
    run_in_process("distill", _argv(train_data, tiny_models, out_dir, "--max_steps", "1", *flags))
    assert set(decodes) == ({"compiled" if "auto" in flags else "static"} if samplers else set())
    config = yaml.safe_load((out_dir / "train_config.yaml").read_text())
    assert {name: config[name] for name in recorded} == recorded
    [record] = read_metrics(out_dir, "train")
    divergence = recorded["distill_loss"]
    assert record[divergence] > 0 and ("kl" in record) == (divergence == "kl")
    assert used == samplers  # one micro-batch, sampled by the student (--lmbda 1), the teacher (--seq_kd) or none
    if recorded["lmbda"]:
        assert record["on_policy"] == 1.0  # every supervised token of the step was the student's own
    assert read_summary(out_dir)["status"] == "finished"


def test_a_checkpoint_from_before_the_gkd_flags_resumes_as_before(distilled, train_data, tiny_models, tmp_path,
                                                                  capsys):
    """The run's step-3 checkpoint with the GKD flags taken out of its recorded config (as one written before they
    existed): resumed with the defaults it notes no change of them; with --distill_loss jsd it notes that change.
    Both resume to --max_steps 3, the checkpoint's step (noted as the one change, nothing left to train): what the
    resumed steps train, bit for bit, is test_a_resumed_distillation_run_reproduces_it_bit_for_bit's."""
    import json

    from trainer.arg_fields import GKD_FLAGS

    old = tmp_path / "old" / "step_00000003"
    shutil.copytree(distilled / "checkpoints" / "step_00000003", old)
    state_file = old / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert set(GKD_FLAGS) <= set(state["config"])
    state["config"] = {name: value for name, value in state["config"].items() if name not in GKD_FLAGS}
    state_file.write_text(json.dumps(state))
    capsys.readouterr()
    resumed = tmp_path / "resumed"
    run_in_process("distill", _argv(train_data, tiny_models, resumed, "--alpha", "0.25", "--temperature", "2",
                                    "--max_steps", "3", "--resume", str(old)))
    out = capsys.readouterr().out
    assert "resumed from" in out and "nothing left to train" in out
    assert ("changed since the checkpoint: --max_steps was 6 there and is 3 now; the run goes on with the new "
            "values\n") in out
    jsd = tmp_path / "jsd"
    run_in_process("distill", _argv(train_data, tiny_models, jsd, "--alpha", "0.25", "--temperature", "2",
                                    "--max_steps", "3", "--distill_loss", "jsd", "--resume", str(old)))
    assert ("changed since the checkpoint: --max_steps was 6 there and is 3 now, --distill_loss was kl there and is "
            "jsd now; the run goes on with the new values\n") in capsys.readouterr().out


# A covering set of {--lmbda 1, --seq_kd} x {FSDP2, torchrun}, each value of each once: the student samples under
# FSDP2 (the one pair whose code path depends on both: the whole copy it samples through, distillation.py's
# rollouts), the teacher (never sharded, the same on every launcher) under torchrun; the seeds by the row's place
# in the global batch are the same code under both launchers.
@pytest.mark.parametrize("flags, launch", [(["--lmbda", "1", "--max_new_tokens", "6"], "fsdp"),
                                           (["--seq_kd", "--max_new_tokens", "5"], "torchrun")],
                         ids=["lmbda-fsdp", "seq_kd-torchrun"])
def test_two_processes_sample_and_distill_like_one_process(flags, launch, train_data, tiny_models, tmp_path):
    """GKD's sampled steps on two processes of 2 conversations against one process of 4 (the same global batch),
    2 steps, FSDP2 and DDP (torchrun): each completion's seed is its row's place in the step's global batch and the
    step's draw is the same on every process, so both sample the same completions (the student's with --lmbda 1,
    the teacher's with --seq_kd); the loss, CE, KL, on_policy, the validation and the final weights agree. Under
    FSDP2 the student samples through a whole copy of its weights on each process (on the sharded model itself the
    first training forward after sampling failed)."""
    def argv(out_dir, batch_size: str) -> list[str]:
        flags_of_run = _argv(train_data, tiny_models, out_dir, "--eval_interval", "1", *flags)
        flags_of_run[flags_of_run.index("--batch_size") + 1] = batch_size
        flags_of_run[flags_of_run.index("--max_steps") + 1] = "2"
        return flags_of_run

    one = tmp_path / "one"
    run_in_process("distill", argv(one, "4"))
    two = tmp_path / "two"
    run = launch_two_processes(launch, "distill", argv(two, "2"), tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert ("x2, float32, FSDP" if launch == "fsdp" else "x2, float32") in run.stdout
    train = read_metrics(one, "train")
    assert len(train) == 2 and all(record["kl"] > 0 for record in train)
    if "--lmbda" in flags:
        assert all(record["on_policy"] == 1.0 for record in train)  # both steps trained on the student's samples
    assert_same_logged_metrics(two, one)
    assert_same_model(two, one)
