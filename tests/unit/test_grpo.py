"""The GRPO objective (trainer/grpo.py) against references written here in fp64: the completions' log-probs, the
loss and gradient it computes on a hand-made rollout batch for each --loss_type (per-token and per-sequence
ratios), and its rollouts: groups of completions scored by the rewards with every column aligned, advantages
normalised within each group, the same samples for the same optimizer step, and a reward's breach as one line."""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
from contextlib import nullcontext

import pytest
import torch

from dataset.chat_format import encode_chatml
from dataset.prompt_dataset import PromptDataset, prompt_messages
from model import MiniNormConfig, MiniNormForCausalLM
from tests.step_stats import logged_step_stats
from tests.threaded_processes import OneProcess
from trainer.grpo import (GroupRelativePolicy, RolloutSettings, completion_log_probs, completion_log_probs_and_entropy,
                          first_sample)
from trainer.rewards import Reward, RewardError, math_answer

VOCAB = 17


def _model(vocab: int = VOCAB, seed: int = 0) -> MiniNormForCausalLM:
    torch.manual_seed(seed)
    config = MiniNormConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=64, norm_impl="eager")
    return MiniNormForCausalLM(config)


def _settings(loss_type: str = "grpo", beta: float = 0.0, group: int = 2, iterations: int = 1,
              level: str = "token") -> RolloutSettings:
    # decode "static": the rollouts' sampling eagerly, as --compile off has it. The default ("compiled") paid a cold
    # compile of the decode step (7 s alone, 15 under a busy suite) for the same tokens: that the compiled step
    # equals the static one is tests/unit/test_decode_step.py's, and a run's rollouts under --compile auto
    # decoding compiled is tests/integration/test_grpo_runs.py's.
    return RolloutSettings(loss_type, group, max_completion_length=6, temperature=1.0, top_p=1.0, beta=beta,
                           epsilon_low=0.2, epsilon_high=0.28, num_iterations=iterations,
                           importance_sampling_level=level, decode="static")


class _Pad:
    pad_token_id = 0


def _hand_made_batch() -> dict:
    """Four completions (two prompts of two), prompts of 3 and 5 tokens, completions of 2, 4, 1 and 3 tokens."""
    generator = torch.Generator().manual_seed(1)
    starts, lengths = [3, 5, 3, 5], [2, 4, 1, 3]
    width = max(s + n for s, n in zip(starts, lengths))
    input_ids = torch.zeros(4, width, dtype=torch.long)
    attention_mask = torch.zeros(4, width, dtype=torch.long)
    for row, (start, length) in enumerate(zip(starts, lengths)):
        input_ids[row, :start + length] = torch.randint(1, VOCAB, (start + length,), generator=generator)
        attention_mask[row, :start + length] = 1
    mask = torch.tensor([[t < n for t in range(max(lengths))] for n in lengths])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "starts": torch.tensor(starts),
            "completion_mask": mask, "advantages": torch.tensor([0.7, -0.7, 1.3, -0.4]),
            "ref_logp": -torch.rand(4, max(lengths), generator=generator) * 3,
            "rollout_stats": torch.tensor([0.5, 0.25, 2.5, 1.0, 4.0, 0.25, 2.0, 1.0, 3.0, 0.5]), "step_completions": 4,
            "step_completion_tokens": 10}


def _reference_loss(model64: MiniNormForCausalLM, batch: dict, loss_type: str, beta: float,
                    settings: RolloutSettings, old: list[list[float]] | None = None) -> torch.Tensor:
    rows = _reference_terms(model64, batch, loss_type, beta, settings, old)
    if loss_type == "grpo":
        return sum(sum(terms) / len(terms) for terms in rows) / 4
    if loss_type == "dr_grpo":
        return sum(sum(terms) for terms in rows) / (4 * settings.max_completion_length)
    return sum(sum(terms) for terms in rows) / sum(len(terms) for terms in rows)


def _reference_terms(model64: MiniNormForCausalLM, batch: dict, loss_type: str, beta: float,
                     settings: RolloutSettings, old: list[list[float]] | None = None) -> list[list[torch.Tensor]]:
    """The loss in fp64, token by token: log p from log_softmax of the logits one position back, divided by the
    sampling temperature (the distribution the completions were drawn from, as TRL's GRPOTrainer); ratio
    exp(logp - sg(logp)) = 1 with the policy's gradient (or exp(logp - old) against given old log-probs); per
    token -min(r A, clip(r) A) (grpo, dr_grpo) or -sg(clip(r)) A logp (cispo), plus beta (exp(ref - logp) -
    (ref - logp) - 1); then each loss's mean. With --importance_sampling_level sequence (GSPO) every token's ratio is
    its completion's exp(mean over its tokens of (logp - old))."""
    logits = model64(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits / settings.temperature
    rows = []
    for i in range(4):
        start, length = int(batch["starts"][i]), int(batch["completion_mask"][i].sum())
        terms = []
        logps = [torch.log_softmax(logits[i, start + t - 1], dim=-1)[batch["input_ids"][i, start + t]]
                 for t in range(length)]
        olds = [logp.detach() if old is None else old[i][t] for t, logp in enumerate(logps)]
        sequence_ratio = torch.exp(sum(logp - o for logp, o in zip(logps, olds)) / length)
        for t in range(length):
            logp = logps[t]
            ratio = sequence_ratio if settings.importance_sampling_level == "sequence" else torch.exp(logp - olds[t])
            advantage = float(batch["advantages"][i])
            clipped = ratio.clamp(1 - settings.epsilon_low, 1 + settings.epsilon_high)
            if loss_type == "cispo":
                term = -clipped.detach() * advantage * logp
            else:
                term = -torch.minimum(ratio * advantage, clipped * advantage)
            ref = float(batch["ref_logp"][i, t])
            terms.append(term + beta * (torch.exp(ref - logp) - (ref - logp) - 1))
        rows.append(terms)
    return rows


def _rows(batch: dict, rows: slice) -> dict:
    """The rows of a micro-batch of the step; what is the whole step's stays whole."""
    whole = ("rollout_stats", "step_completions", "step_completion_tokens")
    return {key: value[rows] if key not in whole else value
            for key, value in batch.items()}


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "bnpo", "dapo", "cispo"])
def test_an_accumulated_steps_gradient_equals_the_hand_normalized_full_batch(loss_type):
    """The hand-made batch as two micro-batches (completions 1-2: 6 tokens, 3-4: 4 tokens), each micro-batch's loss
    over the step's units, summed (gradient accumulation; processes add theirs the same way): the gradient is the
    full batch's with each loss type's normalization written out by hand, TRL's -- grpo: the mean over completions
    of their token means; dr_grpo: the token sum / (4 x max_completion_length); dapo and cispo: the token sum / the
    step's 10 tokens; bnpo: the mean over the two micro-batches of each one's token mean (sum / 6 and sum / 4)."""
    beta = 0.1
    model, batch = _model(), _hand_made_batch()
    model64 = copy.deepcopy(model).double()
    settings = _settings(loss_type, beta)
    objective = GroupRelativePolicy([], _Pad(), settings, None, seed=0, process_index=0, autocast=nullcontext)
    micro = [_rows(batch, slice(0, 2)), _rows(batch, slice(2, 4))]
    units = sum(objective.count_items(part) for part in micro)
    sum(objective.loss(model, part, units)[0] for part in micro).backward()
    rows = [sum(terms) for terms in _reference_terms(model64, batch, loss_type, beta, settings)]
    lengths = [2, 4, 1, 3]
    expected = {"grpo": sum(row / n for row, n in zip(rows, lengths)) / 4,
                "dr_grpo": sum(rows) / (4 * settings.max_completion_length),
                "dapo": sum(rows) / 10, "cispo": sum(rows) / 10,
                "bnpo": ((rows[0] + rows[1]) / 6 + (rows[2] + rows[3]) / 4) / 2}[loss_type]
    expected.backward()
    for (name, ours), theirs in zip(model.named_parameters(), model64.parameters()):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_first_sample_is_where_accelerate_puts_each_micro_batch(world):
    """A completion's sampling seed names its prompt's index in the step's global batch, so it must be the index of
    the prompt Accelerate's sharding actually hands that micro-batch (BatchSamplerShard: batch i of the order goes to
    process i mod world), or two processes would not sample what one process samples on the same global batch."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    batch_size, micro_batches = 3, 4
    order = BatchSampler(range(batch_size * micro_batches * world), batch_size, drop_last=False)
    for process in range(world):
        shard = list(BatchSamplerShard(order, num_processes=world, process_index=process))
        assert len(shard) == micro_batches
        for micro_batch, prompts in enumerate(shard):
            assert first_sample(micro_batch, process, world, batch_size) == prompts[0]


def test_completion_log_probs_are_the_tokens_log_probs_one_position_back():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, VOCAB, dtype=torch.float64, generator=generator)
    input_ids = torch.randint(0, VOCAB, (2, 7), generator=generator)
    got = completion_log_probs(logits, input_ids, torch.tensor([2, 4]), 3)
    for i, start in enumerate((2, 4)):
        for t in range(3):
            position = min(start + t, 6)
            row = logits[i, position - 1].tolist()
            expected = row[input_ids[i, position]] - math.log(sum(math.exp(x) for x in row))
            assert got[i, t].item() == pytest.approx(expected, rel=1e-12)


def test_the_entropy_is_each_positions_sampling_distributions_from_the_same_log_softmax():
    """The entropy -sum_v p_v log p_v in nats of softmax(logits / T) at each completion position (one position
    back, as the log-probs), written out in fp64 here; the log-probs beside it are completion_log_probs's exactly,
    and the entropy carries no graph (it is logged, not trained)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, VOCAB, generator=generator, requires_grad=True)
    input_ids = torch.randint(0, VOCAB, (2, 7), generator=generator)
    starts = torch.tensor([2, 4])
    logp, entropy = completion_log_probs_and_entropy(logits, input_ids, starts, 3, temperature=0.7)
    assert torch.equal(logp, completion_log_probs(logits, input_ids, starts, 3, temperature=0.7))
    assert logp.requires_grad and not entropy.requires_grad
    for i, start in enumerate((2, 4)):
        for t in range(3):
            row = [x / 0.7 for x in logits[i, min(start + t, 6) - 1].double().tolist()]
            total = sum(math.exp(x) for x in row)
            expected = -sum(math.exp(x) / total * (x - math.log(total)) for x in row)
            assert entropy[i, t].item() == pytest.approx(expected, rel=1e-5)
    assert completion_log_probs_and_entropy(logits, input_ids, starts, 3, entropy=False)[1] is None
    # a token of probability 0 (logit -inf) adds 0, not 0 x -inf = NaN: two equal logits left, entropy log 2
    certain = torch.tensor([[[0.0, 0.0, float("-inf")]] * 2])
    assert completion_log_probs_and_entropy(certain, torch.zeros(1, 2, dtype=torch.long), torch.tensor([1]),
                                            1)[1].item() == pytest.approx(math.log(2))


