"""GRPO's and PPO's rollouts that call tools (trainer/tool_rollouts.py through trainer/grpo.py, --tools): with a fake
sampler that emits a fixed calculator call and then an answer, the episode's ids are the chat template's rendering of
the conversation token by token and the completion mask is False exactly on the tool message's tokens; each turn's
seed is its (step, sample, generation, round) digest, the same when the step is split over two processes; a cut
episode counts as cut; the loss and its gradient are the plain GRPO formula computed in fp64 by hand over the sampled
tokens only; the rewards get the episode's messages; PPO's rewards, GAE (over the sampled tokens in order),
advantages, loss and gradients equal an fp64 computation by hand over the sampled tokens."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch

from dataset.chat_format import IM_END, TOOL_CALL, TOOL_CALL_END, control_id, encode_chatml, encode_text, tool_call_text
from dataset.prompt_dataset import PromptDataset
from dataset.tools import tool_schemas
from model import MiniNormConfig, MiniNormForCausalLM
from tests.threaded_processes import OneProcess
from trainer.grpo import GroupRelativePolicy, RolloutSettings, rollout_seed
from trainer.rewards import Reward

TOOLS = ("wiki", "calculator", "convert_units")
CALL = {"name": "calculator", "arguments": {"expression": "2 + 3"}}
ANSWER = "2 + 3 = 5."
QUESTION = [{"role": "system", "content": "", "tools": tool_schemas()}, {"role": "user", "content": "What is 2 + 3?"}]
# What the template writes between the call's <|im_end|> and the answer, written out by hand: the tool message's
# turn and the next generation prompt (with its empty thinking block).
CONTEXT_TEXT = ("\n<|im_start|>user\n<tool_response>5</tool_response><|im_end|>\n<|im_start|>assistant\n"
                "<think>\n\n</think>\n\n")


def _model(vocab: int, seed: int) -> MiniNormForCausalLM:
    torch.manual_seed(seed)
    config = MiniNormConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=256, norm_impl="eager")
    return MiniNormForCausalLM(config)


def _settings(group: int = 2, length: int = 96, beta: float = 0.0, rounds: int = 2) -> RolloutSettings:
    return RolloutSettings("grpo", group, max_completion_length=length, temperature=1.0, top_p=1.0, beta=beta,
                           epsilon_low=0.2, epsilon_high=0.2, tools=TOOLS, max_tool_rounds=rounds)


def _call_ids(tokenizer) -> list[int]:
    return ([control_id(tokenizer, TOOL_CALL)] + encode_text(tokenizer, tool_call_text(CALL))
            + [control_id(tokenizer, TOOL_CALL_END), control_id(tokenizer, IM_END)])


def _answer_ids(tokenizer) -> list[int]:
    return encode_text(tokenizer, ANSWER) + [control_id(tokenizer, IM_END)]


def _fake_sampler(tokenizer, turns: list):
    """A stand-in for sample_completions: a turn whose prompt holds no tool response yet is the fixed call, one after
    it is the answer; every turn is recorded in `turns` as (prompt ids, seed, max_new_tokens)."""
    response = control_id(tokenizer, "<tool_response>")

    def sample(model, tok, prompt_ids, settings, decode):
        out = []
        for ids, setting in zip(prompt_ids, settings):
            turns.append((list(ids), setting.seed, setting.max_new_tokens))
            turn = _answer_ids(tokenizer) if response in ids else _call_ids(tokenizer)
            out.append(turn[:setting.max_new_tokens])
        return out
    return sample


def _prompt_batch(tokenizer, count: int = 1) -> dict:
    ids = encode_chatml(tokenizer, QUESTION, add_generation_prompt=True).input_ids
    row = {"tool": "calculator", "arguments": CALL["arguments"], "result": "5", "fact": "5"}
    return PromptDataset.collate([{"input_ids": torch.tensor(ids), "prompt": "What is 2 + 3?", "columns": row}
                                  for _ in range(count)])


def _objective(tokenizer, settings: RolloutSettings, seen: list | None = None, reference=None, process: int = 0,
               world: int = 1) -> GroupRelativePolicy:
    def reward(prompts, completions, completion_messages, **columns):
        if seen is not None:
            seen.append((completions, completion_messages))
        return [float(index % 2) for index in range(len(completions))]

    return GroupRelativePolicy([Reward("r", reward)], tokenizer, settings, reference, seed=9, process_index=process,
                               autocast=nullcontext, world=world)


@pytest.fixture
def policy(tokenizer):
    return _model(len(tokenizer), seed=3)


def test_the_mask_excludes_exactly_the_tool_results_tokens(tokenizer, policy, monkeypatch):
    import trainer.grpo as grpo

    turns, seen = [], []
    monkeypatch.setattr(grpo, "sample_completions", _fake_sampler(tokenizer, turns))
    objective = _objective(tokenizer, _settings(), seen)
    batch = objective.rollouts(policy, [_prompt_batch(tokenizer)], step=3, accelerator=OneProcess())[0]
    prompt = encode_chatml(tokenizer, QUESTION, add_generation_prompt=True).input_ids
    call, answer = _call_ids(tokenizer), _answer_ids(tokenizer)
    # The template's rendering of the conversation up to the answer's generation prompt, token by token.
    rendered = encode_chatml(tokenizer, QUESTION + [{"role": "assistant", "content": "", "tool_calls": [CALL]},
                                                    {"role": "tool", "content": "5"}],
                             add_generation_prompt=True).input_ids
    context = rendered[len(prompt) + len(call):]
    assert tokenizer.decode(context, skip_special_tokens=False) == CONTEXT_TEXT
    episode = len(call) + len(context) + len(answer)
    for row, start, mask in zip(batch["input_ids"].tolist(), batch["starts"].tolist(),
                                batch["completion_mask"].tolist()):
        assert start == len(prompt) and row[:start] == prompt
        assert row[start:start + episode] == call + context + answer
        assert row[:start + len(call) + len(context)] == rendered
        assert mask == [True] * len(call) + [False] * len(context) + [True] * len(answer)
    assert batch["ended"].tolist() == [True, True]
    assert batch["tool_counts"].tolist() == [[1, 1], [0, 0]]  # calls, errors: one right call each
    assert batch["tool_stats"].tolist() == [1.0, 0.0]
    assert objective.stat_names[len(grpo.STAT_NAMES):len(grpo.STAT_NAMES) + 2] == ("tool_calls", "tool_errors")
    # The rewards see the whole episode: its text, tool results included, and its messages.
    (completions, messages), = seen
    assert completions == [tokenizer.decode(call + context + answer[:-1], skip_special_tokens=False)] * 2
    assert messages == [[{"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": "5"},
                         {"role": "assistant", "content": ANSWER}]] * 2
    # Each turn's seed is its (step, sample, generation, round) digest; the answer's budget is what is left.
    assert [(seed, budget) for _, seed, budget in turns] == [
        (rollout_seed(9, 3, 0, 0), 96), (rollout_seed(9, 3, 0, 1), 96),
        (rollout_seed(9, 3, 0, 0, 1), 96 - len(call) - len(context)),
        (rollout_seed(9, 3, 0, 1, 1), 96 - len(call) - len(context))]
    assert rollout_seed(9, 3, 0, 0, 1) != rollout_seed(9, 3, 0, 0)


def test_the_seeds_do_not_depend_on_how_the_step_is_split(tokenizer, policy, monkeypatch):
    """Two prompts as one process, and as two processes of one: every turn of every episode samples with the same
    seed."""
    import trainer.grpo as grpo

    def seeds(process: int, world: int, count: int) -> list[int]:
        turns = []
        monkeypatch.setattr(grpo, "sample_completions", _fake_sampler(tokenizer, turns))
        _objective(tokenizer, _settings(), process=process, world=world).rollout(
            policy, _prompt_batch(tokenizer, count), step=5, micro_batch=0)
        return sorted(seed for _, seed, _ in turns)

    whole = seeds(0, 1, 2)
    assert len(set(whole)) == 8  # 2 prompts x 2 generations x 2 rounds
    assert sorted(seeds(0, 2, 1) + seeds(1, 2, 1)) == whole


def test_an_episode_the_tool_result_does_not_fit_is_cut(tokenizer, policy, monkeypatch):
    import trainer.grpo as grpo

    turns = []
    monkeypatch.setattr(grpo, "sample_completions", _fake_sampler(tokenizer, turns))
    limit = len(_call_ids(tokenizer)) + 5  # the call, and 5 of the tool message's tokens
    batch = _objective(tokenizer, _settings(length=limit)).rollouts(policy, [_prompt_batch(tokenizer)], step=1,
                                                                   accelerator=OneProcess())[0]
    assert len(turns) == 2  # no turn after the cut
    assert batch["completion_mask"].tolist() == [[True] * len(_call_ids(tokenizer)) + [False] * 5] * 2
    assert batch["ended"].tolist() == [False, False]
    assert batch["rollout_stats"].tolist()[grpo.STAT_NAMES.index("truncated_fraction") - 2] == 1.0


def test_the_calls_of_a_turn_after_the_last_round_are_not_run(tokenizer, policy, monkeypatch):
    """A sampler that always calls: with --max_tool_rounds 1 the second turn's call is left unrun, the episode
    ends with it."""
    import trainer.grpo as grpo

    turns = []

    def always_calls(model, tok, prompt_ids, settings, decode):
        turns.append(len(settings))
        return [_call_ids(tokenizer) for _ in settings]

    monkeypatch.setattr(grpo, "sample_completions", always_calls)
    batch = _objective(tokenizer, _settings(rounds=1)).rollouts(policy, [_prompt_batch(tokenizer)], step=1,
                                                               accelerator=OneProcess())[0]
    assert turns == [2, 2] and batch["tool_counts"][0].tolist() == [1, 1]
    assert batch["ended"].tolist() == [True, True]
    assert batch["completion_mask"][0].tolist()[-len(_call_ids(tokenizer)):] == [True] * len(_call_ids(tokenizer))


def test_the_loss_is_the_plain_formula_over_the_sampled_tokens_only(tokenizer, policy, monkeypatch):
    """beta 0.1 against another model as the reference: the loss and its gradient equal, in fp64 by hand, the mean
    over the completions of the mean over each one's sampled tokens (the call's and the answer's, positions known
    from the fake turns, not from the mask) of -A exp(logp - sg(logp)) + beta (exp(ref - logp) - (ref - logp) - 1)."""
    import trainer.grpo as grpo

    monkeypatch.setattr(grpo, "sample_completions", _fake_sampler(tokenizer, []))
    reference = _model(len(tokenizer), seed=4)
    settings = _settings(beta=0.1)
    objective = _objective(tokenizer, settings, reference=reference)
    batch = objective.rollouts(policy, [_prompt_batch(tokenizer, 2)], step=2, accelerator=OneProcess())[0]
    batch["advantages"] = torch.tensor([1.0, -0.5, 0.25, -1.5])
    call, answer = _call_ids(tokenizer), _answer_ids(tokenizer)
    context = len(encode_text(tokenizer, "\n")) + len(encode_chatml(
        tokenizer, [{"role": "tool", "content": "5"}], add_generation_prompt=True).input_ids)
    sampled = list(range(len(call))) + list(range(len(call) + context, len(call) + context + len(answer)))
    model64, reference64 = copy.deepcopy(policy).double(), copy.deepcopy(reference).double()
    ids = batch["input_ids"]
    logits = model64(input_ids=ids, attention_mask=batch["attention_mask"]).logits
    with torch.no_grad():
        ref_logits = reference64(input_ids=ids, attention_mask=batch["attention_mask"]).logits
    expected = 0
    for i in range(4):
        # the sampled tokens' positions of the row, indexed at once: indexing one position at a time made the
        # backward write a zero gradient of all the logits per position (most of the test's 8 s)
        positions = torch.tensor([int(batch["starts"][i]) + t for t in sampled])
        tokens = ids[i, positions].unsqueeze(-1)
        logp = torch.log_softmax(logits[i, positions - 1], dim=-1).gather(-1, tokens).squeeze(-1)
        ref = torch.log_softmax(ref_logits[i, positions - 1], dim=-1).gather(-1, tokens).squeeze(-1)
        advantage = float(batch["advantages"][i])
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        terms = -advantage * torch.exp(logp - logp.detach()) + 0.1 * kl
        expected = expected + terms.sum() / len(sampled)
    expected = expected / 4
    units = objective.count_items(batch)
    loss, _ = objective.loss(policy, batch, units)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    loss.backward()
    expected.backward()
    for (name, ours), theirs in zip(policy.named_parameters(), model64.parameters()):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-4, atol=1e-7, msg=name)


PPO_BETA, PPO_VF_COEF, PPO_GAMMA, PPO_LAM = 0.1, 0.3, 0.9, 0.8


def _ppo_objective(tokenizer, policy, reference, scores: list[float]):
    """PPO --tools (trainer/ppo.py) with a critic whose values are of order 1 (not a fresh head's zeros), GAE's
    gamma and lambda below 1 (so that where the recursion steps shows), the KL's beta 0.1 against `reference`."""
    from trainer.ppo import CriticModel, PolicyAndCritic, PPOSettings, ProximalPolicy

    critic = CriticModel(_model(len(tokenizer), seed=5).model)
    with torch.no_grad():
        critic.value_head.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(6))
        critic.value_head.bias.fill_(0.1)
    settings = PPOSettings(num_generations=1, max_completion_length=96, temperature=1.0, top_p=1.0, beta=PPO_BETA,
                           epsilon=0.2, cliprange_value=0.2, vf_coef=PPO_VF_COEF, gamma=PPO_GAMMA, lam=PPO_LAM,
                           ppo_epochs=1, tools=TOOLS, max_tool_rounds=2)

    def reward(prompts, completions, completion_messages, **columns):
        return scores[:len(completions)]

    objective = ProximalPolicy([Reward("r", reward)], tokenizer, settings, reference, seed=9, process_index=0,
                               autocast=nullcontext)
    return objective, PolicyAndCritic(policy, critic)


