"""--reward_model (trainer/reward_model.py): a tiny randomly initialised LlamaForSequenceClassification built here
scores each prompt + completion as the model's own output on the text its tokenizer's chat template renders (written
out by hand here), and a directory that is not a one-label reward model is refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from trainer.reward_model import RewardModelScorer, load_reward_model
from trainer.rewards import score

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def _reward_model(tokenizer, path, num_labels: int = 1):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         num_labels=num_labels, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForSequenceClassification(config).eval()
    model.save_pretrained(path)
    own = copy.deepcopy(tokenizer)  # the shared fixture keeps its template
    own.chat_template = TEMPLATE
    own.save_pretrained(path)
    return model


def test_the_score_is_the_models_own_output_on_the_rendered_text(tokenizer, tmp_path):
    model = _reward_model(tokenizer, tmp_path / "rm")
    reward = load_reward_model(tmp_path / "rm", weight=0.5)
    prompts, completions = ["What is 2 + 3?", "Name a colour."], ["It is 5.", "red, or maybe blue"]
    expected = []
    for prompt, completion in zip(prompts, completions):
        text = f"[user] {prompt}\n[assistant] {completion}\n"  # the template, rendered by hand
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            expected.append(float(model(input_ids=ids).logits[0, 0]))
    assert len(set(expected)) == 2
    totals, per_function = score([reward], prompts, completions, {"answer": ["5", "red"]})
    assert per_function[0] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert totals == pytest.approx([0.5 * e for e in expected], rel=1e-5, abs=1e-6)
    assert reward.function.__name__ == "reward_model"


def test_a_directory_that_is_not_a_reward_model_is_refused_in_one_line(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^--reward_model .*: no model there"):
        RewardModelScorer(tmp_path)
    _reward_model(tokenizer, tmp_path / "two", num_labels=2)
    with pytest.raises(ValueError, match=r"^--reward_model .*: num_labels is 2; a reward model has one"):
        RewardModelScorer(tmp_path / "two")
