"""GRPO (trainer/train_grpo.py) end to end on the training core: a tiny run samples, scores and trains, logs the
reward, KL, clip fraction and completion length, and saves; resumed from its checkpoint it samples the same
rollouts and reproduces the uninterrupted run bit for bit; a reward function that breaks its contract stops the run
in one line and the checkpoint saved before stays complete."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.training_runs import run_in_process, train_losses, write_jsonl
from trainer.core import main
from trainer.run_dir import SUMMARY_FILE, model_task, read_metrics, read_summary

LETTER_REWARD = """
def letter_e(prompts, completions, answer, **columns):
    assert len(prompts) == len(completions) == len(answer)
    return [completion.count("e") / 10 for completion in completions]
"""
BROKEN_REWARD = """
calls = 0

def short_by_one(prompts, completions, **columns):
    global calls
    calls += 1
    return [0.0] * (len(completions) - (1 if calls == 3 else 0))
"""


@pytest.fixture(scope="module")
def grpo_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_data")
    rows = [{"prompt": f"What is {i} + 2?", "answer": str(i + 2)} for i in range(12)]
    rows += [{"messages": [{"role": "user", "content": f"Say {i} twice."}], "answer": f"{i} {i}"} for i in range(2)]
    rows += [{"conversations": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": ""}],
              "answer": "red"}]
    write_jsonl(root / "prompts.jsonl", rows)
    (root / "letters.py").write_text(LETTER_REWARD)
    (root / "broken.py").write_text(BROKEN_REWARD)
    return root


def _argv(data, start, out_dir, *extra: str) -> list[str]:
    return ["--data_path", str(data / "prompts.jsonl"), "--from_weight", str(start), "--out_dir", str(out_dir),
            "--max_steps", "4", "--batch_size", "2", "--num_generations", "4", "--max_completion_length", "12",
            "--save_interval", "2", "--eval_interval", "100", "--eval_batches", "1", "--log_interval", "1",
            "--learning_rate", "1e-3", "--warmup_steps", "1", "--max_seq_len", "48", "--dtype", "float32",
            "--norm_impl", "eager", "--compile", "off", "--reward", f"{data / 'letters.py'}:letter_e",
            "--reward", "math_answer", "--reward_weights", "1", "0.5", *extra]


@pytest.fixture(scope="module")
def grpo_run(grpo_data, tiny_models, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("grpo") / "run"
    run_in_process("grpo", _argv(grpo_data, tiny_models.pretrain, out_dir))
    return out_dir


def test_a_grpo_run_logs_its_rollout_statistics_and_saves(grpo_run):
    train = read_metrics(grpo_run, "train")
    assert len(train) == 4
    for record in train:
        assert {"loss", "reward", "reward_std", "kl", "clip_fraction", "completion_length"} <= set(record)
        assert record["clip_fraction"] == 0  # one update per rollout: the ratio is exactly 1
        assert 1 <= record["completion_length"] <= 12
        assert record["reward"] >= 0 and record["kl"] >= 0
        # the weighted sum of the functions' means (every completion is scored by both)
        assert record["reward"] == pytest.approx(record["rewards/letter_e"] + 0.5 * record["rewards/math_answer"])
    assert any(record["reward_std"] > 0 for record in train)  # the groups' completions differ
    assert train[0]["kl"] == pytest.approx(0, abs=1e-6)  # the policy starts as the reference
    assert max(record["kl"] for record in train[1:]) > 0  # and moves away from it
    summary = read_summary(grpo_run)
    assert summary["status"] == "finished" and summary["final_val"]["prompts"] >= 1
    assert summary["final_val"]["loss"] == -summary["final_val"]["reward"]
    assert (grpo_run / "model.safetensors").is_file() and model_task(grpo_run) == "grpo"


def test_a_resumed_grpo_run_samples_the_same_rollouts(grpo_run, grpo_data, tiny_models, tmp_path):
    resumed = tmp_path / "resumed"
    run_in_process("grpo", _argv(grpo_data, tiny_models.pretrain, resumed, "--resume",
                                 str(grpo_run / "checkpoints" / "step_00000002")))
    theirs = read_metrics(grpo_run, "train")[2:]
    ours = read_metrics(resumed, "train")
    assert train_losses(resumed) == train_losses(grpo_run)[2:]
    assert [r["reward"] for r in ours] == [r["reward"] for r in theirs]
    assert [r["completion_length"] for r in ours] == [r["completion_length"] for r in theirs]
    mine, reference = load_file(resumed / "model.safetensors"), load_file(grpo_run / "model.safetensors")
    assert all(torch.equal(mine[name], tensor) for name, tensor in reference.items())


def test_a_reward_that_breaks_its_contract_stops_the_run_in_one_line(grpo_data, tiny_models, tmp_path, capsys):
    out_dir = tmp_path / "broken"
    argv = _argv(grpo_data, tiny_models.pretrain, out_dir)
    argv[argv.index(f"{grpo_data / 'letters.py'}:letter_e")] = f"{grpo_data / 'broken.py'}:short_by_one"
    with pytest.raises(SystemExit) as stopped:
        main("grpo", argv)
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == f"error: reward {grpo_data / 'broken.py'}:short_by_one: returned 7 values for 8 completions"
    checkpoint = out_dir / "checkpoints" / "step_00000002"  # saved after step 2; the 3rd step's rollout broke
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == 2
    assert not (out_dir / SUMMARY_FILE).exists() and not (out_dir / "checkpoints" / "step_00000003").exists()