def test_the_entropy_holds_no_tensor_of_the_batch_by_the_vocabulary():
    """With the entropy, the log-probs' graph keeps the same tensors as without (nothing more for the backward), and
    no operation makes a tensor larger than one completion's (length, V) besides those the log-probs make anyway:
    4 completions of 32 positions over a vocabulary of 6400, where a (4, 32, 6400) temporary is 4 times that."""
    from torch.autograd.graph import saved_tensors_hooks
    from torch.profiler import ProfilerActivity, profile

    completions, length, vocab = 4, 32, 6400
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(completions, 40, vocab, generator=generator, requires_grad=True)
    input_ids = torch.randint(0, vocab, (completions, 40), generator=generator)
    starts = torch.tensor([8, 5, 3, 8])
    kept, made = {}, {}
    for entropy in (False, True):
        kept[entropy] = []
        with saved_tensors_hooks(lambda tensor, into=kept[entropy]: into.append(tuple(tensor.shape)) or tensor,
                                 lambda tensor: tensor), profile(activities=[ProfilerActivity.CPU],
                                                                 profile_memory=True) as profiler:
            completion_log_probs_and_entropy(logits, input_ids, starts, length, 0.7, entropy=entropy)
        made[entropy] = sorted((event.name, event.cpu_memory_usage) for event in profiler.events()
                               if event.cpu_memory_usage > length * vocab * 4)
    assert kept[True] == kept[False] and (completions, length, vocab) in kept[False]
    assert made[True] == made[False] and ("aten::log_softmax", completions * length * vocab * 4) in made[False]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "bnpo", "dapo", "cispo"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_the_objectives_loss_and_gradient_equal_an_fp64_reference(loss_type, beta):
    model, batch = _model(), _hand_made_batch()
    model64 = copy.deepcopy(model).double()
    settings = _settings(loss_type, beta)
    objective = GroupRelativePolicy([], _Pad(), settings, None, seed=0, process_index=0, autocast=nullcontext)
    units = objective.count_items(batch)
    assert int(units) == {"cispo": 10, "dapo": 10, "bnpo": 1}.get(loss_type, 4)  # tokens, micro-batches, completions
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    loss, stats = objective.loss(model, batch, units)
    assert len(forwards) == 1  # the logged entropy comes from the loss's own forward
    expected = _reference_loss(model64, batch, loss_type, beta, settings)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    loss.backward()
    expected.backward()
    for (name, ours), theirs in zip(model.named_parameters(), model64.parameters()):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-4, atol=1e-7, msg=name)
    reward, reward_std, kl, clip_fraction, length = (stats / units).tolist()[:5]
    assert (reward, reward_std, clip_fraction, length) == pytest.approx((0.5, 0.25, 0.0, 2.5))
    assert kl > 0  # the k3 KL to the hand-made reference, logged even with beta 0
    # Another process's share of the step: the loss is this micro-batch's sum over the step's units.
    half, _ = objective.loss(model, batch, 2 * units)
    assert half.item() == pytest.approx(loss.item() / 2, rel=1e-6)


def test_log_probs_are_the_sampling_distributions_at_the_rollout_temperature():
    """The completions are drawn from softmax(logits / T) at --temperature T, so the policy's log-probs (the loss,
    the ratio, the KL) and the reference's are those of the distributions at T, as TRL's GRPOTrainer and
    PPOTrainer divide the logits by the sampling temperature: the k3 KL is an unbiased estimate only for tokens
    sampled from its first distribution, and the policy gradient is that of the distribution that sampled."""
    model, batch, reference = _model(), _hand_made_batch(), _model(seed=3)
    model64, reference64 = copy.deepcopy(model).double(), copy.deepcopy(reference).double()
    settings = dataclasses.replace(_settings("grpo", beta=0.1), temperature=0.6)
    objective = GroupRelativePolicy([], _Pad(), settings, reference, seed=0, process_index=0, autocast=nullcontext)
    ref_logp = objective.reference_log_probs(batch)
    ref_logits = reference64(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits / 0.6
    for i in range(4):
        start = int(batch["starts"][i])
        for t in range(int(batch["completion_mask"][i].sum())):
            expected = torch.log_softmax(ref_logits[i, start + t - 1], -1)[batch["input_ids"][i, start + t]]
            assert ref_logp[i, t].item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    batch["ref_logp"] = ref_logp
    loss, _ = objective.loss(model, batch, objective.count_items(batch))
    expected = _reference_loss(model64, batch, "grpo", 0.1, settings)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    loss.backward()
    expected.backward()
    for (name, ours), theirs in zip(model.named_parameters(), model64.parameters()):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-4, atol=1e-7, msg=name)


@pytest.fixture
def policy(tokenizer):
    return _model(vocab=len(tokenizer), seed=3)


def _prompts(tokenizer) -> dict:
    samples = [{"input_ids": torch.tensor([1, 2, 3]), "prompt": "one", "columns": {"answer": "1"}},
               {"input_ids": torch.tensor([4, 5]), "prompt": "two", "columns": {"answer": "2"}}]
    return PromptDataset.collate(samples)


def test_rollouts_score_groups_and_normalise_advantages_within_each(tokenizer, policy):
    seen = {}

    def reward(prompts, completions, answer, **columns):
        seen.update(prompts=prompts, answer=answer, completions=completions)
        return [float(len(c) % 5) for c in completions]

    settings = _settings(group=3)
    objective = GroupRelativePolicy([Reward("lengths", reward)], tokenizer, settings, None, seed=7, process_index=0,
                                    autocast=nullcontext)
    batch = objective.rollouts(policy, [_prompts(tokenizer)], step=5, accelerator=OneProcess())[0]
    assert seen["prompts"] == ["one"] * 3 + ["two"] * 3 and seen["answer"] == ["1"] * 3 + ["2"] * 3
    rewards = [float(len(c) % 5) for c in seen["completions"]]
    assert len(set(rewards[:3])) > 1 and len(set(rewards[3:])) > 1  # two groups of unequal rewards
    for first in (0, 3):  # fp64 by hand: (r - mean) / (sample std + 1e-4)
        group = rewards[first:first + 3]
        mean = sum(group) / 3
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / 2)
        expected = [(r - mean) / (std + 1e-4) for r in group]
        assert batch["advantages"][first:first + 3].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert objective.stat_names[-2:] == ("rewards/reward", "rewards/reward_std")
    assert batch["reward_function_stats"].tolist() == pytest.approx([sum(rewards) / 6, statistics.stdev(rewards)])
    assert batch["rollout_stats"].tolist()[:3] == pytest.approx(
        [sum(rewards) / 6, statistics.stdev(rewards), float(batch["completion_mask"].sum()) / 6], rel=1e-6)
    assert batch["input_ids"][:3, :3].tolist() == [[1, 2, 3]] * 3 and batch["starts"].tolist() == [3] * 3 + [2] * 3
    assert batch["completion_mask"].sum(dim=1).tolist() == [len(t) for t in _token_lists(batch)]
    again = objective.rollout(policy, _prompts(tokenizer), step=5, micro_batch=0)
    assert torch.equal(again["input_ids"], batch["input_ids"])  # the same step samples the same completions
    other = objective.rollout(policy, _prompts(tokenizer), step=6, micro_batch=0)
    assert not torch.equal(other["input_ids"], batch["input_ids"])


