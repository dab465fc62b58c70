"""The PPO objective (trainer/ppo.py) against references written here in fp64, token by token: the loss and the
gradients of policy and critic on a hand-made rollout batch; a rollout's old log-probs and values, its rewards
with the KL (k1 or k3) folded in, whitened or not, the missing-eos penalty, GAE advantages (whitened) and returns,
over one micro-batch or two; and the critic a run starts with."""

from __future__ import annotations

import copy
import math
import statistics
from contextlib import nullcontext

import pytest
import torch

from dataset.prompt_dataset import PromptDataset
from model import MiniNormConfig, MiniNormForCausalLM
from tests.step_stats import logged_step_stats
from tests.threaded_processes import OneProcess
from trainer.grpo import completion_log_probs
from trainer.ppo import CriticModel, PolicyAndCritic, PPOSettings, ProximalPolicy, completion_values, load_critic
from trainer.rewards import Reward

VOCAB = 17
EPSILON, CLIP_VALUE, VF_COEF, BETA, GAMMA, LAM = 0.2, 0.2, 0.3, 0.1, 0.9, 0.8


def _model(vocab: int = VOCAB, seed: int = 0) -> MiniNormForCausalLM:
    torch.manual_seed(seed)
    config = MiniNormConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=64, norm_impl="eager")
    return MiniNormForCausalLM(config)


def _policy_and_critic(vocab: int = VOCAB) -> PolicyAndCritic:
    critic = CriticModel(_model(vocab, seed=1).model)
    with torch.no_grad():  # a critic that has learned something: values of order 1
        critic.value_head.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
        critic.value_head.bias.fill_(0.1)
    return PolicyAndCritic(_model(vocab), critic)


def _settings(group: int = 1, temperature: float = 1.0, **options) -> PPOSettings:
    # decode "static" (--compile off's, the step run eagerly): what a rollout makes of its completions is tested
    # here, not how they decode; compiling the step cost the first test 10-16 s (test_decode_step compares the two)
    return PPOSettings(num_generations=group, max_completion_length=6, temperature=temperature, top_p=1.0, beta=BETA,
                       epsilon=EPSILON, cliprange_value=CLIP_VALUE, vf_coef=VF_COEF, gamma=GAMMA, lam=LAM,
                       ppo_epochs=2, decode="static", **options)


class _Pad:
    pad_token_id = 0


def _hand_made_batch() -> dict:
    """Four completions, prompts of 3 and 5 tokens, completions of 2, 4, 1 and 3 tokens, with old log-probs and
    values away from the model's (so ratios and values clip), per-token advantages and returns."""
    generator = torch.Generator().manual_seed(1)
    starts, lengths = [3, 5, 3, 5], [2, 4, 1, 3]
    width = max(s + n for s, n in zip(starts, lengths))
    input_ids = torch.zeros(4, width, dtype=torch.long)
    attention_mask = torch.zeros(4, width, dtype=torch.long)
    for row, (start, length) in enumerate(zip(starts, lengths)):
        input_ids[row, :start + length] = torch.randint(1, VOCAB, (start + length,), generator=generator)
        attention_mask[row, :start + length] = 1
    mask = torch.tensor([[t < n for t in range(max(lengths))] for n in lengths])
    shape = (4, max(lengths))
    return {"input_ids": input_ids, "attention_mask": attention_mask, "starts": torch.tensor(starts),
            "completion_mask": mask, "old_logp": -torch.rand(shape, generator=generator) * 4,
            "old_values": (torch.rand(shape, generator=generator) * 2 - 1) * mask,
            "advantages": torch.randn(shape, generator=generator) * mask,
            "returns": torch.randn(shape, generator=generator) * mask,
            "rollout_stats": torch.tensor([0.5, 0.25, 0.01, 0.3, 2.5, 1.0, 4.0, 0.25, 2.0, 1.0, 3.0]),
            "reward_function_stats": torch.zeros(0)}


