"""White-box knowledge distillation (Hinton et al. 2015, "Distilling the Knowledge in a Neural Network"): the loss
and its objective for the training core.

On every supervised token (the labelled targets: every token of pretraining text, the assistant's answers of SFT
data) the student is trained toward the label and toward the frozen teacher's next-token distribution:

    loss = alpha * CE(student, label) + (1 - alpha) * T^2 * KL(p_teacher^T || p_student^T)

where p^T = softmax(logits / T). The T^2 factor keeps the soft term's gradient on the scale of the hard term's
as T changes (Hinton et al., section 2). The loss is the token mean over the optimizer step, like language
modeling's; CE and KL (the unweighted KL at temperature T) are logged beside it. The teacher may be larger than the
student, but both must use one tokenizer: the two distributions are compared token id by token id.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

from dataset.atomic_io import first_line
from model.model import shift_labels
from trainer.evaluation import LMEval, evaluate_lm
from trainer.run_dir import (DEFAULT_OUT_DIRS, DEFAULT_TEACHER, create_command, is_model_dir, load_input_model,
                             resolve_input_path, resolve_path)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

STAT_NAMES = ("ce", "kl")


def distillation_losses(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                        alpha: float, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss, per-token CE, per-token KL) for N supervised tokens: logits (N, V), targets (N,), in fp32
    (fp64 inputs stay fp64). The KL is KL(p_teacher^T || p_student^T), before the (1 - alpha) T^2 weight."""
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    student, teacher = student_logits.to(dtype), teacher_logits.to(dtype)
    ce = F.cross_entropy(student, targets, reduction="none")
    student_log_p = F.log_softmax(student / temperature, dim=-1)
    teacher_log_p = F.log_softmax(teacher / temperature, dim=-1)
    kl = (teacher_log_p.exp() * (teacher_log_p - student_log_p)).sum(dim=-1)
    return alpha * ce + (1 - alpha) * temperature ** 2 * kl, ce, kl


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


class Distillation:
    """The distillation objective: its unit is the supervised token. `teacher` is the frozen teacher on the
    training device; `autocast` is the mixed-precision context the student's forward runs in (the teacher's
    forward runs in it too, without gradients). Validation is the student's plain language-modeling loss, so it
    compares with an SFT or pretraining run's."""

    stat_names = STAT_NAMES
    progress_labels = {"ce": "ce", "kl": "kl"}

    def __init__(self, teacher: torch.nn.Module, alpha: float, temperature: float,
                 autocast: Callable[[], AbstractContextManager]) -> None:
        self.teacher, self.alpha, self.temperature = teacher.eval().requires_grad_(False), alpha, temperature
        self.autocast = autocast

    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (shift_labels(batch["labels"]) != -100).sum()

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
             num_items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask")}
        targets = shift_labels(batch["labels"])
        supervised = targets != -100
        student_logits = model(**inputs).logits[supervised]
        with torch.no_grad(), self.autocast():
            teacher_logits = self.teacher(**inputs).logits[supervised]
        losses, ce, kl = distillation_losses(student_logits, teacher_logits, targets[supervised], self.alpha,
                                             self.temperature)
        return losses.sum() / num_items, torch.stack([ce.detach().sum(), kl.detach().sum()])

    def evaluate(self, model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator,
                 token_bytes: torch.Tensor, max_batches: int) -> LMEval:
        return evaluate_lm(model, loader, accelerator, token_bytes, max_batches)