def test_sharded_weights_are_gathered_once_per_step_and_sample_every_micro_batch(tokenizer, policy, monkeypatch):
    """Under FSDP2 (sharded) the policy samples through a whole copy of its weights (whole_model_everywhere, a
    gather of every weight): rollouts takes it once for the step's micro-batches, and every micro-batch samples from
    that copy, not from the sharded model."""
    import trainer.grpo as grpo

    copy, gathered, samplers = object(), [], []
    monkeypatch.setattr(grpo, "whole_model_everywhere", lambda model: gathered.append(model) or copy)

    def sample(model, tok, prompt_ids, settings, decode):
        samplers.append(model)
        return [[100] for _ in settings]

    monkeypatch.setattr(grpo, "sample_completions", sample)
    monkeypatch.setattr(grpo, "default_eos_token_ids", lambda model, tok: set())
    objective = GroupRelativePolicy([Reward("one", lambda prompts, completions, **columns: [1.0] * len(completions))],
                                    tokenizer, _settings(), None, seed=7, process_index=0, autocast=nullcontext,
                                    sharded=True)
    objective.rollouts(policy, [_prompts(tokenizer), _prompts(tokenizer)], step=2, accelerator=OneProcess())
    assert gathered == [policy] and samplers == [copy, copy]


def test_the_logged_statistics_are_over_the_whole_step_not_each_micro_batch(tokenizer, policy, monkeypatch):
    """Two micro-batches of two prompts, cispo (its unit is the token, so the loss weighs each micro-batch's
    statistics by its tokens): the step's logged reward std and completion length are those of all eight
    completions, its reward and the function's mean those of the completions it scored (it leaves the first of
    each micro-batch unscored: TRL's nanmean, not a reward of 0 it earned), its reward std the std of those scored
    completions' rewards (Bessel's: TRL's reward_std over the step's batch), not the mean of its groups' stds."""
    import trainer.grpo as grpo

    def sample(model, tok, prompt_ids, settings, decode):  # completions of 1 to 6 tokens, by their seeds
        return [[100 + i for i in range(1 + setting.seed % 6)] for setting in settings]

    monkeypatch.setattr(grpo, "sample_completions", sample)
    values = []

    def reward(prompts, completions, **columns):
        values.extend(float(len(c) % 7 + i) if i else None for i, c in enumerate(completions))
        return values[-len(completions):]

    objective = GroupRelativePolicy([Reward("lengths", reward)], tokenizer, _settings("cispo"), None, seed=7,
                                    process_index=0, autocast=nullcontext)
    other = PromptDataset.collate([{"input_ids": torch.tensor([6, 7, 8, 9]), "prompt": "three", "columns": {}},
                                   {"input_ids": torch.tensor([10]), "prompt": "four", "columns": {}}])
    batches = objective.rollouts(policy, [_prompts(tokenizer), other], step=2, accelerator=OneProcess())
    units = sum(objective.count_items(batch) for batch in batches)
    stats = sum(objective.loss(policy, batch, units)[1] for batch in batches) / units
    totals = [v if v is not None else 0.0 for v in values]
    scored = [v for v in values if v is not None]
    # a group's std is its scored completions' (TRL's nanstd); a group of two with one unscored has none
    pairs = [values[first:first + 2] for first in range(0, 8, 2)]
    stds = [statistics.stdev(pair) for pair in pairs if None not in pair]
    assert 0 < len(stds) < 4
    lengths = [int(n) for batch in batches for n in batch["completion_mask"].sum(dim=1)]
    assert sum(lengths[:4]) != sum(lengths[4:])  # the micro-batches' token weights differ
    assert [batch["step_completions"] for batch in batches] == [8, 8]  # what the clip fraction counts against
    assert [batch["step_completion_tokens"] for batch in batches] == [sum(lengths)] * 2  # and the token-level one
    (reward, reward_std, _, _, length), (function_mean, function_std) = stats.tolist()[:5], stats.tolist()[-2:]
    assert (reward, reward_std, length, function_mean) == pytest.approx(
        (sum(scored) / len(scored), statistics.stdev(scored), sum(lengths) / 8, sum(scored) / len(scored)), rel=1e-5)
    assert statistics.stdev(scored) != pytest.approx(sum(stds) / len(stds), rel=1e-2)
    # the function's std over the step's scored completions, Bessel's (TRL's rewards/<f>/std: nanstd), not a
    # micro-batch's, nor their mean
    mean = sum(scored) / len(scored)
    assert function_std == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in scored) / (len(scored) - 1)), rel=1e-5)
    assert len(scored) < 8 and sum(scored) / len(scored) != pytest.approx(sum(totals) / 8)


def test_the_completions_shortest_longest_cut_share_and_equal_reward_groups_are_the_steps(tokenizer, policy,
                                                                                          monkeypatch):
    """Two micro-batches of two prompts, groups of 2, cispo (each micro-batch's statistics weigh by its tokens, 15 and
    13): the step's shortest completion (1 token, the second micro-batch's; the first's is 2) and longest (6, only in
    the first), the share of its 8 completions the length limit cut (1, TRL's completions/clipped_ratio: no
    end-of-turn token; the first micro-batch's share is 1/4, the second's 0), the mean length of the 7 that ended
    (TRL's completions/mean_terminated_length) and the share of its 4 groups whose
    scored rewards are all equal (TRL's frac_reward_zero_std: the first micro-batch's two groups; the second's
    has one unequal group and one with a single scored completion, which has no std and is not counted: 2 of 4, not
    2 of the 3 groups with a std, nor the micro-batches' shares weighed by their tokens)."""
    import trainer.grpo as grpo

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampled = iter([[[5, end], [7, 8, 9, 10, 11, 12], [13, 14, end], [15, 16, 17, end]],
                    [[end], [20, 21, 22, end], [23, 24, end], [25, 26, 27, 28, end]],
                    [[30, 31, 32, 33, 34, 35]] * 4])
    monkeypatch.setattr(grpo, "sample_completions", lambda model, tok, prompt_ids, settings, decode: next(sampled))
    rewards = iter([[1.0, 1.0, 0.5, 0.5], [1.0, 0.0, None, 2.0]])
    objective = GroupRelativePolicy([Reward("given", lambda prompts, completions, **columns: next(rewards))],
                                    tokenizer, _settings("cispo"), None, seed=7, process_index=0, autocast=nullcontext)
    batches = objective.rollouts(policy, [_numbered_prompts(0, 2), _numbered_prompts(2, 2)], step=1,
                                 accelerator=OneProcess())
    assert [batch["completion_mask"].sum(dim=1).tolist() for batch in batches] == [[2, 6, 3, 4], [1, 4, 3, 5]]
    assert [batch["ended"].tolist() for batch in batches] == [[True, False, True, True], [True] * 4]
    assert [int(objective.count_items(batch)) for batch in batches] == [15, 13]
    stats = logged_step_stats(objective, policy, batches)
    assert stats["completion_length_min"] == pytest.approx(1.0) and stats["completion_length_max"] == pytest.approx(6.0)
    assert stats["completion_length"] == pytest.approx(28 / 8)
    assert stats["truncated_fraction"] == pytest.approx(1 / 8)
    assert stats["terminated_length"] == pytest.approx((2 + 3 + 4 + 1 + 4 + 3 + 5) / 7)  # of the 7 that ended
    # the shortest and longest of those 7 (TRL's completions/min_terminated_length, max_terminated_length): both
    # the second micro-batch's (the first's ended ones are 2 to 4), and not the cut 6
    assert (stats["terminated_length_min"], stats["terminated_length_max"]) == pytest.approx((1.0, 5.0))
    assert stats["zero_std_fraction"] == pytest.approx(2 / 4)
    # the function's mean and std (Bessel's, TRL's nanstd) over the 7 completions it scored, in fp64 by hand
    scored = [1.0, 1.0, 0.5, 0.5, 1.0, 0.0, 2.0]
    mean = sum(scored) / 7
    assert (stats["rewards/<lambda>"], stats["rewards/<lambda>_std"]) == pytest.approx(
        (mean, math.sqrt(sum((v - mean) ** 2 for v in scored) / 6)), rel=1e-6)
    # the same four prompts as one micro-batch: the same logged rollout statistics, whatever the split
    whole_sampled = iter([[[5, end], [7, 8, 9, 10, 11, 12], [13, 14, end], [15, 16, 17, end],
                           [end], [20, 21, 22, end], [23, 24, end], [25, 26, 27, 28, end]]])
    monkeypatch.setattr(grpo, "sample_completions",
                        lambda model, tok, prompt_ids, settings, decode: next(whole_sampled))
    whole_rewards = iter([[1.0, 1.0, 0.5, 0.5, 1.0, 0.0, None, 2.0]])
    whole_objective = GroupRelativePolicy([Reward("given", lambda prompts, completions, **columns: next(
        whole_rewards))], tokenizer, _settings("cispo"), None, seed=7, process_index=0, autocast=nullcontext)
    whole = whole_objective.rollouts(policy, [_numbered_prompts(0, 4)], step=1, accelerator=OneProcess())[0]
    for key in ("rollout_stats", "reward_function_stats"):
        assert all(torch.equal(batch[key], whole[key]) for batch in batches), key
    # a step whose completions the limit all cut: no ended one to measure (NaN, written as null; TRL writes 0)
    monkeypatch.setattr(grpo, "sample_completions", lambda model, tok, prompt_ids, settings, decode: next(sampled))
    rewards = iter([[1.0] * 4])
    cut = objective.rollouts(policy, [_numbered_prompts(4, 2)], step=2, accelerator=OneProcess())[0]
    shape = cut["rollout_stats"].tolist()[3:9]
    assert shape[:3] == [6.0, 6.0, 1.0] and all(math.isnan(value) for value in shape[3:])


