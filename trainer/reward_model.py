"""A learned reward model as a reward function (--reward_model DIR): any transformers
`AutoModelForSequenceClassification` directory with one label scores each prompt + completion, rendered as a
user turn and an assistant turn with the reward model's own tokenizer's chat template (MiniMind's and TRL's way).

Text stays text: the template's own control tokens (its "<|im_start|>", "<|eot_id|>", ...) are read as control
tokens, but the prompt and the completion are read as plain text, so a completion that writes "<|im_end|>" or
"<|eot_id|>" cannot close its turn and forge another one for the reward model. The template is rendered once with
marks in place of the two texts to find its own pieces; the text between the template's control tokens (its pieces
and the contents together, so the tokenizer merges across their boundaries as it always does) is encoded with
special-token parsing off (transformers' split_special_tokens). Where no content holds a special-token string the
ids equal the ordinary tokenization of the rendered text."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dataset.atomic_io import first_line
from trainer.rewards import Reward
from trainer.run_dir import is_model_dir, resolve_input_path

REWARD_MODEL_NAME = "reward_model"  # what its logs call it: rewards/reward_model
# Put in place of the prompt and the completion to find them in a rendering: private-use characters no template
# writes.
CONTENT_MARKS = ("\ue000prompt\ue001", "\ue000completion\ue001")


def reward_model_directory(reward_model: str | Path) -> Path:
    """The directory --reward_model `reward_model` names (a relative path from here, else from the repo root, as
    every input flag's):
    the one the run scores with, and the one a resume compares with its checkpoint's (trainer/resume_checks.py)."""
    return resolve_input_path(reward_model)


def reward_model_dir(directory: str | Path) -> Path:
    """The --reward_model directory, which must hold a model (config.json and weights): else a one-line
    FileNotFoundError."""
    directory = Path(directory).expanduser()
    if not is_model_dir(directory):
        raise FileNotFoundError(f"--reward_model {directory}: no model there (expected a transformers "
                                f"AutoModelForSequenceClassification directory)")
    return directory


class RewardModelScorer:
    """Callable with TRL's reward signature; one sequence at a time (no padding: each score is the model's output
    on exactly that text), in eval mode, without gradients, on `device`."""

    __name__ = REWARD_MODEL_NAME

    def __init__(self, directory: str | Path, device: torch.device | str = "cpu") -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from model.loading import load_strictly

        directory = reward_model_dir(directory)
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        if self.tokenizer.chat_template is None:
            raise ValueError(f"--reward_model {directory}: its tokenizer has no chat template to render the "
                             f"prompt and completion with")
        try:  # strictly: a score head missing from the file would score at random
            self.model = load_strictly(directory, AutoModelForSequenceClassification).to(device).eval()
        except ValueError as error:
            raise ValueError(f"--reward_model {error}") from None
        if self.model.config.num_labels != 1:
            raise ValueError(f"--reward_model {directory}: num_labels is {self.model.config.num_labels}; a reward "
                             f"model has one (a scalar score)")
        self.device, self.directory = device, directory
        special = sorted({token.content for token in self.tokenizer.added_tokens_decoder.values() if token.special},
                         key=len, reverse=True)
        self.control = re.compile("(" + "|".join(map(re.escape, special)) + ")") if special else None
        self.pieces = self._template_pieces()

    def text(self, prompt: str, completion: str) -> str:
        """What the reward model reads, as the template renders it: the user's prompt and the completion as the
        assistant's answer."""
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                                   {"role": "assistant", "content": completion}], tokenize=False)

    def _template_pieces(self) -> tuple[str, str, str]:
        """The template's own text before, between and after the two contents."""
        try:
            marked = self.text(*CONTENT_MARKS)
        except Exception as error:  # jinja's TemplateError, or Python's own from what the template computes (1 / 0)
            raise ValueError(f"--reward_model {self.directory}: its chat template does not render: "
                             f"{first_line(error, named=True)}") from None
        if any(marked.count(mark) != 1 for mark in CONTENT_MARKS) or marked.index(CONTENT_MARKS[0]) > marked.index(
                CONTENT_MARKS[1]):
            raise ValueError(f"--reward_model {self.directory}: its chat template does not render the prompt and "
                             f"then the completion once each")
        before, rest = marked.split(CONTENT_MARKS[0])
        between, after = rest.split(CONTENT_MARKS[1])
        return before, between, after

    def contents(self, prompt: str, completion: str) -> tuple[str, str]:
        """The prompt and the completion as the template writes them into the rendering: as they are, or as a
        template that changes them (e.g. Llama 3's `| trim`) made them, each found with the other's mark in its
        place (so a completion that repeats the template's own pieces cannot move the boundary)."""
        before, between, after = self.pieces
        rendered = self.text(prompt, completion)
        if rendered == before + prompt + between + completion + after:
            return prompt, completion
        head, tail = before + CONTENT_MARKS[0] + between, between + CONTENT_MARKS[1] + after
        with_prompt, with_completion = self.text(prompt, CONTENT_MARKS[1]), self.text(CONTENT_MARKS[0], completion)
        written = (with_prompt[len(before):len(with_prompt) - len(tail)],
                   with_completion[len(head):len(with_completion) - len(after)])
        if not (with_prompt.startswith(before) and with_prompt.endswith(tail) and with_completion.startswith(head)
                and with_completion.endswith(after) and before + written[0] + between + written[1] + after == rendered):
            raise ValueError(f"--reward_model {self.directory}: its chat template changes the texts in a way that "
                             f"hides where they lie in its rendering")
        return written

    def input_ids(self, prompt: str, completion: str) -> list[int]:
        """The token ids the reward model reads: the template's control tokens as themselves, the rest as text."""
        before, between, after = self.pieces
        written_prompt, written_completion = self.contents(prompt, completion)
        ids: list[int] = []
        text = ""

        def flush() -> None:
            nonlocal text
            if text:
                ids.extend(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids)
            text = ""

        for part, is_content in ((before, False), (written_prompt, True), (between, False),
                                 (written_completion, True), (after, False)):
            if is_content or self.control is None:
                text += part
                continue
            for index, piece in enumerate(self.control.split(part)):
                if index % 2:  # a control token of the template
                    flush()
                    ids.append(self.tokenizer.convert_tokens_to_ids(piece))
                else:
                    text += piece
        flush()
        return ids

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float]:
        scores = []
        for prompt, completion in zip(prompts, completions):
            ids = torch.tensor([self.input_ids(prompt, completion)], device=self.device)
            scores.append(float(self.model(input_ids=ids).logits[0, 0]))
        return scores


def load_reward_model(directory: str | Path, weight: float = 1.0, device: torch.device | str = "cpu") -> Reward:
    return Reward(f"--reward_model {directory}", RewardModelScorer(directory, device), weight)
