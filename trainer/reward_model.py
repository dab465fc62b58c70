"""A learned reward model as a reward function (--reward_model DIR): any transformers
`AutoModelForSequenceClassification` directory with one label scores each prompt + completion, rendered as a
user turn and an assistant turn with the reward model's own tokenizer's chat template (MiniMind's and TRL's way)."""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.rewards import Reward

REWARD_MODEL_NAME = "reward_model"  # what its logs call it: rewards/reward_model


class RewardModelScorer:
    """Callable with TRL's reward signature; one sequence at a time (no padding: each score is the model's output
    on exactly that text), in eval mode, without gradients, on `device`."""

    __name__ = REWARD_MODEL_NAME

    def __init__(self, directory: str | Path, device: torch.device | str = "cpu") -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        directory = Path(directory).expanduser()
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(f"--reward_model {directory}: no model there (expected a transformers "
                                    f"AutoModelForSequenceClassification directory)")
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        if self.tokenizer.chat_template is None:
            raise ValueError(f"--reward_model {directory}: its tokenizer has no chat template to render the "
                             f"prompt and completion with")
        self.model = AutoModelForSequenceClassification.from_pretrained(directory).to(device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"--reward_model {directory}: num_labels is {self.model.config.num_labels}; a reward "
                             f"model has one (a scalar score)")
        self.device = device

    def text(self, prompt: str, completion: str) -> str:
        """What the reward model reads: the user's prompt and the completion as the assistant's answer."""
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                                   {"role": "assistant", "content": completion}], tokenize=False)

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float]:
        scores = []
        for prompt, completion in zip(prompts, completions):
            encoded = self.tokenizer(self.text(prompt, completion), return_tensors="pt", add_special_tokens=False)
            scores.append(float(self.model(**encoded.to(self.device)).logits[0, 0]))
        return scores


def load_reward_model(directory: str | Path, weight: float = 1.0, device: torch.device | str = "cpu") -> Reward:
    return Reward(f"--reward_model {directory}", RewardModelScorer(directory, device), weight)