def test_the_completion_shape_and_equal_reward_groups_are_the_steps_over_processes(tokenizer, policy, monkeypatch):
    """Two processes (threads whose all-reduce sums, ThreadedProcesses), groups of 3: the first holds two
    micro-batches of one prompt, whose completions are 2, 6 (cut by the limit) and 3 tokens and 4, 1 and 5; the
    second one micro-batch of two prompts, 3, 3, 2 and 4, 5, 2 tokens (none reaches the limit, so the first's length
    histogram, not its own, holds the 6). The logged shortest (1) and longest (6), the cut share (1 of 12), the
    mean length of the 11 that ended (34/11) and the share of the 4 groups whose scored rewards are all equal (3: the
    first process's one with a single scored completion has no std; 3/4, not the first's 1/2 or the second's 2/2)
    are the step's in both processes, not each its own."""
    import trainer.grpo as grpo
    from tests.threaded_processes import ThreadedProcesses

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def ended(length: int) -> list[int]:
        return [40 + k for k in range(length - 1)] + [end]

    lengths = {1: [2, 6, 3], 2: [4, 1, 5], 3: [3, 3, 2], 4: [4, 5, 2]}  # by the prompt's first token
    completions = {first: [ended(n) if n < 6 else [30 + k for k in range(6)] for n in row]
                   for first, row in lengths.items()}
    monkeypatch.setattr(grpo, "sample_completions", lambda model, tok, prompt_ids, settings, decode: [
        completions[ids[0]][index % 3] for index, ids in enumerate(prompt_ids)])
    given = {"p0": [0.5, 0.5, 0.5], "p1": [None, None, 2.0], "p2": [0.25] * 3, "p3": [1.0] * 3}

    def reward(prompts, completions, **columns):
        return [given[prompt][index % 3] for index, prompt in enumerate(prompts)]

    settings = RolloutSettings("grpo", 3, max_completion_length=6, temperature=1.0, top_p=1.0, beta=0.0,
                               epsilon_low=0.2, epsilon_high=0.28)
    splits = [[_numbered_prompts(0, 1), _numbered_prompts(1, 1)], [_numbered_prompts(2, 2)]]

    def process(rank: int, accelerator) -> tuple[GroupRelativePolicy, list[dict]]:
        objective = GroupRelativePolicy([Reward("given", reward)], tokenizer, settings, None, seed=7,
                                        process_index=rank, autocast=nullcontext, world=2)
        return objective, objective.rollouts(policy, splits[rank], step=1, accelerator=accelerator)

    processes = ThreadedProcesses(2).run(process)
    assert [[batch["completion_mask"].sum(dim=1).tolist() for batch in batches] for _, batches in processes] == [
        [[2, 6, 3], [4, 1, 5]], [[3, 3, 2, 4, 5, 2]]]
    for objective, batches in processes:
        stats = logged_step_stats(objective, policy, batches)
        assert [stats[name] for name in ("completion_length_min", "completion_length_max", "truncated_fraction",
                                         "terminated_length", "zero_std_fraction")] == pytest.approx(
            [1.0, 6.0, 1 / 12, 34 / 11, 3 / 4])
        assert stats["completion_length"] == pytest.approx(40 / 12)
        # the shortest ended completion is the first process's 1 (the second's is 2), the longest both's 5
        assert (stats["terminated_length_min"], stats["terminated_length_max"]) == pytest.approx((1.0, 5.0))
        # the function's mean and std (Bessel's) over the 10 completions of both processes it scored, in fp64
        scored = [0.5] * 3 + [2.0] + [0.25] * 3 + [1.0] * 3
        mean = sum(scored) / 10
        assert (stats["rewards/reward"], stats["rewards/reward_std"]) == pytest.approx(
            (mean, math.sqrt(sum((v - mean) ** 2 for v in scored) / 9)), rel=1e-6)


def test_a_step_no_reward_scores_logs_its_reward_as_null(tokenizer, policy, monkeypatch):
    """Every completion of the step unscored (the function returns None for all): the logged reward is NaN (no
    completion to average over), which the metrics file writes as null; the completion length is still logged."""
    import trainer.grpo as grpo
    from dataset.json_text import strict_json

    monkeypatch.setattr(grpo, "sample_completions", _fake_sampler([]))
    objective = GroupRelativePolicy([Reward("nothing", lambda prompts, completions, **columns: [None] * len(
        completions))], tokenizer, _settings(), None, seed=7, process_index=0, autocast=nullcontext)
    batches = objective.rollouts(policy, [_numbered_prompts(0, 2)], step=1, accelerator=OneProcess())
    units = sum(objective.count_items(batch) for batch in batches)
    stats = dict(zip(objective.stat_names, (objective.loss(policy, batches[0], units)[1] / units).tolist()))
    assert math.isnan(stats["reward"]) and math.isnan(stats["rewards/<lambda>"]) and math.isnan(stats["reward_std"])
    assert stats["completion_length"] == pytest.approx(float(batches[0]["completion_mask"].sum()) / 4)
    assert strict_json({"reward": stats["reward"]}) == '{"reward": null}'


def _fake_sampler(sampled: list[list[int]]):
    """A stand-in for sample_completions: each completion's tokens come from its seed alone (1 to 6 tokens), and
    every completion is recorded in `sampled`."""
    def sample(model, tok, prompt_ids, settings, decode):
        out = [[100 + (setting.seed + i) % 50 for i in range(1 + setting.seed % 6)] for setting in settings]
        sampled.extend(out)
        return out
    return sample


def _numbered_prompts(first: int, count: int) -> dict:
    return PromptDataset.collate([{"input_ids": torch.tensor([1 + j % 9, 2]), "prompt": f"p{j}", "columns": {}}
                                  for j in range(first, first + count)])


@pytest.mark.parametrize(("loss_type", "scale"), [("grpo", True), ("dr_grpo", False), ("cispo", True)])
def test_rollout_advantages_and_completion_masks_by_hand(tokenizer, policy, monkeypatch, loss_type, scale):
    """Per group of 3: grpo and cispo take (r - mean) / (sample std + 1e-4), Dr. GRPO (Liu et al. 2025, section 3.2)
    only r - mean; each completion's mask is 1 on exactly its sampled tokens (lengths 1 to 6, so most rows are
    padded)."""
    import trainer.grpo as grpo

    sampled: list[list[int]] = []
    monkeypatch.setattr(grpo, "sample_completions", _fake_sampler(sampled))

    def reward(prompts, completions, **columns):
        return [float(len(c) % 4) + 0.5 * (c[:1] == "a") for c in completions]

    objective = GroupRelativePolicy([Reward("r", reward)], tokenizer, _settings(loss_type, group=3), None, seed=11,
                                    process_index=0, autocast=nullcontext)
    batch = objective.rollouts(policy, [_numbered_prompts(0, 4)], step=3, accelerator=OneProcess())[0]
    rewards = batch["scores"].double().tolist()
    assert sum(statistics.stdev(rewards[first:first + 3]) > 0.2 for first in range(0, 12, 3)) >= 2
    for first in range(0, 12, 3):
        group = rewards[first:first + 3]
        mean = sum(group) / 3
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / 2)
        expected = [(r - mean) / (std + 1e-4) if scale else r - mean for r in group]
        assert batch["advantages"][first:first + 3].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert len({len(c) for c in sampled}) > 1  # completions of several lengths
    width = max(len(c) for c in sampled)
    assert batch["completion_mask"].tolist() == [[t < len(c) for t in range(width)] for c in sampled]
    for row, start, completion in zip(batch["input_ids"].tolist(), batch["starts"].tolist(), sampled):
        assert row[start:start + len(completion)] == completion


@pytest.mark.parametrize(("loss_type", "scale_rewards", "divisor"), [
    ("grpo", None, "group"), ("dr_grpo", None, "none"), ("grpo", "group", "group"), ("grpo", "batch", "batch"),
    ("grpo", "none", "none"), ("dr_grpo", "group", "group"), ("cispo", "batch", "batch")])