def test_completion_values_are_the_values_one_position_back():
    values = torch.arange(14, dtype=torch.float32).view(2, 7)
    assert completion_values(values, torch.tensor([2, 4]), 3).tolist() == [[1, 2, 3], [10, 11, 12]]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_the_objectives_loss_and_gradients_equal_an_fp64_reference(temperature):
    """The log-probs are those of the sampling distribution, softmax(logits / T) at --temperature T (as TRL's
    PPOTrainer divides the logits by the temperature in its rollout and training forwards)."""
    model, batch = _policy_and_critic(), _hand_made_batch()
    model64 = copy.deepcopy(model).double()
    objective = ProximalPolicy([], _Pad(), _settings(temperature=temperature), None, seed=0, process_index=0,
                               autocast=nullcontext)
    units = objective.count_items(batch)
    assert int(units) == 10  # completion tokens
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    loss, stats = objective.loss(model, batch, units)
    assert len(forwards) == 1  # the logged entropy comes from the loss's own forward
    logits = model64.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits / temperature
    values = model64.critic(batch["input_ids"], batch["attention_mask"])
    expected, clipped, value_clipped = 0.0, 0, 0
    for i in range(4):
        start = int(batch["starts"][i])
        for t in range(int(batch["completion_mask"][i].sum())):
            logp = torch.log_softmax(logits[i, start + t - 1], dim=-1)[batch["input_ids"][i, start + t]]
            ratio = torch.exp(logp - float(batch["old_logp"][i, t]))
            advantage = float(batch["advantages"][i, t])
            policy = -torch.minimum(ratio * advantage, ratio.clamp(1 - EPSILON, 1 + EPSILON) * advantage)
            clipped += bool((ratio > 1 + EPSILON and advantage > 0) or (ratio < 1 - EPSILON and advantage < 0))
            value, old = values[i, start + t - 1], float(batch["old_values"][i, t])
            target = float(batch["returns"][i, t])
            value_clipped += bool(abs(value - old) > CLIP_VALUE)
            moved = old + (value - old).clamp(-CLIP_VALUE, CLIP_VALUE)
            value_loss = 0.5 * torch.maximum((value - target) ** 2, (moved - target) ** 2)
            expected = expected + policy + VF_COEF * value_loss
    expected = expected / 10
    assert 0 < clipped < 10 and 0 < value_clipped < 10  # both clips act on some tokens, not all
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    loss.backward()
    expected.backward()
    for (name, ours), theirs in zip(model.named_parameters(), model64.parameters()):
        assert ours.grad is not None and ours.grad.abs().sum() > 0, name  # policy and critic both learn
        # fp32 against fp64: the critic's embedding gradients reach ~20, so the tolerance scales with the largest
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-4,
                                   atol=1e-6 * float(theirs.grad.abs().max()), msg=name)
    reward, reward_std, kl, clip_fraction, _, _, explained, length = (stats / units).tolist()[:8]
    assert (reward, reward_std, kl, explained, length) == pytest.approx((0.5, 0.25, 0.01, 0.3, 2.5))
    assert clip_fraction == pytest.approx(clipped / 10)
    # Another process's share of the step: the loss is this micro-batch's sum over the step's units.
    half, _ = objective.loss(model, batch, 2 * units)
    assert half.item() == pytest.approx(loss.item() / 2, rel=1e-6)


def _rows(batch: dict, rows: slice) -> dict:
    """The rows of a micro-batch of the step; what is the whole step's (its rollout statistics) stays whole."""
    whole = ("rollout_stats", "reward_function_stats")
    return {key: value if key in whole else value[rows] for key, value in batch.items()}


