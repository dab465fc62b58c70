"""GRPO (trainer/train_grpo.py) end to end on the training core: a tiny run samples, scores and trains, logs the
reward, KL, clip fraction and completion length, and saves; resumed from its checkpoint it samples the same
rollouts and reproduces the uninterrupted run bit for bit; rollouts (or a validation's) that meet NaN logits end the
run as diverged, also when only one of two processes meets them; --loss_type, --scale_rewards and
--importance_sampling_level reach the objective; a
reward function that breaks its contract stops the run in one line and the checkpoint saved before stays complete;
several updates per rollout (--num_iterations) clip; two processes of other token counts log one process's clip
fraction and KL; a reward that counts a frequent word rises within a few
dozen steps on a tiny model; and a --tools run (rollouts that call tools) logs its tool stats and resumes to the
same run."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.training_runs import (ONE_THREAD, assert_same_logged_metrics, frequent_word_rewards,
                                 record_objective_settings, record_rollout_decodes, refused_run, run_in_process,
                                 tool_run_argv, train_losses, write_prompt_data)
from trainer.command import main
from trainer.run_dir import CONFIG_FILE, SUMMARY_FILE, model_task, read_metrics, read_summary


@pytest.fixture(scope="module")
def grpo_data(tmp_path_factory):
    return write_prompt_data(tmp_path_factory.mktemp("grpo_data"))


# _argv's --reward_weights, as a diverged run's line names them (trainer/arg_fields.py, loss_multipliers_set)
WEIGHTS_SET = "; loss multipliers set away from their defaults: --reward_weights 1 0.5"


def _argv(data, start, out_dir, *extra: str) -> list[str]:
    return ["--data_path", str(data / "prompts.jsonl"), "--from_weight", str(start), "--out_dir", str(out_dir),
            "--max_steps", "4", "--batch_size", "2", "--num_generations", "4", "--max_completion_length", "12",
            "--save_interval", "2", "--eval_interval", "100", "--eval_batches", "1", "--log_interval", "1",
            "--learning_rate", "1e-3", "--warmup_steps", "1", "--max_seq_len", "48", "--dtype", "float32",
            "--norm_impl", "eager", "--compile", "off", "--reward", f"{data / 'letters.py'}:letter_e",
            "--reward", "math_answer", "--reward_weights", "1", "0.5", *ONE_THREAD, *extra]


@pytest.fixture(scope="module")
def grpo_run(grpo_data, tiny_models, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("grpo") / "run"
    run_in_process("grpo", _argv(grpo_data, tiny_models.pretrain, out_dir))
    return out_dir


def test_a_grpo_run_logs_its_rollout_statistics_and_saves(grpo_run):
    train = read_metrics(grpo_run, "train")
    assert len(train) == 4
    for record in train:
        assert {"loss", "reward", "reward_std", "kl", "clip_fraction", "completion_length", "completion_length_min",
                "completion_length_max", "truncated_fraction", "terminated_length", "terminated_length_min",
                "terminated_length_max", "zero_std_fraction", "entropy", "clip_fraction_low",
                "clip_fraction_high"} <= set(record)
        assert record["clip_fraction"] == record["clip_fraction_low"] == record["clip_fraction_high"] == 0
        assert 1 <= record["completion_length_min"] <= record["completion_length"] <= \
            record["completion_length_max"] <= 12
        assert 0 <= record["truncated_fraction"] <= 1 and 0 <= record["zero_std_fraction"] <= 1
        assert record["entropy"] > 0
        assert record["reward"] >= 0 and record["kl"] >= 0
        # the weighted sum of the functions' means (every completion is scored by both)
        assert record["reward"] == pytest.approx(record["rewards/letter_e"] + 0.5 * record["rewards/math_answer"])
    assert any(record["reward_std"] > 0 for record in train)  # the step's rewards differ
    assert train[0]["kl"] == pytest.approx(0, abs=1e-6)  # the policy starts as the reference
    assert max(record["kl"] for record in train[1:]) > 0  # and moves away from it
    summary = read_summary(grpo_run)
    assert summary["status"] == "finished" and summary["final_val"]["prompts"] >= 1
    assert summary["final_val"]["loss"] == -summary["final_val"]["reward"]
    assert (grpo_run / "model.safetensors").is_file() and model_task(grpo_run) == "grpo"


def test_a_resumed_grpo_run_samples_the_same_rollouts(grpo_run, grpo_data, tiny_models, tmp_path, capsys):
    resumed = tmp_path / "resumed"
    run_in_process("grpo", _argv(grpo_data, tiny_models.pretrain, resumed, "--resume",
                                 str(grpo_run / "checkpoints" / "step_00000002")))
    out = capsys.readouterr()  # the same command line: nothing changed (--epsilon_high, --reward left to resolve)
    assert "resumed from" in out.out and "changed since the checkpoint" not in out.out + out.err
    theirs = read_metrics(grpo_run, "train")[2:]
    ours = read_metrics(resumed, "train")
    assert train_losses(resumed) == train_losses(grpo_run)[2:]
    assert [r["reward"] for r in ours] == [r["reward"] for r in theirs]
    assert [r["completion_length"] for r in ours] == [r["completion_length"] for r in theirs]
    mine, reference = load_file(resumed / "model.safetensors"), load_file(grpo_run / "model.safetensors")
    assert all(torch.equal(mine[name], tensor) for name, tensor in reference.items())


@pytest.mark.parametrize("flags, loss_type, scale_rewards", [
    (["--loss_type", "dapo", "--scale_rewards", "batch"], "dapo", "batch"),
    (["--loss_type", "bnpo", "--scale_rewards", "none"], "bnpo", "none"),
    (["--loss_type", "dr_grpo"], "dr_grpo", "none")])
def test_the_loss_and_scaling_flags_reach_the_objective_and_the_record(flags, loss_type, scale_rewards, grpo_data,
                                                                      tiny_models, tmp_path, monkeypatch):
    """The objective the run builds has the loss type and reward scaling asked for (unset: dr_grpo's none), and
    train_config.yaml records them, so a resume compares them."""
    import trainer.grpo as grpo

    built = record_objective_settings(monkeypatch, grpo.GroupRelativePolicy)
    out_dir = tmp_path / "run"
    run_in_process("grpo", _argv(grpo_data, tiny_models.pretrain, out_dir, "--max_steps", "1", *flags))
    assert [(s.loss_type, s.reward_scaling) for s in built] == [(loss_type, scale_rewards)]
    config = yaml.safe_load((out_dir / CONFIG_FILE).read_text())
    assert (config["loss_type"], config["scale_rewards"]) == (loss_type, scale_rewards)
    assert len(read_metrics(out_dir, "train")) == 1


def test_a_sequence_level_ratio_reaches_the_objective_and_the_record(grpo_data, tiny_models, tmp_path,
                                                                   monkeypatch):
    """--importance_sampling_level sequence (GSPO): the objective the run builds takes it, train_config.yaml records
    it, and a step of two updates per rollout trains with it."""
    import trainer.grpo as grpo

    built = record_objective_settings(monkeypatch, grpo.GroupRelativePolicy)
    out_dir = tmp_path / "run"
    run_in_process("grpo", _argv(grpo_data, tiny_models.pretrain, out_dir, "--max_steps", "1",
                                 "--importance_sampling_level", "sequence", "--num_iterations", "2"))
    assert [s.importance_sampling_level for s in built] == ["sequence"]
    assert yaml.safe_load((out_dir / CONFIG_FILE).read_text())["importance_sampling_level"] == "sequence"
    [step] = read_metrics(out_dir, "train")
    assert math.isfinite(step["loss"]) and 0 <= step["clip_fraction"] <= 1


@pytest.mark.parametrize("compile_mode, decode", [("off", "static"), ("auto", "compiled")])
def test_the_rollouts_compile_their_decode_step_unless_compile_is_off(compile_mode, decode, grpo_data, tiny_models,
                                                                     tmp_path, monkeypatch, capsys):
    """--compile off compiles nothing: the rollouts (and the final validation's greedy ones) decode the static step
    eagerly; auto compiles the decode step whatever the run's length (a 1-step run here, whose model auto leaves
    eager), since a few steps of rollouts pay its compile back. The run's first line says which."""
    asked = record_rollout_decodes(monkeypatch)
    out_dir = tmp_path / "run"
    run_in_process("grpo", _argv(grpo_data, tiny_models.pretrain, out_dir, "--max_steps", "1", "--compile",
                                 compile_mode))
    assert len(asked) >= 2 and set(asked) == {decode}  # the step's rollouts, then the final greedy validation
    first = capsys.readouterr().out.splitlines()[0]
    assert ("compile off (the sampling's decode step compiled)," in first) == (decode == "compiled")
    assert ("compile off," in first) == (decode == "static")
    assert yaml.safe_load((out_dir / CONFIG_FILE).read_text())["compile"] == compile_mode


@pytest.mark.parametrize("steps, where", [
    ("3", "at optimizer step 2 (the policy's sampling scores became NaN or infinite)"),
    ("1", "at optimizer step 1 (the policy's sampling scores became NaN or infinite in the validation after it)")])
def test_rollouts_whose_logits_turn_nan_end_the_run_as_diverged(steps, where, grpo_data, tiny_models, tmp_path,
                                                               monkeypatch):
    """Weights a learning rate blew up make the policy's logits NaN: step 2's rollouts (or, in a 1-step run, the
    final validation's greedy ones) cannot sample. That was a RuntimeError traceback (exit 1, no summary); it is the
    run's divergence now, as a NaN loss is: the state before it saved, run_summary.json "diverged", one line naming
    the cause (exit 3 from the command line)."""
    import trainer.grpo as grpo
    from trainer.run_summary import TrainingDiverged

    engines = []
    engine = grpo.GenerationEngine

    def blown_up_at_the_second_sampling(model, tokenizer, max_batch, decode):
        engines.append(decode)
        if len(engines) == 2:  # after step 1's rollouts (one micro-batch a step), the weights blew up
            with torch.no_grad():
                model.lm_head.weight.fill_(float("nan"))
        return engine(model, tokenizer, max_batch=max_batch, decode=decode)

    monkeypatch.setattr(grpo, "GenerationEngine", blown_up_at_the_second_sampling)
    out_dir = tmp_path / "run"
    with pytest.raises(TrainingDiverged) as error:
        run_in_process("grpo", _argv(grpo_data, tiny_models.pretrain, out_dir, "--max_steps", steps))
    checkpoint = out_dir / "checkpoints" / "step_00000001"
    assert str(error.value) == f"training diverged {where}; the last good state is saved in {checkpoint}{WEIGHTS_SET}"
    assert read_summary(out_dir)["status"] == "diverged" and (checkpoint / "model.safetensors").is_file()


@pytest.mark.parametrize("steps, where", [
    ("2", "at optimizer step 2 (the policy's sampling scores became NaN or infinite)"),
    ("1", "at optimizer step 1 (the policy's sampling scores became NaN or infinite in the validation after it)")])
def test_one_processs_sampling_meeting_nan_logits_ends_the_run_as_diverged_on_every_process(steps, where, grpo_data,
                                                                                           tiny_models, tmp_path):
    """Two real processes over gloo (two single-process torchrun nodes on loopback, so that each node's launcher
    reports its own process's exit code): only process 1's sampling meets NaN logits (tests/diverging_sampling.py),
    from its second one on: step 2's rollouts (or, in a 1-step run, the final validation's greedy ones). Both
    processes end the run as diverged -- exit 3, one line naming the step, run_summary.json "diverged" at step 1,
    step 1's state saved by both -- within the launch's `timeout`: agreed_sampling's collective tells process 0,
    whose own sampling went well, that the step (or validation) cannot go on. Without that collective process 1 went
    on alone into the diverged run's save while process 0 waited in the rollouts' sums (or the validation's): process
    1 gave up after --dist_timeout (exit 4) and process 0 ended in a gloo traceback (exit 1)."""
    from tests.paths import REPO
    from tests.training_runs import run_two_nodes
    from trainer.run_dir import EXIT_DIVERGED

    out_dir = tmp_path / "run"
    rows = (grpo_data / "prompts.jsonl").read_text().splitlines()
    (tmp_path / "val.jsonl").write_text("".join(row + "\n" for row in rows[:4]))  # 2 prompts for each process
    argv = _argv(grpo_data, tiny_models.pretrain, out_dir, "--max_steps", steps, "--save_interval", "100",
                 "--val_data_path", str(tmp_path / "val.jsonl"), "--dist_timeout", "30")  # a lone wait: 30 s, not 300
    nodes = run_two_nodes([str(REPO / "tests" / "diverging_sampling.py"), "grpo", "1", "2", *argv], tmp_path)
    checkpoint = out_dir / "checkpoints" / "step_00000001"
    line = f"error: training diverged {where}; the last good state is saved in {checkpoint}{WEIGHTS_SET}"
    for node, (returncode, stderr) in enumerate(nodes):
        assert returncode not in (0, 124, 137), f"node {node}: {stderr[-4000:]}"  # not stopped by `timeout`
        assert f"exitcode  : {EXIT_DIVERGED}" in stderr, f"node {node}: {stderr[-4000:]}"  # its process's own code
        assert [text for text in stderr.splitlines() if text.startswith("error:")] == [line], stderr[-4000:]
    summary = read_summary(out_dir)
    assert (summary["status"], summary["steps"]) == ("diverged", 1)
    assert {"model.safetensors", "random_states_0.pkl", "random_states_1.pkl", "trainer_state.json"} <= {
        path.name for path in checkpoint.iterdir()}


def test_a_reward_given_twice_is_refused_in_one_line_before_training(grpo_data, tiny_models, tmp_path, capsys):
    """math_answer twice logged one rewards/math_answer mean for both (trainer/grpo.py check_reward_names)."""
    error = refused_run("grpo", _argv(grpo_data, tiny_models.pretrain, tmp_path / "run", "--reward", "math_answer",
                                      "--reward_weights", "1", "0.5", "1"), capsys, after_progress=True)
    assert error == ("error: --reward 'math_answer' and 'math_answer' log as one mean, rewards/math_answer: give each "
                     "reward function once, under a name of its own (--reward_weights weighs one)")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


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


@pytest.mark.parametrize("length", ["81", str(10 ** 30)])
def test_a_completion_the_models_positions_cannot_hold_after_the_prompt_is_refused_before_training(
        length, grpo_data, tiny_models, tmp_path, capsys):
    """A rollout is a prompt of up to --max_seq_len tokens and its completion, one sequence through the model's
    positions (128 here); 10**30 was an OverflowError traceback after the first rollout (found fuzzing the flags)."""
    argv = _argv(grpo_data, tiny_models.pretrain, tmp_path / "run", "--max_completion_length", length)
    error = refused_run("grpo", argv, capsys, after_progress=True)
    assert error == (f"error: --max_completion_length={length} is not allowed; a prompt of up to --max_seq_len=48 "
                     f"tokens and its completion must fit the model's max_position_embeddings=128: it must be at "
                     f"most 80 (or lower --max_seq_len)")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_several_updates_per_rollout_clip_the_ratio(grpo_data, tiny_models, tmp_path):
    """--num_iterations 3: each of the 2 steps (rollouts) takes 3 updates; the later ones take the ratio against
    the sampling policy's log-probs, so tokens clip (one update per rollout never clips: the test above)."""
    out_dir = tmp_path / "iterations"
    argv = _argv(grpo_data, tiny_models.pretrain, out_dir, "--num_iterations", "3")
    argv[argv.index("--max_steps") + 1] = "2"
    run_in_process("grpo", argv)
    train = read_metrics(out_dir, "train")
    assert len(train) == 2  # --max_steps counts rollouts
    assert all(record["clip_fraction"] > 0 for record in train)


def test_grpo_raises_a_reward_that_counts_a_frequent_word(word_model, tmp_path):
    """A tiny model pretrained on a 22-word corpus writes "the" about once in 16 tokens; 30 GRPO steps (fixed
    seed, groups of 4) more than triple the reward that counts it."""
    rewards = frequent_word_rewards("grpo", word_model, tmp_path / "grpo", 30, "--batch_size", "2",
                                    "--num_generations", "4")
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    assert last > 3 * first and last > first + 0.4, rewards


def _greedy_completion(model, prompt_ids: list[int], max_tokens: int, stop: set[int]) -> list[int]:
    """Greedy decoding by full forwards, token by token (independent of the trainer's engine)."""
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        with torch.no_grad():
            token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        if token in stop:
            break
    return ids[len(prompt_ids):]


def test_grpo_defaults_to_the_arithmetic_problems_and_reports_their_held_out_accuracy(tiny_models, tmp_path):
    """No --data_path, no --reward: the embedded arithmetic problems, math_answer, and the greedy accuracy on every
    held-out problem at the end, which equals an independent count (full forwards, own answer parsing)."""
    from dataset.chat_format import encode_chatml
    from dataset.post_training_data import ensure_post_training_data
    from dataset.tokenization import load_tokenizer
    from model.model import MiniNormForCausalLM

    out_dir = tmp_path / "default"
    run_in_process("grpo", ["--from_weight", str(tiny_models.pretrain), "--out_dir", str(out_dir), "--max_steps",
                            "1", "--batch_size", "4", "--num_generations", "2", "--max_completion_length", "5",
                            "--max_seq_len", "96", "--dtype", "float32", "--norm_impl", "eager", "--compile", "off",
                            "--eval_interval", "100", "--save_interval", "100", "--beta", "0"])
    config = yaml.safe_load((out_dir / CONFIG_FILE).read_text())
    paths = ensure_post_training_data()
    assert config["reward"] == ["math_answer"] and config["data_path"] is None
    rows = [json.loads(line) for line in paths.grpo_val.read_text().splitlines()]
    final = read_summary(out_dir)["final_val"]
    assert final["prompts"] == len(rows) == 300
    tokenizer = load_tokenizer()
    model = MiniNormForCausalLM.from_pretrained(out_dir).eval()
    stop = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    correct, lengths = 0, 0
    for row in rows:
        prompt = encode_chatml(tokenizer, [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True)
        completion = _greedy_completion(model, prompt.input_ids, 5, stop)
        lengths += len(completion)
        numbers = [w.strip(".,") for w in tokenizer.decode(completion, skip_special_tokens=True).split()]
        numbers = [w for w in numbers if w.lstrip("-").isdigit()]
        correct += bool(numbers) and int(numbers[-1]) == int(row["answer"])
    assert final["completion_length"] == pytest.approx(lengths / len(rows))
    assert final["accuracy"] == pytest.approx(correct / len(rows))
    assert read_metrics(out_dir, "val")[-1]["val_accuracy"] == pytest.approx(correct / len(rows))


def _sampling_argv(grpo_data, tiny_models, out_dir, batch_size: str) -> list[str]:
    flags = _argv(grpo_data, tiny_models.pretrain, out_dir, "--val_data_path", str(grpo_data / "val.jsonl"),
                  "--eval_interval", "1")
    flags[flags.index("--batch_size") + 1] = batch_size
    flags[flags.index("--max_steps") + 1] = "2"  # the second step already updates from Adam's moments
    return flags


@pytest.fixture(scope="module")
def one_process_of_four(grpo_data, tiny_models, tmp_path_factory):
    """The one-process run (4 prompts a step, 7 validation prompts) both launchers' two processes are compared
    with: one run for both, their flags but the batch size being the same."""
    rows = [json.loads(line) for line in (grpo_data / "prompts.jsonl").read_text().splitlines()]
    (grpo_data / "val.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:7]))
    one = tmp_path_factory.mktemp("grpo_one_of_four") / "one"
    run_in_process("grpo", _sampling_argv(grpo_data, tiny_models, one, "4"))
    return one


@pytest.mark.parametrize("launch", ["torchrun", "fsdp"])
def test_two_processes_sample_and_train_like_one_process(launch, one_process_of_four, grpo_data, tiny_models,
                                                        tmp_path):
    """torchrun (DDP) and FSDP2, two processes of 2 prompts against one process of 4 (the same global batch): each
    completion's seed depends on its prompt's place in the global batch, not on the process, so both sample the
    same rollouts; losses, rewards, the validation (7 prompts: one shard padded, the copy not counted) and the
    weights agree. Under FSDP2 the policy samples through a whole copy of its weights on each process (on the
    sharded policy the first training forward after sampling failed). (PPO's: tests/integration/test_ppo_runs.py.)"""
    from tests.training_runs import ADAM_STEPS_ATOL, assert_same_model, launch_two_processes

    one = one_process_of_four
    two = tmp_path / "two"
    run = launch_two_processes(launch, "grpo", _sampling_argv(grpo_data, tiny_models, two, "2"), tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert ("x2, float32, FSDP" if launch == "fsdp" else "x2, float32") in run.stdout
    assert_same_logged_metrics(two, one)
    assert read_summary(two)["final_val"]["prompts"] == 7
    assert_same_model(two, one, atol=ADAM_STEPS_ATOL)


@pytest.mark.parametrize("task", ["grpo", "ppo"])
def test_lora_trains_only_the_policys_adapters_and_saves_an_adapter_chat_loads(task, grpo_data, tiny_models,
                                                                               tmp_path, capsys):
    """--lora: the starting weights stay as they were (in the checkpoint), the adapters move, the KL's reference is
    the policy without them (0 at the first step, > 0 after), and the run saves a PEFT adapter that chat runs."""
    from eval.chat import main as chat

    out_dir = tmp_path / f"{task}_lora"
    argv = _argv(grpo_data, tiny_models.pretrain, out_dir, "--lora", "--lora_rank", "4", "--learning_rate", "1e-2")
    argv[argv.index("--max_steps") + 1] = "2"  # the KL's second step, after one update
    argv[argv.index("--save_interval") + 1] = "1"  # the checkpoint after that update (the last step saves none)
    if task == "ppo":
        argv[argv.index("--num_generations") + 1] = "2"
    run_in_process(task, argv)
    assert (out_dir / "adapter_config.json").is_file() and not (out_dir / "model.safetensors").exists()
    adapter = load_file(out_dir / "adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter)
    assert any(tensor.abs().sum() > 0 for name, tensor in adapter.items() if "lora_B" in name)  # B starts at 0
    start = load_file(tiny_models.pretrain / "model.safetensors")
    saved = load_file(out_dir / "checkpoints" / "step_00000001" / "model.safetensors")
    prefix = "policy.base_model.model." if task == "ppo" else "base_model.model."
    frozen = {name[len(prefix):].replace(".base_layer", ""): tensor for name, tensor in saved.items()
              if name.startswith(prefix) and "lora_" not in name}
    assert set(start) <= set(frozen)
    assert all(torch.equal(frozen[name], tensor) for name, tensor in start.items())
    kl = [record["kl"] for record in read_metrics(out_dir, "train")]
    assert kl[0] == pytest.approx(0, abs=1e-6) and max(kl[1:]) > 0
    capsys.readouterr()
    # --no_tools: the tools' system turn alone nearly fills the tiny model's 128-token context
    assert chat(["--lora", str(out_dir), "--model_path", str(tiny_models.pretrain), "--prompt", "Hi", "--no_tools",
                 "--temperature", "0", "--no_stream", "--max_new_tokens", "5"]) == 0


def test_a_reward_model_scores_beside_a_reward_function(grpo_data, tiny_models, tmp_path):
    """--reward_model DIR with --reward and --reward_weights: logged as rewards/reward_model, weighted into the
    reward; a tiny randomly initialised LlamaForSequenceClassification (one label) is the reward model."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from dataset.tokenization import load_tokenizer

    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id)).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    out_dir = tmp_path / "with_rm"
    argv = _argv(grpo_data, tiny_models.pretrain, out_dir, "--reward_model", str(tmp_path / "rm"))
    at = argv.index("--reward_weights")
    argv[at:at + 3] = ["--reward_weights", "1", "0.5", "2"]
    argv[argv.index("--max_steps") + 1] = "2"
    run_in_process("grpo", argv)
    for record in read_metrics(out_dir, "train"):
        assert record["rewards/reward_model"] != 0
        assert record["reward"] == pytest.approx(record["rewards/letter_e"] + 0.5 * record["rewards/math_answer"]
                                                 + 2 * record["rewards/reward_model"], rel=1e-5)


def test_a_validation_file_row_math_answer_cannot_read_is_refused_before_training(grpo_data, tiny_models, tmp_path,
                                                                                  capsys, caplog):
    """Every row of every file the run reads, the --val_data_path one too (it was only the training file's):
    a bad answer would score 0 for ever and count in the accuracy."""
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"prompt": "What is 2 + 2?", "answer": 4}) + "\n"
                   + json.dumps({"prompt": "What is 3 + 3?", "answer": {"value": 6}}) + "\n")
    out_dir = tmp_path / "refused"
    with pytest.raises(SystemExit) as stopped:
        main("grpo", _argv(grpo_data, tiny_models.pretrain, out_dir, "--val_data_path", str(val)))
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (f'error: {val}:2: "answer" must be a number or a number as text for the math_answer reward, '
                     f"got an object (pass --skip_bad_lines to skip bad lines)")
    assert not out_dir.exists() or not any(out_dir.iterdir())
    # A bad line like any other: --skip_bad_lines skips it and names it (it stopped the run with the flag given).
    with caplog.at_level("WARNING"):
        main("grpo", _argv(grpo_data, tiny_models.pretrain, out_dir, "--val_data_path", str(val), "--skip_bad_lines",
                           "true", "--max_steps", "1", "--save_interval", "1"))
    assert any(record.getMessage().startswith(f'{val}:2: "answer" must be') for record in caplog.records)
    assert read_summary(out_dir)["steps"] == 1


@pytest.fixture(scope="module")
def recorded_two_and_one(grpo_data, tiny_models, tmp_path_factory):
    """One configuration for the two tests below (one launch and one reference where there were two of each):
    --scale_rewards batch, --num_iterations 2 --beta 0.1 (the second update clips, the KL moves), loss grpo (its
    unit the completion), --seed 1, from the tiny chat model; torchrun, two processes of 2 prompts, against one
    process of 4, both recording each completion's advantage and each process's completion tokens
    (tests/grpo_advantages.py). Returns the folder holding one/, one_record/, two/ and two_record/."""
    from tests.grpo_advantages import recording_finish_rollouts
    from trainer.grpo import GroupRelativePolicy

    root = tmp_path_factory.mktemp("grpo_two_and_one")

    def argv(out_dir, batch_size: str) -> list[str]:
        flags = _argv(grpo_data, tiny_models.chat, out_dir, "--scale_rewards", "batch", "--num_iterations", "2",
                      "--beta", "0.1", "--seed", "1")
        flags[flags.index("--batch_size") + 1] = batch_size
        flags[flags.index("--max_steps") + 1] = "2"
        return flags

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GroupRelativePolicy, "finish_rollouts", recording_finish_rollouts(root / "one_record"))
        run_in_process("grpo", argv(root / "one", "4"))
    _two_recording_processes(root, argv(root / "two", "2"))
    return root


def test_two_processes_scale_rewards_by_the_global_batchs_std_like_one_process(recorded_two_and_one):
    """--scale_rewards batch divides by the Bessel std of the step's global batch of scored rewards: torchrun, two
    processes of 2 prompts, against one process of 4 (recorded_two_and_one). Every completion's advantage, as the
    loss receives it, is the one-process run's (a process dividing by the std of its own half of the batch was up
    to 7% off, in every one)."""
    from tests.grpo_advantages import advantages_by_step

    root = recorded_two_and_one
    one, two = advantages_by_step(root / "one_record"), advantages_by_step(root / "two_record")
    assert len(one) == len(two) == 2 and all(len(step) == 16 for step in one)
    for ours, reference in zip(two, one):
        assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in reference]  # the same rollouts
        assert [advantage for _, advantage in ours] == pytest.approx([a for _, a in reference], rel=1e-6, abs=1e-7)
        assert any(abs(advantage) > 0.1 for _, advantage in reference)  # not all zero: a spread to scale
    assert train_losses(root / "two") == pytest.approx(train_losses(root / "one"), rel=1e-4, abs=1e-6)


def test_two_processes_of_other_token_counts_log_the_clip_fraction_and_kl_of_one_process(recorded_two_and_one):
    """--num_iterations 2 --beta 0.1 (the second update clips, the KL moves), loss grpo (its unit the completion):
    torchrun, two processes of 2 prompts against one process of 4 (recorded_two_and_one). The tiny chat model ends
    some completions early (<|im_end|> after 7 tokens, else the 12-token limit) and --seed 1 gives its two processes
    other token counts at both steps (asserted); the logged clip fraction and KL, the shares of the
    step's completion tokens, equal the one process's, as do the clip fraction's sides, the entropy and the
    completions' shortest, longest, cut share, ended mean, shortest and longest length and share of equal-reward
    groups. Each process's own share weighed by its completions (the loss's unit) failed this test."""
    from tests.grpo_advantages import completion_tokens_by_step

    root = recorded_two_and_one
    tokens = completion_tokens_by_step(root / "two_record")
    assert len(tokens) == 2 and all(first != second for first, second in tokens), tokens
    one, two = read_metrics(root / "one", "train"), read_metrics(root / "two", "train")
    assert len(one) == len(two) == 2
    for ours, reference in zip(two, one):
        assert reference["clip_fraction"] > 0 and reference["kl"] > 0
        # the completions end early or at the limit: their shortest, longest and cut share are not trivial
        assert 0 < reference["truncated_fraction"] < 1
        assert reference["completion_length_min"] < reference["completion_length_max"]
        for name in ("clip_fraction", "kl", "completion_length", "loss", "clip_fraction_low", "clip_fraction_high",
                     "entropy", "completion_length_min", "completion_length_max", "truncated_fraction",
                     "terminated_length", "terminated_length_min", "terminated_length_max", "zero_std_fraction"):
            assert ours[name] == pytest.approx(reference[name], rel=1e-4, abs=1e-6), name


def _two_recording_processes(tmp_path, flags: list[str]) -> None:
    """A GRPO run of `flags` as two torchrun processes (one thread each) through tests/grpo_advantages.py, which
    records each process's rollouts under tmp_path / "two_record"."""
    import os
    import subprocess

    from tests.paths import REPO
    from tests.training_runs import launcher

    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    script = str(REPO / "tests" / "grpo_advantages.py")
    run = subprocess.run([*launcher("torchrun"), script, str(tmp_path / "two_record"), *flags],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "x2, float32" in run.stdout


def test_max_seq_len_that_lets_a_prompt_fill_the_context_is_refused_before_training(grpo_data, tiny_models,
                                                                                    tokenizer, tmp_path, capsys):
    """--max_seq_len equal to the model's 128 positions kept a 128-token prompt, and the first rollout stopped the
    run with "the prompt has 128 tokens; it must have 1 to 127" (the engine's words, naming neither flag)."""
    out_dir = tmp_path / "refused"
    with pytest.raises(SystemExit) as stopped:
        main("grpo", _argv(grpo_data, tiny_models.pretrain, out_dir, "--max_seq_len", "128"))
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --max_seq_len=128 keeps prompts that fill the model's max_position_embeddings=128, leaving no room "
        "for a completion: a prompt of up to --max_seq_len tokens and its completion of up to "
        "--max_completion_length=12 must fit together")
    assert not out_dir.exists() or not any(out_dir.iterdir())
    # the boundary: 127 leaves one position, and a prompt of 127 tokens gets its one-token completion
    from dataset.chat_format import encode_chatml

    prompt = "word " * 108  # 127 tokens in the chat format with the assistant's header
    assert len(encode_chatml(tokenizer, [{"role": "user", "content": prompt}],
                             add_generation_prompt=True).input_ids) == 127
    data = tmp_path / "long"
    data.mkdir()
    (data / "prompts.jsonl").write_text(json.dumps({"prompt": prompt, "answer": "7"}) + "\n", encoding="utf-8")
    (data / "val.jsonl").write_text(json.dumps({"prompt": prompt, "answer": "7"}) + "\n", encoding="utf-8")
    (data / "letters.py").write_text((grpo_data / "letters.py").read_text())
    main("grpo", _argv(data, tiny_models.pretrain, tmp_path / "fits", "--max_seq_len", "127",
                       "--max_completion_length", "1", "--max_steps", "1",
                       "--batch_size", "1", "--save_interval", "1", "--val_data_path", str(data / "val.jsonl")))
    assert read_summary(tmp_path / "fits")["steps"] == 1


# --tools: the tiny model memorized to ask the calculator for 2 + 3, and its prompts (tests/training_runs.py)
@pytest.fixture(scope="module")
def tool_run_inputs(tmp_path_factory, tokenizer):
    from tests.training_runs import write_tool_run_inputs

    return write_tool_run_inputs(tmp_path_factory.mktemp("grpo_tools"), tokenizer)


def test_a_tools_run_logs_its_tool_stats_and_resumes_to_the_same_run(tool_run_inputs, tmp_path, capsys):
    """train_grpo.py --tools ... --reward tool_use (in this process: the script's command line and exit code 0 are
    the two-process tests' above) logs the calls per rollout, the failed calls and the reward's parts; resumed from
    its step-1 checkpoint it samples the same episodes (each turn's seed is the (step, sample, generation, round)
    digest) and ends with the same weights."""
    model, data = tool_run_inputs
    out_dir = tmp_path / "run"
    run_in_process("grpo", tool_run_argv(model, data, out_dir, 4))
    train = read_metrics(out_dir, "train")
    assert len(train) == 2
    for record in train:
        assert {"tool_calls", "tool_errors", "rewards/tool_use", "rewards/tool_call",
                "rewards/tool_fact"} <= set(record)
        assert record["rewards/tool_use"] == pytest.approx(0.5 * record["rewards/tool_call"]
                                                          + 0.5 * record["rewards/tool_fact"])
        assert record["reward"] == pytest.approx(record["rewards/tool_use"])  # its parts weigh 0
        assert 0 <= record["tool_errors"] <= record["tool_calls"] <= 2
    assert sum(record["tool_calls"] for record in train) > 0 and sum(r["rewards/tool_fact"] for r in train) > 0
    capsys.readouterr()
    resumed = tmp_path / "resumed"
    step_one = out_dir / "checkpoints" / "step_00000001"
    run_in_process("grpo", tool_run_argv(model, data, resumed, 4, "--resume", str(step_one)))
    out = capsys.readouterr()
    assert "resumed from" in out.out and "changed since the checkpoint" not in out.out + out.err
    ours, theirs = read_metrics(resumed, "train"), train[1:]
    for name in ("loss", "reward", "tool_calls", "tool_errors", "completion_length", "kl"):
        assert [r[name] for r in ours] == [r[name] for r in theirs], name
    mine, reference = load_file(resumed / "model.safetensors"), load_file(out_dir / "model.safetensors")
    assert all(torch.equal(mine[name], tensor) for name, tensor in reference.items())