def test_scale_rewards_divides_the_centred_rewards_as_trl(tokenizer, policy, monkeypatch, loss_type, scale_rewards,
                                                          divisor):
    """Two micro-batches of two prompts, groups of 3, the second completion of each micro-batch unscored (None):
    each advantage is r - the mean of its group's scored rewards, divided (TRL's scale_rewards) by the group's
    std + 1e-4 (group), by the std of all the step's scored rewards + 1e-4 (batch: across micro-batches), or by
    nothing (none); Bessel's std throughout; an unscored completion's advantage is 0. Unset, it is group, and none
    for dr_grpo: the behaviour of every loss type before the flag."""
    import trainer.grpo as grpo

    monkeypatch.setattr(grpo, "sample_completions", _fake_sampler([]))

    def reward(prompts, completions, **columns):
        return [None if i == 1 else float(len(c) % 4) + 0.25 * i for i, c in enumerate(completions)]

    settings = dataclasses.replace(_settings(loss_type, group=3), scale_rewards=scale_rewards)
    objective = GroupRelativePolicy([Reward("r", reward)], tokenizer, settings, None, seed=5, process_index=0,
                                    autocast=nullcontext)
    batches = objective.rollouts(policy, [_numbered_prompts(0, 2), _numbered_prompts(2, 2)], step=4,
                                 accelerator=OneProcess())
    rewards = [None if i % 6 == 1 else value for i, value in
               enumerate(torch.cat([batch["scores"] for batch in batches]).double().tolist())]
    scored = [r for r in rewards if r is not None]
    batch_mean = sum(scored) / len(scored)
    batch_std = math.sqrt(sum((r - batch_mean) ** 2 for r in scored) / (len(scored) - 1))
    expected = []
    for first in range(0, 12, 3):
        group = [r for r in rewards[first:first + 3] if r is not None]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        scale = {"group": std + 1e-4, "batch": batch_std + 1e-4, "none": 1.0}[divisor]
        expected += [0.0 if r is None else (r - mean) / scale for r in rewards[first:first + 3]]
    assert len(set(scored)) > 3 and abs(batch_std - 1) > 0.1  # the three divisors differ
    got = torch.cat([batch["advantages"] for batch in batches]).tolist()
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_a_completion_no_reward_scores_is_out_of_its_groups_advantages(tokenizer, policy, monkeypatch):
    """Two reward functions that each leave some completions unscored (None), one of a group's three scored by
    neither: as TRL's GRPOTrainer, that completion's advantage is 0 and its group's mean and std are the two
    scored completions' (its weighted sum, 0, is not a reward it earned). The others keep None's meaning for one
    function: it adds nothing to their weighted sum."""
    import trainer.grpo as grpo

    monkeypatch.setattr(grpo, "sample_completions", _fake_sampler([]))

    def lengths(prompts, completions, **columns):  # scores the second and third of each group
        return [float(len(c)) if i % 3 else None for i, c in enumerate(completions)]

    def firsts(prompts, completions, **columns):  # scores only the third
        return [0.5 if i % 3 == 2 else None for i, c in enumerate(completions)]

    objective = GroupRelativePolicy([Reward("lengths", lengths), Reward("firsts", firsts)], tokenizer,
                                    _settings(group=3), None, seed=11, process_index=0, autocast=nullcontext)
    batch = objective.rollouts(policy, [_numbered_prompts(0, 4)], step=3, accelerator=OneProcess())[0]
    tokens = batch["completion_mask"].sum(dim=1).double().tolist()
    for first in range(0, 12, 3):
        a, b = tokens[first + 1], tokens[first + 2] + 0.5
        mean, std = (a + b) / 2, abs(a - b) / math.sqrt(2)
        expected = [0.0, (a - mean) / (std + 1e-4), (b - mean) / (std + 1e-4)]
        assert batch["advantages"][first:first + 3].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # the logged reward is the mean over the eight completions some function scored (one function's None does not
    # unscore a completion); the reward std their std (Bessel's), the unscored ones left out, not counted as 0
    pairs = [(tokens[first + 1], tokens[first + 2] + 0.5) for first in range(0, 12, 3)]
    assert len({abs(a - b) for a, b in pairs}) > 1
    reward, reward_std = batch["rollout_stats"].tolist()[:2]
    assert (reward, reward_std) == pytest.approx(
        (sum(a + b for a, b in pairs) / 8, statistics.stdev([r for pair in pairs for r in pair])), rel=1e-5)


def test_batch_scaling_of_a_step_with_two_scored_rewards_divides_by_their_std(tokenizer, policy, monkeypatch):
    """--scale_rewards batch, one group of three, its first completion unscored: the two scored rewards' std
    (Bessel's, TRL's nanstd) divides their centred rewards; two are enough for a std."""
    import trainer.grpo as grpo

    monkeypatch.setattr(grpo, "sample_completions", _fake_sampler([]))

    def reward(prompts, completions, **columns):
        return [None, 1.0, 3.5]

    settings = dataclasses.replace(_settings(group=3), scale_rewards="batch")
    objective = GroupRelativePolicy([Reward("r", reward)], tokenizer, settings, None, seed=2, process_index=0,
                                    autocast=nullcontext)
    batch = objective.rollouts(policy, [_numbered_prompts(0, 1)], step=1, accelerator=OneProcess())[0]
    std = statistics.stdev([1.0, 3.5])
    expected = [0.0, -1.25 / (std + 1e-4), 1.25 / (std + 1e-4)]
    assert batch["advantages"].tolist() == pytest.approx(expected, rel=1e-5)


def test_batch_scaling_of_a_step_with_one_scored_reward_leaves_every_advantage_0(tokenizer, policy, monkeypatch):
    """--scale_rewards batch, one group of three, only its second completion scored: no group has two scored
    rewards, so every advantage is 0, and the step's batch has no std (its logged reward_std is NaN, written as
    null), which the scaling must not divide by: 0 / NaN would make every advantage, and so the loss, NaN."""
    import trainer.grpo as grpo

    monkeypatch.setattr(grpo, "sample_completions", _fake_sampler([]))

    def reward(prompts, completions, **columns):
        return [None, 2.5, None]

    settings = dataclasses.replace(_settings(group=3), scale_rewards="batch")
    objective = GroupRelativePolicy([Reward("r", reward)], tokenizer, settings, None, seed=2, process_index=0,
                                    autocast=nullcontext)
    batch = objective.rollouts(policy, [_numbered_prompts(0, 1)], step=1, accelerator=OneProcess())[0]
    assert batch["advantages"].tolist() == [0.0, 0.0, 0.0]
    stats = logged_step_stats(objective, policy, [batch])
    assert stats["reward"] == pytest.approx(2.5) and math.isnan(stats["reward_std"])
    assert torch.isfinite(objective.loss(policy, batch, objective.count_items(batch))[0])


def test_a_prompts_completions_do_not_depend_on_how_the_step_is_split(tokenizer, policy, monkeypatch):
    """Six prompts in one micro-batch, in three micro-batches of two, and as two processes of three (Accelerate
    hands micro-batch m of process p the (m x world + p)-th batch): each prompt's completions are the same, since a
    completion's seed names its prompt's place in the global batch and its place in its group."""
    import trainer.grpo as grpo

    sampled: list[list[int]] = []
    monkeypatch.setattr(grpo, "sample_completions", _fake_sampler(sampled))

    def run(process: int, world: int, micro_batches: list[dict]) -> list[list[int]]:
        sampled.clear()
        objective = GroupRelativePolicy([Reward("r", lambda prompts, completions, **c: [0.0] * len(completions))],
                                        tokenizer, _settings(group=2), None, seed=5, process_index=process,
                                        autocast=nullcontext, world=world)
        for index, batch in enumerate(micro_batches):
            objective.rollout(policy, batch, step=4, micro_batch=index)
        return list(sampled)

    whole = run(0, 1, [_numbered_prompts(0, 6)])
    assert len(set(map(tuple, whole))) == 12  # twelve different completions
    assert run(0, 1, [_numbered_prompts(0, 2), _numbered_prompts(2, 2), _numbered_prompts(4, 2)]) == whole
    # Two processes, micro-batches of one prompt: process p's micro-batch m holds global prompt m x 2 + p.
    by_process = {p: run(p, 2, [_numbered_prompts(m * 2 + p, 1) for m in range(3)]) for p in (0, 1)}
    for m in range(3):
        for p in (0, 1):
            prompt = m * 2 + p
            assert by_process[p][2 * m:2 * m + 2] == whole[2 * prompt:2 * prompt + 2]


def _token_lists(batch: dict) -> list[list[int]]:
    return [row[start:int(mask.sum())].tolist()
            for row, start, mask in zip(batch["input_ids"], batch["starts"], batch["attention_mask"])]


def test_a_reward_that_returns_nan_stops_the_rollout_in_one_line(tokenizer, policy):
    def nan_reward(prompts, completions, **columns):
        return [math.nan] * len(completions)

    objective = GroupRelativePolicy([Reward("nan.py:nan_reward", nan_reward)], tokenizer, _settings(), None,
                                    seed=0, process_index=0, autocast=nullcontext)
    with pytest.raises(RewardError, match=r"^reward nan.py:nan_reward: returned NaN for completion 0 "):
        objective.rollout(policy, _prompts(tokenizer), step=0, micro_batch=0)


