"""PPO (trainer/train_ppo.py) end to end on the training core: `python trainer/train_ppo.py` samples, scores and
trains policy and critic, logs the rollout and critic statistics, saves the policy alone as the model and both in
its checkpoints; resumed from a checkpoint it reproduces the uninterrupted run bit for bit (rollouts and critic
included); TRL's --kl_estimator, --whiten_rewards and --missing_eos_penalty reach the objective and the record;
two processes take one process's steps, with --whiten_rewards too; a broken reward function stops it in one line;
and a reward that counts a frequent word rises within a few dozen steps on a tiny model."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.paths import REPO
from tests.training_runs import (ADAM_STEPS_ATOL, assert_same_logged_metrics, assert_same_model, frequent_word_rewards,
                                 launch_two_processes, record_objective_settings, record_rollout_decodes, refused_run,
                                 run_in_process, tool_run_argv, train_losses, write_prompt_data, write_tool_run_inputs)
from trainer.command import main
from trainer.run_dir import model_task, read_metrics, read_summary

STATS = {"loss", "reward", "reward_std", "kl", "clip_fraction", "policy_loss", "value_loss", "explained_variance",
         "completion_length", "completion_length_min", "completion_length_max", "truncated_fraction",
         "terminated_length", "terminated_length_min", "terminated_length_max", "entropy", "approx_kl",
         "value_clip_fraction", "ratio", "rewards/letter_e", "rewards/letter_e_std"}


@pytest.fixture(scope="module")
def ppo_data(tmp_path_factory):
    return write_prompt_data(tmp_path_factory.mktemp("ppo_data"))


def _argv(data, start, out_dir, *extra: str) -> list[str]:
    return ["--data_path", str(data / "prompts.jsonl"), "--from_weight", str(start), "--out_dir", str(out_dir),
            "--max_steps", "5", "--batch_size", "4", "--max_completion_length", "12", "--save_interval", "2",
            "--eval_interval", "100", "--eval_batches", "1", "--log_interval", "1", "--learning_rate", "1e-3",
            "--warmup_steps", "1", "--max_seq_len", "48", "--dtype", "float32", "--norm_impl", "eager",
            "--compile", "off", "--threads", "1", "--reward", f"{data / 'letters.py'}:letter_e", *extra]


def _command_line(argv: list[str]) -> str:
    """Run train_ppo.py with `argv`; its output (stdout, then stderr)."""
    run = subprocess.run([sys.executable, "trainer/train_ppo.py", *argv], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout + run.stderr


@pytest.fixture(scope="module")
def ppo_run(ppo_data, tiny_models, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ppo") / "run"
    _command_line(_argv(ppo_data, tiny_models.pretrain, out_dir))
    return out_dir


def test_a_ppo_run_from_the_command_line_logs_its_statistics_and_saves_the_policy(ppo_run, tiny_models):
    train = read_metrics(ppo_run, "train")
    assert len(train) == 5
    for record in train:
        assert STATS <= set(record)
        assert 1 <= record["completion_length"] <= 12 and record["value_loss"] >= 0
        assert record["completion_length_min"] <= record["completion_length"] <= record["completion_length_max"]
        assert 0 <= record["truncated_fraction"] <= 1 and 0 <= record["value_clip_fraction"] <= 1
        assert record["entropy"] > 0 and record["approx_kl"] >= 0 and record["ratio"] > 0
        assert record["reward"] == pytest.approx(record["rewards/letter_e"])
    assert train[0]["kl"] == 0  # the policy starts as the reference
    assert max(record["kl"] for record in train[1:]) > 0  # and moves away from it
    assert any(record["clip_fraction"] > 0 for record in train)  # --ppo_epochs 2: the second update clips
    summary = read_summary(ppo_run)
    assert summary["status"] == "finished" and summary["final_val"]["prompts"] >= 1
    assert model_task(ppo_run) == "ppo"
    # The model directory is the policy alone, a plain model of the starting one's shape ...
    policy, start = load_file(ppo_run / "model.safetensors"), load_file(tiny_models.pretrain / "model.safetensors")
    assert policy.keys() == start.keys()
    assert any(not torch.equal(policy[name], start[name]) for name in start)
    # ... and a checkpoint holds the critic beside it, its value head trained away from zero.
    checkpoint = load_file(ppo_run / "checkpoints" / "step_00000004" / "model.safetensors")
    assert {f"policy.{name}" for name in start} <= checkpoint.keys()
    assert checkpoint["critic.value_head.weight"].abs().sum() > 0


def test_a_resumed_ppo_run_equals_the_uninterrupted_one(ppo_run, ppo_data, tiny_models, tmp_path, capsys):
    """In this process (the command line is ppo_run's): from the step-2 checkpoint to the end, bit for bit."""
    resumed = tmp_path / "resumed"
    run_in_process("ppo", _argv(ppo_data, tiny_models.pretrain, resumed, "--resume",
                                str(ppo_run / "checkpoints" / "step_00000002")))
    out = capsys.readouterr()
    assert "resumed from" in out.out and "changed since the checkpoint" not in out.out + out.err  # the same flags
    theirs, ours = read_metrics(ppo_run, "train")[2:], read_metrics(resumed, "train")
    assert train_losses(resumed) == train_losses(ppo_run)[2:]
    for name in ("reward", "completion_length", "value_loss", "explained_variance"):
        assert [r[name] for r in ours] == [r[name] for r in theirs], name
    for path in ("model.safetensors", "checkpoints/step_00000004/model.safetensors"):  # the critic: in the second
        mine, reference = load_file(resumed / path), load_file(ppo_run / path)
        assert mine.keys() == reference.keys()
        assert all(torch.equal(mine[name], tensor) for name, tensor in reference.items()), path


@pytest.mark.parametrize("flags, recorded", [
    (["--kl_estimator", "k3"], {"kl_estimator": "k3"}),
    (["--whiten_rewards"], {"whiten_rewards": True}),
    (["--missing_eos_penalty", "100", "--compile", "auto"], {"missing_eos_penalty": 100.0})])
def test_trls_options_reach_the_objective_and_the_record(flags, recorded, ppo_data, tiny_models, tmp_path,
                                                         monkeypatch):
    """One step with each of TRL's PPO options: the objective the run builds has it, train_config.yaml records it
    (so a resume compares it), and the step trains; the missing-eos penalty shows in the logged reward (the tiny
    model's completions are cut at 12 tokens), not in the reward function's own mean. The rollouts decode the
    static step eagerly under --compile off, a compiled one under auto (GRPO's rule)."""
    import yaml

    import trainer.ppo as ppo

    built = record_objective_settings(monkeypatch, ppo.ProximalPolicy)
    decodes = record_rollout_decodes(monkeypatch)
    out_dir = tmp_path / "run"
    run_in_process("ppo", _argv(ppo_data, tiny_models.pretrain, out_dir, "--max_steps", "1", *flags))
    defaults = {"kl_estimator": "k1", "whiten_rewards": False, "missing_eos_penalty": 0.0}
    assert [{name: getattr(s, name) for name in defaults} for s in built] == [{**defaults, **recorded}]
    assert decodes and set(decodes) == {"compiled" if "auto" in flags else "static"}
    config = yaml.safe_load((out_dir / "train_config.yaml").read_text())
    assert {name: config[name] for name in defaults} == {**defaults, **recorded}
    [step] = read_metrics(out_dir, "train")
    assert math.isfinite(step["loss"])
    if "missing_eos_penalty" in recorded:
        assert step["reward"] < step["rewards/letter_e"] - 10  # 100 off each cut completion's score
    else:
        assert step["reward"] == pytest.approx(step["rewards/letter_e"])


def test_a_reward_that_breaks_its_contract_stops_the_ppo_run_in_one_line(ppo_data, tiny_models, tmp_path, capsys):
    out_dir = tmp_path / "broken"
    argv = _argv(ppo_data, tiny_models.pretrain, out_dir)
    argv[argv.index(f"{ppo_data / 'letters.py'}:letter_e")] = f"{ppo_data / 'broken.py'}:short_by_one"
    with pytest.raises(SystemExit) as stopped:
        main("ppo", argv)
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == f"error: reward {ppo_data / 'broken.py'}:short_by_one: returned 3 values for 4 completions"
    checkpoint = out_dir / "checkpoints" / "step_00000002"  # saved after step 2; the 3rd step's rollout broke
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == 2


def test_ppo_raises_a_reward_that_counts_a_frequent_word(word_model, tmp_path):
    """A tiny model pretrained on a 22-word corpus writes "the" about once in 16 tokens; 20 PPO steps (fixed
    seed) more than double the reward that counts it."""
    rewards = frequent_word_rewards("ppo", word_model, tmp_path / "ppo", 20, "--batch_size", "8", "--ppo_epochs", "4")
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    assert last > 2 * first and last > first + 0.5, rewards


@pytest.fixture(scope="module")
def two_and_one(ppo_data, tiny_models, tmp_path_factory):
    """One configuration for the two tests below (one launch and one reference where there were two of each):
    torchrun, two processes of 2 prompts against one process of 4 (the same global batch, the same rollouts:
    trainer/grpo.py's seeds), 2 steps, --whiten_rewards, from the tiny chat model (it ends some completions early,
    at <|im_end|>) with --seed 1, validated on 7 prompts after each step and checkpointed after each. Returns the
    folder holding one/ and two/, the one process's completion tokens of each step's halves (its first 2 prompts
    are process 0's, with --num_generations 2 its first 4 completions) and the launch's stdout."""
    import trainer.ppo as ppo

    rows = [json.loads(line) for line in (ppo_data / "prompts.jsonl").read_text().splitlines()]
    (ppo_data / "val.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:7]))
    root = tmp_path_factory.mktemp("ppo_two_and_one")

    def argv(out_dir, batch_size: str) -> list[str]:
        flags = _argv(ppo_data, tiny_models.chat, out_dir, "--whiten_rewards", "--num_generations", "2", "--seed", "1",
                      "--val_data_path", str(ppo_data / "val.jsonl"), "--eval_interval", "1", "--save_interval", "1")
        flags[flags.index("--batch_size") + 1] = batch_size
        flags[flags.index("--max_steps") + 1] = "2"  # the second step already updates from Adam's moments
        return flags

    finish_rollouts, halves = ppo.ProximalPolicy.finish_rollouts, []

    def recording(self, batches, accelerator) -> None:
        lengths = [int(n) for batch in batches for n in batch["completion_mask"].sum(dim=1)]
        halves.append((sum(lengths[:4]), sum(lengths[4:])))
        finish_rollouts(self, batches, accelerator)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ppo.ProximalPolicy, "finish_rollouts", recording)
        run_in_process("ppo", argv(root / "one", "4"))
    run = launch_two_processes("torchrun", "ppo", argv(root / "two", "2"), root)
    assert run.returncode == 0, run.stderr[-4000:]
    return root, halves, run.stdout


def _assert_same_policy_and_critic(two, one) -> None:
    """The policy after both steps, and the policy and the critic checkpointed after the first, agree."""
    assert_same_model(two, one, atol=ADAM_STEPS_ATOL)
    checkpoint = "checkpoints/step_00000001/model.safetensors"
    mine, theirs = load_file(two / checkpoint), load_file(one / checkpoint)
    assert mine.keys() == theirs.keys() and "critic.value_head.weight" in mine
    for name, tensor in theirs.items():
        torch.testing.assert_close(mine[name], tensor, rtol=1e-4, atol=ADAM_STEPS_ATOL, msg=name)


def test_two_processes_take_the_same_steps_as_one_process(two_and_one):
    """torchrun, two processes of 2 prompts against one process of 4 (two_and_one): the advantages are whitened
    and the statistics taken over the step's global batch (all processes), so every logged statistic, the
    validation (7 prompts: one shard padded, the copy not counted), the policy and the critic agree. Whitening
    per process (MiniMind's) fails this test."""
    root, _, stdout = two_and_one
    assert "x2, float32" in stdout
    assert_same_logged_metrics(root / "two", root / "one")
    assert read_summary(root / "two")["final_val"]["prompts"] == 7
    _assert_same_policy_and_critic(root / "two", root / "one")


def test_two_processes_whiten_rewards_over_the_steps_tokens_like_one_process(two_and_one):
    """--whiten_rewards, torchrun, two processes of 2 prompts against one process of 4, 2 steps (two_and_one): the
    rewards are whitened with the mean and variance of the step's global batch's tokens, so every logged statistic
    (train and validation), the policy and the critic (checkpointed after step 1) agree. The tiny chat model ends
    some completions early (<|im_end|>) and --seed 1 gives the two processes' prompts other completion token counts
    at both steps (asserted), so the token means (clip fraction, KL, losses) are weighed across processes too.
    Whitening the rewards with each process's own moments fails this test, and so does weighing each process's
    token means equally (the clip fraction)."""
    root, halves, stdout = two_and_one
    assert len(halves) == 2 and all(first != second for first, second in halves), halves
    assert "x2, float32" in stdout
    assert_same_logged_metrics(root / "two", root / "one")
    assert [record["clip_fraction"] > 0 for record in read_metrics(root / "one", "train")] == [True, True]
    _assert_same_policy_and_critic(root / "two", root / "one")


@pytest.mark.parametrize("flags, message", [
    (["--max_completion_length", "81"],
     "error: --max_completion_length=81 is not allowed; a prompt of up to --max_seq_len=48 tokens and its completion "
     "must fit the model's max_position_embeddings=128: it must be at most 80 (or lower --max_seq_len)"),
    (["--max_seq_len", "128"],
     "error: --max_seq_len=128 keeps prompts that fill the model's max_position_embeddings=128, leaving no room for a "
     "completion: a prompt of up to --max_seq_len tokens and its completion of up to --max_completion_length=12 must "
     "fit together"),
])
def test_a_rollout_the_models_positions_cannot_hold_is_refused_before_training(flags, message, ppo_data, tiny_models,
                                                                              tmp_path, capsys):
    """PPO's rollouts are GRPO's (a prompt of up to --max_seq_len tokens, then its completion, in the model's 128
    positions), so the same two refusals stop it before training (73670c5, f809e5f)."""
    error = refused_run("ppo", _argv(ppo_data, tiny_models.pretrain, tmp_path / "run", *flags), capsys,
                        after_progress=True)
    assert error == message
    assert not (tmp_path / "run" / "checkpoints").exists()


# --tools: the tiny model memorized to ask the calculator for 2 + 3, and its prompts (tests/training_runs.py)
@pytest.fixture(scope="module")
def tool_run_inputs(tmp_path_factory, tokenizer):
    return write_tool_run_inputs(tmp_path_factory.mktemp("ppo_tools"), tokenizer)


def test_a_tools_run_logs_its_tool_stats_and_resumes_to_the_same_run(tool_run_inputs, tmp_path, monkeypatch):
    """train_ppo.py --tools ... --reward tool_use (in this process): the objective samples episodes that call the
    tools, and the run logs the calls per rollout, the failed calls and the reward's parts as GRPO's does; resumed
    from its step-1 checkpoint it samples the same episodes, logs the same step 2 (the critic's value loss included)
    and ends with the same policy, bit for bit."""
    import trainer.ppo as ppo

    model, data = tool_run_inputs
    built = record_objective_settings(monkeypatch, ppo.ProximalPolicy)
    out_dir = tmp_path / "run"
    run_in_process("ppo", tool_run_argv(model, data, out_dir, 2))
    assert [(s.tools, s.max_tool_rounds) for s in built] == [(("wiki", "calculator", "convert_units"), 2)]
    train = read_metrics(out_dir, "train")
    assert len(train) == 2
    for record in train:
        assert {"tool_calls", "tool_errors", "rewards/tool_use", "rewards/tool_call", "rewards/tool_fact",
                "value_loss"} <= set(record)
        assert record["reward"] == pytest.approx(record["rewards/tool_use"])  # its parts weigh 0
        assert 0 <= record["tool_errors"] <= record["tool_calls"] <= 2
    assert sum(record["tool_calls"] for record in train) > 0 and sum(r["rewards/tool_fact"] for r in train) > 0
    resumed = tmp_path / "resumed"
    step_one = out_dir / "checkpoints" / "step_00000001"
    run_in_process("ppo", tool_run_argv(model, data, resumed, 2, "--resume", str(step_one)))
    ours, theirs = read_metrics(resumed, "train"), train[1:]
    # the value loss: the critic's, resumed from the checkpoint
    for name in ("loss", "reward", "tool_calls", "tool_errors", "completion_length", "kl", "value_loss"):
        assert [r[name] for r in ours] == [r[name] for r in theirs], name
    mine, reference = load_file(resumed / "model.safetensors"), load_file(out_dir / "model.safetensors")
    assert mine.keys() == reference.keys()
    assert all(torch.equal(mine[name], tensor) for name, tensor in reference.items())
