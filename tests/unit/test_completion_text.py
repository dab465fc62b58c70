"""What a reward function reads of a completion (trainer/grpo.py, completion_text) and the prompts that let the
policy think (--open_thinking): control tokens such as <think> reach the rewards as their text, the end-of-turn
token that ends a completion does not, and a tag the model wrote in ordinary tokens reads as the same text -- in
the rollouts and in the validation alike; with --open_thinking the prompts end at the assistant's header, without
the empty thinking block."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from tests.threaded_processes import OneProcess
import trainer.grpo as grpo
from dataset.chat_format import ENDOFTEXT, IM_END, IM_START, THINK, THINK_END, encode_chatml
from dataset.prompt_dataset import PromptDataset
from model import MiniNormConfig, MiniNormForCausalLM
from trainer.grpo import GroupRelativePolicy, RolloutSettings, completion_text
from trainer.rewards import Reward, load_reward

THOUGHT = f"{THINK}\nthree and four\n{THINK_END}\n\nIt is 7."


def _ids(tokenizer, text: str, control: bool = True) -> list[int]:
    """The ids of `text`: its tags as control tokens, or (control=False) spelled in ordinary tokens."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=not control).input_ids


def test_control_tokens_are_read_as_their_text_and_the_end_of_turn_is_not(tokenizer):
    think, end = tokenizer.convert_tokens_to_ids(THINK), tokenizer.convert_tokens_to_ids(IM_END)
    control = _ids(tokenizer, THOUGHT) + [end]
    spelled = _ids(tokenizer, THOUGHT, control=False)
    assert think in control and think not in spelled  # two different generations ...
    assert completion_text(tokenizer, control) == completion_text(tokenizer, spelled) == THOUGHT  # ... one text
    assert completion_text(tokenizer, _ids(tokenizer, "7") + [tokenizer.convert_tokens_to_ids(ENDOFTEXT)]) == "7"
    # The end-of-turn token ends a completion; its text written in ordinary tokens is what the model wrote.
    assert completion_text(tokenizer, _ids(tokenizer, f"7{IM_END}", control=False)) == f"7{IM_END}"
    # A control token inside a completion is kept where it is (a new turn the model began).
    assert completion_text(tokenizer, _ids(tokenizer, f"7{IM_START}user") + [end]) == f"7{IM_START}user"


def test_the_rewards_read_the_tags_in_the_rollouts_and_in_the_validation(tokenizer, monkeypatch):
    """End to end through the GRPO objective: think_format scores the completion the model closed with control
    tokens and the one it spelled alike (1.0), and the answer without thinking 0.0; a function sees the texts."""
    end = tokenizer.convert_tokens_to_ids(IM_END)
    completions = [_ids(tokenizer, THOUGHT) + [end], _ids(tokenizer, THOUGHT, control=False),
                   _ids(tokenizer, "It is 7.") + [end]]

    def sample(model, tok, prompt_ids, settings, decode):  # prompt [k] "completes" as completions[k]
        return [completions[ids[0]] for ids in prompt_ids]

    monkeypatch.setattr(grpo, "sample_completions", sample)
    seen = []

    def recorder(prompts, completions, **columns):
        seen.append(list(completions))
        return [0.0] * len(completions)

    torch.manual_seed(0)
    policy = MiniNormForCausalLM(MiniNormConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                                num_attention_heads=4, num_key_value_heads=2, norm_impl="eager"))
    settings = RolloutSettings("grpo", 1, max_completion_length=32, temperature=1.0, top_p=1.0, beta=0.0,
                               epsilon_low=0.2, epsilon_high=0.2)
    objective = GroupRelativePolicy([load_reward("think_format"), Reward("recorder", recorder)], tokenizer,
                                    settings, None, seed=0, process_index=0, autocast=nullcontext)
    prompts = PromptDataset.collate([{"input_ids": torch.tensor([k]), "prompt": "q", "columns": {}}
                                     for k in range(3)])
    batch = objective.rollouts(policy, [prompts], step=0, accelerator=OneProcess())[0]
    assert seen == [[THOUGHT, THOUGHT, "It is 7."]]
    assert batch["scores"].tolist() == [1.0, 1.0, 0.0]
    result = objective.evaluate(policy, [prompts], OneProcess())
    assert seen[-1] == [THOUGHT, THOUGHT, "It is 7."] and result.reward == pytest.approx(2 / 3)


def test_open_thinking_leaves_the_thinking_block_to_the_policy(tokenizer, tmp_path):
    from trainer.args import parse_args
    from trainer.data import build_run_data

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "What is 3 + 4?", "answer": 7}\n' * 4, encoding="utf-8")
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    header = _ids(tokenizer, f"{IM_START}assistant\n")
    closed = encode_chatml(tokenizer, messages, add_generation_prompt=True).input_ids
    opened = encode_chatml(tokenizer, messages, add_generation_prompt=True, open_thinking=True).input_ids
    assert opened[-len(header):] == header and closed[:len(opened)] == opened  # the same prompt, the block left out
    assert closed[len(opened):] == _ids(tokenizer, f"{THINK}\n\n{THINK_END}\n\n")
    for task in ("grpo", "ppo"):
        assert parse_args(task, []).open_thinking is False
        for flags, expected in (([], closed), (["--open_thinking"], opened)):
            args = parse_args(task, ["--data_path", str(path), "--val_data_path", str(path), "--batch_size", "2",
                                     *flags])
            data = build_run_data(args, tokenizer, quiet=True)
            assert data.train[0]["input_ids"].tolist() == data.val[0]["input_ids"].tolist() == expected