def test_ppo_takes_the_tool_results_as_context_in_its_rewards_gae_and_losses(tokenizer, policy, monkeypatch):
    """PPO --tools on two episodes of the fixed call, its tool message and the answer, against fp64 by hand over the
    sampled tokens only (their positions known from the fake turns, not from the mask): the KL-penalised rewards
    (k1, the score at the answer's last token), GAE over the sampled tokens in order -- the call's <|im_end|> followed
    by the answer's first token, whose value is the critic's at the tool message's last token --, the returns,
    the advantages whitened over the sampled tokens, 0 on the tool message's tokens; then the loss and every
    gradient, policy's and critic's: the clipped policy loss and vf_coef x the value loss as token means over the
    sampled tokens; the logged KL, length and tool statistics."""
    import trainer.grpo as grpo
    from trainer.ppo import STAT_NAMES

    monkeypatch.setattr(grpo, "sample_completions", _fake_sampler(tokenizer, []))
    scores = [1.0, -0.5]
    objective, model = _ppo_objective(tokenizer, policy, _model(len(tokenizer), seed=4), scores)
    batch = objective.rollouts(model, [_prompt_batch(tokenizer, 2)], step=2, accelerator=OneProcess())[0]
    call, answer = _call_ids(tokenizer), _answer_ids(tokenizer)
    context = len(encode_text(tokenizer, "\n")) + len(encode_chatml(
        tokenizer, [{"role": "tool", "content": "5"}], add_generation_prompt=True).input_ids)
    width = len(call) + context + len(answer)
    sampled = list(range(len(call))) + list(range(len(call) + context, width))
    assert batch["completion_mask"].tolist() == [[t in sampled for t in range(width)]] * 2
    model64, reference64 = copy.deepcopy(model).double(), copy.deepcopy(objective.reference).double()
    ids = batch["input_ids"]
    logits, values = model64.policy(input_ids=ids).logits, model64.critic(ids)
    with torch.no_grad():
        ref_logits = reference64(input_ids=ids).logits
    logps, state_values, targets, gae_rows, kls = [], [], [], [], []
    for i, score in enumerate(scores):
        start = int(batch["starts"][i])
        positions = [start + t for t in sampled]
        logp = [torch.log_softmax(logits[i, p - 1], dim=-1)[ids[i, p]] for p in positions]
        ref = [torch.log_softmax(ref_logits[i, p - 1], dim=-1)[ids[i, p]].item() for p in positions]
        value = [values[i, p - 1] for p in positions]  # the state before each sampled token
        kls += [lp.item() - r for lp, r in zip(logp, ref)]  # k1
        rewards = [-PPO_BETA * (lp.item() - r) for lp, r in zip(logp, ref)]
        rewards[-1] += score
        v = [x.item() for x in value] + [0.0]  # 0 after the episode's last sampled token
        deltas = [rewards[k] + PPO_GAMMA * v[k + 1] - v[k] for k in range(len(sampled))]
        advantages = [sum((PPO_GAMMA * PPO_LAM) ** (j - k) * deltas[j] for j in range(k, len(sampled)))
                      for k in range(len(sampled))]
        returns = [a + x for a, x in zip(advantages, v)]
        for name, expected in (("rewards", rewards), ("returns", returns), ("old_values", v[:-1])):
            row = [0.0] * width
            for t, x in zip(sampled, expected):
                row[t] = x
            assert batch[name][i].tolist() == pytest.approx(row, rel=1e-4, abs=1e-5), name
        logps.append(logp), state_values.append(value), targets.append(returns), gae_rows.append(advantages)
    flat = [a for row in gae_rows for a in row]
    mean = sum(flat) / len(flat)
    scale = (sum((a - mean) ** 2 for a in flat) / (len(flat) - 1) + 1e-8) ** 0.5
    whitened = [[(a - mean) / scale for a in row] for row in gae_rows]
    for i, row in enumerate(whitened):
        expected = [0.0] * width
        for t, a in zip(sampled, row):
            expected[t] = a
        assert batch["advantages"][i].tolist() == pytest.approx(expected, rel=1e-3, abs=1e-4)
    # The first update: the ratio is 1 and no value moved, so nothing clips; token means over the sampled tokens.
    units = objective.count_items(batch)
    assert int(units) == 2 * len(sampled)
    loss, stats = objective.loss(model, batch, units)
    expected = sum(-a * torch.exp(lp - lp.detach()) + PPO_VF_COEF * 0.5 * (value - target) ** 2
                   for row in zip(whitened, logps, state_values, targets) for a, lp, value, target in zip(*row))
    expected = expected / (2 * len(sampled))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-6)
    loss.backward()
    expected.backward()
    for (name, ours), theirs in zip(model.named_parameters(), model64.parameters()):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-3,
                                   atol=1e-5 * float(theirs.grad.abs().max()), msg=name)
    logged = dict(zip(objective.stat_names, (stats / units).tolist()))
    assert objective.stat_names[len(STAT_NAMES):len(STAT_NAMES) + 2] == ("tool_calls", "tool_errors")
    assert (logged["tool_calls"], logged["tool_errors"]) == (1.0, 0.0)  # one right call per episode
    assert logged["completion_length"] == len(sampled)
    assert logged["kl"] == pytest.approx(sum(kls) / len(kls), rel=1e-4, abs=1e-6)