@pytest.mark.parametrize("row, messages", [
    ({"prompt": "hi", "answer": 1}, [{"role": "user", "content": "hi"}]),
    # TRL's conversational prompt: refused before ("field 'prompt' must be a non-empty string")
    ({"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], "answer": 1},
     [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]},
     [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]),
    ({"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
     [{"role": "user", "content": "q"}]),
])
def test_prompt_rows_in_each_format(row, messages):
    assert prompt_messages(row) == messages


@pytest.mark.parametrize("row, message", [
    ({"answer": 1}, "no prompt: expected one of the fields prompt, messages, conversations"),
    ({"prompt": 3}, "field 'prompt' must be a non-empty string or a list of messages"),
    ({"prompt": [{"role": "user"}]}, "prompt\\[0\\] has no \"content\" string"),
    ({"conversations": [{"role": "assistant", "content": "a"}]},
     "field 'conversations' holds no message before its last assistant turn"),
])
def test_a_bad_prompt_row_names_its_field(row, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        prompt_messages(row)


# Raw lines the strict reader refuses, each written as line 2 between good prompts: (bytes, reason fragment).
HOSTILE_PROMPT_LINES = {
    "not UTF-8": (b'{"prompt": "caf\xe9"}', "not valid UTF-8"),
    "a lone surrogate in the prompt": (rb'{"prompt": "a\ud800b"}', "lone surrogate"),
    "a lone surrogate in a column": (rb'{"prompt": "ok", "answer": "\udfff"}', "lone surrogate"),
    "deep nesting": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    "a duplicate key": (b'{"prompt": "a", "prompt": "b"}', 'duplicate key "prompt"'),
    "a form feed line": (b"\f", "invalid JSON"),
}


@pytest.mark.parametrize("name", HOSTILE_PROMPT_LINES)
def test_a_hostile_prompt_line_is_named_or_skipped(name, tokenizer, tmp_path):
    line, reason = HOSTILE_PROMPT_LINES[name]
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"prompt": "What is 1 + 1?", "answer": "2"}\n' + line + b'\n{"prompt": "Hi"}\n')
    with pytest.raises(ValueError) as error:
        PromptDataset(path, tokenizer, max_seq_len=64)
    assert str(error.value).startswith(f"{path}:2: ") and reason in str(error.value)
    data = PromptDataset(path, tokenizer, max_seq_len=64, skip_bad_lines=True)
    assert data.stats["skipped_lines"] == 1 and [data[i]["prompt"] for i in range(len(data))] == \
        ["What is 1 + 1?", "Hi"]


def test_a_prompt_file_names_a_bad_line_drops_long_prompts_and_keeps_the_columns(tokenizer, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "What is 1 + 1?", "answer": "2", "level": 1}\n{"answer": 3}\n'
                    f'{{"prompt": "{"long " * 80}"}}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{path}:2: no prompt: expected one of the fields prompt, "
                                         rf"messages, conversations \(pass --skip_bad_lines to skip bad lines\)$"):
        PromptDataset(path, tokenizer, max_seq_len=32)
    data = PromptDataset(path, tokenizer, max_seq_len=32, skip_bad_lines=True)
    assert data.stats == {"prompts": 1, "tokens": len(data[0]["input_ids"]), "dropped_too_long": 1,
                          "skipped_lines": 1}
    expected = encode_chatml(tokenizer, [{"role": "user", "content": "What is 1 + 1?"}], add_generation_prompt=True)
    assert data[0]["input_ids"].tolist() == expected.input_ids
    assert PromptDataset.collate([data[0]]) == {"prompt_ids": [expected.input_ids], "prompts": ["What is 1 + 1?"],
                                                "padding": [False], "columns": {"answer": ["2"], "level": [1]}}
    assert data.rows == ((1, {"answer": "2", "level": 1}),)


@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
def test_several_updates_per_rollout_take_the_ratio_against_the_sampling_policy(loss_type):
    """--num_iterations 3: the first update is the single-update loss exactly (ratio 1) and records its log-probs;
    after the policy moved, the next update's ratio is against those, so tokens clip."""
    model, batch = _model(), _hand_made_batch()
    settings = _settings(loss_type, beta=0.1, iterations=3)
    several = GroupRelativePolicy([], _Pad(), settings, None, seed=0, process_index=0, autocast=nullcontext)
    single = GroupRelativePolicy([], _Pad(), _settings(loss_type, beta=0.1), None, seed=0, process_index=0,
                                 autocast=nullcontext)
    assert several.updates_per_rollout == 3 and single.updates_per_rollout == 1
    units = several.count_items(batch)
    reused = dict(batch)
    first, first_stats = several.loss(model, reused, units)
    first.backward()
    gradients = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected, expected_stats = single.loss(model, dict(batch), units)
    expected.backward()
    assert torch.equal(first, expected) and torch.equal(first_stats, expected_stats)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), gradients))
    assert "old_logp" not in batch and "old_logp" in reused  # recorded in the rollout batch it reuses
    old = reused["old_logp"]
    model64 = copy.deepcopy(model).double()
    logits = model64(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    for i in range(4):
        start, length = int(batch["starts"][i]), int(batch["completion_mask"][i].sum())
        for t in range(length):
            expected_logp = torch.log_softmax(logits[i, start + t - 1], dim=-1)[batch["input_ids"][i, start + t]]
            assert old[i, t].item() == pytest.approx(expected_logp.item(), rel=1e-5)
    with torch.no_grad():  # an update moved the policy
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    model.zero_grad()
    second, stats = several.loss(model, reused, units)
    moved64 = copy.deepcopy(model).double()
    reference = _reference_loss(moved64, batch, loss_type, 0.1, settings, old=old.double().tolist())
    assert second.item() == pytest.approx(reference.item(), rel=1e-5, abs=1e-7)
    second.backward()
    reference.backward()
    for (name, ours), theirs in zip(model.named_parameters(), moved64.parameters()):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-4, atol=1e-7, msg=name)
    clip_fraction = (stats / units).tolist()[3]
    assert first_stats[3].item() == 0.0 and clip_fraction > 0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_sequence_level_ratios_after_the_policy_moved_equal_gspo_by_hand_and_accumulate(loss_type):
    """--importance_sampling_level sequence --num_iterations 2: the second update's loss and gradient, after the
    policy moved, equal the fp64 reference with each completion's one ratio exp(mean_t (logp - old)) (GSPO, TRL's
    form), the whole batch as two accumulated micro-batches; the clip fraction counts the completions clipped."""
    model, batch = _model(), _hand_made_batch()
    # a clip range that some completions leave and one does not
    settings = dataclasses.replace(_settings(loss_type, beta=0.1, iterations=2, level="sequence"), epsilon_low=0.1,
                                   epsilon_high=0.1)
    objective = GroupRelativePolicy([], _Pad(), settings, None, seed=0, process_index=0, autocast=nullcontext)
    micro = [_rows(batch, slice(0, 2)), _rows(batch, slice(2, 4))]
    units = sum(objective.count_items(part) for part in micro)
    first = sum(objective.loss(model, part, units)[0] for part in micro)  # records each micro-batch's log-probs
    assert first.item() == pytest.approx(_reference_loss(copy.deepcopy(model).double(), batch, loss_type, 0.1,
                                                         settings).item(), rel=1e-5, abs=1e-7)
    old = torch.cat([part["old_logp"] for part in micro]).double().tolist()
    with torch.no_grad():  # an update moved the policy
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(3)))
    model.zero_grad()
    results = [objective.loss(model, part, units) for part in micro]
    second = sum(loss for loss, _ in results)
    moved64 = copy.deepcopy(model).double()
    reference = _reference_loss(moved64, batch, loss_type, 0.1, settings, old=old)
    token_level = _reference_loss(copy.deepcopy(model).double(), batch, loss_type, 0.1,
                                  dataclasses.replace(settings, importance_sampling_level="token"), old=old)
    assert abs(reference.item() - token_level.item()) > 1e-4  # the two ratios give other losses here
    assert second.item() == pytest.approx(reference.item(), rel=1e-5, abs=1e-7)
    second.backward()
    reference.backward()
    for (name, ours), theirs in zip(model.named_parameters(), moved64.parameters()):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-4, atol=1e-7, msg=name)
    clipped = []
    for i in range(4):  # each completion's ratio against the bounds, in fp64
        with torch.no_grad():
            logits = moved64(input_ids=batch["input_ids"][i:i + 1]).logits[0]
        start, length = int(batch["starts"][i]), int(batch["completion_mask"][i].sum())
        log_ratio = sum(torch.log_softmax(logits[start + t - 1], -1)[batch["input_ids"][i, start + t]].item()
                        - old[i][t] for t in range(length)) / length
        ratio, advantage = math.exp(log_ratio), float(batch["advantages"][i])
        if loss_type == "cispo":
            clipped.append(not 0.9 <= ratio <= 1.1)
        else:
            clipped.append((ratio < 0.9 and advantage < 0) or (ratio > 1.1 and advantage > 0))
    assert any(clipped) and not all(clipped)
    # the step's clip fraction is the share of its four completions clipped
    assert float(sum(stats[3] for _, stats in results) / units) == pytest.approx(sum(clipped) / 4)