def test_the_logged_clip_fraction_and_losses_are_the_steps_token_means_whatever_the_micro_batches():
    """The step as two micro-batches of other token counts (completions 1-3: 7 tokens, completion 4: 3 tokens),
    summed and divided as the core does (its stat sums over every micro-batch of every process, over the step's
    completion tokens): the clip fraction is the share of the step's 10 tokens clipped, counted by hand -- old
    log-probs moved so that the first completion's first token has log-ratio +0.4 (advantage > 0), the second's two
    last tokens and all three of the fourth's -0.5 (advantages < 0): 6 of 10 clip; the third's token has +0.4 with
    an advantage < 0, which does not clip; every other ratio is 1 -- and the policy and value losses are the fp64
    token means over the 10 tokens, as are the share of the tokens whose clipped value loss was the larger, the
    policy's entropy, the approximate KL (log-ratio^2 / 2) and the ratio. Each micro-batch's own share weighed
    equally (TRL's per-micro-batch mean: (3/7 + 1) / 2 = 0.71) or by its completions ((3/7 x 3 + 1) / 4 = 0.57)
    would be off. Processes hold a step's micro-batches the same way (the core all-reduces the sums and the
    units), so this is their case too."""
    model, batch = _policy_and_critic(), _hand_made_batch()
    objective = ProximalPolicy([], _Pad(), _settings(), None, seed=0, process_index=0, autocast=nullcontext)
    model64 = copy.deepcopy(model).double()
    with torch.no_grad():  # the model's own log-probs and values, so the ratios are exp(the shifts) below
        logits = model64.policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        values = model64.critic(batch["input_ids"], batch["attention_mask"])
    mask = batch["completion_mask"]
    logp = completion_log_probs(logits, batch["input_ids"], batch["starts"], mask.shape[1]) * mask
    shifts = torch.tensor([[0.4, 0.0, 0.0, 0.0], [0.0, 0.0, -0.5, -0.5], [0.4, 0.0, 0.0, 0.0],
                           [-0.5, -0.5, -0.5, 0.0]], dtype=torch.float64)
    advantages = torch.tensor([[0.7, -0.2, 0.0, 0.0], [0.3, 0.5, -0.7, -0.1], [-1.3, 0.0, 0.0, 0.0],
                               [-0.4, -0.9, -0.2, 0.0]])
    assert torch.equal(shifts != 0, (shifts != 0) & mask) and torch.equal(advantages != 0, mask)
    batch.update(old_logp=(logp - shifts).float(), advantages=advantages,
                 old_values=((completion_values(values, batch["starts"], mask.shape[1]) + 0.3 * batch["returns"])
                             * mask).float())
    micro = [_rows(batch, slice(0, 3)), _rows(batch, slice(3, 4))]
    assert [int(part["completion_mask"].sum()) for part in micro] == [7, 3]
    stats = logged_step_stats(objective, model, micro)
    policy_terms, value_terms, values_clipped, clipped_taken, entropies = [], [], 0, [], []
    for i in range(4):  # fp64, token by token
        start = int(batch["starts"][i])
        for t in range(int(mask[i].sum())):
            ratio = math.exp(float(shifts[i, t]))
            advantage = float(advantages[i, t])
            policy_terms.append(-min(ratio * advantage, min(max(ratio, 1 - EPSILON), 1 + EPSILON) * advantage))
            value, old = float(values[i, start + t - 1]), float(batch["old_values"][i, t])
            target = float(batch["returns"][i, t])
            moved = old + min(max(value - old, -CLIP_VALUE), CLIP_VALUE)
            value_terms.append(0.5 * max((value - target) ** 2, (moved - target) ** 2))
            values_clipped += abs(value - old) > CLIP_VALUE
            clipped_taken.append((moved - target) ** 2 > (value - target) ** 2)  # TRL's vf_clipfrac rule
            p = torch.softmax(logits[i, start + t - 1], dim=-1)
            entropies.append(float(-(p * p.log()).sum()))
    assert len(policy_terms) == 10 and 0 < values_clipped < 10  # the value clip acts on some tokens
    assert stats["clip_fraction"] == pytest.approx(6 / 10, rel=1e-6)
    assert stats["policy_loss"] == pytest.approx(sum(policy_terms) / 10, rel=1e-5)
    assert stats["value_loss"] == pytest.approx(sum(value_terms) / 10, rel=1e-5)
    # TRL's val/clipfrac_avg, policy/entropy_avg, policy/approxkl_avg and val/ratio, as the step's token means: the
    # micro-batches' own means (7 and 3 tokens) weighed equally would be off for each (asserted for the KL)
    assert 0 < sum(clipped_taken) < 10
    assert stats["value_clip_fraction"] == pytest.approx(sum(clipped_taken) / 10, rel=1e-6)
    assert stats["entropy"] == pytest.approx(sum(entropies) / 10, rel=1e-5)
    log_ratios = [float(shifts[i, t]) for i in range(4) for t in range(int(mask[i].sum()))]
    assert stats["approx_kl"] == pytest.approx(sum(0.5 * x ** 2 for x in log_ratios) / 10, rel=1e-4)
    assert stats["approx_kl"] != pytest.approx((sum(0.5 * x ** 2 for x in log_ratios[:7]) / 7
                                                + sum(0.5 * x ** 2 for x in log_ratios[7:]) / 3) / 2, rel=1e-2)
    assert stats["ratio"] == pytest.approx(sum(math.exp(x) for x in log_ratios) / 10, rel=1e-5)
    # the rollout's statistics are the step's already (finish_rollouts, tested above): unchanged by the split
    assert [stats[name] for name in ("reward", "reward_std", "kl", "explained_variance", "completion_length")] == \
        pytest.approx([0.5, 0.25, 0.01, 0.3, 2.5], rel=1e-6)


def _prompts() -> dict:
    samples = [{"input_ids": torch.tensor([1, 2, 3]), "prompt": "one", "columns": {}},
               {"input_ids": torch.tensor([4, 5]), "prompt": "two", "columns": {}}]
    return PromptDataset.collate(samples)


@pytest.mark.parametrize(("temperature", "kl_estimator", "whiten_rewards"), [
    (1.0, "k1", False), (0.6, "k1", False), (1.0, "k3", False), (1.0, "k1", True), (0.6, "k3", True)])
