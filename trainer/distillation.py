"""White-box knowledge distillation (Hinton et al. 2015, "Distilling the Knowledge in a Neural Network") and its
generalization GKD (Agarwal et al. 2024, "On-Policy Distillation of Language Models"; TRL's GKDTrainer): the loss
and its objective for the training core.

On every supervised token (the labelled targets: every token of pretraining text, the assistant's answers of SFT
data) the student is trained toward the label and toward the frozen teacher's next-token distribution
(trainer/distillation_losses.py has the math):

    loss = alpha * CE(student, label) + (1 - alpha) * T^2 * D(p_teacher^T, p_student^T)

where p^T = softmax(logits / T) and D, the soft divergence (--distill_loss), is Hinton's KL(p_teacher^T ||
p_student^T) (kl, the default) or the generalized Jensen-Shannon divergence of GKD (jsd, `soft_divergences`). The
T^2 factor keeps the soft term's gradient on the scale of the hard term's as T changes (Hinton et al., section 2).
The loss is the token mean over the optimizer step, like language modeling's; CE and D (unweighted, at
temperature T) are logged beside it. The teacher may be larger than the student, but both must use one tokenizer:
the two distributions are compared token id by token id.

GKD's data (`CompletionSettings`): with probability --lmbda an optimizer step trains on completions the student
samples for the data's prompts instead of on the data's answers (on-policy), and with --seq_kd a step that does
not trains on the teacher's sampled completions (sequence-level KD); the sampled tokens are then the labels. The
choice is a digest of (--seed, step), so every process of a step and a resumed run make the same one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from dataset.atomic_io import first_line
from dataset.sft_dataset import IGNORE_INDEX, collate_rows
from model.generation import GenerationSettings
from model.model import shift_labels
from trainer.distillation_losses import DistillLoss, distillation_losses
from trainer.evaluation import LMEval, evaluate_lm
from trainer.export import whole_model_everywhere
from trainer.grpo import agreed_sampling, first_sample, rollout_decode, rollout_seed, sample_completions
from trainer.memory import working_on
from trainer.run_dir import (DEFAULT_OUT_DIRS, DEFAULT_TEACHER, create_command, is_model_dir, load_input_model,
                             not_a_model_folder, resolve_input_path, resolve_path)
from trainer.step import POLICY, TEACHER, StatWindow

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def tokenizer_mismatch(student_tokenizer: PreTrainedTokenizerBase,
                       teacher_tokenizer: PreTrainedTokenizerBase) -> str | None:
    """How the two tokenizers differ, in words (None: they map the same strings to the same ids)."""
    student, teacher = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if len(student) != len(teacher):
        return f"{len(teacher)} tokens in the teacher's vocabulary, {len(student)} in the student's"
    differing = sum(teacher.get(token) != index for token, index in student.items())
    if differing:
        return f"{differing} of {len(student)} tokens have another id or are missing"
    return None


def teacher_directory(teacher: str | None) -> Path:
    """The directory --teacher names (None: DEFAULT_TEACHER's output)."""
    return resolve_input_path(teacher) if teacher else resolve_path(DEFAULT_OUT_DIRS[DEFAULT_TEACHER])


def teacher_model_dir(teacher: str | None) -> Path:
    """teacher_directory(teacher), which must hold a model: else a one-line FileNotFoundError."""
    teacher_dir = teacher_directory(teacher)
    if (words := not_a_model_folder(teacher_dir)) is not None:
        raise FileNotFoundError(f"--teacher {words}")
    if not is_model_dir(teacher_dir):
        raise FileNotFoundError(f"--teacher {teacher_dir}: no model there; create it with "
                                f"`{create_command(DEFAULT_TEACHER, teacher_dir)}` (or pass --teacher DIR)")
    return teacher_dir


def load_teacher(teacher: str | None, student_tokenizer: PreTrainedTokenizerBase, student_vocab_size: int,
                 **runtime) -> torch.nn.Module:
    """The teacher model of the directory `teacher` (--teacher; None: DEFAULT_TEACHER's output), after checking it
    shares the student's tokenizer and vocabulary size; a one-line error otherwise. `runtime`: the run's model
    fields a loaded model may change (norm_impl, dropout)."""
    from dataset.tokenization import load_tokenizer

    teacher_dir = teacher_model_dir(teacher)
    why = "distillation compares the two models' next-token distributions id by id, so both need one tokenizer"
    try:
        teacher_tokenizer = load_tokenizer(teacher_dir)
    except (OSError, ValueError) as error:
        raise ValueError(f"--teacher {teacher_dir}: no tokenizer can be read there ({first_line(error)}); "
                         f"{why}") from None
    mismatch = tokenizer_mismatch(student_tokenizer, teacher_tokenizer)
    if mismatch is not None:
        raise ValueError(f"--teacher {teacher_dir}: its tokenizer differs from the student's ({mismatch}); {why}")
    teacher = load_input_model(teacher_dir, "--teacher", **runtime)
    if teacher.config.vocab_size != student_vocab_size:
        raise ValueError(f"--teacher {teacher_dir}: vocab_size {teacher.config.vocab_size}, the student's is "
                         f"{student_vocab_size}; {why}")
    return teacher


class CompletionSource(StrEnum):
    """What a step's labels are: the data's answers, or completions sampled for its prompts by the student
    (on-policy, --lmbda) or by the teacher (--seq_kd)."""

    DATA = "data"
    STUDENT = "student"
    TEACHER = "teacher"


@dataclass(frozen=True)
class CompletionSettings:
    """GKD's data, with TRL's names: the probability `lmbda` that a step trains on the student's completions,
    `seq_kd` (a step that does not trains on the teacher's), and how a completion is sampled (`max_new_tokens`,
    `temperature`; no top-p or top-k, as TRL's)."""

    lmbda: float = 0.0
    seq_kd: bool = False
    max_new_tokens: int = 128
    temperature: float = 0.9
    decode: str = rollout_decode("auto")  # how completions decode: rollout_decode(--compile)

    @property
    def samples(self) -> bool:
        """Whether any step may train on sampled completions."""
        return self.lmbda > 0 or self.seq_kd

    @property
    def always_samples(self) -> bool:
        """Whether every step trains on sampled completions (step_source), so none learns the data's answers."""
        return self.lmbda >= 1 or self.seq_kd


def step_source(seed: int, step: int, settings: CompletionSettings) -> CompletionSource:
    """What optimizer step `step` (the steps done before it) trains on: the student's completions with probability
    lmbda -- a uniform draw in [0, 1) digested from (seed, step), so every process of the step and a resumed run
    draw the same --, else the teacher's with seq_kd, else the data's answers (TRL's order)."""
    if settings.lmbda > 0:
        digest = hashlib.sha256(f"{seed}/{step}/lmbda".encode()).digest()
        if int.from_bytes(digest[:7], "big") / 2 ** 56 < settings.lmbda:
            return CompletionSource.STUDENT
    return CompletionSource.TEACHER if settings.seq_kd else CompletionSource.DATA


def last_answer_start(labels: Sequence[int]) -> int | None:
    """Where a row's last run of supervised labels (its final answer) begins; None when none is supervised. The
    tokens before it are the prompt a sampled completion answers (TRL's GKD: the conversation but its last turn)."""
    supervised = [index for index, label in enumerate(labels) if label != IGNORE_INDEX]
    if not supervised:
        return None
    start = supervised[-1]
    for index in reversed(supervised[:-1]):
        if index != start - 1:
            break
        start = index
    return start


def with_completions(batch: dict[str, torch.Tensor], completions: dict[int, tuple[int, list[int]]],
                     pad_id: int) -> dict[str, torch.Tensor]:
    """The micro-batch with each row r of `completions` ({r: (prompt length, completion ids)}) replaced by its
    prompt then the completion, supervised on the completion only; the other rows (no answer to replace) kept.
    Right-padded as the data's batches are (collate_rows)."""
    rows = []
    for index, (ids, labels, mask) in enumerate(zip(batch["input_ids"].tolist(), batch["labels"].tolist(),
                                                    batch["attention_mask"].tolist())):
        if index in completions:
            prompt_length, completion = completions[index]
            ids, labels = ids[:prompt_length] + completion, [IGNORE_INDEX] * prompt_length + completion
        else:
            ids, labels = ids[:sum(mask)], labels[:sum(mask)]
        rows.append({"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)})
    device = batch["input_ids"].device
    return {name: tensor.to(device) for name, tensor in collate_rows(rows, pad_id).items()}


class Distillation:
    """The distillation objective: its unit is the supervised token. `teacher` is the frozen teacher on the
    training device; `autocast` is the mixed-precision context the student's forward runs in (the teacher's
    forward runs in it too, without gradients); `loss` and `beta`: the soft divergence (soft_divergences).
    `completions`: GKD's sampled data (by default none: every step trains on the data's answers); sampling needs
    the `tokenizer`, the run's `seed`, and `process_index` of `world` processes (where this process's rows sit in
    the step's global batch, which seeds each completion); `sharded`: the student's weights are (FSDP2), so it
    samples through a whole copy (whole_model_everywhere). Validation is the student's plain language-modeling
    loss, so it compares with an SFT or pretraining run's."""

    def __init__(self, teacher: torch.nn.Module, alpha: float, temperature: float,
                 autocast: Callable[[], AbstractContextManager], loss: str = DistillLoss.KL, beta: float = 0.5,
                 completions: CompletionSettings = CompletionSettings(),
                 tokenizer: PreTrainedTokenizerBase | None = None, seed: int = 0, process_index: int = 0,
                 world: int = 1, sharded: bool = False) -> None:
        if completions.samples and tokenizer is None:
            raise ValueError("sampling completions (lmbda > 0 or seq_kd) needs the tokenizer")
        self.teacher, self.alpha, self.temperature = teacher.eval().requires_grad_(False), alpha, temperature
        self.autocast, self.divergence, self.beta = autocast, DistillLoss(loss), beta
        self.completions, self.tokenizer = completions, tokenizer
        self.seed, self.process_index, self.world, self.sharded = seed, process_index, world, sharded
        name = self.divergence.value  # the logged divergence: kl or jsd
        # on_policy: the fraction of the step's supervised tokens the student sampled (1 or 0: a step is one or other)
        self.stat_names = ("ce", name) + (("on_policy",) if completions.lmbda > 0 else ())
        self.progress_labels = {"ce": "ce", name: name}
        self.stat_windows: dict[str, StatWindow] = {}  # every one a mean over the log window

    def rollouts(self, model: torch.nn.Module, batches: Sequence[dict[str, Any]], step: int,
                 accelerator: Accelerator) -> list[dict[str, Any]]:
        """The step's micro-batches as the step trains on them (trainer/core.py's train_step calls this before
        the loss): the data's, or with sampled completions in place of each row's last answer (step_source). Each
        completion's seed is a digest of (--seed, step, the row's index in the step's global batch), as GRPO's
        rollouts': a resumed run, and any number of processes, sample the same ones. Collective when the student's
        weights are sharded and it samples: every process makes the step's draw alike, so all of them gather it."""
        source = step_source(self.seed, step, self.completions)
        if source == CompletionSource.DATA:
            return list(batches)
        sampler = self.teacher  # kept whole on every process
        if source == CompletionSource.STUDENT:
            sampler = whole_model_everywhere(model) if self.sharded else model
        return agreed_sampling(accelerator, self.world, lambda: [
            {**self.sampled(sampler, batch, step, index), "source": source} for index, batch in enumerate(batches)],
            sampler=TEACHER if source == CompletionSource.TEACHER else POLICY)

    def sampled(self, sampler: torch.nn.Module, batch: dict[str, torch.Tensor], step: int,
                micro_batch: int) -> dict[str, torch.Tensor]:
        """The micro-batch with each row's last answer replaced by a completion `sampler` samples for the tokens
        before it (with_completions)."""
        settings = self.completions
        first = first_sample(micro_batch, self.process_index, self.world, len(batch["input_ids"]))
        prompts: dict[int, list[int]] = {}
        for index, (ids, labels) in enumerate(zip(batch["input_ids"].tolist(), batch["labels"].tolist())):
            start = last_answer_start(labels)
            if start == 0:
                raise ValueError("a sampled completion answers the tokens before the data's last answer, and this "
                                 "row has none (every token supervised: pretraining text); use --distill_data sft")
            if start is not None:
                prompts[index] = ids[:start]
        generation = [GenerationSettings(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                         top_p=1.0, seed=rollout_seed(self.seed, step, first + index, 0))
                      for index in prompts]
        sampled = (sample_completions(sampler, self.tokenizer, list(prompts.values()), generation, settings.decode)
                   if prompts else [])
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return with_completions(batch, {index: (len(prompt), completion) for (index, prompt), completion
                                        in zip(prompts.items(), sampled)}, pad_id)

    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (shift_labels(batch["labels"]) != -100).sum()

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
             num_items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask")}
        targets = shift_labels(batch["labels"])
        supervised = targets != -100
        student_logits = model(**inputs).logits[supervised]
        with torch.no_grad(), self.autocast(), working_on("the teacher's forward"):
            teacher_logits = self.teacher(**inputs).logits[supervised]
        losses, ce, divergence = distillation_losses(student_logits, teacher_logits, targets[supervised], self.alpha,
                                                     self.temperature, self.divergence, self.beta)
        stats = [ce.detach().sum(), divergence.detach().sum()]
        if self.completions.lmbda > 0:
            on_policy = batch.get("source") == CompletionSource.STUDENT
            stats.append(supervised.sum().to(ce.dtype) * on_policy)
        return losses.sum() / num_items, torch.stack(stats)

    def evaluate(self, model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator,
                 token_bytes: torch.Tensor, max_batches: int) -> LMEval:
        return evaluate_lm(model, loader, accelerator, token_bytes, max_batches)