def _reference_kl(model64: MiniNormForCausalLM, batch: dict) -> list[list[float]]:
    """Per completion, per token, the k3 KL to the batch's reference log-probs in fp64: exp(ref - logp) - (ref -
    logp) - 1, log p from log_softmax of the logits one position back (temperature 1)."""
    logits = model64(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    rows = []
    for i in range(len(batch["starts"])):
        start, length = int(batch["starts"][i]), int(batch["completion_mask"][i].sum())
        row = []
        for t in range(length):
            logp = float(torch.log_softmax(logits[i, start + t - 1], dim=-1)[batch["input_ids"][i, start + t]])
            ref = float(batch["ref_logp"][i, t])
            row.append(math.exp(ref - logp) - (ref - logp) - 1)
        rows.append(row)
    return rows


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "bnpo", "dapo", "cispo"])
def test_the_logged_clip_fraction_and_kl_are_the_steps_token_shares_whatever_the_micro_batches(loss_type, level):
    """The step as two micro-batches of other token counts (completions 1-3: 7 tokens, completion 4: 3 tokens): the
    logged kl is the mean k3 KL over the step's 10 completion tokens, and with per-token ratios the clip fraction is
    the share of those 10 tokens clipped, counted by hand (log-ratios set to +0.4 on the first completion's first
    token, advantage 0.7 > 0, and -0.5 on the second's two last tokens and all three of the fourth's, advantages < 0:
    ratios e^0.4 > 1.28 and e^-0.5 < 0.8, so 6 of 10 tokens, whichever clip rule -- cispo's either side, the
    surrogate's only where the advantage pushes; every other token's ratio is 1), for every loss type, whose units
    would otherwise weigh each micro-batch's own share (grpo, dr_grpo: 3/7 x 3/4 + 1 x 1/4 = 0.57; bnpo: (3/7 + 1)
    / 2 = 0.71). Per-sequence ratios: the second completion's mean log-ratio is -0.5 x 2/4, ratio e^-0.25 < 0.8, so
    the second and the fourth clip out of the four, and the first (mean 0.2: e^0.2 < 1.28) does not. The clip
    fraction's low and high sides (TRL's clip_ratio/low_mean, high_mean) are counted the same way, and the entropy is
    the fp64 mean over the step's 10 tokens of each position's distribution's."""
    model, batch = _model(), _hand_made_batch()
    model64 = copy.deepcopy(model).double()
    settings = _settings(loss_type, iterations=2, level=level)  # clip range [0.8, 1.28]
    objective = GroupRelativePolicy([], _Pad(), settings, None, seed=0, process_index=0, autocast=nullcontext)
    micro = [_rows(batch, slice(0, 3)), _rows(batch, slice(3, 4))]
    assert [int(part["completion_mask"].sum()) for part in micro] == [7, 3]
    units = sum(objective.count_items(part) for part in micro)
    for part in micro:  # the first update records the policy's log-probs
        objective.loss(model, part, units)
    # lengths 2, 4, 1, 3; advantages 0.7, -0.7, 1.3, -0.4
    shifts = torch.tensor([[0.4, 0.0, 0.0, 0.0], [0.0, 0.0, -0.5, -0.5], [0.0, 0.0, 0.0, 0.0],
                           [-0.5, -0.5, -0.5, 0.0]])
    assert torch.equal(shifts != 0, (shifts != 0) & batch["completion_mask"])
    for part, rows in zip(micro, (slice(0, 3), slice(3, 4))):
        part["old_logp"] = part["old_logp"] - shifts[rows]
    stats = logged_step_stats(objective, model, micro)
    kl = [term for row in _reference_kl(model64, batch) for term in row]
    assert len(kl) == 10
    assert stats["kl"] == pytest.approx(sum(kl) / 10, rel=1e-5)
    assert stats["clip_fraction"] == pytest.approx(6 / 10 if level == "token" else 2 / 4)
    # TRL's clip_ratio/low_mean and high_mean: per token, the five tokens of the second and fourth completions
    # clip below (advantages < 0) and the first's first token above; per sequence, the second and fourth completions
    # below and none above
    assert (stats["clip_fraction_low"], stats["clip_fraction_high"]) == pytest.approx(
        (5 / 10, 1 / 10) if level == "token" else (2 / 4, 0.0))
    # the entropy of each position's distribution, fp64, over the step's 10 tokens (the first micro-batch's 7 and
    # the second's 3 have other means: their mean weighed by the micro-batches or completions would be off)
    entropies = _reference_entropies(model64, batch)
    assert stats["entropy"] == pytest.approx(sum(entropies) / 10, rel=1e-5)
    assert abs(sum(entropies[:7]) / 7 - sum(entropies[7:]) / 3) > 1e-3