def test_a_rollout_folds_the_kl_into_the_rewards_and_whitens_gae_advantages(tokenizer, temperature, kl_estimator,
                                                                           whiten_rewards):
    """The old and reference log-probs (and so the KL in the rewards) are those of the distributions at the
    sampling temperature, softmax(logits / T), as TRL's PPOTrainer computes them; the KL each token pays is TRL's
    kl_estimator, k1 = logp - ref or k3 = (r - 1) - log r with log r = ref - logp; with whiten_rewards (TRL's) the
    rewards are whitened with their mean kept -- (x - mean) / sqrt(var + 1e-8) + mean over all the completion tokens,
    Bessel's variance -- before GAE."""
    model, reference = _policy_and_critic(len(tokenizer)), _model(len(tokenizer), seed=4)
    scored = []

    def lengths(prompts, completions, **columns):
        scored.extend(float(len(c) % 5) for c in completions)
        return scored[-len(completions):]

    settings = _settings(2, temperature, kl_estimator=kl_estimator, whiten_rewards=whiten_rewards)
    objective = ProximalPolicy([Reward("lengths", lengths)], tokenizer, settings, reference, seed=7,
                               process_index=0, autocast=nullcontext)
    batch = objective.rollouts(model, [_prompts()], step=3, accelerator=OneProcess())[0]
    assert model.training  # back in training mode after the no-grad forwards
    model64, reference64 = copy.deepcopy(model).double().eval(), copy.deepcopy(reference).double()
    mask = batch["completion_mask"]
    def kl(p: float, r: float) -> float:
        return p - r if kl_estimator == "k1" else math.exp(r - p) - 1 - (r - p)

    all_rewards, all_values, kls = [], [], []
    for i in range(4):
        start, length = int(batch["starts"][i]), int(mask[i].sum())
        ids = batch["input_ids"][i:i + 1, :start + length]  # the row alone, without padding
        logits = model64.policy(input_ids=ids).logits[0] / temperature
        ref_logits = reference64(input_ids=ids).logits[0] / temperature
        values = model64.critic(ids)[0]
        logp = [torch.log_softmax(logits[start + t - 1], -1)[ids[0, start + t]].item() for t in range(length)]
        ref = [torch.log_softmax(ref_logits[start + t - 1], -1)[ids[0, start + t]].item() for t in range(length)]
        value = [values[start + t - 1].item() for t in range(length)]
        assert batch["old_logp"][i, :length].tolist() == pytest.approx(logp, rel=1e-4, abs=1e-5)
        assert batch["old_values"][i, :length].tolist() == pytest.approx(value, rel=1e-4, abs=1e-5)
        assert batch["old_values"][i, length:].abs().sum() == 0
        rewards = [-BETA * kl(p, r) for p, r in zip(logp, ref)]
        rewards[-1] += scored[i]  # the score at the last token
        all_rewards.append(rewards)
        all_values.append(value)
        kls.extend(kl(p, r) for p, r in zip(logp, ref))
    if whiten_rewards:
        flat = [r for row in all_rewards for r in row]
        mean = sum(flat) / len(flat)
        std = math.sqrt(sum((r - mean) ** 2 for r in flat) / (len(flat) - 1) + 1e-8)
        all_rewards = [[(r - mean) / std + mean for r in row] for row in all_rewards]
    rows = []
    for i, (rewards, value) in enumerate(zip(all_rewards, all_values)):
        length = len(rewards)
        assert batch["rewards"][i, :length].tolist() == pytest.approx(rewards, rel=1e-4, abs=1e-5)
        advantages = [0.0] * length
        for t in range(length):  # A_t = sum_l (gamma lam)^l delta_{t+l}, V = 0 after the last token
            for k in range(t, length):
                next_value = value[k + 1] if k + 1 < length else 0.0
                advantages[t] += (GAMMA * LAM) ** (k - t) * (rewards[k] + GAMMA * next_value - value[k])
        assert batch["returns"][i, :length].tolist() == pytest.approx(
            [a + v for a, v in zip(advantages, value)], rel=1e-4, abs=1e-5)
        rows.append(advantages)
    flat = [a for row in rows for a in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((a - mean) ** 2 for a in flat) / (len(flat) - 1) + 1e-8)
    for i, row in enumerate(rows):
        assert batch["advantages"][i, :len(row)].tolist() == pytest.approx([(a - mean) / std for a in row],
                                                                           rel=1e-3, abs=1e-4)
        assert batch["advantages"][i, len(row):].abs().sum() == 0
    reward, reward_std, kl, _, length = batch["rollout_stats"].tolist()[:5]
    score_mean = sum(scored) / 4
    assert reward == pytest.approx(score_mean)
    assert reward_std == pytest.approx(math.sqrt(sum((s - score_mean) ** 2 for s in scored) / 4))
    assert kl == pytest.approx(sum(kls) / len(kls), rel=1e-4, abs=1e-6)
    assert length == pytest.approx(float(mask.sum()) / 4)
    # The first update's policy is the one that sampled: its ratio is 1 (to float rounding), nothing clips.
    _, stats = objective.loss(model, batch, objective.count_items(batch))
    assert stats[3].item() == 0.0


