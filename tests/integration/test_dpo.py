"""DPO (trainer/train_dpo.py) on the training core: the loss (sigmoid and IPO), rewards and answer masks against an
fp64 computation written out here from the two models' log-probabilities; a tiny run drives the reward accuracy up
from its start at log 2 loss; --loss_type (TRL's other types and weighted sums of several), --loss_weights,
--label_smoothing, --discopop_tau, --ld_alpha and --f_divergence_type reach a run, whose first loss is each
formula's value where every log-ratio is 0; sft's, RPO's and WPO's first loss is the starting model's value computed
here; bco_pair's running mean of the rewards is saved with a checkpoint and carried across a resume, the same on two
processes as on one; RPO's NLL the step's token mean, the same accumulated and on two processes as in one batch; a
checkpoint from before the new flags resumes as before; MiniMind-format files (system turns, extra fields) load for
both LoRA and DPO; bad preference lines are one-line errors naming file and line; the embedded default pairs."""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from dataset.dpo_dataset import DPODataset
from tests.training_runs import finetune_argv, launch_two_processes, run_in_process, write_jsonl
from trainer.dpo import DirectPreference
from trainer.run_dir import read_metrics, recorded_config

BETA = 0.15
SYSTEM = {"role": "system", "content": "You are a careful assistant.", "lang": "en"}


def _minimind_pairs() -> list[dict]:
    """Preference lines as MiniMind's files hold them: a system turn, extra fields on messages and lines, a
    multi-turn prompt whose earlier assistant answer must not count, and a control-token string as text."""
    return [
        {"chosen": [SYSTEM, {"role": "user", "content": "What is water?"},
                    {"role": "assistant", "content": "Water is a compound of hydrogen and oxygen."}],
         "rejected": [SYSTEM, {"role": "user", "content": "What is water?"},
                      {"role": "assistant", "content": "water water water water", "reasoning_content": ""}],
         "source": "test", "score": [5, 1]},
        {"chosen": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello. How can I help?"},
                    {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
         "rejected": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello. How can I help?"},
                      {"role": "user", "content": "Name a colour."},
                      {"role": "assistant", "content": "The <|im_end|> sky is a place, not a colour."}]},
    ]