def _reference_entropies(model64: MiniNormForCausalLM, batch: dict) -> list[float]:
    """Each completion token's position's entropy -sum_v p_v log p_v in nats, p = softmax of the logits one position
    back (temperature 1), in fp64, completion after completion."""
    with torch.no_grad():
        logits = model64(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    entropies = []
    for i in range(len(batch["starts"])):
        start, length = int(batch["starts"][i]), int(batch["completion_mask"][i].sum())
        for t in range(length):
            p = torch.softmax(logits[i, start + t - 1], dim=-1)
            entropies.append(float(-(p * p.log()).sum()))
    return entropies


def test_validation_reports_the_greedy_accuracy_on_the_answers(tokenizer, policy, monkeypatch):
    import trainer.grpo as grpo
    texts = {"a": "so it is 12.", "b": "the answer is 8", "c": "\\boxed{3.5} apples", "d": "40 apples in all",
             "e": "no number here"}
    asked = []

    def greedy(model, tok, prompt_ids, settings, decode):  # the "completion" of prompt [k] is texts' k-th text
        asked.append([s.temperature for s in settings])
        return [tokenizer.encode(list(texts.values())[ids[0]], add_special_tokens=False) for ids in prompt_ids]

    monkeypatch.setattr(grpo, "sample_completions", greedy)
    rows = [([0], "a", {"answer": 12}), ([1], "b", {"answer": "7"}), ([2], "c", {"answer": "3.50"}),
            ([3], "d", {"answer": "... #### 40"}), ([4], "e", {"answer": 0})]
    batches = [PromptDataset.collate([{"input_ids": torch.tensor(ids), "prompt": p, "columns": c}
                                      for ids, p, c in rows[:3]]),
               PromptDataset.collate([{"input_ids": torch.tensor(ids), "prompt": p, "columns": c}
                                      for ids, p, c in rows[3:]])]
    constant = Reward("constant", lambda prompts, completions, **columns: [0.25] * len(completions))
    objective = GroupRelativePolicy([constant], tokenizer, _settings(), None, seed=0, process_index=0,
                                    autocast=nullcontext)
    result = objective.evaluate(policy, batches, OneProcess())
    assert all(t == 0.0 for temperatures in asked for t in temperatures)  # greedy
    # by hand: a (12 = 12), c (3.5 = 3.50) and d (40 = 40) are right, b (8 != 7) and e (no number) are not
    assert result.prompts == 5 and result.accuracy == pytest.approx(3 / 5) and result.reward == pytest.approx(0.25)
    assert result.logged()["val_accuracy"] == pytest.approx(3 / 5) and "accuracy 60.00%" in result.describe()
    assert objective.evaluate(policy, batches, OneProcess(), max_batches=1).accuracy == pytest.approx(2 / 3)
    no_answers = [PromptDataset.collate([{"input_ids": torch.tensor([0]), "prompt": "a", "columns": {}}])]
    assert math.isnan(objective.evaluate(policy, no_answers, OneProcess()).accuracy)


def test_the_ended_extremes_skip_a_shorter_completion_the_full_context_cut_and_a_constant_std_is_0(tokenizer, policy,
                                                                                                   monkeypatch):
    """A completion may stop without its end-of-turn token short of --max_completion_length (the model's context was
    full: the engine's FINISH_LENGTH): the step's shortest completion is then that cut one (1 token), while the
    shortest that ended (TRL's completions/min_terminated_length) is 3, taken from the ended lengths alone. A function
    scoring 0.1 on the 3 completions it scored has std exactly 0 (its sum of squares less sum x mean is -3.5e-18 in
    fp64, clamped), not NaN; one that scored a single completion has no std (NaN, null: TRL's nanstd), not 0."""
    import trainer.grpo as grpo

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampled = iter([[[30], [31, 32, end], [33, 34, 35, end], [36, 37, 38, 39, end]]])
    monkeypatch.setattr(grpo, "sample_completions", lambda model, tok, prompt_ids, settings, decode: next(sampled))
    objective = GroupRelativePolicy([Reward("given", lambda prompts, completions, **columns: [0.1, 0.1, None, 0.1]),
                                     Reward("once", lambda prompts, completions, **columns: [None, 0.5, None, None])],
                                    tokenizer, _settings("cispo"), None, seed=7, process_index=0, autocast=nullcontext)
    batch = objective.rollouts(policy, [_numbered_prompts(0, 2)], step=1, accelerator=OneProcess())[0]
    assert batch["ended"].tolist() == [False, True, True, True]
    shape = dict(zip(grpo.COMPLETION_SHAPE, batch["rollout_stats"].tolist()[3:9]))
    assert shape == pytest.approx({"completion_length_min": 1.0, "completion_length_max": 5.0,
                                   "truncated_fraction": 0.25, "terminated_length": 4.0,
                                   "terminated_length_min": 3.0, "terminated_length_max": 5.0})
    # each function's means, then its stds: one scored a single completion, whose std is NaN (TRL's nanstd), not 0
    means_and_stds = batch["reward_function_stats"].tolist()
    assert means_and_stds[:3] == pytest.approx([0.1, 0.5, 0.0]) and math.isnan(means_and_stds[3])


def test_the_functions_stds_of_rewards_far_from_0_are_exact_over_micro_batches_and_processes(tokenizer, policy,
                                                                                              monkeypatch):
    """A reward model's scores: 1e8 plus a spread of about 0.01 (and one completion unscored), two processes (threads
    whose all-reduce sums), the first of two micro-batches of one prompt, the second of one of two, groups of 3. Each
    function's logged std is statistics.stdev's (exact rational arithmetic) over the step's 11 scored values, to
    1e-6: a std from the sums of the values and of their squares (sum x^2 - n mean^2, about 1e17 each in fp64, whose
    rounding is larger than the spread) loses it all."""
    import random

    import trainer.grpo as grpo
    from tests.threaded_processes import ThreadedProcesses

    monkeypatch.setattr(grpo, "sample_completions", _fake_sampler([]))
    noise = random.Random(4)
    given = {f"p{j}": [1e8 + noise.gauss(0.0, 0.01) for _ in range(3)] for j in range(4)}
    given["p1"][0] = None
    # three times the spread about 0: each function's std is its own, not its neighbour's in the sums
    shifted = {prompt: [None if v is None else 3 * (v - 1e8) for v in values] for prompt, values in given.items()}

    def reward(prompts, completions, **columns):
        return [given[prompt][index % 3] for index, prompt in enumerate(prompts)]

    def offset(prompts, completions, **columns):  # weight 0: the weighted rewards are far's alone
        return [shifted[prompt][index % 3] for index, prompt in enumerate(prompts)]

    splits = [[_numbered_prompts(0, 1), _numbered_prompts(1, 1)], [_numbered_prompts(2, 2)]]

    def process(rank: int, accelerator) -> tuple[GroupRelativePolicy, list[dict]]:
        objective = GroupRelativePolicy([Reward("far", reward), Reward("near", offset, 0.0)], tokenizer,
                                        _settings(group=3), None, seed=7, process_index=rank,
                                        autocast=nullcontext, world=2)
        return objective, objective.rollouts(policy, splits[rank], step=1, accelerator=accelerator)

    scored = [v for values in given.values() for v in values if v is not None]
    expected = statistics.stdev(scored)
    assert len(scored) == 11 and 0.005 < expected < 0.02
    for objective, batches in ThreadedProcesses(2).run(process):
        stats = logged_step_stats(objective, policy, batches)
        assert stats["rewards/reward_std"] == pytest.approx(expected, rel=1e-6)
        assert stats["rewards/offset_std"] == pytest.approx(3 * expected, rel=1e-6)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_the_logged_reward_std_is_trls_over_the_steps_batch_over_processes(tokenizer, policy, monkeypatch,
                                                                          scale_rewards):
    """TRL 0.28's GRPOTrainer logs reward_std as the std (Bessel's, torch.std) of the rewards of the step's whole
    gathered batch, whatever scale_rewards (0.26 logged the mean of the groups' stds under group and none): written
    out here in fp64 over two processes (threads whose all-reduce sums), the first of two micro-batches of one
    prompt, the second of one of two, groups of 3, every completion scored, weights 1 (where TRL's
    rewards_per_func.nansum is the reward); the groups' means differ, so the mean of their stds is another number.
    The logged reward is the same batch's mean."""
    import trainer.grpo as grpo
    from tests.threaded_processes import ThreadedProcesses

    monkeypatch.setattr(grpo, "sample_completions", _fake_sampler([]))
    given = {"p0": [0.0, 1.0, 0.5], "p1": [3.0, 3.5, 5.0], "p2": [1.0, 1.0, 1.0], "p3": [-2.0, 0.25, 0.0]}
    halves = {prompt: [v / 2 for v in values] for prompt, values in given.items()}

    def reward(prompts, completions, **columns):
        return [halves[prompt][index % 3] for index, prompt in enumerate(prompts)]

    splits = [[_numbered_prompts(0, 1), _numbered_prompts(1, 1)], [_numbered_prompts(2, 2)]]
    settings = dataclasses.replace(_settings(group=3), scale_rewards=scale_rewards)

    def process(rank: int, accelerator) -> tuple[GroupRelativePolicy, list[dict]]:
        objective = GroupRelativePolicy([Reward("a", reward), Reward("b", reward)], tokenizer, settings, None,
                                        seed=7, process_index=rank, autocast=nullcontext, world=2)
        return objective, objective.rollouts(policy, splits[rank], step=1, accelerator=accelerator)

    per_function = torch.tensor([[v / 2, v / 2] for values in given.values() for v in values], dtype=torch.float64)
    trl_rewards = per_function.nansum(dim=1)  # TRL's logged rewards: rewards_per_func.nansum(dim=1), gathered
    group_stds = trl_rewards.view(-1, 3).std(dim=1)
    assert float(trl_rewards.std()) != pytest.approx(float(group_stds.mean()), rel=1e-2)
    for objective, batches in ThreadedProcesses(2).run(process):
        stats = logged_step_stats(objective, policy, batches)
        assert (stats["reward"], stats["reward_std"]) == pytest.approx(
            (float(trl_rewards.mean()), float(trl_rewards.std())), rel=1e-6)


def test_a_reward_models_scores_far_from_0_keep_their_spread_in_the_advantages_and_reward_std(tokenizer, policy,
                                                                                              monkeypatch):
    """Scores of 1e8 plus a spread of about 0.01, groups of 3, two micro-batches: the weighted rewards are kept in
    fp64 (in fp32, 1e8's neighbours are 8 apart: every spread rounds away), so each advantage is (r - the group's
    mean) / (its std + 1e-4) in fp64 by hand and the logged reward std statistics.stdev's, to 1e-5."""
    import random

    import trainer.grpo as grpo

    monkeypatch.setattr(grpo, "sample_completions", _fake_sampler([]))
    noise = random.Random(6)
    given = {f"p{j}": [1e8 + noise.gauss(0.0, 0.01) for _ in range(3)] for j in range(4)}

    def reward(prompts, completions, **columns):
        return [given[prompt][index % 3] for index, prompt in enumerate(prompts)]

    objective = GroupRelativePolicy([Reward("far", reward)], tokenizer, _settings(group=3), None, seed=7,
                                    process_index=0, autocast=nullcontext)
    batches = objective.rollouts(policy, [_numbered_prompts(0, 2), _numbered_prompts(2, 2)], step=1,
                                 accelerator=OneProcess())
    expected = []
    for values in given.values():
        mean = math.fsum(values) / 3
        expected += [(v - mean) / (statistics.stdev(values) + 1e-4) for v in values]
    assert max(abs(a) for a in expected) > 0.5
    assert torch.cat([batch["advantages"] for batch in batches]).tolist() == pytest.approx(expected, rel=1e-5)
    stats = logged_step_stats(objective, policy, batches)
    scored = [v for values in given.values() for v in values]
    assert stats["reward_std"] == pytest.approx(statistics.stdev(scored), rel=1e-5)


class _OtherProcess:
    """An accelerator of two processes whose other process's sampling diverged or not: reduce adds its flag."""

    device = "cpu"

    def __init__(self, diverged: bool) -> None:
        self.diverged = diverged

    def reduce(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor:
        assert reduction == "sum"
        return tensor + float(self.diverged)


@pytest.mark.parametrize("here, there", [(False, False), (True, False), (False, True), (True, True)])
def test_every_process_ends_the_step_when_any_processs_sampling_diverged(here, there) -> None:
    """agreed_sampling: the sampling's result where no process's diverged; SamplingDiverged on every process where
    any one's did (so that none goes on alone into the step's next collective). (Two real processes:
    tests/integration/test_grpo_runs.py.)"""
    from trainer.grpo import agreed_sampling
    from trainer.step import TEACHER, SamplingDiverged

    def sample() -> list[int]:
        if here:
            raise SamplingDiverged()
        return [1, 2]

    if here or there:
        with pytest.raises(SamplingDiverged, match="^the policy's sampling scores became NaN or infinite$"):
            agreed_sampling(_OtherProcess(there), 2, sample)
        # distillation's --seq_kd: every process names the teacher, also one whose own sampling went well
        with pytest.raises(SamplingDiverged, match="^the teacher's sampling scores became NaN or infinite$"):
            agreed_sampling(_OtherProcess(there), 2, sample, sampler=TEACHER)
    else:
        assert agreed_sampling(_OtherProcess(there), 2, sample) == [1, 2]
    if not here:
        assert agreed_sampling(None, 1, sample) == [1, 2]  # one process: no collective


def _score_a(prompts, completions, **columns):
    return [1.0] * len(completions)


def _score_b(prompts, completions, **columns):
    return [0.0] * len(completions)


_score_a.__name__ = _score_b.__name__ = "score"  # two files' functions of one name


@pytest.mark.parametrize("rewards, specs", [
    ([Reward("a.py:score", _score_a), Reward("b.py:score", _score_b)], "'a.py:score' and 'b.py:score'"),
    ([Reward("math_answer", math_answer), Reward("math_answer", math_answer)], "'math_answer' and 'math_answer'")])
def test_two_rewards_that_log_as_one_mean_are_refused_in_one_line(rewards, specs) -> None:
    """Two reward functions of one name logged one mean, rewards/<name>, the last one written: one of them went
    unseen. A run's rewards are refused so (trainer/task_setup.py), naming both specs."""
    from trainer.grpo import check_reward_names

    name = f"rewards/{rewards[0].function.__name__}"
    with pytest.raises(ValueError) as error:
        check_reward_names(rewards)
    assert str(error.value) == (f"--reward {specs} log as one mean, {name}: give each reward function once, under a "
                                f"name of its own (--reward_weights weighs one)")