def test_the_advantages_are_whitened_and_the_statistics_taken_over_the_whole_step(tokenizer, monkeypatch):
    """Two micro-batches (as two processes, or --accumulation_steps 2, sample them) of other token counts (a
    stand-in sampler: 1 to 6 tokens by each completion's seed; the random model runs every completion to the limit):
    the advantages are whitened with the mean and variance of all the step's completion tokens, and the logged
    reward, its std, the KL, the explained variance and the length are over all of them -- what one micro-batch of
    all four prompts gives. Each micro-batch's own GAE advantages, returns and values are `rollout`'s (no
    collective, checked above)."""
    import trainer.grpo as grpo

    def sample(model, tok, prompt_ids, settings, decode):
        return [[100 + (setting.seed + i) % 50 for i in range(1 + setting.seed % 6)] for setting in settings]

    monkeypatch.setattr(grpo, "sample_completions", sample)
    model, reference = _policy_and_critic(len(tokenizer)), _model(len(tokenizer), seed=4)

    def lengths(prompts, completions, **columns):
        return [float(len(c) % 5) for c in completions]

    objective = ProximalPolicy([Reward("lengths", lengths)], tokenizer, _settings(group=2), reference, seed=7,
                               process_index=0, autocast=nullcontext)
    other = PromptDataset.collate([{"input_ids": torch.tensor([6, 7, 8, 9]), "prompt": "three", "columns": {}},
                                   {"input_ids": torch.tensor([10]), "prompt": "four", "columns": {}}])
    raw = [objective.rollout(model, prompts, step=3, micro_batch=index)
           for index, prompts in enumerate([_prompts(), other])]
    batches = objective.rollouts(model, [_prompts(), other], step=3, accelerator=OneProcess())

    def tokens(name: str, source: list[dict]) -> list[float]:
        return [float(value) for batch in source for row, mask in zip(batch[name], batch["completion_mask"])
                for value, keep in zip(row, mask) if keep]

    assert int(raw[0]["completion_mask"].sum()) != int(raw[1]["completion_mask"].sum())  # the KL's weights differ
    advantages, returns = tokens("advantages", raw), tokens("returns", raw)
    residuals = [r - v for r, v in zip(returns, tokens("old_values", raw))]
    mean = statistics.fmean(advantages)
    scale = math.sqrt(statistics.variance(advantages) + 1e-8)  # Bessel's correction
    assert tokens("advantages", batches) == pytest.approx([(a - mean) / scale for a in advantages],
                                                          rel=1e-4, abs=1e-5)
    scores = [float(s) for batch in raw for s in batch["scores"]]
    expected = [statistics.fmean(scores), statistics.pstdev(scores), statistics.fmean(tokens("kl", raw)),
                1 - statistics.pvariance(residuals) / statistics.pvariance(returns), len(advantages) / 8]
    for batch in batches:
        assert batch["rollout_stats"].tolist()[:5] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    # one micro-batch alone is whitened with its own tokens' moments, which differ
    alone = objective.rollouts(model, [_prompts()], step=3, accelerator=OneProcess())[0]
    assert not torch.allclose(alone["advantages"], batches[0]["advantages"])


def test_the_critic_starts_from_the_starting_models_trunk_with_zero_values(tmp_path):
    start = _model(seed=5)
    start.save_pretrained(tmp_path)
    critic = load_critic(tmp_path)
    trunk = start.model.state_dict()
    assert all(torch.equal(tensor, trunk[name]) for name, tensor in critic.model.state_dict().items())
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    assert torch.equal(critic(ids), torch.zeros(2, 6))


def test_the_missing_eos_penalty_comes_off_the_scores_of_completions_the_length_limit_cut(tokenizer, monkeypatch):
    """TRL's missing_eos_penalty: a completion that did not end with its end-of-turn token (here cut at
    max_completion_length 6) has the penalty taken off its score before the score joins the rewards at its last
    token; the logged reward is the penalised mean, as TRL's scores; one that ended keeps its score."""
    import trainer.grpo as grpo

    eos = tokenizer.eos_token_id
    sampled = [[5, 6, eos], [7, 8, 9, 10, 11, 12], [13, eos], [14, 15, 16, 17, 18, 19]]
    monkeypatch.setattr(grpo, "sample_completions", lambda model, tok, prompt_ids, settings, decode: sampled)
    model, reference = _policy_and_critic(len(tokenizer)), _model(len(tokenizer), seed=4)

    def lengths(prompts, completions, **columns):
        return [float(len(c)) for c in completions]

    batches = {}
    for penalty in (0.0, 1.5):
        objective = ProximalPolicy([Reward("lengths", lengths)], tokenizer, _settings(2, missing_eos_penalty=penalty),
                                   reference, seed=7, process_index=0, autocast=nullcontext)
        batches[penalty] = objective.rollouts(model, [_prompts()], step=3, accelerator=OneProcess())[0]
    plain, penalised = batches[0.0], batches[1.5]
    assert plain["ended"].tolist() == [True, False, True, False]
    cut = torch.tensor([0.0, 1.5, 0.0, 1.5])
    assert penalised["scores"].tolist() == pytest.approx((plain["scores"] - cut).tolist())
    expected = plain["rewards"].clone()
    for i, length in enumerate(len(ids) for ids in sampled):
        expected[i, length - 1] -= cut[i]  # the score's token, the last
    torch.testing.assert_close(penalised["rewards"], expected)
    assert penalised["rollout_stats"][0].item() == pytest.approx(float((plain["scores"] - cut).mean()))