def _answer_log_prob(model, tokenizer, messages: list[dict]) -> tuple[float, list[int]]:
    """fp64 sum of log p(answer token) over the final answer's tokens (its content, then <|im_end|>), after the
    prompt as the tokenizer's own chat template renders it; and those answer tokens."""
    prompt = tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages[:-1]],
                                           tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(messages[-1]["content"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
    answer_ids = answer_ids + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    ids = torch.tensor([prompt_ids + answer_ids])
    with torch.no_grad():
        log_probs = torch.log_softmax(model.double()(input_ids=ids).logits[0].double(), dim=-1)
    model.float()
    positions = range(len(prompt_ids) - 1, len(prompt_ids) + len(answer_ids) - 1)
    return sum(log_probs[t, ids[0, t + 1]].item() for t in positions), answer_ids


def test_dpo_loss_rewards_and_masks_match_fp64_by_hand(tiny_models, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    pairs = _minimind_pairs()
    data = DPODataset(write_jsonl(tmp_path / "dpo.jsonl", pairs), tokenizer, max_seq_len=128,
                      cache_dir=tmp_path / "cache")
    batch = data.collate([data[i] for i in range(len(data))])
    reference = AutoModelForCausalLM.from_pretrained(tiny_models.sft).eval()
    policy = AutoModelForCausalLM.from_pretrained(tiny_models.sft).eval()
    generator = torch.Generator().manual_seed(0)  # the same policy whatever ran before in this process
    with torch.no_grad():  # the policy has moved away from the reference
        for parameter in policy.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    objective = DirectPreference(reference, BETA, nullcontext)
    loss, stat_sums = objective.loss(policy, batch, num_items=objective.count_items(batch))

    losses, chosen_rewards, rejected_rewards = [], [], []
    for row, pair in enumerate(pairs):
        rewards = []
        for side, offset in (("chosen", 0), ("rejected", len(pairs))):
            pi, answer_ids = _answer_log_prob(policy, tokenizer, pair[side])
            ref, _ = _answer_log_prob(reference, tokenizer, pair[side])
            rewards.append(BETA * (pi - ref))
            labels = batch["labels"][row + offset]
            assert labels[labels != -100].tolist() == answer_ids  # the mask: exactly the final answer's tokens
        margin = rewards[0] - rewards[1]
        losses.append(-math.log(1 / (1 + math.exp(-margin))))
        chosen_rewards.append(rewards[0])
        rejected_rewards.append(rewards[1])
    assert loss.item() == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    # One micro-batch of a step that holds three times these pairs: its share of the step's mean over pairs.
    share, _ = objective.loss(policy, batch, num_items=3 * objective.count_items(batch))
    assert share.item() == pytest.approx(sum(losses) / (3 * len(losses)), rel=1e-5)
    accuracy = sum(c > r for c, r in zip(chosen_rewards, rejected_rewards))
    expected = [accuracy, sum(chosen_rewards) - sum(rejected_rewards), sum(chosen_rewards), sum(rejected_rewards)]
    # The margin is a difference of rewards of ~|r|: the padded batch's fp32 forward differs from the unpadded one's
    # by ~1e-5 of them, which a margin near 0 cannot hide in a relative tolerance.
    scale = max(abs(value) for value in chosen_rewards + rejected_rewards)
    assert stat_sums.tolist() == pytest.approx(expected, rel=1e-4, abs=1e-4 * scale)
    # IPO on the same pairs: (the chosen answer's mean per-token log-ratio - the rejected's - 1 / (2 beta))^2, each
    # answer's tokens counted by hand; the logged rewards stay beta x the summed log-ratios.
    ipo = DirectPreference(reference, BETA, nullcontext, "ipo")
    ipo_loss, ipo_stats = ipo.loss(policy, batch, num_items=ipo.count_items(batch))
    squares = []
    for pair in pairs:
        means = []
        for side in ("chosen", "rejected"):
            pi, answer_ids = _answer_log_prob(policy, tokenizer, pair[side])
            ref, _ = _answer_log_prob(reference, tokenizer, pair[side])
            means.append((pi - ref) / len(answer_ids))
        squares.append((means[0] - means[1] - 1 / (2 * BETA)) ** 2)
    assert ipo_loss.item() == pytest.approx(sum(squares) / len(squares), rel=1e-5)
    assert ipo_stats.tolist() == pytest.approx(expected, rel=1e-4, abs=1e-6)

    # Validation on a shard padded with a target-free pair (rows: the chosen answers, then the rejected ones): the
    # means are over the real pairs only.
    n = len(pairs)
    padded = {key: torch.cat([value[:n], value[:1], value[n:], value[n:n + 1]]) for key, value in batch.items()}
    padded["labels"][n] = -100
    padded["labels"][2 * n + 1] = -100
    accelerator = SimpleNamespace(device=torch.device("cpu"), reduce=lambda tensor, reduction: tensor)
    result = objective.evaluate(policy, [padded], accelerator)
    assert result.pairs == n
    assert result.loss == pytest.approx(sum(losses) / n, rel=1e-5)
    assert result.reward_margin == pytest.approx((sum(chosen_rewards) - sum(rejected_rewards)) / n, rel=1e-4)


def test_dpo_run_drives_the_reward_accuracy_up(train_data, tiny_models, tmp_path):
    out_dir = tmp_path / "dpo"
    summary = run_in_process("dpo", finetune_argv("dpo", train_data, tiny_models.sft, out_dir, "--max_steps", "30",
                                                  "--batch_size", "8", "--learning_rate", "5e-4", "--eval_interval",
                                                  "15"))
    train = read_metrics(out_dir, "train")
    # The policy starts as the reference: every reward is 0, the loss log 2 and no pair is ranked right yet.
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert train[0]["reward_accuracy"] == 0 and train[0]["chosen_reward"] == pytest.approx(0, abs=1e-6)
    accuracy = [r["reward_accuracy"] for r in train]
    # (With the think block before every answer the pairs are ranked right from about step 6: the start is the
    # first 5 steps.)
    assert sum(accuracy[-10:]) / 10 > 0.8 and sum(accuracy[-10:]) / 10 > sum(accuracy[:5]) / 5 + 0.3
    assert sum(r["reward_margin"] for r in train[-10:]) > 0
    val = read_metrics(out_dir, "val")
    assert set(val[-1]) >= {"val_loss", "val_reward_accuracy", "val_reward_margin", "val_chosen_reward",
                            "val_rejected_reward"}
    assert val[-1]["val_reward_accuracy"] == 1 and val[-1]["val_loss"] < math.log(2)
    assert summary.final_val["reward_accuracy"] == val[-1]["val_reward_accuracy"]
    assert (out_dir / "model.safetensors").is_file()  # a whole model, for chat, evaluate and the server


@pytest.mark.parametrize("flags, first_loss", [(["--loss_type", "hinge"], 1.0),
                                               (["--loss_type", "ipo", "--beta", "0.5"], 1.0),
                                               (["--label_smoothing", "0.2"], math.log(2))])
def test_the_loss_flags_reach_the_run(flags, first_loss, train_data, tiny_models, tmp_path):
    """The first step's policy is the reference (every log-ratio 0): hinge's loss is max(0, 1 - 0) = 1, IPO's
    (0 - 1 / (2 x 0.5))^2 = 1, smoothed DPO's log 2 as the plain loss's; the run records the flags."""
    out_dir = tmp_path / "dpo"
    run_in_process("dpo", finetune_argv("dpo", train_data, tiny_models.sft, out_dir, "--max_steps", "1",
                                        "--batch_size", "4", *flags))
    assert read_metrics(out_dir, "train")[0]["loss"] == pytest.approx(first_loss, abs=1e-6)
    config = recorded_config(out_dir)
    assert {key: str(config[key]) for key in ("loss_type", "label_smoothing")} == {
        "loss_type": flags[1] if flags[0] == "--loss_type" else "sigmoid",
        "label_smoothing": flags[1] if flags[0] == "--label_smoothing" else "0.0"}


LOG2 = math.log(2)


@pytest.mark.parametrize("flags, recorded, first_loss", [
    # EXO: s(0) (log s(0) - log(1 - eps)) + s(0) (log s(0) - log eps) = -log 2 - log(eps (1 - eps)) / 2
    (["--loss_type", "exo_pair", "--label_smoothing", "0.001"], {"loss_type": "exo_pair", "label_smoothing": 0.001},
     -LOG2 - 0.5 * math.log(0.001 * 0.999)),
    # SPPO hard: (0 - 1 / (2 beta))^2 + (0 + 1 / (2 beta))^2 = 2 at beta 0.5
    (["--loss_type", "sppo_hard", "--beta", "0.5"], {"loss_type": "sppo_hard", "beta": 0.5}, 2.0),
    # DiscoPOP: w = s(0 / tau) = 1/2 whatever tau: -log s(0) / 2 + e^0 / 2
    (["--loss_type", "discopop", "--discopop_tau", "0.2"], {"loss_type": "discopop", "discopop_tau": 0.2},
     (LOG2 + 1) / 2),
    # 0.5 x NCA's -log s(0) - log s(0) / 2 - log s(0) / 2 = 2 log 2, + 2 x APO-zero's 1 - s(0) + s(0) = 1
    (["--loss_type", "nca_pair", "apo_zero", "--loss_weights", "0.5", "2"],
     {"loss_type": "nca_pair,apo_zero", "loss_weights": [0.5, 2.0]}, LOG2 + 2),
    # robust DPO: ((1 - eps) log 2 - eps log 2) / (1 - 2 eps) = log 2
    (["--loss_type", "robust", "--label_smoothing", "0.2"], {"loss_type": "robust", "label_smoothing": 0.2}, LOG2),
    # APO-down: s(0) + 1 - s(0) = 1
    (["--loss_type", "apo_down"], {"loss_type": "apo_down"}, 1.0),
    # AOT: the sorted margins are all 0, sigmoid's -log s(0), smoothed or not
    (["--loss_type", "aot"], {"loss_type": "aot"}, LOG2),
    (["--loss_type", "aot_unpaired", "--label_smoothing", "0.1"], {"loss_type": "aot_unpaired", "label_smoothing": 0.1},
     LOG2),
    # sigmoid_norm: -log s(beta x 0)
    (["--loss_type", "sigmoid_norm"], {"loss_type": "sigmoid_norm"}, LOG2),
    # LD-DPO reweighs both models' log-probabilities alike: the log-ratios stay 0
    (["--ld_alpha", "0.5"], {"ld_alpha": 0.5}, LOG2),
    # f-DPO: psi(0) - psi(0) = 0 whatever the divergence; hinge 1, IPO (0 - 1 / (2 x 0.5))^2 = 1
    (["--loss_type", "hinge", "--f_divergence_type", "js_divergence"], {"f_divergence_type": "js_divergence"}, 1.0),
    (["--loss_type", "ipo", "--beta", "0.5", "--f_divergence_type", "alpha_divergence", "--f_alpha_divergence_coef",
      "0.5"], {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.5}, 1.0),
])
def test_trls_other_loss_types_reach_the_run_at_their_formulas_start(flags, recorded, first_loss, train_data,
                                                                     tiny_models, tmp_path):
    """The first step's policy is the reference (every log-ratio 0): each type's loss is its formula's value there;
    train_config.yaml records the flags (a list of loss types as one comma-separated value)."""
    out_dir = tmp_path / "dpo"
    run_in_process("dpo", finetune_argv("dpo", train_data, tiny_models.sft, out_dir, "--max_steps", "1",
                                        "--batch_size", "4", *flags))
    assert read_metrics(out_dir, "train")[0]["loss"] == pytest.approx(first_loss, abs=1e-6)
    config = recorded_config(out_dir)
    assert {key: config[key] for key in recorded} == recorded


def _answer_sharpness(model, tokenizer, messages: list[dict]) -> float:
    """fp64 mean over the final answer's tokens of log p(token) - log sum_v p_v^2 (WPO's per-answer exponent)."""
    prompt = tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages[:-1]],
                                           tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(messages[-1]["content"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
    ids = torch.tensor([prompt_ids + answer_ids + [tokenizer.convert_tokens_to_ids("<|im_end|>")]])
    with torch.no_grad():
        log_probs = torch.log_softmax(model.double()(input_ids=ids).logits[0].double(), dim=-1)
    model.float()
    positions = range(len(prompt_ids) - 1, ids.shape[1] - 1)
    terms = [log_probs[t, ids[0, t + 1]].item() - torch.logsumexp(2 * log_probs[t], dim=-1).item() for t in positions]
    return sum(terms) / len(terms)


def test_sft_rpo_and_wpo_start_at_the_models_values(tiny_models, tokenizer, tmp_path):
    """On one pair repeated (so every step holds the same pairs): sft's first loss is the starting model's mean
    token NLL of the chosen answer, RPO's log 2 + alpha x it, each logging it as nll_loss; WPO's log 2 x min(1,
    exp(m_c + m_r)), m the answer's mean log p - log sum p^2; each computed here in fp64 from the model."""
    from transformers import AutoModelForCausalLM

    pair = {side: [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": answer}]
            for side, answer in (("chosen", "Blue."), ("rejected", "A sky."))}  # whole within --max_seq_len 64
    write_jsonl(tmp_path / "dpo.jsonl", [pair] * 8)
    model = AutoModelForCausalLM.from_pretrained(tiny_models.sft).eval()
    chosen, answer_ids = _answer_log_prob(model, tokenizer, pair["chosen"])
    nll = -chosen / len(answer_ids)
    weight = min(1.0, math.exp(_answer_sharpness(model, tokenizer, pair["chosen"])
                               + _answer_sharpness(model, tokenizer, pair["rejected"])))
    assert 0 < weight < 1
    for flags, first_loss, logged in ((["--loss_type", "sft"], nll, nll),
                                      (["--rpo_alpha", "0.5"], LOG2 + 0.5 * nll, nll),
                                      (["--use_weighting"], LOG2 * weight, None)):
        out_dir = tmp_path / flags[0].strip("-")
        run_in_process("dpo", finetune_argv("dpo", tmp_path, tiny_models.sft, out_dir, "--max_steps", "1",
                                            "--batch_size", "4", *flags))
        first = read_metrics(out_dir, "train")[0]
        assert first["loss"] == pytest.approx(first_loss, rel=1e-5)  # the run's log-probabilities are fp32
        assert first.get("nll_loss") == (None if logged is None else pytest.approx(logged, rel=1e-5))
    assert recorded_config(tmp_path / "rpo_alpha")["rpo_alpha"] == 0.5
    assert recorded_config(tmp_path / "use_weighting")["use_weighting"] is True


def _bco_argv(train_data, tiny_models, out_dir, *flags: str) -> list[str]:
    return finetune_argv("dpo", train_data, tiny_models.sft, out_dir, "--loss_type", "bco_pair", "--max_steps", "4",
                         "--batch_size", "4", "--learning_rate", "5e-3", "--save_interval", "1",
                         "--keep_checkpoints", "3", *flags)


def _bco_state(out_dir, step: int) -> dict:
    state = json.loads((out_dir / "checkpoints" / f"step_{step:08d}" / "trainer_state.json").read_text())
    return state["objective_state"]


def test_bco_pairs_running_mean_is_saved_and_carried_across_a_resume(train_data, tiny_models, tmp_path):
    """m after k steps of 4 pairs is the mean of their logged (chosen_reward + rejected_reward) / 2 (each step's
    mean reward); each checkpoint saves it; a run resumed from step 2 has the uninterrupted run's m at step 3 and
    its step 3 and 4 losses (a lost m would restart from 0 over no pairs)."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run_in_process("dpo", _bco_argv(train_data, tiny_models, whole))
    train = read_metrics(whole, "train")
    assert train[0]["loss"] == pytest.approx(2 * LOG2, abs=1e-6)  # m = 0, every log-ratio 0: 2 log 2
    step_means = [(r["chosen_reward"] + r["rejected_reward"]) / 2 for r in train]
    for step in (1, 2, 3):
        state = _bco_state(whole, step)
        assert state["bco_pairs"] == 4 * step
        assert state["bco_mean"] == pytest.approx(sum(step_means[:step]) / step, rel=1e-5, abs=1e-9)
    assert abs(_bco_state(whole, 3)["bco_mean"]) > 1e-3  # the rewards moved: m is not its start
    run_in_process("dpo", _bco_argv(train_data, tiny_models, resumed, "--resume",
                                    str(whole / "checkpoints" / "step_00000002")))
    assert _bco_state(resumed, 3) == pytest.approx(_bco_state(whole, 3), rel=1e-6)
    assert [r["loss"] for r in read_metrics(resumed, "train")] == pytest.approx([r["loss"] for r in train[2:]],
                                                                                rel=1e-6)


def test_bco_pairs_running_mean_is_the_same_on_two_processes(train_data, tiny_models, tmp_path):
    """torchrun with 2 processes of 2 pairs is one process of 4: the same m at every checkpoint (it is folded in
    from the step's global reward means)."""
    one, two = tmp_path / "one", tmp_path / "two"
    run_in_process("dpo", _bco_argv(train_data, tiny_models, one, "--max_steps", "3"))
    done = launch_two_processes("torchrun", "dpo", _bco_argv(train_data, tiny_models, two, "--max_steps", "3",
                                                             "--batch_size", "2"), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    for step in (1, 2):
        assert _bco_state(two, step) == pytest.approx(_bco_state(one, step), rel=1e-5, abs=1e-9)


def test_rpos_nll_is_the_steps_token_mean_on_any_split(train_data, tiny_models, tmp_path):
    """--rpo_alpha: 3 steps of 4 pairs (chosen answers of uneven lengths) as one micro-batch, as 2 accumulated
    micro-batches of 2, and as torchrun's 2 processes of 2 pairs log the same loss and nll_loss at every step (the
    NLL the token mean over the step's chosen tokens: a micro-batch's or a process's own token mean, averaged, gives
    other numbers) and end at the same weights."""
    from safetensors.torch import load_file

    def argv(out_dir, *flags: str) -> list[str]:
        return finetune_argv("dpo", train_data, tiny_models.sft, out_dir, "--rpo_alpha", "0.5", "--max_steps", "3",
                             "--learning_rate", "5e-3", *flags)

    whole, accumulated, two = tmp_path / "whole", tmp_path / "accumulated", tmp_path / "two"
    run_in_process("dpo", argv(whole))
    run_in_process("dpo", argv(accumulated, "--batch_size", "2", "--accumulation_steps", "2"))
    done = launch_two_processes("torchrun", "dpo", argv(two, "--batch_size", "2"), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = read_metrics(whole, "train")
    assert len(expected) == 3 and all(row["nll_loss"] > 0 for row in expected)
    weights = load_file(whole / "model.safetensors")
    for run in (accumulated, two):
        rows = read_metrics(run, "train")
        for name in ("loss", "nll_loss"):
            assert [row[name] for row in rows] == pytest.approx([row[name] for row in expected], rel=1e-5), (run, name)
        for key, value in load_file(run / "model.safetensors").items():
            torch.testing.assert_close(value, weights[key], rtol=1e-3, atol=1e-4)  # Adam: lr x a ratio of small numbers


def test_a_dpo_checkpoint_from_before_the_new_loss_flags_resumes_as_before(train_data, tiny_models, tmp_path,
                                                                         capsys):
    """A checkpoint whose config lacks --loss_weights, --discopop_tau and RPO's, LD-DPO's, WPO's and f-DPO's flags
    (written before they existed) and has no objective state resumes with the same command without a change noted,
    and continues as the uninterrupted run."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    argv = finetune_argv("dpo", train_data, tiny_models.sft, whole, "--max_steps", "3", "--save_interval", "2",
                         "--learning_rate", "5e-3")
    run_in_process("dpo", argv)
    checkpoint = whole / "checkpoints" / "step_00000002"
    state_file = checkpoint / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert "objective_state" not in state  # sigmoid keeps none
    for name in ("loss_weights", "discopop_tau", "rpo_alpha", "ld_alpha", "use_weighting", "f_divergence_type",
                 "f_alpha_divergence_coef"):
        del state["config"][name]
    state_file.write_text(json.dumps(state))
    capsys.readouterr()
    run_in_process("dpo", [*argv[:argv.index("--out_dir") + 1], str(resumed), *argv[argv.index("--out_dir") + 2:],
                           "--resume", str(checkpoint)])
    out = capsys.readouterr()
    assert "changed since the checkpoint" not in out.out + out.err
    assert [r["loss"] for r in read_metrics(resumed, "train")] == pytest.approx(
        [r["loss"] for r in read_metrics(whole, "train")][2:], rel=1e-6)


def test_minimind_files_with_system_turns_and_extra_fields_load_for_lora_and_dpo(tiny_models, tokenizer, tmp_path):
    sft = [{"conversations": pair["chosen"], "id": index} for index, pair in enumerate(_minimind_pairs())] * 4
    write_jsonl(tmp_path / "sft.jsonl", sft)
    write_jsonl(tmp_path / "dpo.jsonl", _minimind_pairs() * 4)
    for task, data in (("lora", "sft.jsonl"), ("dpo", "dpo.jsonl")):
        summary = run_in_process(task, finetune_argv(task, tmp_path, tiny_models.sft, tmp_path / task, "--max_steps",
                                                     "2", "--val_data_path", str(tmp_path / data)))
        assert summary.status == "finished" and summary.steps == 2


@pytest.mark.parametrize("line, reason", [
    ({"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
     'missing "rejected" field'),
    ({"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
      "rejected": [{"role": "user", "content": "Hey"}, {"role": "assistant", "content": "Go away"}]},
     '"chosen" and "rejected" must share their prompt (every message before the last answer); chosen[0] and '
     'rejected[0] differ'),
    ({"chosen": [{"role": "user", "content": "Hi"}], "rejected": [{"role": "user", "content": "Hi"}]},
     "chosen[0] must be the assistant's answer, got role 'user'"),
    ({"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": 3}],
      "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"}]},
     'chosen[1] has no "content" string'),
    ({"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
      "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
     '"chosen" and "rejected" have the same answer (chosen[1] and rejected[1]): the pair prefers nothing'),
    # both empty: the empty chosen is named first (it was "the same answer", or, with one side empty, trained)
    ({"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}],
      "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]},
     "chosen[1] is an empty assistant answer (no content, tool_calls or reasoning_content): the pair would teach the "
     "model to prefer answering nothing"),
    ({"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
      "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\t"}]},
     "rejected[1] is an empty assistant answer (no content, tool_calls or reasoning_content): the pair's margin would "
     "rest on one token, the closing <|im_end|>, which the loss can push down alone (the model learns not to stop at "
     "once, not the preference); give a rejected answer with text"),
])
def test_bad_preference_lines_name_file_and_line(line, reason, tokenizer, tmp_path):
    good = _minimind_pairs()[0]
    path = write_jsonl(tmp_path / "dpo.jsonl", [good, good, line])
    with pytest.raises(ValueError) as error:
        DPODataset(path, tokenizer, max_seq_len=64, cache_dir=tmp_path / "cache")
    assert str(error.value) == f"{path}:3: {reason}"


def test_embedded_default_pairs_prefer_the_true_answer(tmp_path):
    from dataset.post_training_data import (LORA_TOPIC, degenerate_answer, ensure_post_training_data,
                                            preference_pairs)
    from dataset.sources import WikiArticle
    from dataset.wiki_qa import conversations_for

    articles = [WikiArticle(f"Topic {i}", f"Topic {i} is thing number {i}. It is known for {i}.", "",
                            ("Arts", "History", LORA_TOPIC)[i % 3]) for i in range(12)]
    pairs = preference_pairs(articles)
    assert len(pairs) == len(articles)
    answers = {conversations_for(a)[0][1]["content"]: a for a in articles}
    kinds = set()
    for article, pair in pairs:
        assert pair["chosen"][:-1] == pair["rejected"][:-1] and pair["chosen"][0]["role"] == "user"
        true_answer = conversations_for(article)[0][1]["content"]
        assert pair["chosen"][-1]["content"] == true_answer
        rejected = pair["rejected"][-1]["content"]
        if rejected == degenerate_answer(true_answer):
            kinds.add("degenerate")
        else:
            assert answers[rejected].topic != article.topic  # another topic's true answer
            kinds.add("off-topic")
    assert kinds == {"degenerate", "off-topic"}
    paths = ensure_post_training_data(tmp_path)
    first = json.loads(paths.dpo_train.read_text(encoding="utf-8").splitlines()[0])
    assert set(first) == {"chosen", "rejected"}
    lora = [json.loads(line) for line in paths.lora_val.read_text(encoding="utf-8").splitlines()]
    assert lora and all(set(record) == {"conversations"} for record in lora)