def test_the_completions_shortest_longest_and_cut_share_are_the_steps(tokenizer, monkeypatch):
    """Two micro-batches of 4 completions (15 and 13 tokens): the logged shortest completion (1 token, only in the
    second), longest (6, only in the first) and share of the step's 8 completions the length limit cut (1: TRL's
    completions/clipped_ratio; the first micro-batch's own share is 1/4, the second's 0) and the mean length of the 7
    that ended -- the step's, whatever the micro-batch's token weights."""
    import trainer.grpo as grpo

    eos = tokenizer.eos_token_id
    sampled = iter([[[5, eos], [7, 8, 9, 10, 11, 12], [13, 14, eos], [15, 16, 17, eos]],
                    [[eos], [20, 21, 22, eos], [23, 24, eos], [25, 26, 27, 28, eos]]])
    monkeypatch.setattr(grpo, "sample_completions", lambda model, tok, prompt_ids, settings, decode: next(sampled))
    model, reference = _policy_and_critic(len(tokenizer)), _model(len(tokenizer), seed=4)
    scored = []  # what the function returned: the completions' text lengths

    def lengths(prompts, completions, **columns):
        scored.extend(float(len(c)) for c in completions)
        return scored[-len(completions):]

    objective = ProximalPolicy([Reward("lengths", lengths)], tokenizer, _settings(2), reference, seed=7,
                               process_index=0, autocast=nullcontext)
    other = PromptDataset.collate([{"input_ids": torch.tensor([6, 7, 8, 9]), "prompt": "three", "columns": {}},
                                   {"input_ids": torch.tensor([10]), "prompt": "four", "columns": {}}])
    batches = objective.rollouts(model, [_prompts(), other], step=3, accelerator=OneProcess())
    assert [int(objective.count_items(batch)) for batch in batches] == [15, 13]
    stats = logged_step_stats(objective, model, batches)
    assert (stats["completion_length_min"], stats["completion_length_max"]) == pytest.approx((1.0, 6.0))
    assert stats["completion_length"] == pytest.approx(28 / 8)
    assert stats["truncated_fraction"] == pytest.approx(1 / 8)
    assert stats["terminated_length"] == pytest.approx((2 + 3 + 4 + 1 + 4 + 3 + 5) / 7)
    # the shortest and longest of the 7 that ended, both in the second micro-batch (the first's: 2 and 4)
    assert (stats["terminated_length_min"], stats["terminated_length_max"]) == pytest.approx((1.0, 5.0))
    # the function's mean and std (Bessel's, as GRPO's) over the step's 8 completions, in fp64 by hand
    assert len(scored) == 8 and len(set(scored)) > 1
    mean = sum(scored) / 8
    assert (stats["rewards/lengths"], stats["rewards/lengths_std"]) == pytest.approx(
        (mean, math.sqrt(sum((v - mean) ** 2 for v in scored) / 7)), rel=1e-6)


def test_the_completions_shortest_longest_and_cut_share_are_the_steps_over_processes(tokenizer, monkeypatch):
    """Two processes (threads whose all-reduce sums, ThreadedProcesses), groups of 2: the first's two micro-batches
    of one prompt sample 2 and 6 tokens (cut by the limit), 3 and 4; the second's micro-batch of two prompts 1, 4, 3
    and 5 (none at the limit: the first's length histogram holds the 6). Both log the step's shortest (1) and
    longest (6), cut share (1 of 8) and mean length of the 7 that ended (22/7), not their own (2, 6, 1/4, 3 and 1, 5,
    0, 13/4)."""
    import trainer.grpo as grpo
    from tests.threaded_processes import ThreadedProcesses

    eos = tokenizer.eos_token_id
    by_prompt = {(1, 2, 3): [[5, eos], [7, 8, 9, 10, 11, 12]], (4, 5): [[13, 14, eos], [15, 16, 17, eos]],
                 (6, 7, 8, 9): [[eos], [20, 21, 22, eos]], (10,): [[23, 24, eos], [25, 26, 27, 28, eos]]}
    monkeypatch.setattr(grpo, "sample_completions", lambda model, tok, prompt_ids, settings, decode: [
        by_prompt[tuple(ids)][index % 2] for index, ids in enumerate(prompt_ids)])
    model, reference = _policy_and_critic(len(tokenizer)), _model(len(tokenizer), seed=4)

    def prompts(*rows: list[int]) -> dict:
        return PromptDataset.collate([{"input_ids": torch.tensor(row), "prompt": f"p{row[0]}", "columns": {}}
                                      for row in rows])

    splits = [[prompts([1, 2, 3]), prompts([4, 5])], [prompts([6, 7, 8, 9], [10])]]

    scored = []  # what the function returned in both processes: the completions' text lengths

    def lengths(prompts, completions, **columns):
        values = [float(len(c)) for c in completions]
        scored.extend(values)
        return values

    def process(rank: int, accelerator) -> tuple[ProximalPolicy, list[dict]]:
        objective = ProximalPolicy([Reward("lengths", lengths)], tokenizer, _settings(2), reference, seed=7,
                                   process_index=rank, autocast=nullcontext, world=2)
        return objective, objective.rollouts(model, splits[rank], step=3, accelerator=accelerator)

    processes = ThreadedProcesses(2).run(process)
    assert [[batch["completion_mask"].sum(dim=1).tolist() for batch in batches] for _, batches in processes] == [
        [[2, 6], [3, 4]], [[1, 4, 3, 5]]]
    for objective, batches in processes:
        stats = logged_step_stats(objective, model, batches)
        assert [stats[name] for name in ("completion_length_min", "completion_length_max", "truncated_fraction",
                                         "terminated_length", "completion_length")] == pytest.approx(
            [1.0, 6.0, 1 / 8, 22 / 7, 28 / 8])
        # the 7 ended ones' shortest and longest: the second process's 1 and 5, not the first's own 2 and 4
        assert (stats["terminated_length_min"], stats["terminated_length_max"]) == pytest.approx((1.0, 5.0))
        assert len(scored) == 8 and len(set(scored)) > 1  # the function's std over both processes' completions
        mean = sum(scored) / 8
        assert stats["rewards/lengths_std"] == pytest.approx(
            math.sqrt(sum((v - mean) ** 2 for v in scored) / 7), rel=1e-6)


def test_a_completion_that_ends_at_an_eos_id_of_the_models_generation_config_is_not_penalised(tokenizer,
                                                                                                monkeypatch):
    """The engine stops at the tokenizer's eos and at those the policy's generation_config names
    (model.generation.default_eos_token_ids): a completion ending at the latter ended too and keeps its score (a
    mutant that took the tokenizer's eos alone survived)."""
    import trainer.grpo as grpo

    model, reference = _policy_and_critic(len(tokenizer)), _model(len(tokenizer), seed=4)
    other = 12
    assert other != tokenizer.eos_token_id
    model.policy.generation_config.eos_token_id = [other]
    sampled = [[5, 6, other], [7, 8, 9, 10, 11, 13], [13, tokenizer.eos_token_id], [14, 15, other]]
    monkeypatch.setattr(grpo, "sample_completions", lambda model, tok, prompt_ids, settings, decode: sampled)
    objective = ProximalPolicy([Reward("lengths", lambda prompts, completions, **columns: [1.0] * len(completions))],
                               tokenizer, _settings(2, missing_eos_penalty=0.5), reference, seed=7, process_index=0,
                               autocast=nullcontext)
    batch = objective.rollouts(model, [_prompts()], step=3, accelerator=OneProcess())[0]
    assert batch["ended"].tolist() == [True, False, True, True]
    assert batch["scores"].tolist() == [1.0, 0.5, 1.0, 1.0]


@pytest.mark.parametrize("whiten_rewards", [False, True])
def test_two_micro_batches_whiten_rewards_and_advantages_as_one(tokenizer, whiten_rewards):
    """The step's four prompts as one micro-batch or as two (gradient accumulation; processes share the step the
    same way): the same completions, and with --whiten_rewards the same whitened rewards, so the same GAE
    advantages, returns and whitened advantages -- the moments are the step's, not a micro-batch's."""
    model, reference = _policy_and_critic(len(tokenizer)), _model(len(tokenizer), seed=4)

    def lengths(prompts, completions, **columns):
        return [float(len(c) % 5) for c in completions]

    objective = ProximalPolicy([Reward("lengths", lengths)], tokenizer, _settings(2, whiten_rewards=whiten_rewards),
                               reference, seed=7, process_index=0, autocast=nullcontext)
    samples = [{"input_ids": torch.tensor(ids), "prompt": name, "columns": {}}
               for ids, name in (([1, 2, 3], "one"), ([4, 5], "two"), ([6, 7, 8, 9], "three"), ([10], "four"))]
    whole = objective.rollouts(model, [PromptDataset.collate(samples)], step=3, accelerator=OneProcess())
    split = objective.rollouts(model, [PromptDataset.collate(samples[:2]), PromptDataset.collate(samples[2:])],
                               step=3, accelerator=OneProcess())

    def tokens(name: str, source: list[dict]) -> list[float]:
        return [float(value) for batch in source for row, mask in zip(batch[name], batch["completion_mask"])
                for value, keep in zip(row, mask) if keep]

    assert [int(n) for b in split for n in b["completion_mask"].sum(1)] == \
        [int(n) for n in whole[0]["completion_mask"].sum(1)]
    for name in ("rewards", "advantages", "returns"):
        assert tokens(name, split) == pytest.approx(tokens(name, whole), rel=1e-4, abs=1e-5), name
    if whiten_rewards:  # the rewards' spread is 1 over the step's tokens (their mean kept)
        assert statistics.stdev(tokens("rewards", whole)) == pytest.approx(1.0, rel=1e-4)


def _far_from_0_rewards(tokenizer, monkeypatch, seed: int) -> tuple:
    """The far-from-0 reward tests' set-up: sampling fixed to one token then the end of turn, a policy with its
    critic and a reference, a reward model's scores (1e8 plus a spread of about 0.01, two per prompt p0 .. p3), the
    reward function that gives them, and a collate of prompts `first` .. `first + count - 1`."""
    import random

    import trainer.grpo as grpo

    eos = tokenizer.eos_token_id
    monkeypatch.setattr(grpo, "sample_completions", lambda model, tok, prompt_ids, settings, decode: [
        [5 + index, eos] for index in range(len(prompt_ids))])
    model, reference = _policy_and_critic(len(tokenizer)), _model(len(tokenizer), seed=4)
    noise = random.Random(seed)
    given = {f"p{j}": [1e8 + noise.gauss(0.0, 0.01) for _ in range(2)] for j in range(4)}

    def reward(prompts, completions, **columns):
        return [given[prompt][index % 2] for index, prompt in enumerate(prompts)]

    def prompts(first: int, count: int) -> dict:
        return PromptDataset.collate([{"input_ids": torch.tensor([1 + j, 2]), "prompt": f"p{j}", "columns": {}}
                                      for j in range(first, first + count)])

    return model, reference, given, reward, prompts


def test_the_functions_std_of_rewards_far_from_0_is_exact_over_micro_batches_and_processes(tokenizer, monkeypatch):
    """A reward model's scores, 1e8 plus a spread of about 0.01, two processes (threads whose all-reduce sums), the
    first of two micro-batches of one prompt, the second of one of two, groups of 2: the function's logged std is
    statistics.stdev's (exact rational arithmetic) over the step's 8 values, to 1e-6 (from the sums of the values and
    of their squares, about 1e17 each in fp64, nothing of the spread is left)."""
    from tests.threaded_processes import ThreadedProcesses

    model, reference, given, reward, prompts = _far_from_0_rewards(tokenizer, monkeypatch, seed=5)

    def offset(prompts, completions, **columns):  # three times the spread about 0, weight 0: a std of its own
        return [3 * (given[prompt][index % 2] - 1e8) for index, prompt in enumerate(prompts)]

    splits = [[prompts(0, 1), prompts(1, 1)], [prompts(2, 2)]]

    def process(rank: int, accelerator) -> tuple[ProximalPolicy, list[dict]]:
        objective = ProximalPolicy([Reward("far", reward), Reward("near", offset, 0.0)], tokenizer, _settings(2),
                                   reference, seed=7, process_index=rank, autocast=nullcontext, world=2)
        return objective, objective.rollouts(model, splits[rank], step=3, accelerator=accelerator)

    expected = statistics.stdev([v for values in given.values() for v in values])
    assert 0.005 < expected < 0.02
    for objective, batches in ThreadedProcesses(2).run(process):
        stats = logged_step_stats(objective, model, batches)
        assert stats["rewards/reward_std"] == pytest.approx(expected, rel=1e-6)
        assert stats["rewards/offset_std"] == pytest.approx(3 * expected, rel=1e-6)


def test_a_reward_models_scores_far_from_0_keep_their_spread_in_the_logged_reward_std(tokenizer, monkeypatch):
    """Scores of 1e8 plus a spread of about 0.01 over two micro-batches: the logged reward std (without Bessel's
    correction) is statistics.pstdev's over the step's 8 scores, to 1e-5 (in fp32, 1e8's neighbours are 8 apart:
    every spread rounds away)."""
    model, reference, given, reward, prompts = _far_from_0_rewards(tokenizer, monkeypatch, seed=7)
    objective = ProximalPolicy([Reward("far", reward)], tokenizer, _settings(2), reference, seed=7, process_index=0,
                               autocast=nullcontext)
    batches = objective.rollouts(model, [prompts(0, 2), prompts(2, 2)], step=3, accelerator=OneProcess())
    stats = logged_step_stats(objective, model, batches)
    assert stats["reward_std"] == pytest.approx(
        statistics.pstdev([v for values in given.values() for v in values]), rel=1e-5)
